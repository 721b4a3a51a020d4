"""Bad input to wb.attention: each is refused before any kernel runs, with an error that names the argument,
the value it got and what is accepted (issue: robustness). Validation runs before a stage is launched, so
the shape checks run here for every stage, GPU-only ones included, without a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import wb_kernels as wb
from wb_kernels import api, validation
from wb_kernels.device import is_torch

from stage_cases import ON_GPU, STAGES, head_dim, make_inputs, run_dtype, stage_params


def expect(error, *patterns):
    """pytest.raises(error) whose message contains every pattern (regular expressions)."""
    return pytest.raises(error, match="".join(f"(?=[\\s\\S]*{p})" for p in patterns))


def small_inputs(name, B=1, H=2, Lq=5, Lk=6, framework="numpy"):
    """Valid inputs for stage `name` (its dtype and head dim), CPU arrays: validation never gets to the device."""
    stage = STAGES[name]
    dtype = run_dtype(stage)
    if dtype == "bfloat16":
        framework = "torch"
    return wb.random_qkv(B, H, Lq, head_dim(stage), Lk=Lk, dtype=dtype, framework=framework)


ALL_STAGES = list(STAGES)


def on_cuda(x):
    """`x` on the GPU; on the simulator, where a CPU-only torch cannot make CUDA tensors, a stand-in that says
    it is on cuda:0 (validation reads no more than its rank, shape, dtype and device)."""
    if ON_GPU:
        return (torch.from_numpy(x) if isinstance(x, np.ndarray) else x).to("cuda")
    return type("Tensor", (), {"__module__": "torch", "ndim": x.ndim, "shape": tuple(x.shape),
                               "dtype": x.dtype if is_torch(x) else getattr(torch, str(x.dtype)), "device": "cuda:0"})()


def where_it_runs(stage, *arrays):
    """The arrays as the stage takes them: CUDA tensors for a GPU-only stage (which refuses CPU inputs before
    it looks at their dtype or head dim), as they are for the others."""
    return tuple(on_cuda(x) for x in arrays) if stage.needs_gpu else arrays


# --- shapes: the same rules for every stage ------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_STAGES)
def test_rank_other_than_4(name):
    q, k, v = small_inputs(name)
    with expect(ValueError, r"^q:", "rank 4", r"rank 3", re.escape(f"shape {tuple(q[0].shape)}")):
        wb.attention(q[0], k, v, stage=name)
    with expect(ValueError, r"^k:", "rank 4", "rank 5"):
        wb.attention(q, k[None], v, stage=name)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_batch_or_heads_differ(name):
    q, k, v = small_inputs(name)
    with expect(ValueError, "batch/heads", re.escape("q has (B, H)=(1, 2)"), re.escape("k (2, 2)"), "must match"):
        wb.attention(q, np.concatenate([k, k]) if isinstance(k, np.ndarray) else torch.cat([k, k]), v, stage=name)
    with expect(ValueError, "batch/heads", re.escape("v (1, 1)")):
        wb.attention(q, k, v[:, :1], stage=name)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_kv_heads_must_divide_query_heads(name):
    """Grouped-query attention: k and v may have Hk heads where Hk divides H; 3 does not divide 4."""
    q, k, v = small_inputs(name, H=4)
    with expect(ValueError, r"^heads:", "H=4", "Hk=3", "Hk must divide H", re.escape("h // (H // Hk)")):
        wb.attention(q, k[:, :3], v[:, :3], stage=name)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_k_and_v_heads_differ(name):
    q, k, v = small_inputs(name, H=4)
    with expect(ValueError, "batch/heads", re.escape("k (1, 2)"), re.escape("v (1, 1)"),
                "k and v must have the same number of heads Hk"):
        wb.attention(q, k[:, :2], v[:, :1], stage=name)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_head_dims_differ(name):
    q, k, v = small_inputs(name)
    D = q.shape[-1]
    with expect(ValueError, "head dim differs", f"q has D={D}", f"k D={D}", f"v D={D // 2}", "must match"):
        wb.attention(q, k, v[..., : D // 2], stage=name)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_v_length_differs_from_k(name):
    q, k, v = small_inputs(name, Lk=6)
    with expect(ValueError, "v has Lk=5 keys", "k has Lk=6", "same length"):
        wb.attention(q, k, v[:, :, :5], stage=name)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_empty_dimension(name):
    q, k, v = small_inputs(name)
    with expect(ValueError, "empty input", re.escape(f"q {tuple(q[:, :, :0].shape)}"), ">= 1"):
        wb.attention(q[:, :, :0], k, v, stage=name)


# --- kinds and dtypes ----------------------------------------------------------------------------------

def test_not_an_array():
    q, k, v = small_inputs("reference")
    with expect(TypeError, r"^q:", "NumPy array or torch tensor", "got list"):
        wb.attention(q.tolist(), k, v)
    with expect(TypeError, r"^v:", "got NoneType"):
        wb.attention(q, k, None)


def test_numpy_and_torch_mixed():
    q, k, v = small_inputs("reference")
    with expect(TypeError, "all NumPy arrays or all torch tensors", "q a NumPy array", "k a torch tensor"):
        wb.attention(q, torch.from_numpy(k), v)


def test_dtypes_differ():
    q, k, v = small_inputs("reference")
    with expect(TypeError, "different dtypes", re.escape("(float32, float64, float32)"), "one dtype"):
        wb.attention(q, k.astype(np.float64), v)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_dtype_the_stage_does_not_take(name):
    stage = STAGES[name]
    refused = next(d for d in ("float64", "float16", "int32") if d not in stage.dtypes)
    q, k, v = small_inputs(name, framework="numpy" if run_dtype(stage) != "bfloat16" else "torch")
    q, k, v = (x.astype(refused) if isinstance(x, np.ndarray) else x.to(getattr(torch, refused)) for x in (q, k, v))
    q, k, v = where_it_runs(stage, q, k, v)
    with expect(TypeError, r"q, k, v", f"stage '{name}'", f"dtype {refused}", "accepts " + re.escape(", ".join(stage.dtypes))):
        wb.attention(q, k, v, stage=name)


@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.head_dims is not None])
def test_head_dim_the_stage_does_not_support(name):
    stage = STAGES[name]
    D = next(d for d in range(8, 1000, 4) if d not in stage.head_dims)
    q, k, v = wb.random_qkv(1, 1, 4, D, dtype=run_dtype(stage), framework="torch" if run_dtype(stage) == "bfloat16" else "numpy")
    q, k, v = where_it_runs(stage, q, k, v)
    with expect(ValueError, f"stage '{name}'", f"head dim D={D}", re.escape(str(list(stage.head_dims)))):
        wb.attention(q, k, v, stage=name)


@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.needs_gpu])
def test_cpu_inputs_for_a_gpu_only_stage(name):
    q, k, v = small_inputs(name, framework="torch")
    with expect(ValueError, f"stage '{name}'", "only on a CUDA GPU", "CUDA torch tensors", "got inputs on cpu"):
        wb.attention(q, k, v, stage=name)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, CUDA inputs are what the stages take")
def test_gpu_inputs_on_the_simulator_are_refused():
    """A CPU-only torch cannot make CUDA tensors; stand-ins that say they are on cuda:0 stand for them."""
    q, k, v = small_inputs("naive", framework="torch")
    with expect(ValueError, "inputs are on cuda:0", "CUDA simulator", "pass CPU data"):
        wb.attention(on_cuda(q), on_cuda(k), on_cuda(v), stage="naive")
    with expect(ValueError, "different devices", re.escape("['cpu', 'cuda:0']"), "one device"):
        wb.attention(on_cuda(q), k, v, stage="naive")


# --- stage names ---------------------------------------------------------------------------------------

def test_unknown_stage():
    q, k, v = small_inputs("reference")
    with expect(ValueError, "stage='flash2'", "not a stage", "available: " + re.escape(", ".join(STAGES))):
        wb.attention(q, k, v, stage="flash2")


@pytest.mark.parametrize("stage", [None, 3, wb.get_stage("reference")])
def test_stage_that_is_not_a_name(stage):
    q, k, v = small_inputs("reference")
    with expect(TypeError, r"^stage:", "stage name", re.escape(", ".join(STAGES)), type(stage).__name__):
        wb.attention(q, k, v, stage=stage)


# --- masks ---------------------------------------------------------------------------------------------

def test_mask_of_the_wrong_kind():
    q, k, v = small_inputs("reference", B=2, Lk=6)
    with expect(TypeError, r"^key_padding_mask:", "bool array", re.escape("(B, Lk)=(2, 6)"), "got list"):
        wb.attention(q, k, v, key_padding_mask=[[True] * 6] * 2)


@pytest.mark.parametrize("shape", [(2, 7), (6,), (2, 1, 1, 6), (1, 6)])
def test_mask_of_the_wrong_shape(shape):
    q, k, v = small_inputs("reference", B=2, Lk=6)
    with expect(ValueError, r"^key_padding_mask:", re.escape("expected shape (B, Lk)=(2, 6)"), re.escape(f"got {shape}")):
        wb.attention(q, k, v, key_padding_mask=np.ones(shape, dtype=bool))


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64"])
def test_mask_of_the_wrong_dtype(dtype):
    q, k, v = small_inputs("reference", B=2, Lk=6)
    with expect(TypeError, r"^key_padding_mask:", "dtype bool", "True = key takes part", f"got {dtype}"):
        wb.attention(q, k, v, key_padding_mask=np.ones((2, 6), dtype=dtype))
    with expect(TypeError, r"^key_padding_mask:", f"got {dtype}"):
        wb.attention(q, k, v, key_padding_mask=torch.ones((2, 6), dtype=getattr(torch, dtype)))


# --- causal and scale ----------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [2, 0.5, [True], b"top_left"])
def test_causal_that_is_not_bool_like(causal):
    q, k, v = small_inputs("reference")
    with expect(TypeError, r"^causal:", "True or False", "'top_left' or 'bottom_right'", re.escape(repr(causal)),
                type(causal).__name__):
        wb.attention(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", ["True", "False", "bottom-right", "BOTTOM_RIGHT", "top", ""])
@pytest.mark.parametrize("name", ALL_STAGES)
def test_causal_string_that_is_not_an_alignment(name, causal):
    """A string other than an alignment's name ("False" would be truthy) is refused with the accepted values."""
    stage = STAGES[name]
    q, k, v = where_it_runs(stage, *small_inputs(name))
    with expect(ValueError, r"^causal:", "True, False", "'top_left', 'bottom_right'", re.escape(f"got {causal!r}")):
        wb.attention(q, k, v, stage=name, causal=causal)


def test_top_left_is_what_true_means():
    q, k, v = small_inputs("reference", Lq=5, Lk=8)
    expected = wb.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(wb.attention(q, k, v, causal="top_left"), expected)
    assert not np.array_equal(wb.attention(q, k, v, causal="bottom_right"), expected)


@pytest.mark.parametrize("causal", [1, 0, np.bool_(True), np.bool_(False), np.array(True), torch.tensor(False), None])
def test_bool_like_causal_is_accepted(causal):
    """Bool-likes, and None: no mask's canonical form, which a call carries to the kernel (wb.reference, the reference
    stage's forward, receives it too)."""
    q, k, v = small_inputs("reference")
    expected = wb.attention(q, k, v, causal=bool(causal))
    np.testing.assert_array_equal(wb.attention(q, k, v, causal=causal), expected)


@pytest.mark.parametrize("scale", ["0.5", True, [0.5], torch.tensor(0.5)])
def test_scale_of_the_wrong_type(scale):
    q, k, v = small_inputs("reference")
    with expect(TypeError, r"^scale:", "finite number or None", type(scale).__name__):
        wb.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -np.inf])
def test_scale_that_is_not_finite(scale):
    q, k, v = small_inputs("reference")
    with expect(ValueError, r"^scale:", "finite number", re.escape(repr(scale))):
        wb.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [np.float32(0.25), np.float64(0.25), 0.25])
def test_numpy_scalar_scale_is_accepted(scale):
    q, k, v = small_inputs("reference")
    np.testing.assert_array_equal(wb.attention(q, k, v, scale=scale), wb.attention(q, k, v, scale=0.25))


# --- sizes that cannot fit or would take minutes ---------------------------------------------------------

def huge_inputs(stage, L, D):
    """(1, 1, L, D) inputs of zero stride: any size, no memory. Validation must refuse before touching them."""
    dtype = run_dtype(stage)
    one = np.zeros((1, 1, 1, D), dtype=dtype if dtype != "bfloat16" else "float16")
    q = np.broadcast_to(one, (1, 1, L, D))
    return q, q, q


@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.workspace_bytes is not None and not s.linear_memory
                                  and not s.needs_gpu])
def test_quadratic_stages_refuse_what_cannot_fit(name):
    stage = STAGES[name]
    L, D = 1_000_000, head_dim(stage)  # Lq x Lk float32 matrices: terabytes
    q, k, v = huge_inputs(stage, L, D)
    need = stage.workspace_bytes(1, 1, L, L, D)
    flash = [n for n, s in STAGES.items() if s.linear_memory]
    where = "GPU" if ON_GPU and name != "reference" else "host"
    with expect(MemoryError, f"stage '{name}' needs {need / 2**30:.2f} GiB of {where} memory", f"{L} x {L}",
                "is free", "O\\(L\\)", re.escape("/".join(flash))):
        wb.attention(q, k, v, stage=name)


@pytest.mark.skipif(ON_GPU, reason="the simulator's time limit applies only on the simulator")
@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.simulator_seconds is not None and not s.needs_gpu])
def test_simulator_refuses_sizes_that_would_take_minutes(name):
    stage = STAGES[name]
    L = 4096 if not stage.linear_memory else 65536
    D = head_dim(stage)
    q, k, v = huge_inputs(stage, L, D)
    seconds = stage.simulator_seconds(1, 1, L, L, D)
    assert seconds > validation.SIMULATOR_MAX_SECONDS
    with expect(ValueError, f"stage '{name}'", f"Lq={L} Lk={L} D={D}", f"about {seconds:.0f} s",
                "CUDA simulator", "WB_SIM_MAX_SECONDS", "run on a GPU"):
        wb.attention(q, k, v, stage=name)


@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if not s.needs_gpu])
def test_error_comes_before_any_launch(name, monkeypatch):
    """validate() raises before the stage's forward is called (a launch would hang or run out of memory)."""
    stage = STAGES[name]
    launched = []
    import dataclasses

    import wb_kernels.stages as stages_module

    spy = dataclasses.replace(stage, forward=lambda *a, **kw: launched.append(1))
    monkeypatch.setattr(stages_module, "get_stage", lambda n: spy)  # (validation reads the registry through it)
    q, k, v = small_inputs(name)
    with pytest.raises(ValueError):
        wb.attention(q, k, v[:, :, :2], stage=name)
    assert launched == []


# --- a GPU-only stage says so first ----------------------------------------------------------------------

@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("wrong", ["dtype", "head dim", "both"])
@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.needs_gpu])
def test_a_gpu_only_stage_says_it_needs_a_gpu_before_dtype_or_head_dim(name, wrong, framework):
    """CPU inputs a GPU-only stage would also refuse for their dtype or head dim: the GPU is what to fix
    first (with the right dtype and D, the learner would still be refused)."""
    stage = STAGES[name]
    dtype = next(d for d in ("float32", "float64") if d not in stage.dtypes) if wrong != "head dim" else run_dtype(stage)
    D = next(d for d in range(8, 1000, 4) if d not in stage.head_dims) if wrong != "dtype" else head_dim(stage)
    q, k, v = wb.random_qkv(1, 1, 4, D, dtype=dtype, framework=framework if dtype != "bfloat16" else "torch")
    with expect(ValueError, f"stage '{name}'", "only on a CUDA GPU", "got inputs on cpu"):
        wb.attention(q, k, v, stage=name)


# --- wb.reference and wb.check: the same rules and messages as wb.attention --------------------------------

def _bad_case(change, error, *patterns):
    """One bad input: `change` turns valid (q, k, v, kwargs) into bad ones; wb.attention raises `error`."""
    return change, error, patterns


def _other_kind(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x.numpy()


BAD_INPUTS = {
    "q of rank 3": _bad_case(lambda q, k, v, kw: ((q[0], k, v), kw), ValueError, r"^q:", "rank 4", "rank 3"),
    "k of rank 5": _bad_case(lambda q, k, v, kw: ((q, k[None], v), kw), ValueError, r"^k:", "rank 5"),
    "q a list": _bad_case(lambda q, k, v, kw: ((q.tolist(), k, v), kw), TypeError, r"^q:", "NumPy array or torch tensor",
                          "got list"),
    "v None": _bad_case(lambda q, k, v, kw: ((q, k, None), kw), TypeError, r"^v:", "got NoneType"),
    "numpy and torch": _bad_case(lambda q, k, v, kw: ((q, _other_kind(k), v), kw), TypeError,
                                 "all NumPy arrays or all torch tensors"),
    "dtypes differ": _bad_case(lambda q, k, v, kw: ((q, k.astype(np.float64), v), kw), TypeError, "different dtypes"),
    "batch differs": _bad_case(lambda q, k, v, kw: ((q, k[:1], v), kw), ValueError, "batch/heads", "must match"),
    "head dim differs": _bad_case(lambda q, k, v, kw: ((q, k, v[..., :8]), kw), ValueError, "head dim differs"),
    "v shorter than k": _bad_case(lambda q, k, v, kw: ((q, k, v[:, :, :5]), kw), ValueError, "v has Lk=5 keys",
                                  "k has Lk=6"),
    "no queries": _bad_case(lambda q, k, v, kw: ((q[:, :, :0], k, v), kw), ValueError, "empty input", ">= 1"),
    "1-D mask": _bad_case(lambda q, k, v, kw: ((q, k, v), {**kw, "key_padding_mask": np.ones(6, bool)}), ValueError,
                          r"^key_padding_mask:", re.escape("expected shape (B, Lk)=(2, 6)"), re.escape("got (6,)")),
    "mask a list": _bad_case(lambda q, k, v, kw: ((q, k, v), {**kw, "key_padding_mask": [[True] * 6] * 2}), TypeError,
                             r"^key_padding_mask:", "got list"),
    "float mask": _bad_case(lambda q, k, v, kw: ((q, k, v), {**kw, "key_padding_mask": np.ones((2, 6), np.float32)}),
                            TypeError, r"^key_padding_mask:", "dtype bool", "got float32"),
    "causal a string": _bad_case(lambda q, k, v, kw: ((q, k, v), {**kw, "causal": "False"}), ValueError, r"^causal:",
                                 "'top_left', 'bottom_right'"),
    "causal 2": _bad_case(lambda q, k, v, kw: ((q, k, v), {**kw, "causal": 2}), TypeError, r"^causal:",
                          "True or False"),
    "Hk not dividing H": _bad_case(lambda q, k, v, kw: ((q, k[:, :3], v[:, :3]), kw), ValueError, r"^heads:", "H=4",
                                   "Hk=3", "Hk must divide H"),
    "k and v heads differ": _bad_case(lambda q, k, v, kw: ((q, k[:, :2], v[:, :1]), kw), ValueError, "batch/heads",
                                      "same number of heads Hk"),
    "scale a string": _bad_case(lambda q, k, v, kw: ((q, k, v), {**kw, "scale": "0.5"}), TypeError, r"^scale:"),
    "scale NaN": _bad_case(lambda q, k, v, kw: ((q, k, v), {**kw, "scale": float("nan")}), ValueError, r"^scale:",
                           "finite number"),
}


def _call(entry, args, kwargs):
    """wb.reference, or wb.check of a well-formed output (with and without a precomputed reference)."""
    good_q, good_k, good_v = small_inputs("reference", B=2, H=4, Lk=6)
    good_out, good_lse = wb.reference(good_q, good_k, good_v)
    if entry == "reference":
        return wb.reference(*args, **kwargs)
    ref = (good_out, good_lse) if entry == "check with ref" else None
    return wb.check("bad input", good_out.astype(np.float32), *args, ref=ref, verbose=False, **kwargs)


@pytest.mark.parametrize("entry", ["reference", "check", "check with ref"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_reference_and_check_refuse_bad_input_as_attention_does(entry, case):
    change, error, patterns = BAD_INPUTS[case]
    q, k, v = small_inputs("reference", B=2, H=4, Lk=6)
    args, kwargs = change(q, k, v, {})
    with expect(error, *patterns) as refused:
        wb.attention(*args, **kwargs)
    with pytest.raises(error, match=f"^{re.escape(str(refused.value))}$"):
        _call(entry, args, kwargs)


# --- wb.check's output and LSE ---------------------------------------------------------------------------

@pytest.mark.parametrize("argument, value", [("out", None), ("out", "list"), ("lse", "list")])  # lse=None: no LSE
def test_check_refuses_an_output_that_is_not_an_array(argument, value):
    q, k, v = small_inputs("reference")
    out, lse = wb.reference(q, k, v)
    given = {"out": out, "lse": lse}
    given[argument] = given[argument].tolist() if value == "list" else None
    with expect(TypeError, f"^{argument}:", "NumPy array or torch tensor", f"got {type(given[argument]).__name__}"):
        wb.check("bad output", given["out"], q, k, v, lse=given["lse"], verbose=False)


@pytest.mark.parametrize("argument", ["out", "lse"])
@pytest.mark.parametrize("dtype", ["int32", "bool", "uint8"])
def test_check_refuses_an_output_of_a_dtype_it_cannot_measure(argument, dtype):
    q, k, v = small_inputs("reference")
    out, lse = wb.reference(q, k, v)
    given = {"out": out.astype(np.float32), "lse": lse.astype(np.float32)}
    given[argument] = torch.from_numpy(given[argument]).to(getattr(torch, dtype))
    with expect(TypeError, f"^{argument}:", f"got {dtype}", re.escape("float16, bfloat16, float32, float64")):
        wb.check("bad output", given["out"], q, k, v, lse=given["lse"], verbose=False)


@pytest.mark.parametrize("shape", [(1, 2, 5, 1), (1, 2, 3), (5,), (1, 2, 5, 5)])
def test_check_fails_an_lse_of_the_wrong_shape(shape):
    """As for the output (test_check.py): a wrong shape is a failed check, said in words, not a NumPy
    broadcast error (or, worse, a broadcast that happens to work)."""
    q, k, v = small_inputs("reference")
    out, lse = wb.reference(q, k, v)
    wrong = np.zeros(shape, np.float32)
    with expect(wb.CheckFailed, "^bad lse:", "lse shape", re.escape(str(shape)), re.escape("(1, 2, 5)")):
        wb.check("bad lse", out.astype(np.float32), q, k, v, lse=wrong, verbose=False)


# --- random inputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["fp32", "float", "half", "int32"])
def test_random_qkv_names_the_dtypes_it_accepts(dtype, framework):
    with expect(ValueError, r"^dtype:", "float16, bfloat16, float32, float64", f"got '{dtype}'"):
        wb.random_qkv(dtype=dtype, framework=framework)


@pytest.mark.parametrize("make", [lambda fw: wb.random_qkv(framework=fw), lambda fw: wb.random_padding_mask(2, 6, framework=fw)],
                         ids=["random_qkv", "random_padding_mask"])
@pytest.mark.parametrize("framework", ["jax", "Torch", None])
def test_random_inputs_name_the_frameworks_they_accept(make, framework):
    with expect(ValueError, r"^framework:", "'numpy' or 'torch'", f"got {framework!r}"):
        make(framework)


# --- where validation lives ----------------------------------------------------------------------------------------

def _imported_modules(module) -> set:
    """The package-relative modules that `module`'s source imports anywhere (top level or inside a function)."""
    import ast
    import inspect

    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.add(node.module or "")
    return found


def test_validation_imports_run_one_way():
    """arguments <- reference <- rungs <- validation <- execution <- torch_ops <- api: the argument rules import none of
    the floors above them, the reference reads them and no floor above it (not even inside a function, the old
    workaround), validation does not reach up into execution, the operators or the API, and importing the package does
    not import torch."""
    import importlib
    import subprocess
    import sys

    # (the package's `reference` attribute is the function: import the modules by name)
    arguments, reference, validation_module, execution = (
        importlib.import_module(f"wb_kernels.{name}") for name in ("arguments", "reference", "validation", "execution"))
    above = {"api", "torch_ops", "execution", "validation", "reference", "stages", "check"}
    assert not _imported_modules(arguments) & above
    assert not _imported_modules(reference) & above and "arguments" in _imported_modules(reference)
    assert not _imported_modules(validation_module) & {"api", "torch_ops", "execution"}
    assert not _imported_modules(execution) & {"api", "torch_ops"}
    run = subprocess.run([sys.executable, "-c", "import sys, wb_kernels; assert 'torch' not in sys.modules"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_public_names_stay_importable_from_api():
    """What bench and models import from the API, and what the package exports, are the API's."""
    for name in ("attention", "attention_backward", "decode", "validate", "available_stages",
                 "get_stage", "available_backwards", "get_backward"):
        assert getattr(wb, name) is getattr(api, name), name
    assert api.validate is validation.validate
