"""The ladder of attention kernels, one folder per rung (lessons 01-05).

Every package in this folder whose ``__init__`` defines ``STAGE`` (a :class:`Stage`) is a rung;
``wb_kernels.attention`` finds them here, so adding a rung means adding one folder and nothing else
(CONTRIBUTING.md has the whole recipe). A rung's folder holds its kernel, launcher, teaching model,
slider logic, tuning script and ``NOTES.md``; its lesson is ``notebooks/NN_<rung>.ipynb`` and its tests
``tests/test_<rung>.py``. A stage's ``forward`` receives inputs that :mod:`wb_kernels.validation` has already
validated (:mod:`wb_kernels.execution` calls it), and returns ``(out, lse)``: q (B, H, Lq, D), k and v (B, Hk, Lk, D)
with Hk dividing H (query head h uses key/value head h // (H // Hk)), and ``causal`` ``"top_left"``,
``"bottom_right"`` or None for no mask: the canonical form validation gives it, which every forward and Backward gets
as it is (a rung's own code may still pass False). Test it for truth, never against False; :func:`wb_kernels.reference.causal_offset` turns it into the offset of the diagonal.

The registry is discovered once per process, by the first lookup or when the package's torch operators are defined
(:func:`wb_kernels.torch_ops.register`), so that a compiler tracing a first call never walks these folders.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Stage", "Backward", "available_stages", "get_stage", "available_backwards", "get_backward",
           "registered_kernels"]


@dataclass(frozen=True)
class Stage:
    name: str  # what users pass as stage=...
    lesson: str  # notebook that teaches it, e.g. "02_naive"
    summary: str  # one line for listings and error messages
    forward: Callable  # (q, k, v, *, causal, key_padding_mask, scale) -> (out, lse); see the module docstring
    dtypes: tuple  # accepted input dtypes, e.g. ("float32",)
    head_dims: Optional[tuple] = None  # accepted D, None = any
    needs_gpu: bool = False  # True: refuses to run on the simulator / CPU tensors
    # extra device bytes beyond the inputs, from (B, H, Lq, Lk, D); used to refuse sizes that can't fit
    workspace_bytes: Optional[Callable[[int, int, int, int, int], int]] = None
    # rough seconds on numba's CUDA simulator, from (B, H, Lq, Lk, D); used to refuse sizes that would hang
    simulator_seconds: Optional[Callable[[int, int, int, int, int], float]] = None
    order: int = 0  # position on the ladder
    linear_memory: bool = False  # True: no L x L buffer (the flash stages), suggested when others can't fit
    # True: the kernel itself gives NaN/Inf inputs SDPA's result (wb.attention then skips its host-side pass, which
    # synchronises with the GPU: a large part of a small call's cost)
    non_finite_in_kernel: bool = False
    # named versions of the kernel (a rung that grows in versions, each kept runnable): forward(..., version=name)
    # runs one of them, and the benchmark times each as the contender "<name>-<version>" beside the stage's default
    versions: tuple = ()
    # the attention variants it computes (names from wb_kernels.variants.VARIANT_NAMES): a call that uses one it
    # lacks is refused naming the stages that have it; forward(..., variants=Variants) receives them when used
    variants: tuple = ()


@dataclass(frozen=True)
class Backward:
    """The gradients of one stage's forward pass (lesson 08_backward; the ``backward`` rung registers them).

    ``gradients(q, k, v, out, lse, dout, *, causal, key_padding_mask, scale) -> (dq, dk, dv)`` receives what
    :mod:`wb_kernels.validation` validated and :mod:`wb_kernels.execution` made contiguous, the forward's ``out`` and
    ``lse`` (the only things the forward saves) and ``dout``, the gradient of the loss with respect to ``out``; it
    returns gradients shaped like q, k and v (dk and dv summed over each group of query heads that share a key/value
    head, GQA). A row that sees no key gets zero gradients.
    """

    stage: str  # the forward stage whose gradients these are
    summary: str  # one line for listings and error messages
    gradients: Callable
    deterministic: bool = True  # False: the result may differ in its last bits from run to run (atomics)


_FOUND: dict = {}  # the registry, filled by the first lookup: folders are walked once per process, not per call


def available_stages() -> dict:
    """All stages found in this package, in ladder order: {name: Stage} (a copy: callers may change theirs)."""
    if not _FOUND:
        _FOUND.update(_discover())
    return dict(_FOUND)


def _rung_modules():
    for module_info in pkgutil.iter_modules(__path__):
        if not module_info.name.startswith("_"):
            yield importlib.import_module(f"{__name__}.{module_info.name}")


def _discover() -> dict:
    found = [module.STAGE for module in _rung_modules() if isinstance(getattr(module, "STAGE", None), Stage)]
    return {s.name: s for s in sorted(found, key=lambda s: s.order)}


_BACKWARDS: dict = {}


def available_backwards() -> dict:
    """{stage name: Backward} for every stage that has a backward pass, in ladder order (a copy).

    A rung folder registers gradients by defining ``BACKWARDS``, a tuple of :class:`Backward` (the ``backward`` rung
    holds them all: its lesson teaches them).
    """
    if not _BACKWARDS:
        found = {b.stage: b for module in _rung_modules() for b in getattr(module, "BACKWARDS", ())}
        order = list(available_stages())
        _BACKWARDS.update(sorted(found.items(), key=lambda item: order.index(item[0])))
    return dict(_BACKWARDS)


def get_backward(name: str) -> Backward:
    """The Backward of stage `name`; a ValueError that names the stages with a backward when it has none."""
    found = _BACKWARDS.get(name) or available_backwards().get(name)
    if found is None:
        get_stage(name)  # an unknown stage gets that error first
        raise ValueError(f"stage {name!r} computes the forward pass only and has no backward; the stages with "
                         f"gradients are {', '.join(available_backwards())}")
    return found


def get_stage(name: str) -> Stage:
    stage = _FOUND.get(name)
    if stage is not None:
        return stage
    stages = available_stages()
    if name not in stages:
        raise ValueError(f"stage={name!r} is not a stage of this package; available: {', '.join(stages)}")
    return stages[name]


def registered_kernels() -> list:
    """Every numba kernel of every rung (:func:`wb_kernels.resources.registered_kernels`), after importing the rungs
    so that each has registered its own: what CI compiles for real (``tests/test_ptx_compile.py``)."""
    from ..resources import registered_kernels as registered_so_far

    available_stages()
    return registered_so_far()
