"""The front door: every public entry point (all lessons, tests, the benchmark and the models).

- ``attention(q, k, v, stage=..., causal=...)`` and its gradients: through torch autograd, or ``attention_backward``
  for NumPy users (lesson 08_backward); ``attention_varlen``, the same over packed sequences in flash-attn's
  varlen layout;
- ``decode(q, k_cache, v_cache, cache_seqlens, ...)``: one new query per sequence against a KV cache, as serving
  engines call it (lesson 07), and ``decode_problems``;
- ``validate`` and the stage registry's lookups (``available_stages``, ``get_stage``, ``available_backwards``,
  ``get_backward``).

The floors below, each importing only the ones under it: the argument rules (:mod:`wb_kernels.arguments`, under the
reference and the rungs too) <- validation (:mod:`wb_kernels.validation`: every check against the stage, before any
kernel is launched or any buffer allocated, each error naming the argument, the value it got and what is accepted;
``tests/test_api_errors.py``) <- execution (:mod:`wb_kernels.execution`: validated calls run, inputs made
contiguous once, outputs in the caller's kind and dtype, NaN/Inf giving the result SDPA gives;
``tests/test_edge_cases.py``) <- the torch operators (:mod:`wb_kernels.torch_ops`: ``torch.ops.wb.attention``, its
backward and ``torch.ops.wb.decode``, which torch calls that need a gradient, a compiler or fake tensors go through;
``tests/test_autograd.py``) <- this module. A call's options keep one canonical form from validation to the kernel and
back (:class:`~wb_kernels.validation.AttentionCall`).
"""

from __future__ import annotations

import sys

import numpy as np

from . import stages as _stages  # the registry, read through its module: a test that swaps it swaps it here too
from .arguments import (Inputs, canonical_causal, canonical_scale, kind_of, require_array, validate_gradient,
                        validate_inputs)
from .device import is_torch
from .execution import attention_eager, decode_eager, propagate_non_finite, run_backward, run_forward
from .stages import available_backwards, available_stages, get_backward, get_stage  # (the public names)
from .validation import SIMULATOR_MAX_SECONDS, validate, validate_call
from .variants import document_ids_from_cu_seqlens

# the last five were public here before the front door was layered (they live in arguments, execution and validation)
__all__ = ["attention", "attention_varlen", "attention_backward", "decode", "decode_problems", "validate",
           "available_stages", "get_stage", "available_backwards", "get_backward", "torch_operators", "validate_inputs",
           "require_array", "Inputs", "propagate_non_finite", "SIMULATOR_MAX_SECONDS"]

_ops = None  # wb_kernels.torch_ops, once torch_operators() has defined the operators (it imports torch)


def torch_operators():
    """Define the package's torch operators (:func:`wb_kernels.torch_ops.register`, once per process) and return
    their module. Run when ``wb_kernels`` is imported after torch, else by the first eager call with torch tensors:
    a compiler cannot trace the definition, so a compiled first call needs it done before."""
    global _ops
    from . import torch_ops

    torch_ops.register()
    _ops = torch_ops
    return torch_ops


def _operators_defined(torch) -> bool:
    """Whether the operators exist, defining them now unless a compiler traces (which cannot trace a definition)."""
    if _ops is not None:
        return True
    if not torch.compiler.is_compiling():
        torch_operators()
        return True
    from . import torch_ops  # (a compiler traces this: registered() is one global's read)

    return torch_ops.registered()


def attention(q, k, v, *, stage: str = "reference", causal=False, key_padding_mask=None,
              scale: float | None = None, return_lse: bool = False, check_finite: bool = True, softcap=None,
              alibi_slopes=None, bias=None, window=None, document_ids=None, sinks=None):
    """Exact attention softmax(scale * q k^T [masked]) v with the chosen stage's kernel.

    Inputs
        q: (B, H, Lq, D); k, v: (B, Hk, Lk, D) where Hk = H, or Hk divides H: grouped-query attention
        (GQA; MQA when Hk = 1), as SDPA's ``enable_gqa=True``: query head h uses key/value head
        h // (H // Hk). The kernels read that head in place; nothing is copied. All NumPy arrays or all
        torch tensors (CPU, or CUDA on a GPU), of one dtype the stage accepts (``wb.get_stage(name).dtypes``)
        and a head dim D it supports. Non-contiguous inputs (slices, transposes) are copied once. Torch
        tensors are differentiable (``loss.backward()`` reaches q, k and v) with every stage that has a
        backward (``wb.stages.available_backwards()``); asking a gradient of another stage raises a
        ValueError naming those that have one. The call is the registered op ``torch.ops.wb.attention``
        when a gradient is needed, under ``torch.compile`` and for meta/fake tensors
        (:mod:`wb_kernels.torch_ops`); plain tensors that need no gradient take a direct, cheaper path.
    causal
        ``False`` (no mask), ``True`` or ``"top_left"``, or ``"bottom_right"``: query i attends keys
        j <= i + offset, where the offset is 0 at the top left and Lk - Lq at the bottom right
        (:func:`wb_kernels.reference.causal_offset`). The two differ only when Lq != Lk::

                    Lq=2, Lk=4                           Lq=4, Lk=2
                    top_left   bottom_right              top_left   bottom_right
            key     0 1 2 3    0 1 2 3           key     0 1        0 1
            query 0 x . . .    x x x .           query 0 x .        . .
            query 1 x x . .    x x x x           query 1 x x        . .
                                                 query 2 x x        x .
                                                 query 3 x x        x x

        *top-left* is SDPA's ``is_causal=True``: row i sees keys 0..i whatever Lk is. *bottom-right* is
        flash-attn's, what decoding with a KV cache and chunked prefill need: the Lq queries are the last
        Lq positions of a sequence whose first Lk - Lq keys are already cached, so the last query sees
        every key. With Lq > Lk its first Lq - Lk rows see no key (zeros, LSE -inf, as below).
        ``wb_kernels.plots.causal_alignment_figure(Lq, Lk)`` draws both. Accepts True/False, NumPy
        bools and 0/1 for the flag, and None for no mask (the canonical form the call carries to the kernel: None,
        "top_left" or "bottom_right"); another string is refused with the accepted values.
    key_padding_mask
        bool (B, Lk), True = the key takes part (SDPA's boolean ``attn_mask`` convention), on the CPU
        or the inputs' device.
    scale
        a finite number; defaults to 1/sqrt(D).
    softcap, alibi_slopes, bias, window, document_ids, sinks
        the attention variants real models use (:mod:`wb_kernels.variants` says what each does and in which order:
        Gemma 2's softcap, ALiBi, an additive bias broadcast to (B, H, Lq, Lk), a sliding window (left, right),
        packed documents' ids, gpt-oss's learnable sinks). Tensors of q's kind on q's device. ``bias`` and ``sinks``
        get gradients through autograd. A stage that does not compute a variant refuses the call, naming the
        stages that do (``wb.get_stage(name).variants``). With sinks, the LSE includes the row's sink.

    Returns the output (B, H, Lq, D) in the caller's kind (NumPy, or torch on q's device) and dtype, and with
    ``return_lse=True`` also the per-row log-sum-exp (B, H, Lq) (float32; float64 for float64 input). The LSE
    carries no gradient (torch marks it non-differentiable): differentiate through the output.

    Edge cases, the same for every stage:
        - A row that sees no key (every key masked) gets zeros and LSE -inf, never NaN.
        - Large logits (|scale * q.k| up to 1e4 and beyond) do not overflow: the row maximum is
          subtracted before exp.
        - NaN/Inf in the inputs propagate as in PyTorch's SDPA (checked against its math backend):
          a NaN or Inf in query row i makes output row i NaN; a NaN in key row j makes every row that
          attends key j NaN; an Inf in key row j makes a row's score +Inf, -Inf or NaN depending on the
          query's signs: +Inf and NaN make the row NaN, -Inf leaves key j out of that row; a NaN/Inf
          in v[j, d] reaches column d of every row that attends key j. LSE is NaN (or +Inf) in rows
          that are NaN. Exceptions: a row that sees no key stays 0 even if its query is NaN; and
          whether a NaN/Inf in a *masked* key's k or v reaches a row is not specified (SDPA's math
          backend lets it through, as it adds the mask as a -Inf bias; the stages here never use a
          masked key's k, but may multiply its v by 0, and 0 * NaN = NaN).
          The kernels themselves may assume finite inputs (the flash kernels are compiled with fast
          math), so this function keeps the promise: it looks for NaN/Inf in q and k first (one pass
          over each) and, when there are any, marks the rows SDPA would make NaN
          (:func:`wb_kernels.execution.propagate_non_finite`). ``check_finite=False`` skips that pass; the result for
          non-finite inputs is then whatever the kernel makes of them. A stage whose kernel keeps the
          promise itself (``Stage.non_finite_in_kernel``: the mma rung) gets no pass: that pass reads a
          number back from the GPU, which stalls the host on every call.

    Raises, before launching anything: TypeError (wrong kind or dtype of an argument, unknown kind of
    stage name), ValueError (shapes that disagree, Hk not dividing H, an unknown causal alignment,
    unsupported head dim, an unknown stage, CPU inputs for a GPU-only stage, a size the simulator would
    take minutes for), MemoryError (a stage's Lq x Lk
    buffers would not fit: the message says how much they need and suggests the flash stages).
    """
    variants = dict(softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, window=window, document_ids=document_ids,
                    sinks=sinks)
    if all(value is None for value in variants.values()):
        variants = {}  # (a plain call passes none on: the direct path stays a few attribute reads)
    torch = sys.modules.get("torch")  # None: no torch tensor can have been given
    if torch is not None:
        compiling = torch.compiler.is_compiling()
        if _ops is None and not compiling:
            torch_operators()  # defined eagerly, once (one global's read after it): a compiler could not
        if compiling or (isinstance(q, torch.Tensor) and _needs_op(torch, q, k, v, bias, sinks)):
            return _through_op(torch, q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask,
                               scale=scale, return_lse=return_lse, check_finite=check_finite, variants=variants)
    out, lse = attention_eager(q, k, v, key_padding_mask, stage=stage, causal=causal, scale=scale,
                               check_finite=check_finite, **variants)
    if return_lse:
        return out, lse
    return out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, stage: str = "reference", causal=False,
                     scale: float | None = None, return_lse: bool = False, check_finite: bool = True, softcap=None,
                     alibi_slopes=None, bias=None, window=None, sinks=None):
    """Attention over packed sequences in flash-attn's varlen layout: ``q`` (total_q, H, D) holds the queries of
    every sequence one after another, ``k`` and ``v`` (total_k, Hk, D) their keys and values, and ``cu_seqlens_q``
    (``cu_seqlens_k``, by default the same) the offsets [0, L_0, L_0 + L_1, ..., total] where each sequence
    starts. A query attends only keys of its own sequence. Returns the output (total_q, H, D) and, with
    ``return_lse``, the LSE (H, total_q), flash-attn's varlen LSE layout.

    It is :func:`attention` on one batch entry with the sequences as packed documents (``document_ids`` from the
    offsets, :func:`wb_kernels.variants.document_ids_from_cu_seqlens`), so it runs on every stage that computes
    document ids (``wb.get_stage(name).variants``), with gradients through autograd, and the other options mean
    what they mean there, counted along the packed positions. ``causal`` needs the same offsets for q and k (each
    query then sees its own sequence's keys up to itself): with different query and key lengths per sequence the
    diagonal's offset differs from one sequence to the next, which one call's alignment cannot say, so it is
    refused. No key is padding here: there is no ``key_padding_mask``. The triton stage skips every tile between two
    sequences, so the work is about that of the sequences alone, not of their packed length squared.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or len(x.shape) != 3:
            raise ValueError(f"attention_varlen: {name} must be ({'total_q' if name == 'q' else 'total_k'}, heads, "
                             f"D), the packed layout; got shape {tuple(getattr(x, 'shape', ()))} (for batched "
                             f"(B, H, L, D) inputs use wb.attention)")
    same_offsets = cu_seqlens_k is None
    cu_seqlens_k = cu_seqlens_q if same_offsets else cu_seqlens_k
    offsets = {}
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        values = np.asarray(cu.detach().cpu() if is_torch(cu) else cu)
        if values.ndim != 1 or values.size < 2 or values.dtype.kind not in "iu":
            raise ValueError(f"attention_varlen: {name} must be a 1-D integer array of at least two offsets [0, ..., "
                             f"total], got {values.dtype} of shape {values.shape}")
        if values[0] != 0 or np.any(np.diff(values) < 0) or values[-1] != total:
            raise ValueError(f"attention_varlen: {name} must start at 0, never decrease and end at the packed length "
                             f"{total}; got {values.tolist()[:8]}{' ...' if values.size > 8 else ''}")
        offsets[name] = values
    if offsets["cu_seqlens_q"].size != offsets["cu_seqlens_k"].size:
        raise ValueError(f"attention_varlen: cu_seqlens_q holds {offsets['cu_seqlens_q'].size - 1} sequences, "
                         f"cu_seqlens_k {offsets['cu_seqlens_k'].size - 1}: one entry per sequence in both")
    if canonical_causal(causal) and not np.array_equal(offsets["cu_seqlens_q"], offsets["cu_seqlens_k"]):
        raise ValueError("attention_varlen: causal=True needs cu_seqlens_k equal to cu_seqlens_q; with different query "
                         "and key lengths per sequence each sequence's diagonal has its own offset, which one call "
                         "cannot carry (call wb.attention per sequence with causal='bottom_right')")
    torch = sys.modules.get("torch") if is_torch(q) else None
    if torch is not None:
        batched = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # (1, heads, total, D): views
        ids = tuple(document_ids_from_cu_seqlens(torch.as_tensor(offsets[name], device=q.device), total)[None]
                    for name, total in (("cu_seqlens_q", q.shape[0]), ("cu_seqlens_k", k.shape[0])))
    else:
        batched = [np.transpose(x, (1, 0, 2))[None] for x in (q, k, v)]
        ids = tuple(document_ids_from_cu_seqlens(offsets[name], total)[None]
                    for name, total in (("cu_seqlens_q", q.shape[0]), ("cu_seqlens_k", k.shape[0])))
    out, lse = attention(*batched, stage=stage, causal=causal, scale=scale, return_lse=True,
                         check_finite=check_finite, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias,
                         window=window, document_ids=ids, sinks=sinks)
    out = out[0].transpose(0, 1) if torch is not None else np.transpose(out[0], (1, 0, 2))
    return (out, lse[0]) if return_lse else out


def _needs_op(torch, q, k, v, bias=None, sinks=None) -> bool:
    """Whether an eager torch call must go through the operators: a gradient is asked for, or the tensors are not
    plain ones (meta, fake or functional tensors: torch.export, shape inference). (A compiler's tracing is tested
    before, and without :func:`~wb_kernels.device.is_torch`, whose cache of types a compiler cannot guard on.) A CUDA
    call that needs none of this keeps the direct path: a few attribute reads here."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False  # mixed kinds: validation says what is wrong
    learnable = any(isinstance(x, torch.Tensor) and x.requires_grad for x in (bias, sinks))
    if (q.requires_grad or k.requires_grad or v.requires_grad or learnable) and torch.is_grad_enabled():
        return True
    return type(q) is not torch.Tensor or q.is_meta


def _through_op(torch, q, k, v, *, stage, causal, key_padding_mask, scale, return_lse, check_finite, variants):
    """wb.attention with autograd. In eager mode everything is validated here, before anything runs, a stage
    without a backward is refused before its forward when a gradient is asked for, and the call runs
    :class:`~wb_kernels.torch_ops.EagerAttention` (the op's arithmetic without ``torch.library``'s per-call
    wrappers); while a compiler traces, and for fake or meta tensors, it is ``torch.ops.wb.attention``, checked by
    the op's fake implementation (shapes) and its real one (everything, at run time)."""
    learnable = [variants.get(name) for name in ("bias", "sinks")]
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in learnable))
    if not (torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta):
        call = validate_call(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                             **variants)
        if wants_grad:
            _stages.get_backward(stage)  # ValueError naming the stages that have one, before the forward runs
        out, lse = _ops.EagerAttention.apply(q, k, v, key_padding_mask, *learnable, call, bool(check_finite))
        return (out, lse) if return_lse else out
    if not isinstance(stage, str):
        validate_call(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    causal, scale = canonical_causal(causal), canonical_scale(scale)  # the schema's form: the canonical one
    # the variants as the schema's arguments, their numbers canonical; the op's fake and real implementations check
    # the tensors (canonical_variants here would read the package's cache of tensor types, which a compiler's guards
    # cannot hold)
    extra = _ops.schema_variant_args(**variants) if variants else ()
    if wants_grad:
        _stages.get_backward(stage)  # (a dictionary's lookup: the registry was discovered with the operators)
    if not _operators_defined(torch):
        raise RuntimeError(f"wb.attention's operator, torch.ops.wb.attention, {_ops_missing()}")
    out, lse = torch.ops.wb.attention(q, k, v, key_padding_mask, stage, causal, scale, bool(check_finite), *extra)
    return (out, lse) if return_lse else out


def _ops_missing() -> str:
    from .torch_ops import MISSING

    return MISSING


def attention_backward(q, k, v, dout, *, stage: str = "reference", causal=False, key_padding_mask=None,
                       scale: float | None = None, out=None, lse=None, softcap=None, alibi_slopes=None, bias=None,
                       window=None, document_ids=None, sinks=None):
    """The gradients of :func:`attention` with respect to q, k and v: ``(dq, dk, dv)`` for `dout` = dL/d(out).

    For NumPy users (the lesson runs it on a laptop) and anyone who wants gradients without autograd. Inputs and
    options are those of :func:`attention`, validated alike; `dout` is shaped like the output (B, H, Lq, D), of
    q's kind, dtype and device. `out` and `lse` are what ``attention(..., return_lse=True)`` returned for these
    inputs; when not given, the forward runs first (the backward needs them: the forward saves nothing else).
    dk and dv are summed over each group of query heads that share a key/value head (GQA). A row that sees no key
    gets zero gradients. Returns the gradients in the caller's kind and each input's dtype, without autograd
    history (no double backward: through autograd, differentiating wb.attention's gradients again raises).
    A call with variants (:func:`attention`'s ``softcap`` ... ``sinks``) returns ``(dq, dk, dv, dbias, dsinks)``,
    the last two None where the call has no bias or no sinks.

    Raises the errors :func:`attention` raises, a ValueError naming the stages that have a backward when `stage`
    has none, and TypeError/ValueError for a `dout`, `out` or `lse` of the wrong kind, shape, dtype or device.
    """
    variants = dict(softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, window=window, document_ids=document_ids,
                    sinks=sinks)
    variants = {} if all(value is None for value in variants.values()) else variants
    call = validate_call(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                         **variants)
    _stages.get_backward(stage)
    inputs = validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    validate_gradient(dout, q, inputs)
    if (out is None) != (lse is None):
        raise ValueError("out, lse: pass both (what attention(..., return_lse=True) returned) or neither")
    if out is None:
        out, lse = run_forward(call, q, k, v, key_padding_mask)
    else:
        for name, given, shape in (("out", out, (inputs.B, inputs.H, inputs.Lq, inputs.D)),
                                   ("lse", lse, (inputs.B, inputs.H, inputs.Lq))):
            require_array(name, given)
            if kind_of(given) != kind_of(q) or tuple(given.shape) != shape:
                raise ValueError(f"{name}: expected a {kind_of(q)} of shape {shape} (from attention(..., "
                                 f"return_lse=True)), got a {kind_of(given)} of shape {tuple(given.shape)}")
    return run_backward(call, q, k, v, out, lse, dout, key_padding_mask)


def decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, stage: str = "decode", scale=None,
           num_splits: int | None = None, max_seqlen: int | None = None, return_lse: bool = False,
           kv_layout: str = "HND"):
    """Attention of one new query per sequence over its KV cache (shapes below).

    `stage`: "decode" (the split-KV kernels of lesson 07) or "reference" (float64 NumPy). `num_splits`: the
    number of key splits per sequence, an int in [1, max(64, capacity)] (at most ``validation.MAX_NUM_SPLITS``;
    default: chosen from the problem and the GPU's SM count, see
    ``wb_kernels.stages.decode.splitkv.choose_num_splits``). `max_seqlen`: an upper bound of cache_seqlens that the
    caller knows on the host, or a bucket of it (:func:`~wb_kernels.validation.seqlen_bucket`), so the splits cover the
    keys there are rather than the cache's whole capacity; default: the capacity. Lengths on the host above it are
    refused; lengths on the GPU above it are computed in full by the last split and reported by
    :func:`decode_problems` (no synchronisation here). `kv_layout`: "HND" or "NHD".

        out = wb.decode(q, k_cache, v_cache, cache_seqlens)                        # contiguous cache
        out = wb.decode(q, k_pages, v_pages, cache_seqlens, block_table=table)     # paged cache

    Shapes (GQA/MQA: the cache has Hk heads, Hk divides H; query head h reads KV head h // (H // Hk)):

    - q: (B, H, D), the new token's queries (after RoPE);
    - contiguous cache: k_cache, v_cache (B, Hk, L, D), sequence b's keys in [:cache_seqlens[b]];
    - paged cache: k_pages, v_pages (num_pages, Hk, page_size, D) shared by all sequences, and block_table
      (B, pages per sequence) int32: key t of sequence b lives in page block_table[b, t // page_size] at slot
      t % page_size (vLLM's PagedAttention layout, Kwon et al. 2023);
    - cache_seqlens: (B,) int32, the number of valid keys of each sequence, the new token's included.

    ``kv_layout="NHD"`` takes caches whose last two axes are (keys, heads, D) instead: (B, L, Hk, D) or
    (num_pages, page_size, Hk, D) (flash-attn's and FlashInfer's NHD), read in place through their strides. The shapes
    alone cannot tell the layouts apart when both readings divide H, so a paged NHD cache must be named.

    On a GPU the call is safe to capture in a CUDA graph and to compile with ``torch.compile(fullgraph=True)`` (it
    is the registered op ``torch.ops.wb.decode`` for compilers and fake tensors): the split count depends on the
    cache's capacity or on `max_seqlen` (a bucket, see :func:`~wb_kernels.validation.seqlen_bucket`), never on the
    lengths' values, which are read on the device only; the buffers come from PyTorch's caching allocator. A length
    that the splits do not cover (a `max_seqlen` below it) is still computed in full, by the last split, and reported
    by :func:`decode_problems`.

    The new token sees every key of its own sequence (bottom-right causal alignment with one query) and nothing
    beyond its length. Returns (B, H, D) (and the LSE (B, H) with ``return_lse=True``). A sequence of length 0 gets
    zeros and LSE -inf.
    """
    torch = sys.modules.get("torch")  # None: no torch tensor can have been given
    if torch is not None and isinstance(q, torch.Tensor):
        if torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta:
            # a compiler traces, or fake/meta tensors: the registered op (its fake implementation gives the shapes)
            if not _operators_defined(torch):
                raise RuntimeError(f"wb.decode's operator, torch.ops.wb.decode, {_ops_missing()}")
            out, lse = torch.ops.wb.decode(q, k_cache, v_cache, cache_seqlens, block_table, stage, scale,
                                           num_splits, max_seqlen, kv_layout)
            return (out, lse) if return_lse else out
        if _ops is None:
            torch_operators()  # (one global's read once they are): so that a later compile finds the op
    out, lse = decode_eager(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage, scale=scale,
                            num_splits=num_splits, max_seqlen=max_seqlen, kv_layout=kv_layout)
    return (out, lse) if return_lse else out


def decode_problems(device=None, *, reset: bool = True) -> list:
    """What the CUDA decode kernel found wrong with lengths that live on the GPU since the last look, as sentences
    saying what to do (empty: nothing). Reads a flag from the device, so it waits for the GPU: call it after a
    step, or a graph's replay, not inside one. `device`: a CUDA device (default: the current one)."""
    from .stages.decode.launcher import read_status

    return read_status(device, reset=reset)
