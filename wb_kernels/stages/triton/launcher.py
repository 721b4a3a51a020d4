"""The Triton stage's host side: allocate, pick block sizes, launch :mod:`.kernels` (lesson 11_triton).

- :func:`forward` ``(out, lse)`` and :func:`gradients` ``{"q", "k", "v", "bias"?, "sinks"?}``, with the variants of
  :mod:`wb_kernels.variants`, a ``score_mod`` and a ``mask_mod`` (``@triton.jit`` functions, FlexAttention's
  signatures: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, ``mask_mod(b, h, q_idx, kv_idx) -> bool``);
- :func:`block_mask`: a :class:`BlockMask` built once from a ``mask_mod``, which both passes iterate;
- :func:`visited_key_blocks`: how many key blocks each query block's program visited (what block skipping saves);
- :func:`stage_forward` and :func:`stage_gradients`: what the stage registry calls (NumPy or torch in, same out).

Triton is imported lazily, here and only here, so importing the rung costs nothing and works without triton. The
first launch decides, once per process, between Triton's compiler and its interpreter (``TRITON_INTERPRET=1``,
numpy on the CPU): the interpreter when there is no CUDA GPU or the package runs on its simulator
(``WB_BACKEND=simulator``). Triton reads the variable when a kernel is decorated, so it must be set before
:mod:`.kernels` is imported; a process that imported triton in the other mode gets an error that says so.
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ...device import is_torch
from ...reference import causal_offset
from ...variants import NO_VARIANTS, Variants

__all__ = ["forward", "gradients", "block_mask", "BlockMask", "visited_key_blocks", "stage_forward",
           "stage_gradients", "launch_config", "interpreting", "use_compiled_kernels", "kernel_arguments",
           "document_block_ranges",
           "load_kernels", "simulator_seconds", "DTYPES"]

DTYPES = ("float16", "bfloat16", "float32")
# The backward recomputes P = exp2(score · log2 e - lse · log2 e) in float32: past |LSE| = 2^24 the rounding of the
# LSE alone is about 1 in that exponent (scores of -1e31 make P 0 or inf), so such calls are refused, as the flash
# backward refuses them, rather than answered wrong.
LSE_LIMIT = 2.0**24
INTERPRETER_BLOCK = 32  # rows and keys per block on the interpreter (numpy arrays: small, several per test problem)

_KERNELS = None  # the kernels module, once imported
# the compiled forward of the last launch (Triton's CompiledKernel on a GPU: its PTX, registers, shared memory; None
# on the interpreter), what the lesson's generated-code summary reads (compiled.py)
LAST_COMPILED: dict = {}
_INTERPRETING: Optional[bool] = None  # the mode, decided at the first launch


def _wants_interpreter() -> bool:
    import torch

    from ...backend import BACKEND

    return BACKEND.is_simulator or not torch.cuda.is_available()


def _interpret_flag(value: Optional[str]) -> bool:
    return (value or "0").strip().lower() in ("1", "true", "yes", "on")


def _imported_for_the_compiler() -> bool:
    """Whether triton is imported with its library decorated for the compiler (not for the interpreter)."""
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(standard.cdiv).__name__ != "InterpretedFunction"


def load_kernels():
    """The kernels module (:mod:`.kernels`), imported the first time it is asked for, in the mode this process runs
    Triton in: what a ``score_mod`` that calls the kernels' helpers (their ``tanh``) imports it through."""
    global _KERNELS, _INTERPRETING
    if _KERNELS is not None:
        return _KERNELS
    setting = os.environ.get("TRITON_INTERPRET")
    want = _wants_interpreter() or _interpret_flag(setting)
    if want and setting is not None and not _interpret_flag(setting):
        raise RuntimeError(
            f"the triton stage needs Triton's interpreter here (no CUDA GPU, or WB_BACKEND=simulator), but "
            f"TRITON_INTERPRET={setting} asks for its compiler; unset it (or set TRITON_INTERPRET=1)")
    if want and _imported_for_the_compiler():
        # Triton decorated its own library (tl.max, tl.cdiv, ...) for the compiler when it was imported; the
        # interpreter cannot call those (wb_kernels sets TRITON_INTERPRET=1 on import, before anything imports
        # triton, as for numba: here something imported triton first)
        raise RuntimeError(
            "the triton stage needs Triton's interpreter here (no CUDA GPU, or WB_BACKEND=simulator), but triton was "
            "imported for its compiler before wb_kernels (torch.compile imports it). Restart Python and import "
            "wb_kernels before anything imports triton (or set TRITON_INTERPRET=1 first)")
    if want:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from . import kernels
    except ImportError as error:
        if getattr(error, "name", None) == "triton" or "triton" not in sys.modules:
            raise ImportError("the triton stage needs Triton, which is not installed: pip install triton (or the "
                              "project's lab extra, pip install -e '.[lab]'; Linux wheels only); on a CPU-only "
                              "machine its interpreter runs the kernels") from error
        raise
    _INTERPRETING = kernels.INTERPRETING
    _KERNELS = kernels
    return kernels


def use_compiled_kernels(kernels) -> None:
    """Use `kernels`, a :mod:`.kernels` module imported with ``TRITON_INTERPRET=0``, as the compiled ones, whatever
    this machine has: for compiling without a GPU (lesson 11's generated-code cells, :mod:`.compiled`), where nothing
    is launched and :func:`kernel_arguments` must give what a GPU's launch would get."""
    global _KERNELS, _INTERPRETING
    _KERNELS, _INTERPRETING = kernels, False


def interpreting() -> bool:
    """Whether the kernels run on Triton's CPU interpreter (decides the mode if no kernel has run yet)."""
    load_kernels()
    return bool(_INTERPRETING)


# ---------------------------------------------------------------------------------------------- launch settings

def launch_config(D: int, dtype: str, *, backward: bool = False) -> dict:
    """Block sizes, warps and pipeline stages for one call. One function of what a ``triton.autotune`` would key on
    (head dim, dtype; causal and a length bucket could join), so that an autotuned table can replace it.

    On the interpreter, small blocks: each block is numpy arrays, and the tests want several blocks per row. On a
    GPU, FlashAttention-2's usual shapes: 128 query rows by 64 keys, fewer for float32 (twice the registers and
    shared memory per element) and for the backward (five tiles live at once), 8 warps at D = 128.
    """
    if interpreting():
        return dict(block_m=INTERPRETER_BLOCK, block_n=INTERPRETER_BLOCK, num_warps=1, num_stages=1)
    wide = D > 64
    if backward:
        block = 32 if dtype == "float32" else 64
        return dict(block_m=block, block_n=block, num_warps=8 if wide else 4, num_stages=2)
    if dtype == "float32":
        return dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return dict(block_m=128, block_n=64, num_warps=8 if wide else 4, num_stages=2 if wide else 3)


def _settings(D, dtype, backward, block_m, block_n, num_warps, num_stages, mask: Optional["BlockMask"]):
    found = launch_config(D, dtype, backward=backward)
    if mask is not None:  # the block mask's tiles are the kernels' blocks
        for name, given in (("block_m", block_m), ("block_n", block_n)):
            if given is not None and given != getattr(mask, name):
                raise ValueError(f"{name}={given} differs from the block mask's {name}={getattr(mask, name)}: "
                                 f"build the block mask with the blocks the call uses")
        block_m, block_n = mask.block_m, mask.block_n
    for name, given in (("block_m", block_m), ("block_n", block_n), ("num_warps", num_warps),
                        ("num_stages", num_stages)):
        if given is not None:
            found[name] = int(given)
    for name in ("block_m", "block_n"):
        size = found[name]
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}: expected a power of two >= 16 (tl.dot's smallest tile), got {size}")
    return found


def _block_d(D: int) -> int:
    return max(16, 1 << (D - 1).bit_length())


# ---------------------------------------------------------------------------------------------- the block mask

@dataclass(frozen=True)
class BlockMask:
    """A ``mask_mod`` and, per tile of ``block_m`` query rows by ``block_n`` keys, what it leaves visible.

    ``tile_state`` (B', H', query blocks, key blocks) int8: 0 no element visible, 1 some, 2 all (B' and H' are B and
    H, or 1 for a mask the same for every batch entry or head). The kernels read lists built from it: per query
    block, ``kv_count`` of the key blocks with a visible element, their indices first in ``kv_indices`` (ascending)
    and ``kv_full`` 1 where the whole tile is visible (the kernel then skips the elementwise mask); per key block,
    the same for query blocks (``q_count``, ``q_indices``, ``q_full``), for the backward's dK/dV loop.
    """

    mask_mod: Callable
    shape: tuple  # (B', H', Lq, Lk)
    block_m: int
    block_n: int
    tile_state: object
    kv_count: object
    kv_indices: object
    kv_full: object
    q_count: object
    q_indices: object
    q_full: object

    @property
    def num_blocks(self) -> tuple:
        """(query blocks, key blocks)."""
        return tuple(self.tile_state.shape[2:])

    def visible_fraction(self) -> float:
        """The fraction of tiles a kernel visits (1 - the sparsity FlexAttention reports)."""
        return float((self.tile_state > 0).float().mean())

    def __repr__(self) -> str:
        Bm, Hm, Lq, Lk = self.shape
        return (f"BlockMask(shape=({Bm}, {Hm}, {Lq}, {Lk}), blocks={self.block_m}x{self.block_n}, "
                f"tiles={self.num_blocks}, visited={self.visible_fraction():.0%}, "
                f"full={float((self.tile_state == 2).float().mean()):.0%})")


def _lists(state):
    """(count, indices, full) of the visible tiles along the last dimension of `state`, visible indices first."""
    import torch

    visible = state > 0
    count = visible.sum(-1, dtype=torch.int32).contiguous()
    # a stable sort of "not visible" puts the visible blocks first, in ascending order
    order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
    full = (state == 2).to(torch.int8).gather(-1, order).contiguous()
    return count, order.to(torch.int32).contiguous(), full


def block_mask(mask_mod, B: int, H: int, Lq: int, Lk: int, block_m: Optional[int] = None,
               block_n: Optional[int] = None, device=None) -> BlockMask:
    """Evaluate `mask_mod` on every (query block, key block) tile once (the ``block_mask_tiles`` kernel) and build
    the per-block lists of tiles to visit. Pass B = 1 or H = 1 for a mask that does not depend on b or h: it then
    serves every batch entry or head. Building the lists is O(tiles) work in torch, like FlexAttention's; the
    O(Lq · Lk) part, the mask itself, runs in the kernel. Default blocks: those of :func:`launch_config` (its
    float16 forward's), which both passes then use. `device`: where the calls it serves run (default: the CPU on the
    interpreter, the GPU otherwise)."""
    import torch

    kernels = load_kernels()
    device = device if device is not None else ("cpu" if interpreting() else "cuda")
    defaults = launch_config(64, "float16")
    block_m = int(block_m or defaults["block_m"])
    block_n = int(block_n or defaults["block_n"])
    num_q_blocks, num_k_blocks = triton_cdiv(Lq, block_m), triton_cdiv(Lk, block_n)
    state = torch.empty((B, H, num_q_blocks, num_k_blocks), dtype=torch.int8, device=device)
    with _mods_refused():
        kernels.block_mask_tiles[(num_q_blocks, num_k_blocks, B * H)](
            state, H, Lq, Lk, num_q_blocks, num_k_blocks, MASK_MOD=mask_mod, BLOCK_M=block_m, BLOCK_N=block_n)
    kv = _lists(state)
    q_lists = _lists(state.transpose(-1, -2))
    return BlockMask(mask_mod, (B, H, Lq, Lk), block_m, block_n, state, *kv, *q_lists)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- shared arguments

def _as_torch(x, device=None):
    """A torch tensor of `x` (a NumPy caller's array shared where torch can share it, copied where it is read-only)."""
    import torch

    if x is None or is_torch(x):
        return x
    array = np.ascontiguousarray(x)
    found = torch.from_numpy(array if array.flags.writeable else array.copy())
    return found if device is None else found.to(device)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _block_id_ranges(ids, block: int):
    """(smallest, largest) document id of each block of `block` positions, (B, blocks) each: O(L)."""
    import torch

    B, L = ids.shape
    pad = triton_cdiv(L, block) * block - L
    big = torch.iinfo(torch.int64).max
    low = torch.cat([ids, ids.new_full((B, pad), big)], 1).view(B, -1, block).amin(-1)
    high = torch.cat([ids, ids.new_full((B, pad), -big)], 1).view(B, -1, block).amax(-1)
    return low, high


def document_block_ranges(q_ids, k_ids, block_m: int, block_n: int) -> tuple:
    """For each (batch entry, query block) the key blocks [first, last + 1) that can share a document id with it,
    and for each (batch entry, key block) the query blocks: (B, query blocks, 2) and (B, key blocks, 2) int32, what
    the kernels' ``document_block_range`` reads. Two blocks can share an id when their [smallest, largest] id
    ranges overlap; for sorted ids (packed sequences) those blocks are contiguous and the range is exact. A block
    that meets none gets an empty range. O(B · query blocks · key blocks) booleans on the device."""
    import torch

    q_low, q_high = _block_id_ranges(q_ids, block_m)
    k_low, k_high = _block_id_ranges(k_ids, block_n)
    meet = (q_low[:, :, None] <= k_high[:, None, :]) & (k_low[:, None, :] <= q_high[:, :, None])  # (B, nq, nk)

    def span(meets):  # (B, rows, blocks) -> (B, rows, 2): first meeting block, one past the last; [0, 0) if none
        blocks = meets.shape[-1]
        index = torch.arange(blocks, device=meets.device, dtype=torch.int32)
        first = torch.where(meets, index, blocks).amin(-1)
        last = torch.where(meets, index, -1).amax(-1)
        found = last >= 0
        return torch.stack([torch.where(found, first, 0), torch.where(found, last + 1, 0)], -1).to(torch.int32)

    return span(meet).contiguous(), span(meet.transpose(1, 2)).contiguous()


def kernel_arguments(q, k, v, causal, key_padding_mask, scale, variants: Variants, score_mod, mask_mod, mask, cfg):
    """The arguments every kernel takes, by name, from one call's inputs and variants."""
    import torch

    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if H % Hk:
        raise ValueError(f"k, v: {Hk} key/value heads do not divide the {H} query heads")
    device = q.device
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    num_q_blocks, num_k_blocks = triton_cdiv(Lq, block_m), triton_cdiv(Lk, block_n)
    offset = causal_offset(causal, Lq, Lk) or 0
    dtype = _dtype_name(q)
    args = dict(H=H, Hk=Hk, Lq=Lq, Lk=Lk, D=D, scale=float(1.0 / math.sqrt(D) if scale is None else scale),
                offset=offset, num_q_blocks=num_q_blocks, num_k_blocks=num_k_blocks,
                IS_CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(D),
                # float32 exact (no TF32); bfloat16 through float32 on the interpreter (see kernels.dot)
                FLOAT32_DOT=dtype == "float32" or (dtype == "bfloat16" and interpreting()))
    keep = None if key_padding_mask is None else _as_torch(key_padding_mask, device).to(torch.uint8).contiguous()
    args.update(KeyKeep=keep, HAS_KEY_PADDING=keep is not None)
    args.update(softcap=float(variants.softcap or 0.0), HAS_SOFTCAP=variants.softcap is not None)
    slopes = variants.alibi_slopes
    if slopes is not None:
        slopes = _as_torch(slopes, device).to(torch.float32).expand(B, H).contiguous()
    args.update(Slopes=slopes, HAS_ALIBI=slopes is not None)
    bias = variants.bias
    if bias is not None:
        bias = _as_torch(bias, device)
        strides = [0 if bias.shape[i] == 1 else bias.stride(i) for i in range(4)]
    else:
        strides = [0, 0, 0, 0]
    args.update(Bias=bias, stride_bias_b=strides[0], stride_bias_h=strides[1], stride_bias_m=strides[2],
                stride_bias_n=strides[3], HAS_BIAS=bias is not None)
    left, right = variants.window if variants.window is not None else (None, None)
    args.update(window_left=int(left or 0), window_right=int(right or 0), HAS_LEFT=left is not None,
                HAS_RIGHT=right is not None)
    docs = dict(QIds=None, KIds=None, DocKeyBlocks=None, DocQueryBlocks=None)
    if variants.document_ids is not None:
        q_ids, k_ids = (_as_torch(ids, device).to(torch.int64).contiguous() for ids in variants.document_ids)
        key_blocks, query_blocks = document_block_ranges(q_ids, k_ids, block_m, block_n)
        docs = dict(QIds=q_ids, KIds=k_ids, DocKeyBlocks=key_blocks, DocQueryBlocks=query_blocks)
    args.update(docs, HAS_DOCS=variants.document_ids is not None)
    sinks = variants.sinks
    if sinks is not None:
        sinks = _as_torch(sinks, device).to(torch.float32).contiguous()
    args.update(SCORE_MOD=score_mod, MASK_MOD=mask_mod)
    if mask is not None:
        Bm, Hm, mLq, mLk = mask.shape
        if (mLq, mLk) != (Lq, Lk) or Bm not in (1, B) or Hm not in (1, H):
            raise ValueError(f"block mask: built for (B, H, Lq, Lk)={mask.shape}, the call is {(B, H, Lq, Lk)} (B and "
                             f"H may be 1 in the mask, Lq and Lk must match)")
        mask_strides = dict(mask_stride_b=Hm if Bm > 1 else 0, mask_stride_h=1 if Hm > 1 else 0)
    else:
        mask_strides = dict(mask_stride_b=0, mask_stride_h=0)
    args.update(mask_strides)
    return args, sinks


MOD_COMPLAINTS = ("score_mod must", "mask_mod must")  # how kernels.checked_score / checked_mask's refusals begin


def mod_complaint(error: BaseException) -> Optional[str]:
    """What a score_mod or mask_mod did wrong, if that is why a launch failed: the message of the kernels' static
    assertion (``kernels.checked_score``, ``checked_mask``), found in the compiler's error (its ``error_message``)
    or the interpreter's (an AssertionError under an InterpreterError). None for any other error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        said = getattr(error, "error_message", None) or (str(error) if isinstance(error, AssertionError) else "")
        if str(said).startswith(MOD_COMPLAINTS):
            return str(said)
        error = error.__cause__ or error.__context__
    return None


@contextmanager
def _mods_refused():
    """A launch whose score_mod or mask_mod returned the wrong shape or dtype raises ValueError with the kernels'
    own sentence, not the compiler's trace."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised as it came unless a mod's check refused it
        said = mod_complaint(error)
        if said is None:
            raise
        raise ValueError(said) from error


def _check_inputs(q, k, v):
    dtype = _dtype_name(q)
    if dtype not in DTYPES:
        raise TypeError(f"q: the triton stage computes in {', '.join(DTYPES)}, got {dtype}"
                        + (" (float64: use stage='reference')" if dtype == "float64" else ""))
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {dtype}, got {_dtype_name(x)}")
    if not interpreting() and not q.is_cuda and not q.is_meta:  # (meta: compiled without a launch, figures.py)
        raise ValueError("the triton stage compiles for the GPU here: pass CUDA tensors (CPU tensors run on Triton's "
                         "interpreter, chosen when there is no GPU or WB_BACKEND=simulator)")


def _resolve_mask(mask_mod, mask, B, H, Lq, Lk, block_m, block_n, device):
    if mask is not None:
        if mask_mod is not None and mask_mod is not mask.mask_mod:
            raise ValueError("mask_mod and block_mask disagree: pass one, or the block mask built from this mask_mod")
        return mask
    if mask_mod is None:
        return None
    defaults = launch_config(64, "float16")
    return block_mask(mask_mod, B, H, Lq, Lk, block_m or defaults["block_m"], block_n or defaults["block_n"], device)


# ---------------------------------------------------------------------------------------------- the forward

def _forward(q, k, v, *, causal, key_padding_mask, scale, variants, score_mod, mask_mod, block_mask_,
             block_m, block_n, num_warps, num_stages, count_visits):
    import torch

    kernels = load_kernels()
    q, k, v = (x.contiguous() for x in (q, k, v))
    _check_inputs(q, k, v)
    B, H, Lq, D = q.shape
    mask = _resolve_mask(mask_mod, block_mask_, B, H, q.shape[2], k.shape[2], block_m, block_n, q.device)
    cfg = _settings(D, _dtype_name(q), False, block_m, block_n, num_warps, num_stages, mask)
    args, sinks = kernel_arguments(q, k, v, causal, key_padding_mask, scale, variants, score_mod,
                           None if mask is None else mask.mask_mod, mask, cfg)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    visits = torch.zeros((B * H, args["num_q_blocks"]), dtype=torch.int32, device=q.device) if count_visits else None
    grid = (args["num_q_blocks"], B * H)
    with _mods_refused():
        LAST_COMPILED["forward"] = kernels.attention_forward[grid](
            q, k, v, out, lse, Sinks=sinks, HAS_SINKS=sinks is not None,
            KvCount=None if mask is None else mask.kv_count, KvIndices=None if mask is None else mask.kv_indices,
            KvFull=None if mask is None else mask.kv_full, Visits=visits, COUNT_VISITS=count_visits,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **args)
    return out, lse, visits


def forward(q, k, v, *, causal=None, key_padding_mask=None, scale=None, variants: Variants = NO_VARIANTS,
            score_mod=None, mask_mod=None, block_mask=None, block_m=None, block_n=None, num_warps=None,
            num_stages=None):
    """Attention of torch tensors q (B, H, Lq, D), k and v (B, Hk, Lk, D): ``(out, lse)``, out in q's dtype, the
    LSE float32 (B, H, Lq), with the sinks in it. ``causal`` is None, "top_left" or "bottom_right"; `variants` a
    :class:`~wb_kernels.variants.Variants`. ``score_mod`` runs after the named score variants, in natural units,
    ``mask_mod`` with the other masks; a ``block_mask`` built from ``mask_mod`` (:func:`block_mask`) is built here
    when none is given, and its blocks are then the call's."""
    out, lse, _ = _forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, variants=variants,
                           score_mod=score_mod, mask_mod=mask_mod, block_mask_=block_mask, block_m=block_m,
                           block_n=block_n, num_warps=num_warps, num_stages=num_stages, count_visits=False)
    return out, lse


def visited_key_blocks(q, k, v, **options):
    """The forward's ``(out, lse, visits)``: ``visits`` (B, H, query blocks) counts the key blocks each query block's
    program loaded. Takes :func:`forward`'s options. What block skipping buys, in one tensor: a causal call
    visits about half the tiles, a sliding window (window + block_m) / block_n + 1 per query block whatever L is."""
    call = dict(causal=None, key_padding_mask=None, scale=None, variants=NO_VARIANTS, score_mod=None, mask_mod=None,
                block_m=None, block_n=None, num_warps=None, num_stages=None)
    call.update(options)
    call["block_mask_"] = call.pop("block_mask", None)
    out, lse, visits = _forward(q, k, v, count_visits=True, **call)
    B, H = q.shape[:2]
    return out, lse, visits.view(B, H, -1)


# ---------------------------------------------------------------------------------------------- the backward

def _check_lse_range(lse) -> None:
    """Refuse an LSE whose finite part reaches :data:`LSE_LIMIT` in magnitude (one number read back: a host sync)."""
    import torch

    if not lse.numel() or lse.is_meta:  # (meta: no values, compiled without a launch)
        return
    largest = float(torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse)).amax())
    if largest >= LSE_LIMIT:
        raise ValueError(f"the triton backward: a row's log-sum-exp is {largest:.3g} in magnitude (scores that large, "
                         f"e.g. -1e31); its float32 kernels recompute P = exp(score - LSE), and past |LSE| = 2^24 "
                         f"float32 rounding alone exceeds 1 in that exponent, so the gradients would be wrong. Scale "
                         f"the scores down, or take these gradients with stage='reference' (float64)")


def gradients(q, k, v, out, lse, dout, *, causal=None, key_padding_mask=None, scale=None,
              variants: Variants = NO_VARIANTS, score_mod=None, score_mod_derivative=None, mask_mod=None,
              block_mask=None, block_m=None, block_n=None, num_warps=None, num_stages=None) -> dict:
    """The gradients of :func:`forward`'s output for ``dout`` = dL/d(out), from the forward's ``out`` and ``lse``:
    ``{"q", "k", "v"}`` shaped like the inputs (dk, dv summed over each GQA group), plus ``"bias"`` (the bias's
    shape and dtype, summed over its broadcast dimensions) and ``"sinks"`` ((H,), the sinks' dtype) when the call
    has them. Four kernels: the preprocess (delta, the sinks' parts), dK/dV, dQ.

    A ``score_mod`` needs ``score_mod_derivative(score, b, h, q_idx, kv_idx)``: d score_mod / d score at `score`
    (a ``@triton.jit`` function like score_mod; Triton cannot differentiate a function). A mod that adds a term
    that does not depend on the score (ALiBi, a positional bias) has derivative 1.
    """
    import torch

    kernels = load_kernels()
    if score_mod is not None and score_mod_derivative is None:
        raise ValueError("score_mod: the backward needs its derivative, score_mod_derivative(score, b, h, q_idx, "
                         "kv_idx) -> d score_mod / d score (a @triton.jit function; 1.0 for a mod that adds a "
                         "term independent of the score, as ALiBi does)")
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    _check_inputs(q, k, v)
    lse = lse.to(torch.float32).contiguous()
    _check_lse_range(lse)
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    mask = _resolve_mask(mask_mod, block_mask, B, H, Lq, Lk, block_m, block_n, q.device)
    cfg = _settings(D, _dtype_name(q), True, block_m, block_n, num_warps, num_stages, mask)
    args, sinks = kernel_arguments(q, k, v, causal, key_padding_mask, scale, variants, score_mod,
                           None if mask is None else mask.mask_mod, mask, cfg)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    nq, nk = args["num_q_blocks"], args["num_k_blocks"]

    delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    sink_parts = torch.zeros((B * H, nq), dtype=torch.float32, device=q.device) if sinks is not None else None
    kernels.backward_preprocess[(nq, B * H)](
        out, dout, lse, delta, sinks, sink_parts, H, Lq, D, nq, HAS_SINKS=sinks is not None,
        BLOCK_M=cfg["block_m"], BLOCK_D=args["BLOCK_D"], **launch)

    bias = variants.bias
    dbias32 = None
    bias_flags = dict(BIAS_SUM_ROWS=False, BIAS_ATOMIC=False)
    dbias_strides = dict(stride_dbias_b=0, stride_dbias_h=0, stride_dbias_m=0, stride_dbias_n=0)
    if bias is not None:
        shape = tuple(bias.shape)
        # float32 whatever the bias's dtype: atomics add into it, and a sum over rows or heads needs the range
        dbias32 = torch.zeros(shape, dtype=torch.float32, device=q.device)
        strides = [0 if shape[i] == 1 else dbias32.stride(i) for i in range(4)]
        dbias_strides = dict(zip(("stride_dbias_b", "stride_dbias_h", "stride_dbias_m", "stride_dbias_n"), strides))
        bias_flags = dict(BIAS_SUM_ROWS=shape[2] == 1 and Lq > 1,
                          BIAS_ATOMIC=(shape[0] == 1 and B > 1) or (shape[1] == 1 and H > 1))

    lists = dict(QCount=None, QIndices=None, QFull=None) if mask is None else dict(
        QCount=mask.q_count, QIndices=mask.q_indices, QFull=mask.q_full)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    with _mods_refused():
        kernels.backward_dk_dv[(nk, B * Hk)](
            q, k, v, dout, lse, delta, dk, dv, DBias=dbias32, SCORE_MOD_DERIVATIVE=score_mod_derivative,
            **lists, **dbias_strides, **bias_flags, **args, **launch)

    lists = dict(KvCount=None, KvIndices=None, KvFull=None) if mask is None else dict(
        KvCount=mask.kv_count, KvIndices=mask.kv_indices, KvFull=mask.kv_full)
    dq = torch.empty_like(q)
    with _mods_refused():
        kernels.backward_dq[(nq, B * H)](
            q, k, v, dout, lse, delta, dq, SCORE_MOD_DERIVATIVE=score_mod_derivative, **lists, **args, **launch)

    grads = {"q": dq, "k": dk, "v": dv}
    if bias is not None:
        grads["bias"] = dbias32.to(_as_torch(bias).dtype)
    if sinks is not None:
        # the preprocess's per-block parts, summed over batch and query blocks in a fixed order: O(B * Lq / block)
        dsinks = sink_parts.view(B, H, nq).sum(dim=(0, 2))
        grads["sinks"] = dsinks.to(_as_torch(variants.sinks).dtype)
    return grads


# ---------------------------------------------------------------------------------------------- the stage's entry

def _kind_back(result, template):
    return result.detach().cpu().numpy() if not is_torch(template) else result


def _torch_variants(variants: Variants, device) -> Variants:
    """The variants as torch tensors on `device` (a NumPy caller's arrays, converted once)."""
    if not variants:
        return variants
    from dataclasses import replace

    docs = variants.document_ids
    return replace(variants,
                   alibi_slopes=_as_torch(variants.alibi_slopes, device), bias=_as_torch(variants.bias, device),
                   sinks=_as_torch(variants.sinks, device),
                   document_ids=None if docs is None else tuple(_as_torch(ids, device) for ids in docs))


def stage_forward(q, k, v, *, causal=None, key_padding_mask=None, scale=None, variants: Variants = NO_VARIANTS):
    """The registry's forward: NumPy arrays or torch tensors in, ``(out, lse)`` of the same kind out."""
    template = q
    device = None if interpreting() or is_torch(q) else "cuda"  # NumPy on a GPU: there and back
    q, k, v = (_as_torch(x, device) for x in (q, k, v))
    out, lse = forward(q, k, v, causal=causal, key_padding_mask=_as_torch(key_padding_mask, q.device), scale=scale,
                       variants=_torch_variants(variants, q.device))
    return _kind_back(out, template), _kind_back(lse, template)


def stage_gradients(q, k, v, out, lse, dout, *, causal=None, key_padding_mask=None, scale=None,
                    variants: Variants = NO_VARIANTS):
    """The registry's backward: ``(dq, dk, dv)`` without variants; with them :func:`gradients`' dict (bias and
    sinks gradients included), as :mod:`wb_kernels.execution` reads it. NumPy or torch in, the same kind out."""
    template = q
    device = None if interpreting() or is_torch(q) else "cuda"  # NumPy on a GPU: there and back
    q, k, v, out, lse, dout = (_as_torch(x, device) for x in (q, k, v, out, lse, dout))
    found = gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=_as_torch(key_padding_mask, q.device),
                      scale=scale, variants=_torch_variants(variants, q.device))
    found = {name: _kind_back(g, template) for name, g in found.items()}
    if variants:
        return found
    return found["q"], found["k"], found["v"]


def simulator_seconds(B, H, Lq, Lk, D) -> float:
    """Rough seconds of a forward on Triton's interpreter (numpy) with its default 32 x 32 blocks: about 5 ms per
    (query block, key block) step, hardly growing with D up to 128 (numpy's overhead per operation dominates), the
    backward about 2.5 times that. Measured on a 2-core machine; used to refuse sizes that would take minutes."""
    steps = B * H * triton_cdiv(Lq, INTERPRETER_BLOCK) * triton_cdiv(Lk, INTERPRETER_BLOCK)
    return 0.02 + steps * 5e-3
