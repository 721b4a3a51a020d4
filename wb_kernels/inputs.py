"""Seeded random inputs for every lesson (01-09), the tests and the benchmark.

The values are drawn once in float64 with NumPy's PCG64 generator and then cast, so the same seed
gives the same numbers as NumPy or torch, on the CPU or a GPU, in any dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = ["random_qkv", "random_padding_mask", "paged_copy", "DTYPES"]

# the dtypes of the package's inputs: what random_qkv makes and what wb.check measures errors in
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _check_framework(framework):
    if not isinstance(framework, str) or framework not in ("numpy", "torch"):
        raise ValueError(f"framework: expected 'numpy' or 'torch', got {framework!r}")


def _check_dtype(dtype, framework: str):
    if not isinstance(dtype, str):
        raise TypeError(f"dtype: expected a dtype name (str), one of {', '.join(DTYPES)}; got {dtype!r} of type "
                        f"{type(dtype).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if framework == "numpy" and dtype == "bfloat16":
        raise ValueError("NumPy has no bfloat16; use framework='torch'")


def _convert(x: np.ndarray, dtype: str, framework: str, device: str | None):
    if framework == "numpy":
        return np.ascontiguousarray(x.astype(dtype))
    import torch

    return torch.from_numpy(x).to(device=device or "cpu", dtype=getattr(torch, dtype)).contiguous()


def random_qkv(
    B: int = 1,
    H: int = 1,
    Lq: int = 64,
    D: int = 32,
    *,
    Lk: int | None = None,
    dtype: str = "float32",
    framework: str = "numpy",
    device: str | None = None,
    seed: int = 0,
    std: float = 1.0,
):
    """Q (B, H, Lq, D), K and V (B, H, Lk, D) with entries ~ N(0, std^2).

    ``std`` scales the logits: large values exercise softmax overflow.
    """
    _check_framework(framework)
    _check_dtype(dtype, framework)
    Lk = Lq if Lk is None else Lk
    for name, value in (("B", B), ("H", H), ("Lq", Lq), ("Lk", Lk), ("D", D)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Lq, D)) * std
    k = rng.standard_normal((B, H, Lk, D)) * std
    v = rng.standard_normal((B, H, Lk, D))
    return tuple(_convert(x, dtype, framework, device) for x in (q, k, v))


def random_padding_mask(B: int, Lk: int, *, keep_fraction: float = 0.7, seed: int = 0,
                        framework: str = "numpy", device: str | None = None):
    """Boolean key-padding mask (B, Lk), True = the key takes part. Each batch keeps a random
    prefix of its keys (at least one), like padded sequences of different lengths."""
    _check_framework(framework)
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, np.round(rng.uniform(keep_fraction / 2, 1.0, size=B) * Lk)).astype(int)
    mask = np.arange(Lk)[None, :] < lengths[:, None]
    if framework == "torch":
        import torch

        return torch.from_numpy(mask).to(device or "cpu")
    return mask


def paged_copy(cache, block_table, page_size: int):
    """The pool (num_pages, Hk, page_size, D) that holds `cache` (B, Hk, Lk, D) where `block_table` (B, Lk // page_size)
    says: key t of sequence b at page block_table[b, t // page_size], slot t % page_size. Built one sequence at a time,
    so that the only memory beyond the pool is one sequence's pages (torch tensors; the decode benchmark's paged rows
    and the decode rung's tuning script)."""
    import torch

    B, Hk, Lk, D = cache.shape
    pages = Lk // page_size
    pool = torch.empty((B * pages, Hk, page_size, D), dtype=cache.dtype, device=cache.device)
    for b in range(B):
        pool.index_copy_(0, block_table[b].long(), cache[b].view(Hk, pages, page_size, D).transpose(0, 1))
    return pool
