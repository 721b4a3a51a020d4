"""Do the ranks agree on the problem? One small all-gather before a method's first collective.

Each rank describes its call in a few int64 numbers (its tensors' shapes and dtypes, Lq, Lk, the mask's shape and
a digest of its bits, causal, layout, scale, and for split-KV decode a digest of q's bits) and one
``dist.all_gather`` gives every rank every description. Every rank then runs the same checks on the same numbers,
so a problem raises the same ValueError on every rank, in the caller's terms (which rank has what), instead of
one rank raising while the others wait, or gloo aborting on mismatched buffer sizes, or a merged answer that is
right for no rank. Cost per call: one all-gather of about 40 int64 per rank, and one read of it on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...arguments import canonical_causal
from .sharding import LAYOUTS, shard_length

__all__ = ["describe", "check_agreement", "exchange", "agree"]

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_CAUSAL = {None: 0, "top_left": 1, "bottom_right": 2}  # arguments.canonical_causal's forms
_CAUSAL_NAMES = {0: "False", 1: "'top_left'", 2: "'bottom_right'"}
_MISSING = -1
_MIX = 0x9E3779B97F4A7C15 - 2**64  # an odd multiplier (as a signed int64): position-dependent weights


def _shape(x, dims=4):
    """`dims` numbers: the shape, padded with -1 (a tensor of another rank gives -2 and its ndim)."""
    if x is None:
        return [_MISSING] * dims
    shape = list(x.shape)
    if len(shape) != dims:
        return [-2, len(shape)] + [_MISSING] * (dims - 2)
    return shape


def _dtype(x):
    if x is None:
        return _MISSING
    return _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)


def _digest(x):
    """An exact fingerprint of x's bits: the sum of its elements' bit patterns times position weights, in int64
    arithmetic (wrapping), so the same tensor gives the same number on any rank, in any summation order."""
    if x is None:
        return 0
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    flat = x.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        bits = flat.to(torch.int64)
    else:
        bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        bits = bits.to(torch.int64)
    weights = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) * _MIX + 1
    return int((bits * weights).sum())


def _scale_bits(scale):
    if scale is None:
        return [0, 0]
    return [1, int(torch.tensor([float(scale)], dtype=torch.float64).view(torch.int64))]


def describe(*, q, k, v, key_padding_mask, Lq, Lk, causal, scale, layout, extra=(), q_digest=False):
    """This rank's call as a list of int64 numbers (the layout of :func:`check_agreement`'s fields)."""
    try:  # every rank's value in its one canonical form, so causal=1 and causal=True agree
        causal_code = _CAUSAL[canonical_causal(causal)]
    except (TypeError, ValueError):
        causal_code = 3  # not a causal value: said as such, beside what the other ranks have
    return ([*_shape(q), *_shape(k), *_shape(v), _dtype(q), _dtype(k), _dtype(v),
             *_shape(key_padding_mask, 2), _digest(key_padding_mask), int(Lq), int(Lk), causal_code,
             LAYOUTS.index(layout) if layout in LAYOUTS else _MISSING, *_scale_bits(scale),
             _digest(q) if q_digest else 0]
            + [int(x) for x in extra])


# (name, first index, length) of the fields in describe's list
_FIELDS = dict(q=(0, 4), k=(4, 4), v=(8, 4), q_dtype=(12, 1), k_dtype=(13, 1), v_dtype=(14, 1), mask=(15, 2),
               mask_bits=(17, 1), Lq=(18, 1), Lk=(19, 1), causal=(20, 1), layout=(21, 1), scale=(22, 2),
               q_bits=(24, 1))


def _field(row, name):
    first, length = _FIELDS[name]
    values = row[first:first + length]
    return tuple(values) if length > 1 else values[0]


def _show(name, value):
    if name in ("q", "k", "v", "mask"):
        if value[0] == _MISSING:
            return "None"
        if value[0] == -2:
            return f"a tensor of {value[1]} dims"
        return str(tuple(value))
    if name.endswith("dtype"):
        return "None" if value == _MISSING else str(_DTYPES[value]) if value < len(_DTYPES) else "another dtype"
    if name == "causal":
        return _CAUSAL_NAMES.get(value, "an unknown value")
    if name == "layout":
        return repr(LAYOUTS[value]) if 0 <= value < len(LAYOUTS) else "an unknown layout"
    if name == "scale":
        has, bits = value
        return "None" if not has else repr(float(torch.tensor([bits], dtype=torch.int64).view(torch.float64)))
    if name.endswith("bits"):
        return f"fingerprint {value % 2**32:08x}"
    return str(value)


def _by_rank(rows, pick):
    """'rank 0: X; ranks 1, 2: Y' for the values pick(row) of every rank."""
    groups: dict = {}
    for rank, row in enumerate(rows):
        groups.setdefault(pick(row), []).append(rank)
    parts = []
    for value, ranks in groups.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))}: {value}")
    return "; ".join(parts)


_WHAT = dict(q="q's shape", q_dtype="q's dtype", k_dtype="k's dtype", v_dtype="v's dtype", Lq="Lq", Lk="Lk", causal="causal",
             layout="layout", scale="scale", mask="key_padding_mask's shape", mask_bits="key_padding_mask's values",
             q_bits="q's values")


def check_agreement(caller, rows, *, same=(), shards=None, q_sharded=True, heads_divide=False):
    """Raise one ValueError naming every disagreement between the ranks' descriptions `rows` (every rank runs this
    on the same rows, so every rank raises the same error). `same`: fields of ``describe`` that must be equal on
    every rank; batch, heads and head dim are always compared. `shards`: the layout's shard lengths are checked
    (q's length too where `q_sharded`, else q must be the whole Lq). `heads_divide`: W must divide H and Hk
    (Ulysses)."""
    world = len(rows)
    problems, per_rank = [], {}  # per_rank: {problem: [ranks]}, said once for every rank that has it
    for label, pick in (("the batch B", lambda r: _field(r, "q")[0]), ("the query heads H", lambda r: _field(r, "q")[1]),
                        ("the key/value heads Hk", lambda r: _field(r, "k")[1]),
                        ("the head dim D", lambda r: _field(r, "q")[3])):
        if len({pick(r) for r in rows}) > 1:
            problems.append(f"the ranks disagree on {label}: {_by_rank(rows, pick)}")
    for name in same:
        if len({_field(r, name) for r in rows}) > 1:
            problems.append(f"the ranks disagree on {_WHAT[name]}: "
                            f"{_by_rank(rows, lambda r, n=name: _show(n, _field(r, n)))}")
    def local(rank, text):
        per_rank.setdefault(text, []).append(rank)

    for rank, row in enumerate(rows):
        q, k, v, mask = (_field(row, n) for n in ("q", "k", "v", "mask"))
        Lq, Lk, layout = _field(row, "Lq"), _field(row, "Lk"), _field(row, "layout")
        if min(q[0], k[0], v[0]) < 0:
            local(rank, f"q, k and v must be 4-dim tensors (B, heads, positions, D), got q {_show('q', q)}, "
                        f"k {_show('k', k)}, v {_show('v', v)}")
            continue
        if k != v or q[0] != k[0] or q[3] != k[3] or k[1] == 0 or q[1] % k[1]:
            local(rank, f"q {tuple(q)}, k {tuple(k)} and v {tuple(v)} do not fit together (k and v alike, the same B "
                        f"and D as q, Hk dividing H)")
        if mask[0] != _MISSING and mask != (q[0], Lk):
            local(rank, f"key_padding_mask has shape {_show('mask', mask)}, but it must be the whole sequence's "
                        f"(B, Lk) = {(q[0], Lk)}")
        if heads_divide and (q[1] % world or k[1] % world):
            local(rank, f"W = {world} must divide the query heads ({q[1]}) and the key/value heads ({k[1]}); use the "
                        f"ring for more ranks than heads")
        if shards is not None and 0 <= layout < len(LAYOUTS):
            name = LAYOUTS[layout]
            want_q = shard_length(Lq, world, rank, name) if q_sharded else Lq
            want_k = shard_length(Lk, world, rank, name)
            if q[2] != want_q or k[2] != want_k:
                held = f"{want_q} queries and {want_k} keys" if q_sharded else f"{want_k} keys"
                problems.append(f"rank {rank} of {world} ({name}) should hold {held}, got q {tuple(q)}, "
                                f"k {tuple(k)}, v {tuple(v)}")
    for text, ranks in per_rank.items():
        who = "every rank" if len(ranks) == world > 1 else \
            f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        problems.append(f"{who}: {text}")
    if problems:
        raise ValueError(f"{caller}: " + "; ".join(problems))


def exchange(description, group=None, device=None):
    """Every rank's description (lists of int64), gathered with one all-gather (on `device`: the CPU for gloo, the
    rank's GPU for NCCL)."""
    mine = torch.tensor(description, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [row.tolist() for row in torch.stack(gathered).cpu()]


def agree(caller, *, q, k, v, key_padding_mask, Lq, Lk, causal, scale, layout="contiguous", group=None,
          same=(), shards=True, q_sharded=True, q_digest=False, heads_divide=False):
    """:func:`describe` this rank's call, :func:`exchange` the descriptions, :func:`check_agreement` them."""
    device = q.device if getattr(q, "is_cuda", False) and dist.get_backend(group) == "nccl" else None
    rows = exchange(describe(q=q, k=k, v=v, key_padding_mask=key_padding_mask, Lq=Lq, Lk=Lk, causal=causal,
                             scale=scale, layout=layout, q_digest=q_digest), group, device)
    check_agreement(caller, rows, same=same, shards=layout if shards else None, q_sharded=q_sharded,
                    heads_divide=heads_divide)
