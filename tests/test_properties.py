"""Property tests (hypothesis): every stage against the float64 reference with the tolerance rule, on random
shapes, key/value head counts (GQA), head dims, dtypes, masks (both causal alignments), scales, logit sizes and
memory layouts (issue: robustness); and every stage with a backward (``wb.available_backwards()``) against the
float64 ``reference_backward`` with ``wb.check_gradients``, on the same random problems.

Two profiles, chosen automatically (or by HYPOTHESIS_PROFILE=ci|gpu):

- ``ci`` on the simulator: tiny sizes (L <= 24, B*H <= 2, the smallest head dim of each stage) and a
  number of examples per stage that fits a time budget computed from the stage's own simulator cost
  model, so the file takes well under 90 s on 2 cores. Derandomized: CI sees the same examples each run.
- ``gpu`` when a CUDA GPU runs the kernels: L up to 700, B and H up to 4, every head dim and dtype the
  stage takes, 100 random examples per stage. No shrinking: a GPU run has a time limit, and shrinking
  slow examples could eat it; a failure is reported as drawn.

Each example prints nothing; a failure shows the shrunk problem and the check line.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import wb_kernels as wb

from stage_cases import ON_GPU, STAGES, head_dim, like_inputs, run_dtype, stage_params

settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("gpu", deadline=None, max_examples=100, print_blob=True,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("gpu" if ON_GPU else "ci")
if PROFILE not in ("ci", "gpu"):
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}: use 'ci' or 'gpu'")

# ci: simulator seconds each stage may spend, and how much slower than its cost model the simulator runs
# on 2 busy cores (measured: up to ~4x for the tiled stage).
CI_SECONDS_PER_STAGE = 20.0
COST_MODEL_SLACK = 4.0
CI_MAX_LENGTH = 24
CI_MAX_EXAMPLES = 25


def plan(stage, profile=None, cost_factor: float = 1.0) -> dict:
    """Sizes and number of examples for `stage` under `profile` (default: the active one); `cost_factor` prices an
    example at that many forwards."""
    if (profile or PROFILE) == "gpu":
        return {"max_len": 700, "max_b": 4, "max_h": 4, "max_bh": 16, "head_dims": stage.head_dims or (16, 32, 64, 128),
                "dtypes": stage.dtypes, "examples": settings.get_profile("gpu").max_examples}
    D = head_dim(stage)
    cost = (stage.simulator_seconds(2, 1, CI_MAX_LENGTH, CI_MAX_LENGTH, D) * COST_MODEL_SLACK
            if stage.simulator_seconds else 0.05) * cost_factor
    examples = int(max(3, min(CI_MAX_EXAMPLES, CI_SECONDS_PER_STAGE / cost)))
    dtypes = tuple(d for d in stage.dtypes if d in ("float32", "float64")) or (run_dtype(stage),)
    return {"max_len": CI_MAX_LENGTH, "max_b": 2, "max_h": 2, "max_bh": 2, "head_dims": (D,), "dtypes": dtypes,
            "examples": examples}


@st.composite
def problems(draw, stage, p):
    """One attention problem: shapes, dtype, flags, mask, scale, logit size, layout, seed."""
    B = draw(st.integers(1, p["max_b"]))
    H = draw(st.integers(1, max(1, min(p["max_h"], p["max_bh"] // B))))
    Hk = draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))  # key/value heads (GQA when < H)
    Lq = draw(st.integers(1, p["max_len"]))
    Lk = draw(st.one_of(st.just(Lq), st.integers(1, p["max_len"])))
    D = draw(st.sampled_from(sorted(p["head_dims"])))
    dtype = draw(st.sampled_from(sorted(p["dtypes"])))
    causal = draw(st.sampled_from([False, True, "bottom_right"]))
    mask_kind = draw(st.sampled_from(["none", "random", "prefix", "one_batch_empty"]))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    std = draw(st.sampled_from([0.3, 1.0, 3.0]))  # logits from ~0.1 to ~10 (and 30 with a large scale)
    layout = draw(st.sampled_from(["contiguous", "heads_last", "strided"]))
    framework = draw(st.sampled_from(["numpy", "torch"])) if not ON_GPU and dtype != "bfloat16" else "torch"
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(B=B, H=H, Hk=Hk, Lq=Lq, Lk=Lk, D=D, dtype=dtype, causal=causal, mask_kind=mask_kind, scale=scale,
                std=std, layout=layout, framework=framework, seed=seed)


def build(problem):
    """The inputs and mask a problem describes (NumPy mask for wb.check, and one in the inputs' kind)."""
    P = problem
    device = "cuda" if ON_GPU else None
    q, k, v = wb.random_qkv(P["B"], P["H"], P["Lq"], P["D"], Lk=P["Lk"], dtype=P["dtype"], framework=P["framework"],
                            device=device, seed=P["seed"], std=P["std"])
    k, v = k[:, :P["Hk"]], v[:, :P["Hk"]]  # GQA: a view of the first Hk heads (strided when Hk < H and B > 1)
    if P["layout"] == "heads_last":  # (B, L, H, D) in memory, viewed as (B, H, L, D), as models store them
        q, k, v = (_heads_last(x) for x in (q, k, v))
    elif P["layout"] == "strided":  # every other row of a twice-as-long buffer
        q, k, v = (_strided(x) for x in (q, k, v))
    rng = np.random.default_rng(P["seed"])
    if P["mask_kind"] == "none":
        keep = None
    elif P["mask_kind"] == "random":
        keep = rng.random((P["B"], P["Lk"])) < 0.7
    elif P["mask_kind"] == "prefix":
        keep = wb.random_padding_mask(P["B"], P["Lk"], seed=P["seed"])
    else:
        keep = rng.random((P["B"], P["Lk"])) < 0.7
        keep[0] = False
    mask = None if keep is None else like_inputs(keep, q)
    return q, k, v, keep, mask


def _heads_last(x):
    if hasattr(x, "detach"):
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 1, 2)), 1, 2)


def _strided(x):
    if hasattr(x, "detach"):
        import torch

        return torch.repeat_interleave(x, 2, dim=2)[:, :, ::2]
    return np.repeat(x, 2, axis=2)[:, :, ::2]


# A known gap, not a tolerance picked to pass: the flash stage (CUDA cores, fp32) sums each dot product
# of Q K^T in one chain per thread, as SDPA's MATH backend and eager PyTorch do. SDPA's default fp32 path
# (EFFICIENT) sums in blocks and is about twice as accurate once the softmax is peaked: measured on an H100
# (scripts/error_vs_pytorch.py, results/accuracy/), flash is at 1.2-1.5x SDPA's error with ordinary logits
# and 2.1-2.4x with logits of standard deviation 11-16, level with MATH and eager. Blocked sums need
# registers the tuned kernel has not got (wb_kernels/stages/flash/NOTES.md). So on peaked problems flash is
# held to 2.5x, which still fails a kernel that is worse than PyTorch's own chain-summing paths.
PEAKED_LOGIT_STD = 4.0
FLASH_PEAKED_MULTIPLIER = 2.5


def logit_std(problem) -> float:
    """Typical size of a scaled score: |scale| * std(q) * std(k) * sqrt(D)."""
    scale = problem["scale"] if problem["scale"] is not None else problem["D"] ** -0.5
    return abs(scale) * problem["std"] ** 2 * problem["D"] ** 0.5


def multiplier(name, problem) -> float:
    if name == "flash" and problem["dtype"] == "float32" and logit_std(problem) > PEAKED_LOGIT_STD:
        return FLASH_PEAKED_MULTIPLIER
    return 2.0


def run_random_problems(name, p, what: str, check_one) -> None:
    """`check_one(problem)` on `p["examples"]` random problems for stage `name`; prints how many passed, for the log
    (pytest -rP shows it; hypothesis' own statistics are not reported from pytest-xdist workers, and the GPU check
    runs one stage per worker; scripts/gpu_check.sh greps "random problems matched")."""
    checked = []

    @settings(parent=settings.get_profile(PROFILE), max_examples=p["examples"])
    @given(problem=problems(STAGES[name], p))
    def one_problem(problem):
        note(f"{name} {what}: {problem}")
        check_one(problem)
        checked.append(problem)

    one_problem()
    print(f"{name}: {len(checked)} random problems matched the reference ({what}, {PROFILE} profile)")


@pytest.mark.parametrize("name", stage_params())
def test_stage_matches_reference_on_random_problems(name):
    def check_one(problem):
        q, k, v, keep, mask = build(problem)
        out, lse = wb.attention(q, k, v, stage=name, causal=problem["causal"], key_padding_mask=mask,
                                scale=problem["scale"], return_lse=True)
        assert type(out) is type(q) and tuple(out.shape) == tuple(q.shape)
        if hasattr(q, "device"):
            assert out.device == q.device
        wb.check(name, out, q, k, v, lse=lse, causal=problem["causal"], key_padding_mask=keep,
                 scale=problem["scale"], verbose=False, multiplier=multiplier(name, problem))

    run_random_problems(name, plan(STAGES[name]), "forward", check_one)


# A forward and a backward cost about 3.5 forwards (the backward recomputes P and makes five matrix products)
BACKWARD_COST = 3.5
CI_MAX_GRADIENT_EXAMPLES = 12


def gradient_plan(stage, profile=None) -> dict:
    """:func:`plan` for the gradient property: in the ci profile, each example priced as a forward and a backward,
    and at most CI_MAX_GRADIENT_EXAMPLES (each also runs the reference's and PyTorch's backward, about 0.5 s here)."""
    p = plan(stage, profile, cost_factor=BACKWARD_COST)
    if (profile or PROFILE) == "ci":
        p["examples"] = min(p["examples"], CI_MAX_GRADIENT_EXAMPLES)
    return p


@pytest.mark.parametrize("name", stage_params(list(wb.available_backwards())))
def test_gradients_match_reference_on_random_problems(name):
    """wb.attention_backward (and, for torch inputs, autograd through wb.attention) against reference_backward,
    by check_gradients' rule: GQA, both causal alignments, padding, batches with no key, scales, layouts."""
    def check_one(problem):
        q, k, v, keep, mask = build(problem)
        dout = wb.random_qkv(problem["B"], problem["H"], problem["Lq"], problem["D"], dtype=problem["dtype"],
                             framework=problem["framework"], device="cuda" if ON_GPU else None,
                             seed=problem["seed"] + 1)[0]
        options = dict(causal=problem["causal"], scale=problem["scale"])
        checking = dict(key_padding_mask=keep, verbose=False, multiplier=multiplier(name, problem), **options)
        grads = wb.attention_backward(q, k, v, dout, stage=name, key_padding_mask=mask, **options)
        wb.check_gradients(name, grads, q, k, v, dout, **checking)
        if hasattr(q, "detach"):  # the same through autograd
            import torch

            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
            out = wb.attention(*leaves, stage=name, key_padding_mask=mask, **options)
            wb.check_gradients(f"{name} autograd", torch.autograd.grad(out, leaves, dout), q, k, v, dout, **checking)

    run_random_problems(name, gradient_plan(STAGES[name]), "gradients", check_one)


def test_ci_plan_fits_the_time_budget():
    """The ci profile's examples, priced by each stage's cost model, stay inside the file's budget."""
    if PROFILE != "ci":
        pytest.skip("the time budget is the ci profile's")
    total = 0.0
    for stage in STAGES.values():
        if stage.needs_gpu:
            continue
        p = plan(stage)
        D = p["head_dims"][0]
        per_example = stage.simulator_seconds(2, 1, CI_MAX_LENGTH, CI_MAX_LENGTH, D) if stage.simulator_seconds else 0.01
        total += p["examples"] * per_example
        if stage.name in wb.available_backwards():
            total += gradient_plan(stage)["examples"] * per_example * BACKWARD_COST
        assert p["examples"] >= 3
    assert total < 60, f"the ci profile would need about {total:.0f} s of simulator time"


def test_gpu_plan_covers_every_head_dim_and_dtype():
    for stage in STAGES.values():
        p = plan(stage, "gpu")
        assert set(p["dtypes"]) == set(stage.dtypes)
        assert stage.head_dims is None or set(p["head_dims"]) == set(stage.head_dims)
        assert p["max_len"] > 256 and p["examples"] == 100  # past the tile sizes of every GPU kernel


# ------------------------------------------------------------------------------------------------ the variants

VARIANT_GPU_EXAMPLES = 25
VARIANT_STAGES = [name for name, stage in STAGES.items() if stage.variants and name != "reference"]


@st.composite
def variant_choices(draw, H: int, Lq: int, Lk: int):
    """A random set of the variants (wb_kernels.variants) for a problem's shape, as wb.attention's keywords, each
    value a plain number or a NumPy array (the test puts them in the inputs' kind and place)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    chosen = {}
    if draw(st.booleans()):
        chosen["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    if draw(st.booleans()):
        chosen["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(1, H, Lq, Lk), (1, 1, 1, Lk), (1, H, 1, Lk)]))
        chosen["bias"] = rng.standard_normal(shape)
    if draw(st.booleans()):
        left = draw(st.one_of(st.none(), st.integers(0, max(Lk, 1))))
        right = draw(st.one_of(st.none(), st.integers(0, max(Lk, 1))))
        if left is not None or right is not None:
            chosen["window"] = (left, right)
    if draw(st.booleans()) and Lq == Lk:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(Lq - 1, 1)), max_size=3))))
        chosen["document_ids"] = np.searchsorted(np.array(cuts), np.arange(Lq), side="right")[None]
    if draw(st.booleans()):
        chosen["sinks"] = rng.standard_normal(H)
    return chosen


def _variants_like(chosen: dict, q, B: int, requires_grad: bool):
    """The drawn variants in q's kind, dtype (ids: int64) and place; bias and sinks leaves that require grad."""
    import torch

    found = {}
    for name, value in chosen.items():
        if not isinstance(value, np.ndarray):
            found[name] = value
            continue
        if name == "document_ids":
            value = np.repeat(value, B, axis=0)
        if hasattr(q, "detach"):
            x = torch.from_numpy(np.ascontiguousarray(value)).to(q.device)
            x = x if name == "document_ids" else x.to(q.dtype)
            found[name] = x.requires_grad_(True) if requires_grad and name in ("bias", "sinks") else x
        else:
            found[name] = value if name == "document_ids" else value.astype(q.dtype)
    return found


@pytest.mark.parametrize("name", VARIANT_STAGES)
def test_variants_match_reference_on_random_problems(name):
    """Random sets of variants (softcap, ALiBi, a broadcast bias, windows, packed documents, sinks) on random
    problems: the forward by wb.check's rule with the variants, and, through autograd, every gradient (the bias's and
    the sinks' included) by wb.check_gradients'."""
    stage = STAGES[name]
    p = gradient_plan(stage)
    # on a GPU each example's set of variants compiles its own kernels (Triton specializes on them: ~2 s each on the
    # H100, measured), so fewer examples fit a run's time limit than for the plain problems
    p["examples"] = min(p["examples"], VARIANT_GPU_EXAMPLES if PROFILE == "gpu" else p["examples"])

    checked = []

    @settings(parent=settings.get_profile(PROFILE), max_examples=p["examples"])
    @given(data=st.data())
    def one_problem(data):
        problem = data.draw(problems(stage, p))
        problem["framework"] = "torch"
        chosen = data.draw(variant_choices(problem["H"], problem["Lq"], problem["Lk"]))
        note(f"{name} variants {sorted(chosen)}: {problem}")
        q, k, v, keep, mask = build(problem)
        q, k, v = (x.detach().contiguous().requires_grad_(True) for x in (q, k, v))
        variants = _variants_like(chosen, q, problem["B"], requires_grad=True)
        out, lse = wb.attention(q, k, v, stage=name, causal=problem["causal"], key_padding_mask=mask,
                                scale=problem["scale"], return_lse=True, **variants)
        plain = {n: (x.detach() if hasattr(x, "detach") else x) for n, x in variants.items()}
        wb.check(name, out.detach(), q.detach(), k.detach(), v.detach(), lse=lse, causal=problem["causal"],
                 key_padding_mask=keep, scale=problem["scale"], verbose=False, **plain)
        dout = torch_randn_like(out, problem["seed"] + 1)
        learnable = [n for n in ("bias", "sinks") if n in variants]
        found = dict(zip(["q", "k", "v"] + learnable, __import__("torch").autograd.grad(
            out, [q, k, v] + [variants[n] for n in learnable], dout)))
        # (what wb.attention_backward returns: (dq, dk, dv), and with variants dbias and dsinks, None where absent)
        grads = tuple(found.get(n) for n in ("q", "k", "v", "bias", "sinks")[:5 if plain else 3])
        wb.check_gradients(name, grads, q.detach(), k.detach(), v.detach(), dout, causal=problem["causal"],
                           key_padding_mask=keep, scale=problem["scale"], verbose=False, **plain)
        checked.append(problem)

    one_problem()
    print(f"{name}: {len(checked)} random problems with variants matched the reference ({PROFILE} profile)")


def torch_randn_like(x, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, generator=generator).to(device=x.device, dtype=x.dtype)
