"""The greedy check of lesson 07's decoder: two ways of running it generate from the same prompts in lockstep, and
the record says whether their tokens are identical and, where they are not, whether rounding can account for the
first flip (the near-tie rule). Used by ``decoder_tokens`` (its results file's ``greedy`` records) and the tests.

Two correct attentions, or the same step eager, captured in a CUDA graph or compiled, give logits that differ by their
rounding, carried through every layer. With random weights the two largest logits are often nearly equal, and such
a difference can flip a greedy token: a flip at a near tie, with logits that agree to rounding, is not by itself a
wrong kernel; anything else is.
"""

from __future__ import annotations

import math

import torch

from . import llama_decoder as dec
from .decoder_graphs import EagerRunner

__all__ = ["ROUNDING_ULPS", "compare_greedy", "compare_runners", "greedy_note"]


def _round(x: float, digits: int = 5):
    from ..results_files import round_significant

    return round_significant(x, digits)



# The logits of two correct attentions differ by their rounding, carried through every layer; an attention that is
# wrong moves them by a sizeable fraction of their range. The line between: 16 units of the dtype's rounding
# (torch.finfo(dtype).eps) times the largest |logit|. A guess with room, not a derived bound; the file keeps the
# numbers it is applied to.
ROUNDING_ULPS = 16


@torch.inference_mode()
def compare_greedy(model: dec.Decoder, prompt: torch.Tensor, new_tokens: int, reference, other, *,
                   reference_paged: bool = False, other_paged: bool = False, page_size: int = 16) -> dict:
    """Greedy generation of `new_tokens` per prompt (B, L) with the attention `reference` and with `other`, in
    lockstep: each run is fed its own tokens, and the two runs' logits are compared at every step.

    Step 0 is the prefill's prediction, step s the s-th decode step. A sequence's two runs see the same context at
    step s while none of its earlier tokens differed; the logits are compared only there (past it they differ
    because their inputs do). Returns:

    - ``identical`` (every token equal) and ``sequences_identical``;
    - ``max_logit_diff``, ``logit_absmax`` (the reference's largest |logit|), their ratio ``relative_logit_diff``,
      ``rounding_tolerance`` (:data:`ROUNDING_ULPS` x the dtype's eps) and ``agree_to_rounding`` (the ratio within
      it), and ``min_reference_margin`` (the reference's smallest gap between its top two logits);
    - ``first_divergence``: None, or the first differing step and sequence, both tokens, the reference's top-2
      margin and the largest |logit difference| of that sequence there, and ``near_tie``: the attentions agree to
      rounding and the margin is at most twice that difference, so their rounding can account for the flip.
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens!r}: expected an int >= 1")
    capacity = prompt.shape[1] + new_tokens - 1
    runners = [EagerRunner(model, attend, capacity=capacity, paged=paged, page_size=page_size)
               for attend, paged in ((reference, reference_paged), (other, other_paged))]
    return compare_runners(runners[0], runners[1], prompt, new_tokens, model.dtype)


@torch.inference_mode()
def compare_runners(reference, other, prompt: torch.Tensor, new_tokens: int, dtype: torch.dtype) -> dict:
    """:func:`compare_greedy` for any two runners with ``start(prompt) -> logits`` and ``step(tokens) -> logits``
    (``decoder_graphs``: the eager decoder, a CUDA graph per batch bucket, the compiled step): the same record."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens!r}: expected an int >= 1")
    batch = prompt.shape[0]
    logits = [runner.start(prompt) for runner in (reference, other)]
    tokens, margins, diffs, absmax = [], [], [], []
    for step in range(new_tokens):
        if step:
            logits = [runner.step(token) for token, runner in zip(tokens[-1], (reference, other))]
        ref_logits, other_logits = (x.float().clone() for x in logits)  # exact for 16-bit logits; a replay's
        # logits are a view the next replay overwrites
        top2 = ref_logits.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        diffs.append((ref_logits - other_logits).abs().amax(dim=-1))
        absmax.append(ref_logits.abs().amax(dim=-1))
        tokens.append((logits[0].argmax(-1), logits[1].argmax(-1)))
    ref_tokens = torch.stack([t[0] for t in tokens], dim=1).cpu()  # (B, new_tokens)
    other_tokens = torch.stack([t[1] for t in tokens], dim=1).cpu()
    margins, diffs, absmax = (torch.stack(x, dim=1).cpu() for x in (margins, diffs, absmax))
    differ = ref_tokens != other_tokens
    agreed_so_far = torch.cat([torch.ones(batch, 1, dtype=torch.long), (~differ[:, :-1]).long()], dim=1)
    same_context = agreed_so_far.cumprod(dim=1).bool()  # (B, new_tokens)
    max_diff, logit_absmax = float(diffs[same_context].max()), float(absmax[same_context].max())
    relative = max_diff / logit_absmax if logit_absmax > 0 else math.inf
    tolerance = ROUNDING_ULPS * torch.finfo(dtype).eps
    record = {"identical": not bool(differ.any()), "sequences_identical": int((~differ).all(dim=1).sum()),
              "max_logit_diff": _round(max_diff), "logit_absmax": _round(logit_absmax),
              "relative_logit_diff": _round(relative, 3), "rounding_tolerance": _round(tolerance, 3),
              "agree_to_rounding": relative <= tolerance,
              "min_reference_margin": _round(float(margins[same_context].min())), "first_divergence": None}
    if differ.any():
        steps = torch.where(differ.any(dim=1), differ.float().argmax(dim=1), new_tokens)  # first differing step
        step = int(steps.min())
        sequence = int((steps == step).nonzero()[0])
        margin, diff = float(margins[sequence, step]), float(diffs[sequence, step])
        record["first_divergence"] = {
            "step": step, "sequence": sequence, "reference_token": int(ref_tokens[sequence, step]),
            "other_token": int(other_tokens[sequence, step]), "reference_top2_margin": _round(margin),
            "logit_max_abs_diff": _round(diff), "near_tie": record["agree_to_rounding"] and margin <= 2 * diff,
            "sequences_diverged": int((steps < new_tokens).sum())}
    return record


def greedy_note(record: dict) -> str:
    """One sentence on a compare_greedy record, for the file and the log: what happened, and what it means."""
    agreement = (f"while the two runs saw the same context their logits differed by at most "
                 f"{record['max_logit_diff']:.3g} (relative to the largest |logit|: "
                 f"{record['relative_logit_diff']:.3g}, " + ("within" if record["agree_to_rounding"] else "beyond")
                 + f" the rounding tolerance {record['rounding_tolerance']:.3g})")
    first = record["first_divergence"]
    if first is None:
        return (f"identical tokens; {agreement}; the reference's smallest top-2 margin was "
                f"{record['min_reference_margin']:.3g}")
    text = (f"the tokens differ from step {first['step']} on (sequence {first['sequence']}; "
            f"{first['sequences_diverged']} of {record['sequences_identical'] + first['sequences_diverged']} "
            f"sequences diverge): there the reference's top two logits were {first['reference_top2_margin']:.3g} "
            f"apart and the two runs' logits differed by up to {first['logit_max_abs_diff']:.3g}; {agreement}. ")
    if first["near_tie"]:
        return text + ("A near tie, which the two attentions' rounding can flip; the weights are random, which makes "
                       "near ties common. Not by itself a wrong kernel")
    return text + "Not a near tie that rounding explains: the attention is suspect"
