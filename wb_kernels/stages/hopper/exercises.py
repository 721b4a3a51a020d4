"""Lesson 09's exercises and its coding puzzle: what each answer must equal, the plausible wrong answers, and the
grader of the puzzle.

Every answer is computed from the rung's models (v1's key-tile count, the TMA's 128-byte swizzle, the wgmma
accumulator layout), and each asks for what the lesson does not print. The puzzle, the producer's loop of an mbarrier
ring, is graded without a GPU: the ring model (:mod:`.barrier_ring`) runs the learner's producer against the
package's consumers under many interleavings and at several speeds of the copies and the consumers, with 1 to 4
slots and 1 or 2 consumers, and says what would hang
(a deadlock) or compute on the wrong tile (a stale read, an overwrite) on the GPU. :data:`PUZZLE` lists producers a
learner would plausibly write that are still wrong; tests/test_exercises.py feeds each to the grader. The worked
answers are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations


from ...exercises import Exercise, Puzzle, check_answers, hands_copies
from ...reference import causal_offset
from . import barrier_ring as br
from . import tma_swizzle, v1_model, wgmma_fragments

__all__ = ["EXERCISES", "PUZZLE", "RING_CASES", "TILE_BYTES", "TIMINGS", "check", "check_ring_puzzle"]

# exercise 1: a block of query rows and a shape the lesson does not print, under the bottom-right causal mask
_M0, _LQ, _LK = 128, 300, 500


def _tiles(causal) -> int:
    return v1_model.key_tiles(_M0, _LQ, _LK, causal_offset(causal, _LQ, _LK))


# exercise 2: where the TMA stores element (row 13, column 21) of a 64 x 64 box of 16-bit values
_ROW, _COLUMN = 13, 21


def _stored_byte(xor_row=None) -> int:
    offset = _ROW * tma_swizzle.ROW_BYTES + 2 * _COLUMN
    if xor_row is None:
        return int(tma_swizzle.swizzle_128b(offset))
    return offset ^ (xor_row << 4)


# exercise 3: which thread of the warpgroup holds S[37][50] of a 64 x 64 accumulator
_S_ROW, _S_COLUMN = 37, 50


def _holder(row: int, column: int) -> int:
    return next(t for t in range(wgmma_fragments.WARPGROUP) if (row, column) in
                wgmma_fragments.accumulator_coords(t, 64))


EXERCISES = (
    Exercise("exercise 1", lambda: _tiles("bottom_right"),
             "v1_model.key_tiles: the block's last row is min(m0 + 64, Lq) - 1, and the bottom-right mask lets query i "
             "see keys up to i + Lk - Lq.",
             wrong={"top-left mask": lambda: _tiles("top_left"),
                    "no mask": lambda: _tiles(False),
                    "the block's first row's diagonal": lambda: -(-min(_LK, _M0 + 1 + _LK - _LQ) // 64),
                    "keys, not tiles": lambda: min(_LK, min(_M0 + 64, _LQ) + _LK - _LQ)}),
    Exercise("exercise 2", lambda: _stored_byte(),
             "Element (r, c) is byte 128 r + 2 c of the box; the swizzle XORs bits 4-6 of that offset with bits 7-9.",
             wrong={"not swizzled": lambda: _ROW * tma_swizzle.ROW_BYTES + 2 * _COLUMN,
                    "XOR with the row, not the row mod 8": lambda: _stored_byte(xor_row=_ROW),
                    "in elements, not bytes": lambda: _stored_byte() // 2,
                    "the element's column XORed, not its chunk": lambda: _ROW * 128 + 2 * (_COLUMN ^ (_ROW % 8))}),
    Exercise("exercise 3", lambda: _holder(_S_ROW, _S_COLUMN),
             "Warp w holds rows 16 w .. 16 w + 15; in a warp, lane l holds rows l / 4 and l / 4 + 8, columns "
             "2 (l % 4) and 2 (l % 4) + 1 of every 8.",
             wrong={"the lane, without the warp": lambda: _holder(_S_ROW, _S_COLUMN) % 32,
                    "row and column swapped": lambda: _holder(_S_COLUMN, _S_ROW),
                    "the register index": lambda: wgmma_fragments.accumulator_coords(
                        _holder(_S_ROW, _S_COLUMN), 64).index((_S_ROW, _S_COLUMN)),
                    "the row": _S_ROW}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 09's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


# --- the puzzle: the producer's loop of the ring ---------------------------------------------------------------------

TILE_BYTES = 16384  # one 64 x 64 tile of K and one of V, 16-bit: what the copy engine delivers per slot
# (slots, consumers): one slot (every lap is one tile), two (v1's ring), three and four with two consumers (v2's shape)
RING_CASES = ((1, 1), (2, 1), (3, 2), (4, 2))
# (copy_delay, read_ticks): copies land copy_delay to copy_delay + 2 steps after they start; a consumer computes
# read_ticks steps on each tile before it releases the slot. A ring must work at every speed: consumers slower than
# the copies (the producer waits on empty slots), as fast, and faster (the consumers wait on full ones, and release
# a slot right after it lands). A producer right at one timing only (it waits on a barrier that only happens to be
# in the phase it expects) hangs or overwrites at another.
TIMINGS = ((2, 4), (2, 0), (0, 1), (6, 0), (1, 8))
_SEEDS = range(6)  # interleavings per (ring, timing): deterministic, so the lesson's verdict is the same every run


def _run_ring(producer, stages: int, consumers: int, seed: int, copy_delay: int, read_ticks: int) -> None:
    ring = br.Ring(stages, consumers)
    tiles = 3 * stages + 1  # three laps and one more tile: every phase flip is crossed, both parities
    agents = {"producer": producer(ring, tiles, TILE_BYTES)}
    for c in range(consumers):
        agents[f"consumer {c}"] = br.consumer(ring, tiles)
    # the model's scheduler (the one `simulate` runs), here with the learner's producer in place of the package's,
    # and consumers that compute on each tile for `read_ticks` steps before they release its slot (as a wgmma reads
    # shared memory): a producer that refills a slot before its release then lands a tile on one still being read
    result = br.run_agents(ring, agents, seed=seed, copy_delay=copy_delay, read_ticks=read_ticks)
    expected = sorted((f"consumer {c}", t) for c in range(consumers) for t in range(tiles))
    if sorted(result.reads) != expected:
        raise br.RingError(f"the consumers read {len(result.reads)} tiles, not every one of the {tiles} tiles once each")


@hands_copies
def check_ring_puzzle(producer) -> None:
    """Run the ring model with the learner's `producer` (a generator function ``(ring, tiles, tile_bytes)`` that
    yields the model's instructions) and the package's consumers: 1 to 4 slots, 1 or 2 consumers, each at every
    timing of :data:`TIMINGS` under 6 interleavings. Prints one line: "solved ✓", or what the GPU would do with this
    producer (hang, or read a wrong tile) and at which timing."""
    for stages, consumers in RING_CASES:
        for copy_delay, read_ticks in TIMINGS:
            for seed in _SEEDS:
                try:
                    _run_ring(producer, stages, consumers, seed, copy_delay, read_ticks)
                except br.RingError as error:
                    what = {"Deadlock": "it hangs", "StaleRead": "a consumer reads a tile that has not landed",
                            "Overwrite": "a tile lands on one still being read"}.get(type(error).__name__, "it fails")
                    print(f"puzzle: not solved yet: with {stages} slot(s) and {consumers} consumer(s), consumers "
                          f"computing {read_ticks} step(s) per tile, {what}: "
                          f"{type(error).__name__}: {str(error).split('. ')[0]}")
                    return
                except Exception as error:  # the learner's code itself failed: say how, do not crash the lesson
                    print(f"puzzle: not solved yet: your producer raised {type(error).__name__}: {error}")
                    return
    print(f"puzzle: solved ✓ (every interleaving of {len(RING_CASES)} rings at {len(TIMINGS)} timings finished, "
          "every tile read once, in order)")


def _producer_with(**options):
    """The package's producer with one of the model's mistakes switched on (barrier_ring.producer's keywords)."""
    return lambda ring, tiles, tile_bytes: br.producer(ring, tiles, tile_bytes, **options)


def _flips_every_tile(ring, tiles, tile_bytes):
    """Flips the phase after every tile instead of when the slot index wraps: right for one slot only."""
    stage, phase = 0, 0
    for tile in range(tiles):
        yield br.Wait(ring.empty[stage], phase ^ 1)
        yield br.ArriveExpectTx(ring.full[stage], tile_bytes)
        yield br.Copy(stage, tile, tile_bytes, ring.full[stage])
        stage, phase = (stage + 1) % ring.stages, phase ^ 1


def _waits_on_the_next_slot(ring, tiles, tile_bytes):
    """Waits on the next slot's empty barrier (an off-by-one in the slot index). Inside a lap that is only stricter
    than needed, but at a lap's last slot it waits on slot 0 of the *next* lap with this lap's parity: it returns
    only while the consumers have not yet released slot 0. Slow consumers never have, and the ring works; when the
    consumers keep up, they have, and the producer hangs."""
    stage, phase = 0, 0
    for tile in range(tiles):
        yield br.Wait(ring.empty[(stage + 1) % ring.stages], phase ^ 1)
        yield br.ArriveExpectTx(ring.full[stage], tile_bytes)
        yield br.Copy(stage, tile, tile_bytes, ring.full[stage])
        stage += 1
        if stage == ring.stages:
            stage, phase = 0, phase ^ 1


def _waits_on_full(ring, tiles, tile_bytes):
    """Waits on the slot's full barrier, as the consumers do (the previous lap's tile landed), not on its empty one
    (the previous lap's tile was read and released)."""
    stage, phase = 0, 0
    for tile in range(tiles):
        yield br.Wait(ring.full[stage], phase ^ 1)
        yield br.ArriveExpectTx(ring.full[stage], tile_bytes)
        yield br.Copy(stage, tile, tile_bytes, ring.full[stage])
        stage += 1
        if stage == ring.stages:
            stage, phase = 0, phase ^ 1


PUZZLE = Puzzle(check_ring_puzzle, "my_producer", wrong={
    "waits on the full barrier, as the consumers do": lambda: _waits_on_full,
    "the shipped stub (the consumers' parity, no flip)": lambda: _producer_with(empty_parity_flip=False,
                                                                                flip_on_wrap=False),
    "parity right, no flip on wrap": lambda: _producer_with(flip_on_wrap=False),
    "flips, but waits on the consumers' parity": lambda: _producer_with(empty_parity_flip=False),
    "never waits for a free slot": lambda: _producer_with(wait_empty=False),
    "announces the K tile's bytes only": lambda: _producer_with(expect_bytes=TILE_BYTES // 2),
    "flips after every tile": lambda: _flips_every_tile,
    "waits on the next slot's empty barrier: hangs when the consumers keep up": lambda: _waits_on_the_next_slot,
})
