"""Calling the GEMV kernels from Python: every input checked first (on any machine), then the launch (a GPU).

The products, y (B, N) from W (N, K) row-major and x (B, K) (or x (K,) -> y (N,)), in float16 or bfloat16:

- :func:`gemv_v1`: v1, batch 1, a warp per row, no split, no fusion: the lesson's first kernel and the baseline;
- :func:`gemv`: v2/v3, y = W x for B <= 16, split-K when ``splits`` > 1 (None: :func:`work_split.choose_splits`
  for this GPU's SMs);
- :func:`rmsnorm_gemv`: y = W (rmsnorm(x) * g): the attention norm into QKV, the final norm into the LM head;
- :func:`gemv_residual`: y = residual + W x: the output and down projections' residual add (``out=residual``
  updates it in place);
- :func:`rmsnorm_gate_up_silu`: y (B, F) = SiLU(W_gate x') * (W_up x') with x' = rmsnorm(x) * g, from the MLP's one
  (2F, K) matrix [W_gate; W_up] (the decoder's ``w_gate_up``).

:func:`validate` checks what the kernels assume and refuses the rest with a ValueError or TypeError before any launch
(so CPU tensors with a wrong shape are refused as the GPU's would be): float16/bfloat16 alike everywhere, W 2-D,
contiguous and 16-byte aligned (a weight is never copied per call), K a multiple of 8 (each lane loads 8 values, 16
bytes: the kernels have no tail for a ragged K), 1 <= B <= 16, the norm weight (K,), the residual (B, N), a split
count the kernel can use. Then, without a CUDA device, :class:`GemvNeedsGpu`.

:class:`Workspace`: split-K's partial sums and its per-tile counters. The kernels leave the counters at zero, so a
workspace can serve call after call on one stream (a CUDA graph, a benchmark) with no memset; by default each call
allocates its own (the counters zeroed: one memset).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import work_split as ws

__all__ = ["GemvNeedsGpu", "Workspace", "GemvCall", "validate", "gemv_v1", "gemv", "rmsnorm_gemv",
           "gemv_residual", "rmsnorm_gate_up_silu", "run", "sm_count", "auto_splits"]

DTYPES = ("float16", "bfloat16")


class GemvNeedsGpu(RuntimeError):
    """The kernels run on a CUDA GPU only (a CPU-only machine gets the compile report and the NumPy model)."""


@dataclass(frozen=True)
class GemvCall:
    """A validated call: what the launch needs."""

    form: str  # work_split.FORMS
    n_out: int
    k: int
    batch: int
    squeeze: bool  # x was 1-D: return y 1-D
    splits: int | None  # None: choose for the GPU
    eps: float

    def product(self, dtype_bytes: int = 2) -> ws.Product:
        return ws.Product("call", self.n_out, self.k, self.form, self.batch, dtype_bytes)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _check_tensor(name: str, t, dtype: str | None = None):
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gemv: {name} must be a torch tensor, got {type(t).__name__}")
    if _dtype_name(t) not in DTYPES:
        raise TypeError(f"gemv: {name} is {_dtype_name(t)}; the kernels take float16 or bfloat16")
    if dtype is not None and _dtype_name(t) != dtype:
        raise TypeError(f"gemv: {name} is {_dtype_name(t)} but W is {dtype}: give every operand W's dtype")


def validate(w, x, *, form: str = "plain", norm_weight=None, residual=None, splits=None, eps: float = 1e-5,
             out=None) -> GemvCall:
    """Check a call of form `form` (work_split.FORMS) against what the kernels assume; returns a :class:`GemvCall`
    or raises ValueError / TypeError saying what to change. Runs no kernel and needs no GPU."""
    if form not in ws.FORMS:
        raise ValueError(f"gemv: form {form!r} is not one of {ws.FORMS}")
    _check_tensor("W", w)
    dtype = _dtype_name(w)
    _check_tensor("x", x, dtype)
    if w.dim() != 2:
        raise ValueError(f"gemv: W must be 2-D (N, K), got shape {tuple(w.shape)}")
    rows, k = w.shape
    if x.dim() not in (1, 2) or x.shape[-1] != k:
        raise ValueError(f"gemv: x must be (K,) or (B, K) with K = {k} (W's columns), got {tuple(x.shape)}")
    batch = 1 if x.dim() == 1 else x.shape[0]
    if not 1 <= batch <= 16:
        raise ValueError(f"gemv: batch {batch}: these kernels take 1 to 16 rows of x (one weight read serves every "
                         "row); a larger batch is a matrix product: use torch.matmul")
    if k % ws.CHUNK or k == 0:
        raise ValueError(f"gemv: K = {k} must be a positive multiple of 8: each lane loads 8 values (16 bytes) at a "
                         "time and the kernels have no ragged tail; pad W's and x's columns with zeros")
    if rows == 0 or rows >= 2 ** 31:
        raise ValueError(f"gemv: W has {rows} rows: 1 to 2^31 - 1")
    if not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError("gemv: W must be contiguous (row-major) and 16-byte aligned: a weight is read in place, "
                         "never copied per call; make it contiguous once when you load it")
    n_out = rows
    if form == "norm_gate_up":
        if rows % 2:
            raise ValueError(f"gemv: the gate/up matrix stacks W_gate over W_up, so its rows must be even: {rows}")
        n_out = rows // 2
    if form in ("norm", "norm_gate_up"):
        if norm_weight is None:
            raise ValueError(f"gemv: form {form!r} needs the RMSNorm weight (K,)")
        _check_tensor("the norm weight", norm_weight, dtype)
        if tuple(norm_weight.shape) != (k,):
            raise ValueError(f"gemv: the norm weight must be ({k},), got {tuple(norm_weight.shape)}")
        if not eps > 0 or eps != eps or eps == float("inf"):
            raise ValueError(f"gemv: eps = {eps} must be a positive finite number")
    elif norm_weight is not None:
        raise ValueError(f"gemv: form {form!r} takes no norm weight")
    expected = (n_out,) if x.dim() == 1 else (batch, n_out)
    if form == "residual":
        if residual is None:
            raise ValueError("gemv: form 'residual' needs the residual (B, N)")
        _check_tensor("the residual", residual, dtype)
        if tuple(residual.shape) != expected:
            raise ValueError(f"gemv: the residual must be {expected}, got {tuple(residual.shape)}")
    elif residual is not None:
        raise ValueError(f"gemv: form {form!r} takes no residual")
    if out is not None:
        _check_tensor("out", out, dtype)
        if tuple(out.shape) != expected or not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError(f"gemv: out must be a contiguous, 16-byte aligned {expected} tensor, got "
                             f"{tuple(out.shape)}")
    if splits is not None:
        if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
            raise ValueError(f"gemv: splits = {splits!r} must be a positive int (or None: chosen for the GPU)")
        per_split, used = ws.split_plan(k, splits)
        if used != splits:
            raise ValueError(f"gemv: K = {k} in slices of whole 256-column steps makes {used} splits, not {splits} "
                             f"({per_split} columns each); ask for {used}")
        if splits > 1 and splits * batch * (rows + 1) >= 2 ** 31:
            raise ValueError("gemv: the split-K workspace would pass 2^31 values; use fewer splits")
    if out is not None and any(t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                               for t in (w, x, norm_weight) if t is not None):
        raise ValueError("gemv: out shares memory with W, x or the norm weight, which the kernels read while they "
                         "write out; only the residual may be out (updated in place)")
    for name, t in (("x", x), ("the norm weight", norm_weight), ("the residual", residual), ("out", out)):
        if t is not None and t.device != w.device:
            raise ValueError(f"gemv: {name} is on {t.device} but W is on {w.device}")
    return GemvCall(form, n_out, k, batch, x.dim() == 1, splits, float(eps))


@functools.cache
def sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=256)
def auto_splits(product: ws.Product, device_index: int) -> int:
    """The split count a call with ``splits=None`` runs: work_split.choose_splits for this GPU's SMs (once per
    product and device: the model's loop stays off the per-call path)."""
    return ws.choose_splits(product, ws.Gpu("this GPU", sm_count(device_index), ws.H100.copy_gbps))


def _require_gpu(w) -> None:
    if w.device.type != "cuda":
        raise GemvNeedsGpu(f"gemv: the kernels run on a CUDA GPU; W is on {w.device}. Without a GPU, "
                           "work_split.emulate computes the same sums in NumPy")


class Workspace:
    """Split-K's float32 partial sums and int32 per-tile counters for calls up to `splits` x `batch` x `rows` on
    `device`; the kernels leave the counters at zero, so one workspace serves call after call on one stream (not two
    streams at once)."""

    def __init__(self, rows: int, batch: int, splits: int, device):
        import torch

        tiles = rows  # at least one row per tile: enough counters for any tiling of these rows
        self.partial = torch.empty(max(1, splits * batch * (rows + tiles)), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(1, tiles), dtype=torch.int32, device=device)

    def fits(self, rows: int, batch: int, splits: int, tiles: int) -> bool:
        return self.partial.numel() >= splits * batch * (rows + tiles) and self.counters.numel() >= tiles


_FORM_INDEX = {name: index for index, name in enumerate(ws.FORMS)}


def _aligned(t):
    """`t` itself when contiguous and 16-byte aligned, else a contiguous copy (x, a norm weight, a residual: small)."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
        return t
    import torch

    return t.clone(memory_format=torch.contiguous_format)


def run(w, x, call: GemvCall, *, norm_weight=None, residual=None, out=None, workspace: Workspace | None = None,
        module=None):
    """Launch a validated call (:func:`validate`) on the GPU; returns y. `module`: an extension other than the
    package's (a build variant, build.build_variant)."""
    import torch

    from .build import extension

    _require_gpu(w)
    product = call.product(w.element_size())
    splits = call.splits or auto_splits(product, w.device.index if w.device.index is not None else 0)
    plan = ws.launch(product, "gemv", splits)
    x2 = _aligned(x.reshape(call.batch, call.k))
    norm_weight, residual = _aligned(norm_weight), _aligned(residual)
    if plan.splits > 1:
        if workspace is None:
            workspace = Workspace(w.shape[0], call.batch, plan.splits, w.device)
        elif not workspace.fits(w.shape[0], call.batch, plan.splits, plan.tiles):
            raise ValueError("gemv: the workspace is too small for this call: make one for its rows, batch and splits")
        partial, counters = workspace.partial, workspace.counters
    else:
        partial = counters = torch.empty(0, dtype=torch.float32, device=w.device)
    y = (module or extension()).gemv_forward(w, x2, norm_weight, residual, _FORM_INDEX[call.form], call.eps,
                                             plan.splits, plan.k_per_split, partial, counters, out)
    return y.reshape(call.n_out) if call.squeeze else y


def gemv_v1(w, x):
    """v1: y (N,) or (1, N) = W x at batch 1 (no split, no fusion)."""
    from .build import extension

    call = validate(w, x)
    if call.batch != 1:
        raise ValueError(f"gemv_v1: batch 1 only, got {call.batch}; gemv() takes up to 16")
    _require_gpu(w)
    y = extension().gemv_v1(w, _aligned(x.reshape(call.k)))
    return y.reshape(call.n_out) if call.squeeze else y


def gemv(w, x, *, splits=None, workspace=None):
    """y = W x for x (K,) or (B <= 16, K) (v2 with ``splits`` > 1; v3 for B > 1)."""
    call = validate(w, x, splits=splits)
    return run(w, x, call, workspace=workspace)


def rmsnorm_gemv(w, x, norm_weight, eps: float = 1e-5, *, splits=None, workspace=None):
    """y = W (rmsnorm(x) * norm_weight): the norm's 1 / rms(x) applied to each row's sum (it factors out)."""
    call = validate(w, x, form="norm", norm_weight=norm_weight, splits=splits, eps=eps)
    return run(w, x, call, norm_weight=norm_weight, workspace=workspace)


def gemv_residual(w, x, residual, *, splits=None, out=None, workspace=None):
    """y = residual + W x, rounded once; ``out=residual`` updates the residual in place."""
    call = validate(w, x, form="residual", residual=residual, splits=splits, out=out)
    return run(w, x, call, residual=residual, out=out, workspace=workspace)


def rmsnorm_gate_up_silu(w_gate_up, x, norm_weight, eps: float = 1e-5, *, splits=None, workspace=None):
    """y (B, F) = SiLU(W_gate x') * (W_up x'), x' = rmsnorm(x) * norm_weight, W_gate the first F rows of the
    (2F, K) matrix and W_up the last F: both read in one pass, only the product written."""
    call = validate(w_gate_up, x, form="norm_gate_up", norm_weight=norm_weight, splits=splits, eps=eps)
    return run(w_gate_up, x, call, norm_weight=norm_weight, workspace=workspace)
