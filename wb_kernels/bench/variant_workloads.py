"""What the variants benchmark measures (lesson 11_triton): each variant as a model uses it (:class:`VariantSpec`,
:data:`VARIANTS`), one problem of it (:class:`VariantWorkload`), the pairs of it a mask leaves visible and the FLOPs
counted over them, and the presets (:data:`VARIANT_PRESETS`). Plain data and arithmetic; :mod:`.variants` runs them
and :mod:`.variant_tables` reads what a run wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .measure import TimingPolicy
from .sweeps import TOKENS

__all__ = ["MODES", "VariantSpec", "VARIANTS", "BASE_VARIANTS", "VariantWorkload", "window_sides", "document_lengths",
           "document_ids", "alibi_slopes", "visible_pairs", "pass_flops", "variant_record_key", "VariantPreset",
           "ALL_CONTENDERS", "SMOKE_POLICY", "VARIANT_PRESETS", "PRESET_GROUPS"]

MODES = ("forward", "fwd+bwd")


# ----------------------------------------------------------------------------------------------
# What is measured: the variants, the workloads, the presets
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VariantSpec:
    """One variant as a model uses it. ``window`` is the number of keys a query sees (its own included): the last
    ``window`` keys under a causal mask, ``window // 2`` before and the rest after it without one
    (:func:`window_sides`). ``documents``: that many packed documents per sequence (:func:`document_ids`)."""

    name: str
    causal: bool
    window: Optional[int] = None
    softcap: Optional[float] = None
    alibi: bool = False
    bias: bool = False  # a (1, H, L, L) bias in the inputs' dtype, with its gradient in fwd+bwd
    sinks: bool = False  # one float32 logit per head, with its gradient in fwd+bwd
    documents: int = 0
    model: str = ""

    @property
    def masked(self) -> bool:
        """Whether the variant hides keys (what a block mask can skip)."""
        return self.causal or self.window is not None or self.documents > 0

    @property
    def differentiable(self) -> tuple:
        """The variant's inputs that get a gradient, in the order the gradients are returned."""
        return tuple(name for name, used in (("bias", self.bias), ("sinks", self.sinks)) if used)


VARIANTS = {v.name: v for v in (
    VariantSpec("plain", False, model="an encoder"),
    VariantSpec("causal", True, model="a decoder"),
    VariantSpec("alibi", True, alibi=True, model="BLOOM, MPT"),
    VariantSpec("bias", False, bias=True, model="T5's relative bias, learned biases"),
    VariantSpec("window", True, window=1024, model="Mistral"),
    VariantSpec("window-bidirectional", False, window=1024, model="Longformer's local attention"),
    VariantSpec("softcap", True, softcap=50.0, model="Grok"),
    VariantSpec("sinks", True, sinks=True, model="gpt-oss's sinks alone"),
    VariantSpec("documents", True, documents=4, model="packed training sequences"),
    VariantSpec("gpt-oss", True, window=128, sinks=True, model="gpt-oss: window 128 + sinks"),
    VariantSpec("gemma2", True, window=4096, softcap=50.0, model="Gemma 2: window 4096 + softcap 50"),
)}
BASE_VARIANTS = ("plain", "causal")  # the variants SDPA and the CUDA C++ stages compute too


@dataclass(frozen=True)
class VariantWorkload:
    """One problem: q, k, v (B, H, L, D), one variant; ``window`` replaces the variant's (the window sweep)."""

    variant: str
    B: int
    H: int
    L: int
    D: int
    dtype: str
    window: Optional[int] = None

    @property
    def spec(self) -> VariantSpec:
        spec = VARIANTS[self.variant]
        return spec if self.window is None else replace(spec, window=self.window)

    @property
    def key(self) -> str:
        window = "" if self.window is None else f"|w{self.window}"
        return f"{self.variant}{window}|{self.dtype}|B{self.B}|H{self.H}|L{self.L}|D{self.D}"


def window_sides(spec: VariantSpec) -> Optional[tuple]:
    """The spec's window as ``wb.attention``'s ``(left, right)``, ``spec.window`` keys in all: (w - 1, 0) under a
    causal mask, (w // 2, w - 1 - w // 2) without one."""
    w = spec.window
    if w is None:
        return None
    if w < 1:
        raise ValueError(f"window: expected at least 1 key, got {w}")
    return (w - 1, 0) if spec.causal else (w // 2, w - 1 - w // 2)


def document_lengths(L: int, count: int) -> list:
    """`count` documents of unequal lengths (in the ratio count : count-1 : ... : 1) filling L positions: their
    boundaries fall at no particular block, as packed sequences' do."""
    weights = list(range(count, 0, -1))
    total = sum(weights)
    cuts = [0] + [round(L * sum(weights[:n + 1]) / total) for n in range(count)]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def document_ids(L: int, count: int):
    """One sequence's document ids (L,), int64 NumPy: 0 for the first document's positions, 1 for the next, ..."""
    import numpy as np

    return np.repeat(np.arange(count), document_lengths(L, count))


def alibi_slopes(H: int):
    """ALiBi's slopes for H heads (Press et al.): 2^(-8 (h + 1) / H), float32 NumPy (H,)."""
    import numpy as np

    return np.exp2(-8.0 * np.arange(1, H + 1) / H).astype(np.float32)


def visible_pairs(spec: VariantSpec, L: int) -> int:
    """The (query, key) pairs of one sequence (Lq = Lk = L) that the variant's masks leave visible, counted row by
    row: query i sees the keys from max(0, i - left, its document's start) to min(L - 1, i if causal, i + right, its
    document's end). The documents are contiguous runs (:func:`document_ids`). O(L)."""
    import numpy as np

    i = np.arange(L)
    low, high = np.zeros(L, dtype=np.int64), np.full(L, L - 1, dtype=np.int64)
    if spec.causal:
        high = np.minimum(high, i)
    sides = window_sides(spec)
    if sides is not None:
        low, high = np.maximum(low, i - sides[0]), np.minimum(high, i + sides[1])
    if spec.documents:
        ends = np.cumsum(document_lengths(L, spec.documents))
        starts = ends - document_lengths(L, spec.documents)
        which = np.searchsorted(ends, i, side="right")
        low, high = np.maximum(low, starts[which]), np.minimum(high, ends[which] - 1)
    return int(np.maximum(high - low + 1, 0).sum())


def pass_flops(workload: VariantWorkload, mode: str) -> float:
    """FLOPs of one timed call over the visible pairs only: forward ``4 B H pairs D`` (QK^T and PV, a multiply-add
    each), ``fwd+bwd`` 3.5 times that (the backward's five products)."""
    w = workload
    forward = 4.0 * w.B * w.H * visible_pairs(w.spec, w.L) * w.D
    if mode == "forward":
        return forward
    if mode == "fwd+bwd":
        return 3.5 * forward
    raise ValueError(f"mode: one of {MODES}, got {mode!r}")


def variant_record_key(contender: str, mode: str, workload: VariantWorkload) -> str:
    # the contender first: add_speedups groups records by the rest of the key (mode and workload)
    return f"{contender}|{mode}|{workload.key}"


@dataclass(frozen=True)
class VariantPreset:
    """Contenders x workloads x modes; `policy` replaces the run's timing policy (the smoke preset's few repeats);
    `cpu`: the preset runs on the CPU whatever the machine has (the smoke preset's sizes are the interpreter's)."""

    contenders: tuple
    workloads: tuple
    modes: tuple = MODES
    policy: Optional[TimingPolicy] = None
    cpu: bool = False


ALL_CONTENDERS = ("triton", "flex", "triton-kernel", "sdpa-flash", "sdpa-cudnn", "mma", "hopper")
SMOKE_POLICY = TimingPolicy(seconds=0.001, min_repeats=1, max_repeats=1, warmup=0)


def _workloads(lengths, head_dims, dtypes, variants=tuple(VARIANTS), *, H=16, tokens=TOKENS) -> tuple:
    return tuple(VariantWorkload(name, max(1, tokens // L), H, L, D, dtype)
                 for dtype in dtypes for D in head_dims for L in lengths for name in variants)


def _variant_presets() -> dict:
    bar = _workloads((4096,), (128,), ("float16",))
    full = _workloads((1024, 2048, 4096, 8192, 16384), (64, 128), ("float16", "bfloat16"))
    memory = _workloads((16384,), (128,), ("float16",))
    # the window against L = 16k (128 .. 16k; 1024 is the L sweep's row), then L (1k .. 16k, B * L = 16k) at the
    # window variant's 1024 keys beside causal
    windows = tuple(VariantWorkload("window", 1, 16, 16384, 128, "float16", window=2 ** n)
                    for n in range(7, 15) if n != 10)
    lengths = _workloads((1024, 2048, 4096, 8192, 16384), (128,), ("float16",), ("window", "causal"))
    return {
        "bar": VariantPreset(ALL_CONTENDERS, bar),
        "full": VariantPreset(ALL_CONTENDERS, full),
        "memory": VariantPreset(ALL_CONTENDERS, memory),
        "window-sweep": VariantPreset(("triton", "flex", "triton-kernel"), windows + lengths, modes=("forward",)),
        # every contender planned, so that the rows a CPU cannot run say why; windows of 16 keys at L = 64
        "smoke": VariantPreset(ALL_CONTENDERS, tuple(
            VariantWorkload(name, 1, 2, 64, 16, "float16", window=16 if VARIANTS[name].window else None)
            for name in VARIANTS), policy=SMOKE_POLICY, cpu=True),
    }


VARIANT_PRESETS = _variant_presets()
PRESET_GROUPS = {"all": ("bar", "window-sweep", "memory", "full")}
