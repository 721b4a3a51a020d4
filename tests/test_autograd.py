"""wb.attention with autograd: the registered op ``torch.ops.wb.attention`` (wb_kernels/torch_ops.py), its gradients
for every stage with a backward, the refusal of stages without one, gradcheck, opcheck, torch.compile, torch.export,
meta tensors, and the NumPy ``wb.attention_backward`` with its grader ``wb.check_gradients``.

Stages with a backward join by registering one (``wb.stages.available_backwards()``); GPU-only ones are skipped on
the simulator. Sizes stay tiny: the file runs in about 20 s on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import wb_kernels as wb
from wb_kernels.torch_ops import register

from stage_cases import ON_GPU, STAGES, head_dim, run_dtype, stage_params

WITH_BACKWARD = list(wb.available_backwards())
WITHOUT_BACKWARD = [name for name in STAGES if name not in WITH_BACKWARD]
DEVICE = "cuda" if ON_GPU else "cpu"


class SelfAttention(torch.nn.Module):
    """The smallest model that trains through wb.attention: one projection to q, k, v, causal attention."""

    def __init__(self, dim: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):  # x (B, L, dim)
        B, L, dim = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        return self.attend(q, k, v).transpose(1, 2).reshape(B, L, dim)


def _model_and_input(stage, dtype=torch.float32):
    D = head_dim(STAGES[stage])
    torch.manual_seed(0)
    model = SelfAttention(2 * D, 2, None).to(device=DEVICE, dtype=dtype)
    return model, torch.randn(2, 9, 2 * D, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("name", stage_params(WITH_BACKWARD))
def test_a_model_trained_through_wb_attention_gets_sdpas_gradients(name):
    """The issue's silent detach: a training user lost every gradient behind wb.attention. Now
    ``qkv.weight.grad`` is there and equals SDPA's (within the forward's float32 rounding)."""
    stage = STAGES[name]
    dtype = getattr(torch, run_dtype(stage))
    model, x = _model_and_input(name, dtype)
    grads = {}
    for label, attend in (("wb", lambda q, k, v: wb.attention(q, k, v, stage=name, causal=True)),
                          ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
        model.attend = attend
        model.zero_grad()
        model(x).square().sum().backward()
        assert model.qkv.weight.grad is not None, label
        grads[label] = model.qkv.weight.grad.double().cpu()
    torch.testing.assert_close(grads["wb"], grads["sdpa"], rtol=1e-4 if dtype == torch.float32 else 2e-2,
                               atol=1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("name", stage_params(WITHOUT_BACKWARD))
def test_a_stage_without_backward_refuses_before_it_runs(name, monkeypatch):
    stage = STAGES[name]
    q, k, v = (torch.randn(1, 1, 4, head_dim(stage), dtype=getattr(torch, run_dtype(stage)), device=DEVICE)
               for _ in range(3))
    launched = []
    spy = dataclasses.replace(stage, forward=lambda *a, **kw: launched.append(1))
    monkeypatch.setitem(wb.stages._FOUND, name, spy)  # the registry every lookup reads first
    with pytest.raises(ValueError, match=f"stage '{name}' computes the forward pass only and has no backward; "
                                         f"the stages with gradients are {', '.join(WITH_BACKWARD)}"):
        wb.attention(q.requires_grad_(True), k, v, stage=name)
    assert launched == []


def _float64_inputs(B=1, H=2, Hk=1, Lq=5, Lk=7, D=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(B, Hk, Lk, D, dtype=torch.float64, generator=generator) for _ in range(2))
    return tuple(x.requires_grad_(True) for x in (q, k, v))


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_gradcheck_float64_reference(causal):
    """Finite differences agree with the op's gradients: GQA (2 query heads on 1 key/value head), Lq != Lk, a padded
    key, and (bottom-right with Lq > Lk, top-left row 0 with key 0 padded) rows that see no key."""
    q, k, v = _float64_inputs(Lq=5, Lk=4 if causal == "bottom_right" else 7)
    keep = torch.ones(1, k.shape[2], dtype=torch.bool)
    keep[0, 0] = False

    def attend(q, k, v):
        return wb.attention(q, k, v, stage="reference", causal=causal, key_padding_mask=keep, scale=0.7)

    assert torch.autograd.gradcheck(attend, (q, k, v))


@pytest.mark.parametrize("name", stage_params(WITH_BACKWARD))
def test_eager_calls_and_the_op_give_the_same_bits(name):
    """An eager call that needs a gradient runs EagerAttention, a compiler's tracing the registered op: one arithmetic
    (execution.run_forward, execution.run_backward), so their outputs and gradients agree bit for bit, GQA and a mask
    included."""
    register()
    stage = STAGES[name]
    D, dtype = head_dim(stage), getattr(torch, run_dtype(stage))
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, D, generator=generator).to(device=DEVICE, dtype=dtype)
    k, v = (torch.randn(1, 1, 7, D, generator=generator).to(device=DEVICE, dtype=dtype) for _ in range(2))
    dout = torch.randn(q.shape, generator=generator).to(device=DEVICE, dtype=dtype)
    keep = torch.tensor([[True] * 6 + [False]], device=DEVICE)
    found = []
    for attend in (lambda *x: wb.attention(*x, stage=name, causal="bottom_right", key_padding_mask=keep),
                   lambda *x: torch.ops.wb.attention(*x, keep, name, "bottom_right", None, True)[0]):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = attend(*leaves)
        found.append((out, *torch.autograd.grad(out, leaves, dout)))
    for eager, op in zip(*found):
        assert torch.equal(eager, op)


def test_opcheck_on_the_registered_op():
    """torch.library's own checks of both ops: schema, autograd registration, fake tensors, AOT dispatch."""
    register()  # (wb.attention registers the ops on its first call that needs them)
    q, k, v = _float64_inputs()
    keep = torch.tensor([[True] * 6 + [False]])
    for args in ((q, k, v, None, "reference", None, None, True),  # causal None: no mask, the canonical form
                 (q, k, v, keep, "reference", "bottom_right", 0.5, True)):
        torch.library.opcheck(torch.ops.wb.attention.default, args)
    out, lse = torch.ops.wb.attention(q, k, v, keep, "reference", "top_left", None, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.wb.attention_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, keep, "reference", "top_left",
                           None))


def test_meta_tensors_go_through_the_fake():
    q = torch.empty(2, 4, 5, 8, device="meta", dtype=torch.float16)
    k = torch.empty(2, 2, 3, 8, device="meta", dtype=torch.float16)
    out, lse = wb.attention(q, k, k, stage="reference", return_lse=True)
    assert out.is_meta and out.shape == q.shape and out.dtype == torch.float16
    assert lse.is_meta and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    three_heads = torch.empty(2, 3, 3, 8, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="Hk must divide H"):  # the fake validates what it can without values
        wb.attention(q, three_heads, three_heads)


# The CPU inductor builds C++ (about 15 s on two cores); without a C++ compiler, aot_eager makes the same dynamo and
# AOT-autograd trace, which is where a graph break or an untraceable op would show.
COMPILE_BACKEND = "inductor" if shutil.which("g++") or shutil.which("c++") else "aot_eager"


def test_torch_compile_fullgraph_and_export():
    """No graph break: the op is opaque to the compiler; the compiled forward and gradients equal eager's.
    torch.export captures the same module."""
    model, x = _model_and_input("reference")
    model.attend = lambda q, k, v: wb.attention(q, k, v, stage="reference", causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND)
    eager_out = model(x)
    eager_out.sum().backward()
    eager_grad, model.qkv.weight.grad = model.qkv.weight.grad.clone(), None
    compiled_out = compiled(x)
    compiled_out.sum().backward()
    torch.testing.assert_close(compiled_out, eager_out)
    torch.testing.assert_close(model.qkv.weight.grad, eager_grad)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), eager_out)


_COMPILE_FIRST_CALL = """
import sys
first, second, entry = sys.argv[1:]
__import__(first); __import__(second)
import torch, wb_kernels as wb
q = torch.randn(1, 2, 5, 16, dtype=torch.float64)
lens = torch.tensor([5], dtype=torch.int32)
call = {"attention": lambda q: wb.attention(q, q, q, stage="reference"),
        "decode": lambda q: wb.decode(q[:, :, 0], q, q, lens, stage="reference")}[entry]
compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
try:
    print("ran", torch.allclose(compiled(q), call(q)))
except Exception as error:
    print("refused", "imported wb_kernels before torch" in str(error))
"""


@pytest.mark.parametrize("entry", ["attention", "decode"])
@pytest.mark.parametrize("order, expected", [(("torch", "wb_kernels"), "ran True"),
                                             (("wb_kernels", "torch"), "refused True")])
def test_a_compiled_first_call_finds_the_op_or_says_why(order, expected, entry):
    """The package's ops (wb_kernels.torch_ops: wb.attention's and wb.decode's) are defined at import when torch came
    first, so a process whose first call is compiled (fullgraph) runs; the other import order cannot define them in
    time (the compiler refuses to trace their definition) and says how to fix that. A fresh process each: in this
    one the ops are long defined (the H100 run at c11746a failed this way when the compiled test happened to be a
    worker's first call)."""
    found = subprocess.run([sys.executable, "-c", _COMPILE_FIRST_CALL, *order, entry], capture_output=True,
                           text=True, timeout=240)
    assert found.stdout.strip().splitlines()[-1:] == [expected], found.stdout + found.stderr[-2000:]


def test_nan_pass_runs_inside_the_compiled_op():
    """The NaN/Inf pass is part of the op's real implementation, so a compiled call keeps the promise too."""
    model, x = _model_and_input("reference")
    model.attend = lambda q, k, v: wb.attention(q, k, v, stage="reference")
    x = x.clone()
    x[0, 3, 0] = float("nan")
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


def test_lse_carries_no_gradient():
    q, k, v = _float64_inputs()
    out, lse = wb.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad and lse.dtype == torch.float64


@pytest.mark.parametrize("name", stage_params(WITH_BACKWARD))
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_numpy_attention_backward_matches_reference_backward(name, causal):
    """wb.attention_backward on NumPy inputs (the lesson's laptop path): GQA, a padded key, a batch whose keys are
    all padded (rows that see no key: zero gradients), Lq != Lk; results in the input's kind and dtype."""
    stage = STAGES[name]
    dtype = run_dtype(stage)
    framework, device = ("torch", "cuda") if ON_GPU else ("numpy", None)
    q, k, v = wb.random_qkv(2, 4, 6, head_dim(stage), Lk=9, dtype=dtype, framework=framework, device=device, seed=3)
    k, v = k[:, :2].contiguous() if ON_GPU else k[:, :2].copy(), v[:, :2].contiguous() if ON_GPU else v[:, :2].copy()
    dout = wb.random_qkv(2, 4, 6, head_dim(stage), dtype=dtype, framework=framework, device=device, seed=4)[0]
    keep = np.ones((2, 9), dtype=bool)
    keep[0, 1] = keep[1, :] = False
    grads = wb.attention_backward(q, k, v, dout, stage=name, causal=causal, key_padding_mask=keep)
    for grad, x in zip(grads, (q, k, v)):
        assert type(grad) is type(x) and grad.dtype == x.dtype and grad.shape == x.shape
    assert all(float(np.abs(np.asarray(g.cpu() if ON_GPU else g)[1]).max()) == 0 for g in grads)
    wb.check_gradients(name, grads, q, k, v, dout, causal=causal, key_padding_mask=keep)
    out, lse = wb.attention(q, k, v, stage=name, causal=causal, key_padding_mask=keep, return_lse=True)
    again = wb.attention_backward(q, k, v, dout, stage=name, causal=causal, key_padding_mask=keep, out=out, lse=lse)
    for a, b in zip(grads, again):
        np.testing.assert_array_equal(np.asarray(a.cpu() if ON_GPU else a), np.asarray(b.cpu() if ON_GPU else b))


def test_attention_backward_validates_like_attention():
    q, k, v = wb.random_qkv(1, 2, 4, 16, seed=5)
    dout = np.ones_like(q)
    with pytest.raises(ValueError, match="stage='nope' is not a stage"):
        wb.attention_backward(q, k, v, dout, stage="nope")
    with pytest.raises(ValueError, match="has no backward; the stages with gradients are"):
        wb.attention_backward(q, k, v, dout, stage="naive")
    with pytest.raises(ValueError, match=r"dout: expected the output's shape \(B, H, Lq, D\)=\(1, 2, 4, 16\), got "
                                         r"\(1, 2, 4, 7\)"):
        wb.attention_backward(q, k, v, dout[..., :7])
    with pytest.raises(TypeError, match="dout: expected dtype float32 as q, k, v have, got float64"):
        wb.attention_backward(q, k, v, dout.astype(np.float64))
    with pytest.raises(TypeError, match="dout: expected a NumPy array as q is, got a torch tensor"):
        wb.attention_backward(q, k, v, torch.from_numpy(dout))
    with pytest.raises(ValueError, match="out, lse: pass both"):
        wb.attention_backward(q, k, v, dout, out=q)
    with pytest.raises(ValueError, match="v has Lk=3 keys"):
        wb.attention_backward(q, k, v[:, :, :3], dout)


def test_attention_backward_returns_torch_in_each_inputs_dtype():
    q, k, v = wb.random_qkv(1, 2, 4, 8, dtype="float16", framework="torch", seed=6)
    grads = wb.attention_backward(q, k, v, torch.ones_like(q), causal=True)
    assert all(isinstance(g, torch.Tensor) and g.dtype == torch.float16 and not g.requires_grad for g in grads)
    wb.check_gradients("reference fp16", grads, q, k, v, torch.ones_like(q), causal=True, verbose=False)
