"""The package's PyTorch operators, defined once per process: ``torch.ops.wb.attention`` and its backward
(:mod:`wb_kernels.autograd`), and ``torch.ops.wb.decode`` (:mod:`wb_kernels.decode_op`).

A compiler cannot trace their definition (``torch.library.Library``'s creation), so they must exist before
``torch.compile`` meets ``wb.attention`` or ``wb.decode``: they are defined when ``wb_kernels`` is imported after
torch, or else at the first eager call of either with torch tensors (:func:`ensure`). A compiled first call in a
process that imported ``wb_kernels`` before torch finds them missing and is refused with what to do (the entry
points' RuntimeErrors). This module imports nothing heavy; what it defines imports torch.
"""

from __future__ import annotations

import sys

__all__ = ["registered", "register", "ensure", "MISSING"]

MISSING = ("is defined when wb_kernels is imported after torch, or by the first eager call; this process imported "
           "wb_kernels before torch and compiles its first call, and a compiler cannot define it while it traces. "
           "Import torch before wb_kernels, or call wb_kernels.ops.register() before compiling")


def registered() -> bool:
    """Whether both operators are defined in this process (a dictionary lookup or two)."""
    modules = [sys.modules.get(f"{__package__}.{name}") for name in ("autograd", "decode_op")]
    return all(module is not None and module.registered() for module in modules)


def register() -> None:
    """Define both operators (once per process; later calls return at once). ``wb::attention`` first: its library
    owns the ``wb`` namespace, the decode op is a fragment of it."""
    from . import autograd, decode_op

    autograd.register()
    decode_op.register()


def ensure(torch) -> bool:
    """Define the operators if they are missing and no compiler is tracing; whether they exist now."""
    if registered():
        return True
    if torch.compiler.is_compiling():
        return False
    register()
    return True
