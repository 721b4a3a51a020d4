"""The front door (wb_kernels/arguments.py, validation.py, execution.py, torch_ops.py, api.py): its floors import one
way, a call's ``causal`` keeps one form from validation to the kernel and back, and two paths that were silent are not:
a double backward (a gradient penalty) is refused with an error instead of dropping the penalty, and a compiled first
call that needs gradients works in a fresh process that imported torch first.

CPU-only and small: the file runs in about a minute on a 2-core CPU (the subprocess is most of it).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import subprocess
import sys

import pytest
import torch

import wb_kernels as wb
from wb_kernels import stages, validation
from wb_kernels.torch_ops import DOUBLE_BACKWARD, register

# The floors, lowest first: each may import the ones before it, never one after it.
FLOORS = ["arguments", "validation", "execution", "torch_ops", "api"]


def _package_imports(name: str) -> list:
    """(module, names) of every import of the package's own modules in wb_kernels.<name>, top level or in a function."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(importlib.import_module(f"wb_kernels.{name}")))):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module:
                found.append((node.module.split(".")[0], [alias.name for alias in node.names]))
            else:  # from . import x, y
                found.extend((alias.name, []) for alias in node.names)
    return found


@pytest.mark.parametrize("name", FLOORS)
def test_the_floors_import_one_way_and_no_private_names(name):
    above = set(FLOORS[FLOORS.index(name) + 1:])
    for module, names in _package_imports(name):
        assert module not in above, f"wb_kernels.{name} imports wb_kernels.{module}, a floor above it"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"wb_kernels.{name} imports {private} from wb_kernels.{module}"
    source = inspect.getsource(importlib.import_module(f"wb_kernels.{name}"))
    # no dynamic lookup of the package's own modules (an import the graph above would not see)
    assert "importlib" not in source and "__package__" not in source and "sys.modules.get(\"wb" not in source


# ------------------------------------------------------------------------------------------------ causal's journey

CAUSAL_VALUES = [(False, None), (0, None), (None, None), (True, "top_left"), (1, "top_left"),
                 ("top_left", "top_left"), ("bottom_right", "bottom_right")]


@pytest.fixture
def recording_stage(monkeypatch):
    """The reference stage and its Backward, recording the ``causal`` each receives."""
    seen = {"forward": [], "backward": []}
    real, real_backward = stages.get_stage("reference"), stages.get_backward("reference")

    def forward(q, k, v, *, causal, **options):
        seen["forward"].append(causal)
        return real.forward(q, k, v, causal=causal, **options)

    def gradients(*args, causal, **options):
        seen["backward"].append(causal)
        return real_backward.gradients(*args, causal=causal, **options)

    stage = dataclasses.replace(real, name="recording", forward=forward)
    backward = dataclasses.replace(real_backward, stage="recording", gradients=gradients)
    monkeypatch.setattr(stages, "get_stage", lambda name: stage if name == "recording" else real)
    monkeypatch.setattr(stages, "get_backward", lambda name: backward)
    return seen


@pytest.mark.parametrize("given, canonical", CAUSAL_VALUES, ids=[repr(g) for g, _ in CAUSAL_VALUES])
@pytest.mark.parametrize("path", ["eager", "op"])
def test_causal_keeps_its_canonical_form_to_the_kernel_and_back(recording_stage, given, canonical, path):
    """One form at validation (None, "top_left" or "bottom_right"), the same in the op's schema, the saved context and
    the Backward; a stage's forward gets it too."""
    register()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3))
    call = validation.validate_call(q, k, v, stage="recording", causal=given)
    assert call.causal == canonical and type(call.causal) is type(canonical)
    if path == "eager":
        out = wb.attention(q, k, v, stage="recording", causal=given)
        assert out.grad_fn.call.causal == canonical  # EagerAttention's saved call
    else:
        out = torch.ops.wb.attention(q, k, v, None, "recording", canonical, None, True)[0]
    out.sum().backward()
    assert recording_stage["forward"] == [canonical]
    assert recording_stage["backward"] == [canonical]


# -------------------------------------------------------------------------------------------- double backward

def _attend(path):
    if path == "eager":  # EagerAttention, what an eager call that needs a gradient runs
        return lambda q, k, v: wb.attention(q, k, v, stage="reference", causal="bottom_right")
    register()  # the registered op's autograd formula, what a compiled call runs
    return lambda q, k, v: torch.ops.wb.attention(q, k, v, None, "reference", "bottom_right", None, True)[0]


@pytest.mark.parametrize("path", ["eager", "op"])
def test_a_gradient_penalty_is_refused_not_dropped(path):
    """``create_graph=True`` through wb.attention used to give a gradient that did not require grad (eager) or one
    whose own gradient was silently wrong (the op): a gradient penalty vanished from the loss without an error. Now the
    first-order gradients are unchanged and differentiating them again raises, naming what to use instead."""
    attend = _attend(path)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3))
    plain = torch.autograd.grad(attend(q, k, v).sum(), (q, k, v))
    graphed = torch.autograd.grad(attend(q, k, v).sum(), (q, k, v), create_graph=True)
    for first, second in zip(plain, graphed):
        assert torch.equal(first, second.detach())
    assert all(g.requires_grad for g in graphed)
    penalty = sum(g.pow(2).sum() for g in graphed)
    with pytest.raises(RuntimeError, match="no double backward") as refused:
        penalty.backward()
    assert str(refused.value) == DOUBLE_BACKWARD


@pytest.mark.parametrize("path", ["eager", "op"])
def test_a_single_backward_stays_as_it_was(path):
    """Without create_graph the gradients carry no history (no refusal node, nothing kept alive)."""
    attend = _attend(path)
    q, k, v = (torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grads = torch.autograd.grad(attend(q, k, v).sum(), (q, k, v))
    assert not any(g.requires_grad for g in grads)


# ------------------------------------------------------------------------------- compiled first call with gradients

_COMPILED_FIRST_CALL_WITH_GRAD = """
import torch
import wb_kernels as wb

def attend(q, k, v, keep):
    return wb.attention(q, k, v, stage="reference", causal="bottom_right", key_padding_mask=keep) * 2.0

generator = torch.Generator().manual_seed(2)
q = torch.randn(1, 4, 5, 16, generator=generator, dtype=torch.float64)
k, v = (torch.randn(1, 2, 7, 16, generator=generator, dtype=torch.float64) for _ in range(2))
keep = torch.tensor([[True] * 6 + [False]])
dout = torch.randn(1, 4, 5, 16, generator=generator, dtype=torch.float64)
compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
got = torch.autograd.grad(compiled(*leaves, keep), leaves, dout)  # the process's first call of wb.attention
leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
expected = torch.autograd.grad(attend(*leaves, keep), leaves, dout)  # eager, the reference stage's own gradients
print("same", all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, expected)))
"""


def test_a_compiled_first_call_that_needs_gradients_works_in_a_fresh_process():
    """torch, then wb_kernels (the documented order), then a compiled call with inputs that need grad as the process's
    first: it used to fail inside the backward registry's walk of the rungs' folders, which the compiler traced; the
    registry is now discovered when the operators are defined. Gradients as the reference stage's eager ones."""
    done = subprocess.run([sys.executable, "-c", _COMPILED_FIRST_CALL_WITH_GRAD], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip().splitlines()[-1:] == ["same True"], done.stdout + done.stderr[-3000:]
