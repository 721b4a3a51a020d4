"""An end-to-end LLaMA-shaped decoder that generates with a KV cache and a pluggable decode attention
(lesson 07_decode).

The model is the architecture of LLaMA (Touvron et al., 2023, "LLaMA: Open and Efficient Foundation
Language Models", arXiv:2302.13971): pre-norm RMSNorm (Zhang & Sennrich, 2019, arXiv:1910.07467),
rotary position embeddings (Su et al., 2021, "RoFormer", arXiv:2104.09864), grouped-query attention
(Ainslie et al., 2023, "GQA", arXiv:2305.13245) and a SwiGLU MLP (Shazeer, 2020, "GLU Variants Improve
Transformer", arXiv:2002.05202). :data:`LLAMA_1B` has the shape of Llama 3.2 1B. The weights are random:
how fast a step runs does not depend on their values, and no download is needed.

What the lesson times is the decode step. Each step feeds one new token per sequence through every layer,
appends its key and value to the cache, and calls the attention under test once per layer with the
signature every decode kernel of the package shares::

    attend(q, k_cache, v_cache, cache_seqlens, block_table=None) -> out
    q             (B, H, D)              the new token's queries, RoPE applied
    k/v_cache     (B, Hk, capacity, D)   contiguous, or
                  (num_pages, Hk, page_size, D)  a paged pool shared by all sequences
    cache_seqlens (B,) int32             valid keys per sequence, the new token's included
    block_table   (B, pages_per_seq) int32  for a paged cache: row b lists sequence b's pages in order
    out           (B, H, D)              in q's dtype; the scale is 1/sqrt(D)

The paged layout follows vLLM's PagedAttention (Kwon et al., 2023, arXiv:2309.06180): key t of sequence b
lives in page ``block_table[b, t // page_size]``, slot ``t % page_size``. Pages are handed out in a shuffled
order on purpose, so that a kernel which ignores the table reads another sequence's keys and fails its check.

The prompt goes through the model once (prefill) with causal SDPA, the same for every attention under
test, so that their caches start equal; only the decode steps use ``attend``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["DecoderConfig", "TINY", "LLAMA_1B", "LLAMA_1B_D128", "Decoder", "KVCache", "gather_pages",
           "sdpa_attend", "wb_attend", "FlashInferAttend", "float64_attend", "time_steps", "time_decode",
           "decode_step_roofline", "draw_decode_roofline"]


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a LLaMA-style decoder; every size is a count, not a byte size."""

    vocab_size: int
    dim: int  # width of the residual stream
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; each serves n_heads // n_kv_heads query heads (GQA)
    head_dim: int
    ffn_dim: int  # hidden width of the SwiGLU MLP
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048  # the longest sequence (prompt + generated) the RoPE table covers
    tie_embeddings: bool = True  # the LM head reuses the token embedding matrix

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig.{name}: expected a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"DecoderConfig: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}; "
                             "grouped-query attention gives each key/value head the same number of query heads")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim={self.head_dim}: RoPE rotates pairs of dimensions, "
                             "so it must be even")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError(f"DecoderConfig: rope_theta={self.rope_theta!r} and norm_eps={self.norm_eps!r} "
                             "must be > 0")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def layer_params(self) -> int:
        """Parameters of one transformer block: attention, MLP and its two RMSNorm weights."""
        qkv = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attention = qkv + self.n_heads * self.head_dim * self.dim  # + the output projection
        mlp = 3 * self.dim * self.ffn_dim  # gate, up and down projections
        return attention + mlp + 2 * self.dim

    def params(self) -> int:
        """Total parameter count (the embedding counted once when the LM head is tied to it)."""
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * self.layer_params() + self.dim  # + the final norm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Cache bytes one token of one sequence adds: a key and a value per layer and KV head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes


# Runs on a laptop CPU in a few milliseconds per token. Untied, so that the next token is not simply the one
# that came in (a small random model with a tied head tends to repeat its input, whatever attention returns).
TINY = DecoderConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                     max_seq_len=512, tie_embeddings=False)
# Llama 3.2 1B: 1,235,814,400 parameters, 32 KiB of KV cache per token in 16-bit.
LLAMA_1B = DecoderConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                         ffn_dim=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True)
# The same parameters and KV bytes per token with head_dim 128 (16 query heads, 4 KV heads): it changes only
# the shape a decode kernel sees.
LLAMA_1B_D128 = DecoderConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, head_dim=128,
                              ffn_dim=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True)


@dataclass
class LayerWeights:
    """One transformer block. Q, K and V share one matrix, and so do the MLP's gate and up projections:
    one matrix multiply instead of three (two) per step, which matters when a step is a few hundred
    small launches."""

    attention_norm: torch.Tensor  # (dim,)
    wqkv: torch.Tensor  # ((H + 2 Hk) D, dim): rows of Q, then K, then V
    wo: torch.Tensor  # (dim, H D)
    mlp_norm: torch.Tensor  # (dim,)
    w_gate_up: torch.Tensor  # (2 ffn, dim): rows of the gate, then of the up projection
    w_down: torch.Tensor  # (dim, ffn)


@dataclass
class KVCache:
    """Keys and values of every layer for a batch of sequences, contiguous or paged (see the module docstring)."""

    keys: list  # per layer: (B, Hk, capacity, D), or (num_pages, Hk, page_size, D) when paged
    values: list  # per layer: the same shape as keys
    cache_seqlens: torch.Tensor  # (B,) int32: valid keys per sequence
    capacity: int  # keys each sequence has room for
    block_table: torch.Tensor | None = None  # (B, pages_per_seq) int32, paged only
    page_size: int | None = None
    # The longest sequence as the host knows it: lets a step refuse to overflow without reading
    # cache_seqlens back from the GPU (a host sync).
    host_max_len: int = 0
    # Whether every sequence has host_max_len keys (prompts of one length, then one token per step): then an
    # attention can read exactly those keys without a mask, which is what lets SDPA use its fast kernels.
    host_uniform: bool = True

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor) -> None:
        """Store the keys and values of new tokens: k_new, v_new (B, Hk, T, D) at positions (B, T)."""
        batch_index = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
        if self.paged:
            pages = self.block_table.gather(1, positions // self.page_size)  # (B, T)
            rows, slots = pages.long(), positions % self.page_size
        else:
            rows, slots = batch_index, positions
        # Two index tensors around a slice put their dimensions first: the indexed view is (B, T, Hk, D).
        self.keys[layer][rows, :, slots] = k_new.transpose(1, 2)
        self.values[layer][rows, :, slots] = v_new.transpose(1, 2)

    def truncate(self, length: int) -> None:
        """Forget every key from position `length` on, in every sequence (the next step overwrites them)."""
        self.cache_seqlens.clamp_(max=length)
        self.host_max_len = min(self.host_max_len, length)

    def head(self, batch: int) -> "KVCache":
        """The first `batch` sequences of this cache, as views of its tensors (nothing copied): what a CUDA graph of
        a smaller batch bucket reads and writes (``decoder_graphs``). A paged view shares the whole pool and takes
        the first `batch` rows of the block table."""
        if not 1 <= batch <= self.cache_seqlens.shape[0]:
            raise ValueError(f"head({batch}): the cache holds {self.cache_seqlens.shape[0]} sequences")
        if self.paged:
            keys, values, table = self.keys, self.values, self.block_table[:batch]
        else:
            keys, values, table = [k[:batch] for k in self.keys], [v[:batch] for v in self.values], None
        return KVCache(keys, values, self.cache_seqlens[:batch], self.capacity, table, self.page_size,
                       self.host_max_len, self.host_uniform)


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The first `num_keys` keys of every sequence of a paged pool, copied into a contiguous (B, Hk, num_keys, D).

    This copy is what a paged kernel avoids: it reads each key once, through the table, where it lies.
    """
    _, kv_heads, page_size, head_dim = pool.shape
    pages = block_table[:, :-(-num_keys // page_size)].long()  # (B, P): only the pages that hold the keys
    gathered = pool[pages]  # (B, P, Hk, page_size, D)
    batch = pages.shape[0]
    return gathered.transpose(1, 2).reshape(batch, kv_heads, -1, head_dim)[:, :, :num_keys]


def _keys_to_read(k_cache, cache_seqlens, block_table, max_seqlen=None, equal_lengths=False):
    """How many key positions an attention must look at, and whether every sequence has that many.

    The decoder passes what the host knows (`max_seqlen`, `equal_lengths`), as serving engines pass the longest
    length of a batch to their kernels. Without it: on the CPU the lengths are read for free; on a GPU reading them
    would stall the host once per layer, so the whole capacity is read and the padding masked.
    """
    capacity = k_cache.shape[2] * block_table.shape[1] if block_table is not None else k_cache.shape[2]
    if max_seqlen is not None:
        return min(int(max_seqlen), capacity), bool(equal_lengths)
    if cache_seqlens.device.type != "cpu":
        return capacity, False
    lengths = cache_seqlens.tolist()
    return max(lengths), min(lengths) == max(lengths)


# SDPA's backends for a decode step, in PyTorch's order of preference (see sdpa_attend)
_DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# region: sdpa_attend
def sdpa_attend(q, k_cache, v_cache, cache_seqlens, block_table=None, *, max_seqlen=None, equal_lengths=False):
    """Decode attention with PyTorch's SDPA: the baseline every decode kernel is timed against.

    A paged cache is first gathered through the block table into a contiguous copy; keys at or beyond a
    sequence's length are masked (or, when all lengths are equal and known on the host, sliced off).
    """
    # Not cuDNN's backend, which PyTorch picks by default on recent GPUs: it plans a new execution graph for every
    # new key length, that is, on every decode step (about 60 ms per step on an H100, in tune.py's measurement).
    with sdpa_kernel(_DECODE_SDPA_BACKENDS):
        return _sdpa_attend(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen, equal_lengths)


def _sdpa_attend(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen, equal_lengths):
    num_keys, all_equal = _keys_to_read(k_cache, cache_seqlens, block_table, max_seqlen, equal_lengths)
    if block_table is not None:
        k, v = gather_pages(k_cache, block_table, num_keys), gather_pages(v_cache, block_table, num_keys)
    else:
        k, v = k_cache[:, :, :num_keys], v_cache[:, :, :num_keys]  # (B, Hk, num_keys, D)
    if all_equal:
        # enable_gqa: query head h reads KV head h // (H // Hk) without K and V being repeated in memory.
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)
        return out[:, :, 0, :]
    positions = torch.arange(num_keys, device=q.device)
    mask = (positions[None, :] < cache_seqlens[:, None])[:, None, None, :]  # (B, 1, 1, num_keys)
    # With a mask, SDPA's fused kernels do not take enable_gqa; the query heads of a group become the query rows of
    # their KV head instead ((B, Hk, G, D): heads kv * G .. kv * G + G - 1 are consecutive), which they do take.
    batch, n_heads, head_dim = q.shape
    grouped = q.reshape(batch, k.shape[1], n_heads // k.shape[1], head_dim)
    return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).reshape(batch, n_heads, head_dim)
# endregion


def wb_attend(q, k_cache, v_cache, cache_seqlens, block_table=None, *, max_seqlen=None, equal_lengths=False,
              stage: str = "decode", num_splits: int | None = None):
    """Decode attention by this series' kernel: ``wb.decode`` (lesson 07), its output in q's dtype.

    `max_seqlen` (known on the host) lets the kernel split the keys there are rather than the cache's capacity;
    `equal_lengths` needs nothing special here: the kernel reads each sequence's own length on the GPU.
    `num_splits`: the kernel's split count (default: its own choice from the problem and `max_seqlen`); a CUDA
    graph passes the capacity as `max_seqlen`, so that the split count is the same on every replay.
    """
    import wb_kernels as wb

    out = wb.decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage, max_seqlen=max_seqlen,
                    num_splits=num_splits)
    return out.to(q.dtype)


class FlashInferAttend:
    """Decode attention by FlashInfer's paged decode (``wb_kernels.bench.flashinfer.PagedDecode``), the attention the
    vLLM and SGLang serving engines run: the third attention of lesson 07's tokens per second, next to SDPA and this
    series' kernel. Needs flashinfer on a CUDA GPU (``pip install .[contenders]``) and a paged cache.

    As a serving engine does, it plans once per decode step (when the lengths change) and reuses the plan in every
    layer. The lengths it plans with are the host's: every sequence at `max_seqlen` when the decoder says they are
    equal, otherwise read from the GPU once per step (a synchronisation an engine avoids by keeping them on the host).
    """

    def __init__(self, *, use_tensor_cores: bool = False):
        self.use_tensor_cores = use_tensor_cores
        self._decode = None

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table=None, *, max_seqlen=None, equal_lengths=False):
        from ..bench import flashinfer

        if block_table is None:
            raise ValueError("FlashInferAttend reads a paged cache (its batch decode takes pages and a block table); "
                             "this cache is contiguous")
        why = flashinfer.problem()
        if why is not None:
            raise RuntimeError(why)
        if self._decode is None:
            self._decode = flashinfer.PagedDecode(q.device, use_tensor_cores=self.use_tensor_cores)
        batch, n_heads, head_dim = q.shape
        lengths = [int(max_seqlen)] * batch if equal_lengths and max_seqlen is not None else cache_seqlens.tolist()
        self._decode.plan(block_table, lengths, num_heads=n_heads, kv_heads=k_cache.shape[1], head_dim=head_dim,
                          page_size=k_cache.shape[2], dtype=q.dtype)
        return self._decode.run(q.contiguous(), k_cache, v_cache)


class FlashInferGraphAttend:
    """FlashInfer's paged decode inside :class:`~.decoder_graphs.GraphedDecoder`'s CUDA graphs, as vLLM's and
    SGLang's FlashInfer backends run it (``wb_kernels.bench.flashinfer.GraphPagedDecode``: one wrapper per batch
    size with fixed buffers; the graph captures its ``run``, the host plans before every replay).

    An eager call (the warm-up steps before a capture, or a runner that does not capture) plans from the lengths on
    the GPU (a synchronisation, outside any capture), then runs. Inside a capture it only runs. Before each replay
    the runner calls :meth:`before_replay` with the length every sequence then has (the host knows it: each step
    adds one key), and this plans for it.
    """

    def __init__(self, *, use_tensor_cores: bool = False):
        self.use_tensor_cores = use_tensor_cores
        self._decodes = {}  # batch -> (GraphPagedDecode, its problem: the block table and the plan's sizes)

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table=None, *, max_seqlen=None, equal_lengths=False):
        from ..bench import flashinfer

        if block_table is None:
            raise ValueError("FlashInferGraphAttend reads a paged cache (its batch decode takes pages and a block "
                             "table); this cache is contiguous")
        batch, n_heads, head_dim = q.shape
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if batch not in self._decodes:
            if capturing:
                raise ValueError("FlashInferGraphAttend: run an eager step of this batch before capturing it (the "
                                 "first call makes FlashInfer's wrapper and plans)")
            why = flashinfer.problem()
            if why is not None:
                raise RuntimeError(why)
            decode = flashinfer.GraphPagedDecode(q.device, batch=batch, max_pages=block_table.numel(),
                                                 use_tensor_cores=self.use_tensor_cores)
            sizes = dict(num_heads=n_heads, kv_heads=k_cache.shape[1], head_dim=head_dim, page_size=k_cache.shape[2],
                         dtype=q.dtype)
            self._decodes[batch] = (decode, block_table, sizes)
        decode, table, sizes = self._decodes[batch]
        if block_table.data_ptr() != table.data_ptr():
            raise ValueError("FlashInferGraphAttend serves one runner's cache: its wrappers hold that cache's block "
                             "table and plans; give each GraphedDecoder an attention of its own")
        if not capturing:
            decode.plan(table, cache_seqlens.tolist(), **sizes)
        return decode.run(q.contiguous(), k_cache, v_cache)

    def before_replay(self, batch: int, length: int) -> None:
        """Plan the next replay of `batch` sequences, each `length` keys long (the new key included)."""
        decode, table, sizes = self._decodes[batch]
        decode.plan(table, [length] * batch, **sizes)


def float64_attend(q, k_cache, v_cache, cache_seqlens, block_table=None, *, max_seqlen=None, equal_lengths=False):
    """Decode attention in float64, written out in plain torch: the reference for the tests.

    Reads every key slot of the cache and masks those at or beyond each sequence's length; a sequence
    with no key at all gets output 0. The result is cast back to q's dtype.
    """
    batch, n_heads, head_dim = q.shape
    if block_table is not None:
        capacity = k_cache.shape[2] * block_table.shape[1]
        k, v = gather_pages(k_cache, block_table, capacity), gather_pages(v_cache, block_table, capacity)
    else:
        capacity, k, v = k_cache.shape[2], k_cache, v_cache
    if n_heads % k.shape[1]:
        raise ValueError(f"float64_attend: q has {n_heads} heads, not a multiple of the cache's {k.shape[1]} KV heads")
    group = n_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # (B, H, capacity, D): query head h reads KV head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhkd->bhk", q.double(), k) / math.sqrt(head_dim)
    valid = torch.arange(capacity, device=q.device)[None, :] < cache_seqlens[:, None].long()  # (B, capacity)
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid.any(dim=1)[:, None, None], probs, 0.0)  # no key: 0, not the NaN of 0/0
    return torch.einsum("bhk,bhkd->bhd", probs, v).to(q.dtype)


def _rms_norm(x, weight, eps):
    # In float32 whatever the model's dtype, as LLaMA's reference code does: the mean of squares of a
    # wide fp16 vector can overflow. F.rms_norm is one fused kernel on a GPU where written out it is six
    # (a decode step at batch 1 is a few hundred launches of microseconds each).
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def _apply_rope(x, cos, sin):
    """Rotate x (..., D) by position: dimension i pairs with i + D/2 (the "rotate half" layout of GPT-NeoX and
    Hugging Face; Meta's code pairs neighbours, which is the same up to a fixed permutation of dimensions)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Decoder:
    """A LLaMA-shaped decoder with random weights, for timing and testing decode attention.

    A plain class holding tensors rather than an ``nn.Module``: nothing is trained, and every tensor a step
    reads is in sight. The model's passes run under ``torch.inference_mode``; the cache's tensors are made
    outside it, so that a caller may still rewrite them (:meth:`KVCache.truncate`) anywhere.
    """

    def __init__(self, config: DecoderConfig, *, dtype=torch.float32, device="cpu", seed: int = 0):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        c = config

        def normal(rows, cols, std):
            # Drawn in float32 and cast, so a seed gives the same weights (up to rounding) in every dtype.
            w = torch.empty(rows, cols, device=self.device).normal_(0.0, std, generator=generator)
            return w.to(dtype)

        def ones():
            return torch.ones(c.dim, dtype=dtype, device=self.device)

        # Small weights, as in GPT-2's initialisation: std 0.02, and the projections that add to the residual
        # stream scaled by 1/sqrt(2 n_layers) so that its size stays put over the layers and fp16 never overflows.
        std, residual_std = 0.02, 0.02 / math.sqrt(2 * c.n_layers)
        with torch.inference_mode():
            self.embedding = normal(c.vocab_size, c.dim, std)  # (vocab, dim)
            self.layers = [LayerWeights(attention_norm=ones(),
                                        wqkv=normal((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim, std),
                                        wo=normal(c.dim, c.n_heads * c.head_dim, residual_std),
                                        mlp_norm=ones(),
                                        w_gate_up=normal(2 * c.ffn_dim, c.dim, std),
                                        w_down=normal(c.dim, c.ffn_dim, residual_std))
                           for _ in range(c.n_layers)]
            self.final_norm = ones()
            self.lm_head = self.embedding if c.tie_embeddings else normal(c.vocab_size, c.dim, std)  # (vocab, dim)
            # RoPE angles of every position, in float32: position * theta^(-2i/D) for i < D/2.
            even_dims = torch.arange(0, c.head_dim, 2, device=self.device, dtype=torch.float64)
            inv_freq = c.rope_theta ** (-even_dims / c.head_dim)
            angles = torch.arange(c.max_seq_len, device=self.device, dtype=torch.float64)[:, None] * inv_freq
            self.rope_cos, self.rope_sin = angles.cos().float(), angles.sin().float()  # (max_seq_len, D/2)

    # ---- the cache -------------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int, *, paged: bool = False, page_size: int = 16,
                  seed: int = 0) -> KVCache:
        """An empty cache with room for `capacity` keys per sequence. Paged: the pool has exactly the pages the
        batch needs, assigned to sequences in an order shuffled with `seed`."""
        c = self.config
        if not 1 <= capacity <= c.max_seq_len:
            raise ValueError(f"capacity={capacity}: a cache holds 1 to max_seq_len={c.max_seq_len} keys per sequence")
        if batch < 1:
            raise ValueError(f"batch={batch}: expected at least one sequence")
        zeros = dict(dtype=self.dtype, device=self.device)
        seqlens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        if not paged:
            shape = (batch, c.n_kv_heads, capacity, c.head_dim)
            return KVCache([torch.zeros(shape, **zeros) for _ in range(c.n_layers)],
                           [torch.zeros(shape, **zeros) for _ in range(c.n_layers)], seqlens, capacity)
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size={page_size!r}: expected a positive int")
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq
        shuffled = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
        block_table = shuffled.view(batch, pages_per_seq).to(device=self.device, dtype=torch.int32)
        shape = (num_pages, c.n_kv_heads, page_size, c.head_dim)
        return KVCache([torch.zeros(shape, **zeros) for _ in range(c.n_layers)],
                       [torch.zeros(shape, **zeros) for _ in range(c.n_layers)], seqlens,
                       pages_per_seq * page_size, block_table, page_size)

    # ---- the model -------------------------------------------------------------------------------------

    def _rope_angles(self, positions):
        """cos and sin (B, 1, T, D/2) of positions (B, T): gathered once per pass, shared by every layer."""
        return self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]

    def _project_qkv(self, layer: LayerWeights, x, rope):
        """x (B, T, dim) -> q (B, H, T, D), k and v (B, Hk, T, D), RoPE applied to q and k with `rope`, the
        (cos, sin) of :meth:`_rope_angles`."""
        c = self.config
        qkv = F.linear(_rms_norm(x, layer.attention_norm, c.norm_eps), layer.wqkv)
        q, k, v = qkv.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], dim=-1)
        batch, tokens = x.shape[:2]
        q = q.view(batch, tokens, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(batch, tokens, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, c.n_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v

    def _mlp(self, layer: LayerWeights, x, split_gate_up: bool = False):
        normed = _rms_norm(x, layer.mlp_norm, self.config.norm_eps)
        if split_gate_up:
            # Two products over the row halves of the one matrix (views: no weight is copied). Compiled with
            # Inductor's matrix-vector products as reductions (coordinate_descent_tuning), two reductions of the same
            # shape that read the same input can become one kernel that also computes silu(gate) * up as it stores,
            # where the one product's output must first be split in two by a later kernel.
            ffn = self.config.ffn_dim
            gate, up = F.linear(normed, layer.w_gate_up[:ffn]), F.linear(normed, layer.w_gate_up[ffn:])
        else:
            gate, up = F.linear(normed, layer.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.w_down)

    def _logits(self, x):
        return F.linear(_rms_norm(x, self.final_norm, self.config.norm_eps), self.lm_head)

    def _check_tokens(self, name, ids, ndim):
        integer = isinstance(ids, torch.Tensor) and not (ids.dtype.is_floating_point or ids.dtype.is_complex
                                                         or ids.dtype == torch.bool)
        if not integer:
            raise TypeError(f"{name}: expected an integer torch tensor, got {type(ids).__name__} "
                            f"{getattr(ids, 'dtype', '')}".rstrip())
        if ids.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(ids.shape)}")

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor, cache: KVCache, *, prompt_lens=None) -> torch.Tensor:
        """Run the prompts (B, L) through the model with causal SDPA, fill the cache, and return the logits
        (B, vocab) that predict each sequence's next token.

        `prompt_lens` (B,), optional: sequence b's prompt is its first prompt_lens[b] tokens; the rest of
        its row is padding, which no real token attends (causal) and whose cache slots the next steps overwrite.
        """
        c = self.config
        self._check_tokens("prompt_ids", prompt_ids, 2)
        batch, length = prompt_ids.shape
        if length < 1 or length > cache.capacity:
            raise ValueError(f"prompt_ids: length {length} must be 1 to the cache's capacity {cache.capacity} "
                             f"(max_seq_len={c.max_seq_len})")
        if batch != cache.cache_seqlens.shape[0]:
            raise ValueError(f"prompt_ids: batch {batch} does not match the cache's {cache.cache_seqlens.shape[0]}")
        if int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= c.vocab_size:
            raise ValueError(f"prompt_ids: token ids must lie in [0, {c.vocab_size}), got "
                             f"[{int(prompt_ids.min())}, {int(prompt_ids.max())}]")
        if prompt_lens is None:
            lengths = torch.full((batch,), length, dtype=torch.int32, device=self.device)
        else:
            lengths = torch.as_tensor(prompt_lens, device=self.device).to(torch.int32)
            if lengths.shape != (batch,) or int(lengths.min()) < 1 or int(lengths.max()) > length:
                raise ValueError(f"prompt_lens: expected {batch} lengths in [1, {length}], got {lengths.tolist()}")
        prompt_ids = prompt_ids.to(self.device)
        positions = torch.arange(length, device=self.device).expand(batch, length)  # (B, L)
        x = self.embedding[prompt_ids]  # (B, L, dim)
        rope = self._rope_angles(positions)
        for index, layer in enumerate(self.layers):
            q, k, v = self._project_qkv(layer, x, rope)
            cache.write(index, k, v, positions)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, L, D)
            x = x + F.linear(attended.transpose(1, 2).reshape(batch, length, -1), layer.wo)
            x = x + self._mlp(layer, x)
        cache.cache_seqlens.copy_(lengths)
        cache.host_max_len = length
        cache.host_uniform = prompt_lens is None
        last = x[torch.arange(batch, device=self.device), lengths.long() - 1]  # (B, dim): each prompt's last token
        return self._logits(last)

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, cache: KVCache, attend) -> torch.Tensor:
        """Feed one token per sequence (B,), append its keys and values to the cache, and return the logits
        (B, vocab) for the next one. `attend` is the decode attention under test (see the module docstring).

        Nothing here reads a GPU value back to the host, so the host can queue the next kernels while the
        GPU runs; token ids are not range-checked for that reason. The host tells the attention the longest
        length it knows (``cache.host_max_len``), so that it reads only the keys there are.
        """
        if cache.host_max_len + 1 > cache.capacity:
            raise ValueError(f"the cache is full: {cache.host_max_len} keys per sequence, capacity {cache.capacity}")
        cache.host_max_len += 1
        return self.forward_step(tokens.to(self.device), cache, attend, max_seqlen=cache.host_max_len,
                                 equal_lengths=cache.host_uniform)

    def forward_step(self, tokens: torch.Tensor, cache: KVCache, attend, *, max_seqlen: int,
                     equal_lengths: bool, split_gate_up: bool = False) -> torch.Tensor:
        """One decode step on the device alone: what :meth:`decode_step` runs, and what a CUDA graph captures
        (``decoder_graphs``). Every position comes from ``cache.cache_seqlens`` on the device, every size from
        the host's `max_seqlen` (a graph passes the cache's capacity, the same on every replay), and nothing is
        read back, allocated by the host or checked against a value on the GPU. `split_gate_up`: the MLP's gate and
        up projections as two matrix products over views of their one matrix (a variant of the compiled step,
        ``decoder_graphs.COMPILE_VARIANTS``); the same arithmetic, up to the order of rounding."""
        c = self.config
        batch = tokens.shape[0]
        positions = cache.cache_seqlens.long()[:, None]  # (B, 1): where the new token goes, and its RoPE angle
        cache.cache_seqlens.add_(1)  # every layer's attention sees the new token's key
        x = self.embedding[tokens][:, None, :]  # (B, 1, dim)
        rope = self._rope_angles(positions)
        for index, layer in enumerate(self.layers):
            q, k, v = self._project_qkv(layer, x, rope)
            cache.write(index, k, v, positions)
            attended = attend(q[:, :, 0, :], cache.keys[index], cache.values[index], cache.cache_seqlens,
                              cache.block_table, max_seqlen=max_seqlen, equal_lengths=equal_lengths)  # (B, H, D)
            if attended.shape != (batch, c.n_heads, c.head_dim) or attended.dtype != self.dtype:
                raise ValueError(f"attend returned {tuple(attended.shape)} {attended.dtype}; expected "
                                 f"{(batch, c.n_heads, c.head_dim)} {self.dtype}")
            x = x + F.linear(attended.reshape(batch, 1, -1), layer.wo)
            x = x + self._mlp(layer, x, split_gate_up)
        return self._logits(x[:, 0, :])

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, attend, paged: bool = False, page_size: int = 16):
        """Greedy generation: the prompts (B, L) followed by `max_new_tokens` argmax tokens each, (B, L + new).

        The first new token comes from the prefill's logits; each further one costs one decode step.
        """
        if not isinstance(prompt_ids, torch.Tensor):
            prompt_ids = torch.as_tensor(prompt_ids)
        self._check_tokens("prompt_ids", prompt_ids, 2)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 0")
        batch, length = prompt_ids.shape
        total = length + max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt length {length} + max_new_tokens {max_new_tokens} = {total} exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        prompt_ids = prompt_ids.to(self.device)
        if max_new_tokens == 0:
            return prompt_ids.clone()
        # Room for total - 1 keys: the last token generated is returned, never fed back.
        cache = self.new_cache(batch, total - 1, paged=paged, page_size=page_size)
        next_token = self.prefill(prompt_ids, cache).argmax(-1)
        generated = [next_token]
        for _ in range(max_new_tokens - 1):
            next_token = self.decode_step(next_token, cache, attend).argmax(-1)
            generated.append(next_token)
        return torch.cat([prompt_ids, torch.stack(generated, dim=1).to(prompt_ids.dtype)], dim=1)


class _TimedAttend:
    """Wraps an attend function and adds up the time its calls take: CUDA events on a GPU (read once, after
    the run, so no call waits for the GPU), a host clock on the CPU."""

    def __init__(self, attend, on_cuda: bool):
        self.attend, self.on_cuda = attend, on_cuda
        self.events, self.host_seconds = [], 0.0

    def __call__(self, *args, **kwargs):
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.attend(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = self.attend(*args, **kwargs)
        self.host_seconds += time.perf_counter() - t0
        return out

    def total_ms(self) -> float:
        """The summed time of all calls; on a GPU, call after synchronizing."""
        if self.on_cuda:
            return sum(start.elapsed_time(end) for start, end in self.events)
        return self.host_seconds * 1e3


def time_steps(step, count: int, on_cuda: bool) -> float:
    """Milliseconds that `count` back-to-back calls of `step` take: CUDA events around the loop on a GPU (the
    device's time from the first launch to the last kernel's end), the wall clock on the CPU."""
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    started = time.perf_counter()
    for _ in range(count):
        step()
    return (time.perf_counter() - started) * 1e3


def time_decode(model: Decoder, *, batch: int, prompt_len: int, new_tokens: int, attend, paged: bool = False,
                warmup: int = 3, page_size: int = 16, seed: int = 0) -> dict:
    """Time `new_tokens` greedy decode steps of `batch` random prompts of `prompt_len` tokens each.

    Returns a dict: ``tokens_per_s`` (batch x steps / seconds), ``ms_per_step``, ``attention_ms_per_step`` and
    ``attention_share`` (the part of a step spent inside `attend`), with the run's settings. `warmup` steps run
    first, untimed, and the cache is then rewound to the prompt, so the timed steps see contexts of
    prompt_len + 1 to prompt_len + new_tokens keys.

    On a GPU the time is measured on the GPU with CUDA events: one pair around the whole run and one around
    each attention call, all read after a single synchronization at the end, so no step waits for the host.
    (Events around the attention calls add a little launch work of their own.) On the CPU, a host clock.
    """
    if min(batch, prompt_len, new_tokens) < 1 or warmup < 0:
        raise ValueError(f"batch={batch}, prompt_len={prompt_len}, new_tokens={new_tokens} must be >= 1 "
                         f"and warmup={warmup} >= 0")
    on_cuda = model.device.type == "cuda"
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator)
    cache = model.new_cache(batch, prompt_len + max(warmup, new_tokens), paged=paged, page_size=page_size)
    first_token = model.prefill(prompt, cache).argmax(-1)
    token = first_token
    for _ in range(warmup):
        token = model.decode_step(token, cache, attend).argmax(-1)
    cache.truncate(prompt_len)
    timed_attend = _TimedAttend(attend, on_cuda)
    token = first_token

    def step():
        nonlocal token
        token = model.decode_step(token, cache, timed_attend).argmax(-1)

    if on_cuda:
        torch.cuda.synchronize(model.device)
    total_ms = time_steps(step, new_tokens, on_cuda)
    attention_ms = timed_attend.total_ms()
    return {
        "tokens_per_s": batch * new_tokens / (total_ms / 1e3),
        "ms_per_step": total_ms / new_tokens,
        "attention_ms_per_step": attention_ms / new_tokens,
        "attention_share": attention_ms / total_ms,
        "batch": batch, "prompt_len": prompt_len, "steps": new_tokens, "paged": paged,
        "device": "cuda" if on_cuda else "cpu",
    }


def decode_step_roofline(config: DecoderConfig, *, batch: int, context_len: int, dtype_bytes: int,
                         bandwidth_bytes_per_s: float, peak_flops_per_s: float | None = None) -> dict:
    """What one decode step must move and compute, and how fast memory bandwidth lets it go.

    Bytes read: every weight once per step, whatever the batch (an untied embedding table only for B rows,
    which is left out), plus the whole KV cache: ``context_len`` keys and values per layer per sequence.
    FLOPs: 2 per weight per token for the matrix multiplies (LM head included), and 4 H D per key per layer
    per sequence for q.K and p.V; norms, RoPE and softmax are left out. The step time is bytes / bandwidth,
    or the compute time when `peak_flops_per_s` is given and that is longer.
    """
    if min(batch, context_len, dtype_bytes) < 1 or not bandwidth_bytes_per_s > 0:
        raise ValueError(f"batch={batch}, context_len={context_len}, dtype_bytes={dtype_bytes} must be >= 1 and "
                         f"bandwidth_bytes_per_s={bandwidth_bytes_per_s} > 0")
    c = config
    untied_embedding = 0 if c.tie_embeddings else c.vocab_size * c.dim
    weight_bytes = (c.params() - untied_embedding) * dtype_bytes
    kv_cache_bytes = batch * context_len * c.kv_bytes_per_token(dtype_bytes)
    norm_params = (2 * c.n_layers + 1) * c.dim
    matmul_params = c.params() - norm_params - (c.vocab_size * c.dim if not c.tie_embeddings else 0)
    attention_flops = 4 * c.n_heads * c.head_dim * context_len * c.n_layers * batch
    flops = 2 * matmul_params * batch + attention_flops
    bytes_per_step = weight_bytes + kv_cache_bytes
    step_time_s = bytes_per_step / bandwidth_bytes_per_s
    if peak_flops_per_s is not None:
        step_time_s = max(step_time_s, flops / peak_flops_per_s)
    return {
        "weight_bytes": weight_bytes,
        "kv_cache_bytes": kv_cache_bytes,
        "bytes_per_step": bytes_per_step,
        "kv_share": kv_cache_bytes / bytes_per_step,
        "flops_per_step": flops,
        "arithmetic_intensity": flops / bytes_per_step,  # FLOPs per byte
        "step_time_s": step_time_s,
        "tokens_per_s": batch / step_time_s,
    }


def draw_decode_roofline(config: DecoderConfig, *, dtype_bytes: int, bandwidth_bytes_per_s: float,
                         batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), context_lens=(512, 2048, 8192, 32768),
                         measured=()):
    """Two panels against the batch size, one line per context length: the tokens per second that memory
    bandwidth allows, and the share of the bytes read that is KV cache rather than weights.

    `measured`: results of :func:`time_decode` to mark on the left panel (their context: prompt_len + steps/2).
    """
    from ..plots import new_figure

    fig, (speed_ax, share_ax) = new_figure(ncols=2)
    for context_len in context_lens:
        points = [decode_step_roofline(config, batch=b, context_len=context_len, dtype_bytes=dtype_bytes,
                                       bandwidth_bytes_per_s=bandwidth_bytes_per_s) for b in batches]
        line, = speed_ax.plot(batches, [p["tokens_per_s"] for p in points], "o-", markersize=3,
                              label=f"context {context_len}")
        share_ax.plot(batches, [100 * p["kv_share"] for p in points], "o-", markersize=3, color=line.get_color())
    for result in measured:
        speed_ax.plot(result["batch"], result["tokens_per_s"], "kx")
        speed_ax.annotate(f"{result['prompt_len'] + result['steps'] // 2}", (result["batch"], result["tokens_per_s"]),
                          textcoords="offset points", xytext=(4, -10), fontsize=8)
    speed_ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="tokens / s",
                 title=f"bandwidth bound at {bandwidth_bytes_per_s / 1e12:.3g} TB/s")
    share_ax.set(xscale="log", xlabel="batch (sequences)", ylabel="% of bytes read", ylim=(0, 100),
                 title="KV cache share of each step's bytes")
    speed_ax.legend()
    return fig
