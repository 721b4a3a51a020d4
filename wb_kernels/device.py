"""Moving arrays between the caller's world (NumPy or torch) and the numba kernels (lessons 02-04).

On a GPU, every buffer a stage needs is allocated as a torch CUDA tensor and handed to numba
through ``__cuda_array_interface__`` (zero copy). That way torch's allocator sees all of it, so
:func:`wb_kernels.timing.peak_memory` measures what the kernels really use, and a caller's CUDA
tensors are read in place. On the simulator, buffers are plain NumPy arrays.
"""

from __future__ import annotations

import numpy as np

from .backend import BACKEND

__all__ = ["is_torch", "cuda_signature", "ValidatedCalls", "to_work", "empty", "zeros", "kernel_view", "like_input"]


_TORCH_TYPES: set = set()
_OTHER_TYPES: set = set()


def is_torch(x) -> bool:
    """Whether x is a torch object, without importing torch. Answered per type once, then from a set: the API
    asks it about every argument of every call, and a string test each time was a visible part of a call's cost."""
    kind = type(x)
    if kind in _TORCH_TYPES:
        return True
    if kind in _OTHER_TYPES:
        return False
    found = kind.__module__.startswith("torch")
    (_TORCH_TYPES if found else _OTHER_TYPES).add(kind)
    return found


def cuda_signature(*arrays):
    """What the API's checks of `arrays` depend on, ``(shape, dtype, device)`` of each (None stays None), when every
    one of them is a CUDA torch tensor or None; otherwise None.

    With CUDA tensors, the entry points check shapes, dtypes and devices only (never values: reading them would stall
    the host), so two calls with one signature pass or fail the same checks; :class:`ValidatedCalls` uses that.
    """
    key = []
    for x in arrays:
        if x is None:
            key.append(None)
        # is_torch, not its set alone: a type the process has not met yet is not in it (its first call was not
        # remembered); getattr: a stand-in that only says it is torch's is checked in full
        elif is_torch(x) and getattr(x, "is_cuda", False) is True:
            key.append((x.shape, x.dtype, x.device))
        else:
            return None
    return tuple(key)


class ValidatedCalls:
    """The signatures (:func:`cuda_signature` plus the call's options) whose checks passed, with what the checks
    returned, so that a decoder's thousands of identical calls are checked once, not once per call (the checks
    cost several times a decode kernel's launch). Bounded: past `limit` signatures it starts again."""

    def __init__(self, limit: int = 1024):
        self.limit, self.passed = limit, {}

    def get(self, key):
        return self.passed.get(key) if key is not None else None

    def remember(self, key, result):
        if key is not None:
            if len(self.passed) >= self.limit:
                self.passed.clear()
            self.passed[key] = result
        return result


def to_work(x, dtype=np.float32):
    """The caller's array as a contiguous `dtype` buffer where the kernels run.

    A read-only NumPy array (``np.load(..., mmap_mode="r")``, ``setflags(write=False)``) is copied: the simulator
    copies every kernel argument back into the array it came from after the launch, which a read-only array
    refuses (after the kernel ran), and ``torch.from_numpy`` warns about one. A writable one is used in place.
    """
    if not is_torch(x):
        x = np.asarray(x)
        if not x.flags.writeable:
            x = np.array(x, dtype=dtype, order="C")
    if BACKEND.is_gpu:
        import torch

        t = x if is_torch(x) else torch.from_numpy(x)
        return t.to(device="cuda", dtype=getattr(torch, np.dtype(dtype).name)).contiguous()
    if is_torch(x):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=dtype)


def empty(shape, dtype=np.float32):
    """An uninitialised buffer where the kernels run."""
    if BACKEND.is_gpu:
        import torch

        return torch.empty(tuple(shape), dtype=getattr(torch, np.dtype(dtype).name), device="cuda")
    return np.empty(shape, dtype=dtype)


def zeros(shape, dtype=np.float32):
    if BACKEND.is_gpu:
        import torch

        return torch.zeros(tuple(shape), dtype=getattr(torch, np.dtype(dtype).name), device="cuda")
    return np.zeros(shape, dtype=dtype)


def kernel_view(buffer):
    """What a numba kernel launch takes for `buffer` (a zero-copy device view on a GPU)."""
    if BACKEND.is_gpu:
        from numba import cuda

        return cuda.as_cuda_array(buffer)
    return buffer


def like_input(result, template):
    """Return `result` in the caller's kind: NumPy for NumPy input, torch on the input's device
    for torch input."""
    if is_torch(template):
        import torch

        t = result if is_torch(result) else torch.from_numpy(np.asarray(result))
        return t.to(template.device)
    if is_torch(result):
        return result.detach().cpu().numpy()
    return np.asarray(result)
