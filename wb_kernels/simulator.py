"""A fix for numba's CUDA simulator, applied when the package runs on it (every numba lesson, CI).

The simulator gives the threads of a block one static shared array per ``cuda.shared.array`` call site: the first
thread to reach the line allocates it, the others look it up. The look-up and the allocation are not one atomic
step, and finding the call site reads the source through ``traceback`` (slow the first time in a process, so the
interpreter switches threads in between): two threads of a block could both allocate, and then each works on its
own tile. That showed as a rare wrong result of the tiled stage (max error 0.03 to 2.6, about one fresh benchmark
process in six). :func:`make_shared_arrays_thread_safe` makes the look-up and the allocation one step under a lock,
and finds the call site from the caller's frame directly.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["make_shared_arrays_thread_safe"]

_LOCK = threading.Lock()


def make_shared_arrays_thread_safe() -> None:
    """Replace the simulator's ``cuda.shared.array`` with one that cannot hand a block two arrays (idempotent)."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared = kernelapi.FakeCUDAShared
    if getattr(shared.array, "wb_thread_safe", False):
        return
    unsafe = shared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory (one buffer, no look-up), or an error
            return unsafe(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)  # the kernel's line that asked, as the simulator keys it
        call_site = (frame.f_code.co_filename, frame.f_lineno)
        with _LOCK:
            found = self._allocations.get(call_site)
            if found is None:
                found = self._allocations[call_site] = np.empty(shape, dtype)
        return found

    array.wb_thread_safe = True
    shared.array = array
