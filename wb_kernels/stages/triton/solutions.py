"""Worked solutions to lesson 11_triton's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

try:  # Triton's interpreter wants triton.language among a jit function's globals
    import triton
    import triton.language as tl
except ImportError:  # Linux wheels only
    triton = tl = None

# exercise 1: rows 160..175, window of 40 keys (left 39): keys 121..175, the key blocks 7, 8, 9 and 10
answer_1 = (175 // 16) - (121 // 16) + 1
# exercise 2: lse = log(exp(sink) + sum of nothing) = the sink
answer_2 = -1.5
# exercise 3: the bias's own shape: dZ summed over B (it broadcasts there) and over Lq (one row per head)
answer_3 = (1, 4, 1, 96)
# exercise 4: query blocks of 32 against key blocks of 32; documents [0, 40), [40, 64), [64, 128). Causal and sharing
# a document: (0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3): 6 of 16 tiles visited, 10 skipped
answer_4 = 16 - 6


def local_layer_mods():
    """The puzzle's answer: the local layer's (score_mod, mask_mod). (Triton's interpreter runs a jit function's
    source again with its module's globals: tanh, CAP and WINDOW are globals here, as in the lesson's cell.)"""
    global tanh, CAP, WINDOW
    from .exercises import PUZZLE_SOFTCAP, PUZZLE_WINDOW
    from .launcher import load_kernels

    tanh = load_kernels().tanh  # the kernels' own: Triton's interpreter has no libdevice
    CAP, WINDOW = tl.constexpr(PUZZLE_SOFTCAP), tl.constexpr(PUZZLE_WINDOW)

    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx):
        capped = CAP * tanh(score / CAP)  # Gemma 2 caps the scaled score first,
        slope = tl.exp2(-1.0 - h.to(tl.float32))  # then ALiBi adds its term: slope 2^-(h+1) times the distance
        return capped - slope * (q_idx - kv_idx).to(tl.float32)

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx):
        # causal, and WINDOW keys that end at the query: the query's own and the WINDOW - 1 before it
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)

    return score_mod, mask_mod
