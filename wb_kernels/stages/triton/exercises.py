"""Lesson 11_triton's exercises and its coding puzzle: what each answer must equal (computed from the package when
graded), the puzzle's grader, and the plausible wrong answers each must reject (as data: ``tests/test_exercises.py``
feeds them to the graders).

The worked answers (and a solution to the puzzle) are in ``solutions.py`` next to this file: open it when you want
them.

The puzzle asks for a local attention layer written as FlexAttention writes one: a ``score_mod`` that caps the
scaled score at :data:`PUZZLE_SOFTCAP` (Gemma 2's softcap) and then adds ALiBi's distance term (slope 2^-(h+1) for
head h), and a ``mask_mod`` for a causal sliding window of :data:`PUZZLE_WINDOW` keys, the query's own included, as
Gemma 2 and Mistral count a window. The grader runs the triton stage with them (Triton's interpreter without a GPU)
beside gpt-oss's sinks given as the named variant, and holds the output and the LSE to the float64 reference of the
named variants ``softcap``, ``alibi_slopes``, ``window=(W - 1, 0)``, ``causal`` and ``sinks``. Its problem
(:func:`puzzle_problem`) makes each mistake show: scores of several units, so that a cap bends them and the cap's
place in the order matters; a slope of 1/2 on head 0, so that ALiBi moves scores by several units across the window;
40 positions, so that most rows have keys beyond the window on both sides of its edge, and future keys to hide.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ...check import check as check_against_reference
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies
from ...reference import reference, reference_gradients
from ...variants import document_ids_from_cu_seqlens
from .figures import visited_key_blocks

try:  # Triton's interpreter wants triton.language among a jit function's globals, the wrong answers' below included
    import triton
    import triton.language as tl
except ImportError:  # Linux wheels only: the exercises grade without it; the puzzle says that it cannot run here
    triton = tl = None

__all__ = ["EXERCISES", "PUZZLE", "check", "check_local_layer_puzzle", "puzzle_problem", "puzzle_slopes",
           "PUZZLE_SOFTCAP", "PUZZLE_WINDOW", "PUZZLE_HEADS", "PUZZLE_LENGTH", "PUZZLE_BLOCK"]


# ---------------------------------------------------------------------------------------------- the exercises

def _window_visits() -> int:
    # L = 256, blocks of 16, causal with a window of 40 keys (the query's own included): query block 10
    return int(visited_key_blocks(256, 256, 16, 16, causal="top_left", window=(39, 0))[10])


def _empty_row_lse() -> float:
    # every key padded: the row sees none, and its head's sink is -1.5
    q = k = v = np.zeros((1, 1, 3, 16))
    _, lse = reference(q, k, v, key_padding_mask=np.zeros((1, 3), dtype=bool), sinks=np.array([-1.5]))
    return float(lse[0, 0, 0])


def _bias_gradient_shape() -> tuple:
    # B = 2, H = 4, Lq = Lk = 96, a bias of one row per head, (1, H, 1, Lk)
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((2, 4, 96, 16)) for _ in range(4))
    return tuple(reference_gradients(q, k, v, dout, bias=np.zeros((1, 4, 1, 96)))["bias"].shape)


def _document_tiles_skipped() -> int:
    # documents of 40, 24 and 64 tokens packed into L = 128, causal, blocks of 32: tiles the forward never visits
    ids = document_ids_from_cu_seqlens(np.array([0, 40, 64, 128]), 128)
    return 16 - int(visited_key_blocks(128, 128, 32, 32, causal="top_left", document_ids=ids).sum())


EXERCISES = (
    Exercise("exercise 1", _window_visits,
             "Query block 10 holds rows 160 to 175: the first row's window reaches 39 keys back, the last row sees "
             "up to itself; count the key blocks of 16 that this range touches.",
             wrong={"ceil(40 / 16): the window alone, not the block's own 16 rows": 3,
                    "the blocks from first to last, one too many": 5,
                    "causal alone (blocks 0 to 10)": 11,
                    "every key block": 16}),
    Exercise("exercise 2", _empty_row_lse,
             "The sink is one more logit in the row's log-sum-exp, a logit with no value.",
             wrong={"-inf, as without a sink": float("-inf"),
                    "0, as if the row's sum were 1": 0.0,
                    "exp(sink)": float(np.exp(-1.5)),
                    "log(1 + exp(sink)): the sink beside a key of score 0": float(np.log1p(np.exp(-1.5)))}),
    Exercise("exercise 3", _bias_gradient_shape,
             "A gradient has the shape of what it differentiates: dZ summed over the dimensions where the bias "
             "broadcasts. Answer with a tuple.",
             wrong={"the scores' shape (B, H, Lq, Lk)": (2, 4, 96, 96),
                    "summed over B only": (1, 4, 96, 96),
                    "summed over Lq only": (2, 4, 1, 96),
                    "the size-1 dimensions dropped": (4, 96)}),
    Exercise("exercise 4", _document_tiles_skipped,
             "A tile is visited when its query block and key block share a document and the key block is not above "
             "the diagonal; the other tiles of the 4 x 4 are skipped.",
             wrong={"causal alone (the 6 tiles above the diagonal)": 6,
                    "documents alone, without causal": 8,
                    "only the 4 diagonal tiles visited": 12}),
)


def check(answer_1, answer_2, answer_3, answer_4) -> None:
    """Grade lesson 11's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3, answer_4)


# ---------------------------------------------------------------------------------------------- the puzzle

PUZZLE_SOFTCAP = 4.0  # the cap (Gemma 2 uses 50 at its scores' scale; a small one bends these)
PUZZLE_WINDOW = 12  # keys a query sees: itself and the 11 before it
PUZZLE_HEADS, PUZZLE_LENGTH, PUZZLE_D, PUZZLE_BLOCK = 4, 40, 16, 16


def puzzle_slopes() -> np.ndarray:
    """ALiBi's slope of each head: 2^-(h+1) (1/2, 1/4, ...), what ``puzzle_slope(h)`` computes in the lesson's stub."""
    return 2.0 ** -(np.arange(PUZZLE_HEADS) + 1.0)


def puzzle_problem():
    """(q, k, v, sinks): torch float32 on the triton stage's device (the CPU under Triton's interpreter), one batch
    entry, 4 heads, 40 positions, D = 16; entries of q and k of standard deviation 2, so scaled scores of about
    4 in size, where a cap of 4 bends them. Sinks of one head each."""
    import torch

    from .launcher import interpreting

    device = "cpu" if interpreting() else "cuda"
    generator = torch.Generator().manual_seed(11)
    shape = (1, PUZZLE_HEADS, PUZZLE_LENGTH, PUZZLE_D)
    q, k = (2.0 * torch.randn(shape, generator=generator) for _ in range(2))
    v = torch.randn(shape, generator=generator)
    sinks = torch.randn(PUZZLE_HEADS, generator=generator)
    return tuple(x.to(device) for x in (q, k, v, sinks))


def _named_variants(sinks) -> dict:
    import torch

    return dict(softcap=PUZZLE_SOFTCAP, alibi_slopes=torch.tensor(puzzle_slopes(), dtype=torch.float32,
                                                                  device=sinks.device),
                window=(PUZZLE_WINDOW - 1, 0), sinks=sinks)


def _mods_of(answer):
    """(score_mod, mask_mod) from the learner's answer: the pair, or a function that returns it."""
    if callable(answer) and not isinstance(answer, (tuple, list)) and not hasattr(answer, "run"):
        answer = answer()
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        raise TypeError(f"expected (score_mod, mask_mod), got {type(answer).__name__}")
    return answer


def _puzzle_result(answer):
    from ...variants import canonical_variants
    from .launcher import forward

    if triton is None:
        return SimpleNamespace(passed=False, reason="triton is not installed here (pip install triton; Linux), so "
                                                    "the puzzle's kernels cannot run")
    q, k, v, sinks = puzzle_problem()
    try:
        score_mod, mask_mod = _mods_of(answer)
        out, lse = forward(q, k, v, variants=canonical_variants(q, k, sinks=sinks), score_mod=score_mod,
                           mask_mod=mask_mod, block_m=PUZZLE_BLOCK, block_n=PUZZLE_BLOCK)
    except Exception as error:  # a mod that is not a @triton.jit function, or one Triton cannot compile
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return SimpleNamespace(passed=False, reason=f"the kernel did not run with your mods: "
                                                    f"{type(error).__name__}: {first[:300]}")
    return check_against_reference("your local layer", out, q, k, v, lse=lse, causal="top_left", verbose=False,
                                   raise_on_failure=False, **_named_variants(sinks))


@hands_copies
def check_local_layer_puzzle(answer) -> None:
    """Run the triton stage with the learner's ``(score_mod, mask_mod)`` (and the named sinks) on
    :func:`puzzle_problem` and hold its output and LSE to the float64 reference of the named variants."""
    check_puzzle("puzzle", lambda: _puzzle_result(answer),
                 hint="The cap comes first and bends the score alone (it divides the score and multiplies the "
                      "tanh); ALiBi's term, puzzle_slope(h) times the distance, comes after it. The mask: no key "
                      "from the future, and exactly WINDOW keys, the query's own among them.")


# Plausible wrong answers. Each builds a (score_mod, mask_mod) pair; the puzzle's problem is built so that none passes.

def _triton():
    """triton and triton.language, after putting the kernels' tanh (Triton's interpreter has no libdevice) among this
    module's globals: the interpreter runs a jit function's source again with its module's globals, not with the
    variables of the function that defined it, so the wrong answers below find tanh, CAP and WINDOW there."""
    global tanh
    from .launcher import load_kernels

    tanh = load_kernels().tanh
    return triton, tl


if triton is not None:  # the puzzle's two constants as Triton constants, for the jit functions below
    CAP = tl.constexpr(PUZZLE_SOFTCAP)
    WINDOW = tl.constexpr(PUZZLE_WINDOW)


def _right_score_mod():
    triton, tl = _triton()

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        return CAP * tanh(score / CAP) - tl.exp2(-1.0 - h.to(tl.float32)) * (q_idx - kv_idx).to(tl.float32)

    return score_mod


def _right_mask_mod():
    triton, tl = _triton()

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)

    return mask_mod


def _the_stub():  # as the lesson ships it: scores unchanged, every key visible
    triton, tl = _triton()

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        return score

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx >= 0

    return score_mod, mask_mod


def _window_one_too_many():  # q - kv <= W: W + 1 keys (window=(W, 0) in the named form)
    triton, tl = _triton()

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)

    return _right_score_mod(), mask_mod


def _window_one_too_few():  # W - 1 keys: the query's own key counted outside the window
    triton, tl = _triton()

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW - 1)

    return _right_score_mod(), mask_mod


def _window_without_causal():  # |q - kv| < W: the window reaches into the future too
    triton, tl = _triton()

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        return tl.abs(q_idx - kv_idx) < WINDOW

    return _right_score_mod(), mask_mod


def _window_only_below():  # q - kv < W alone: every future key passes (its distance is negative)
    triton, tl = _triton()

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < WINDOW

    return _right_score_mod(), mask_mod


def _sink_token():  # the sink taken for StreamingLLM's sink token: key 0 always visible, with its value
    triton, tl = _triton()

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)) | (kv_idx == 0)

    return _right_score_mod(), mask_mod


def _cap_after_alibi():  # ALiBi's term inside the tanh: the cap applied after the bias, not before
    triton, tl = _triton()

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        biased = score - tl.exp2(-1.0 - h.to(tl.float32)) * (q_idx - kv_idx).to(tl.float32)
        return CAP * tanh(biased / CAP)

    return score_mod, _right_mask_mod()


def _tanh_not_divided():  # CAP * tanh(score): the score not divided by the cap
    triton, tl = _triton()

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        return CAP * tanh(score) - tl.exp2(-1.0 - h.to(tl.float32)) * (q_idx - kv_idx).to(tl.float32)

    return score_mod, _right_mask_mod()


def _tanh_not_multiplied():  # tanh(score / CAP): every score squashed into (-1, 1)
    triton, tl = _triton()

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        return tanh(score / CAP) - tl.exp2(-1.0 - h.to(tl.float32)) * (q_idx - kv_idx).to(tl.float32)

    return score_mod, _right_mask_mod()


def _alibi_sign_flipped():  # + slope * distance: far keys favoured instead of penalised
    triton, tl = _triton()

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        return CAP * tanh(score / CAP) + tl.exp2(-1.0 - h.to(tl.float32)) * (q_idx - kv_idx).to(tl.float32)

    return score_mod, _right_mask_mod()


def _no_cap():  # ALiBi alone: the cap forgotten
    triton, tl = _triton()

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - tl.exp2(-1.0 - h.to(tl.float32)) * (q_idx - kv_idx).to(tl.float32)

    return score_mod, _right_mask_mod()


def _plain_python_mods():  # the right formulas as plain Python functions: Triton cannot call them in a kernel
    import math

    def score_mod(score, b, h, q_idx, kv_idx):
        return PUZZLE_SOFTCAP * math.tanh(score / PUZZLE_SOFTCAP) - 2.0 ** (-1.0 - h) * (q_idx - kv_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < PUZZLE_WINDOW)

    return score_mod, mask_mod


PUZZLE = Puzzle(
    check=check_local_layer_puzzle,
    solution="local_layer_mods",
    wrong={
        "the stub as shipped": _the_stub,
        "a window of W + 1 keys (q - kv <= W)": _window_one_too_many,
        "a window of W - 1 keys": _window_one_too_few,
        "a window on both sides, without the causal side (|q - kv| < W)": _window_without_causal,
        "q - kv < W alone: future keys pass": _window_only_below,
        "the sink taken for StreamingLLM's sink token (key 0 always visible)": _sink_token,
        "the cap applied after ALiBi's bias, not before": _cap_after_alibi,
        "tanh without dividing by the cap": _tanh_not_divided,
        "tanh without multiplying by the cap": _tanh_not_multiplied,
        "ALiBi's sign flipped": _alibi_sign_flipped,
        "no cap at all": _no_cap,
        "plain Python functions, not @triton.jit": _plain_python_mods,
    },
)
