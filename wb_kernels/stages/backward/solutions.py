"""Worked solutions to lesson 08_backward's exercises and its puzzle. Try them first: the lesson's check cells tell
you when you are right."""

# exercise 1: O (B*H*L*D bf16 numbers, 2 bytes each) and the float32 LSE (B*H*L numbers), in MiB
answer_1 = 2 * 32 * 16384 * (128 * 2 + 4) / 2**20
# exercise 2: the forward does 2 products (S, O); v1's KV-stationary kernel 4 (S, dV, dP, dK) and its Q-stationary
# kernel 3 (S and dP again, then dQ): 7 / 2
answer_2 = 7 / 2
# exercise 3: v1 at D = 128 takes 32 query rows against 64 keys; each of Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO and
# dK += dSᵀ Q is 64 x 32 x 128 multiply-adds = (64/16) (32/8) (128/16) or (64/16) (128/8) (32/16) = 128 mma
answer_3 = 4 * 128

# The puzzle's solution is the package's own step (region backward_tile_step of blockwise.py): S recomputed, P as
# exp(S - LSE) where allowed and 0 elsewhere, dV = Pᵀ dO, dP = dO Vᵀ, dS = P (dP - D), dQ = scale dS K and
# dK = scale dSᵀ Q, with dK and dV summed over the group's heads.
from .blockwise import backward_tile_step  # noqa: E402,F401
