"""The mbarrier ring of a warp-specialized Hopper kernel, as a Python model that fails instead of hanging
(rung ``hopper``; tests/test_hopper.py).

A producer (one thread of the producer warpgroup) fills a ring of ``stages`` shared-memory slots with tiles by TMA;
consumers (warpgroups) compute on them. Two mbarriers per slot:

- ``full[s]``: the producer arrives once with ``arrive.expect_tx(tile bytes)``; the copy engine's ``complete_tx``
  delivers the bytes. Its phase completes when both have happened: the slot holds its tile.
- ``empty[s]``: each consumer arrives once when it no longer reads the slot. Its phase completes when all have.

Everyone walks the ring with a slot index and a phase bit that flips each time the index wraps to 0. The consumer
waits ``full[s]`` with parity ``phase``; the producer waits ``empty[s]`` with parity ``phase ^ 1``, because a wait
on the parity of the phase *before* the current one returns at once: the ring starts empty, and the producer's
first lap must not wait for consumers that have read nothing yet.

On the GPU a wrong parity or a wrong byte count shows in one of two ways: a wait that never returns (the kernel
hangs; the rung's watchdog build traps), or a wait that returns too early (a consumer reads a slot before its tile
landed, or the producer overwrites a tile a consumer still reads: wrong numbers, sometimes). The model runs the
same program text against :class:`MBarrier`, which follows the PTX ISA's rules ("mbarrier": phases, pending
arrivals, tx-count; ``try_wait.parity``), under a scheduler that interleaves the agents and the copy engine, and
raises :class:`Deadlock`, :class:`StaleRead` or :class:`Overwrite`, each naming the barrier, its phase and who
waits on what.

:func:`producer` and :func:`consumer` are the kernel's loops, line for line; their keyword arguments are the
mistakes a learner makes (``empty_parity_flip=False``, ``expect_bytes`` off by one, ``flip_on_wrap=False`` ...).
:func:`simulate` runs them under many interleavings (``seeds``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["MBarrier", "NamedBarrier", "Ring", "run_agents", "Wait", "ArriveExpectTx", "Arrive", "Copy", "Read", "Peek", "BarSync",
           "BarArrive", "Deadlock", "StaleRead", "Overwrite", "RingError", "producer", "consumer", "ws_producer",
           "ws_consumer_warp", "pingpong_consumer_warp", "simulate", "simulate_ws", "Result"]


class RingError(RuntimeError):
    """A schedule that would hang or compute on wrong data on the GPU."""


class Deadlock(RingError):
    """Every agent waits on a phase that nothing left can complete: on the GPU, a hang."""


class StaleRead(RingError):
    """A consumer read a slot whose tile had not landed: on the GPU, wrong numbers (a wait returned too early)."""


class Overwrite(RingError):
    """A tile landed in a slot a consumer had not released: on the GPU, wrong numbers."""


# region: mbarrier_model
@dataclass
class MBarrier:
    """One mbarrier: ``count`` arrivals and ``tx`` bytes complete a phase; then the phase number advances (its parity
    is what ``try_wait.parity`` compares) and the counts start over."""

    name: str
    count: int
    phase: int = 0  # phases completed so far; the current phase's parity is phase % 2
    pending: int = field(init=False)  # arrivals still missing in the current phase
    tx: int = 0  # bytes announced by expect_tx and not yet delivered by complete_tx (may dip below 0 in between)

    def __post_init__(self):
        self.pending = self.count

    def arrive(self, expect_bytes: int = 0) -> None:
        if self.pending == 0:
            raise RingError(f"{self.name}: an arrival beyond its count {self.count} in phase {self.phase}")
        self.tx += expect_bytes
        self.pending -= 1
        self._complete_if_done()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._complete_if_done()

    def _complete_if_done(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def try_wait(self, parity: int) -> bool:
        """True when the phase of parity `parity` is over: the current phase has the other parity. (Waiting on the
        parity of the phase before the current one returns at once.)"""
        return self.phase % 2 != parity

    def state(self) -> str:
        return (f"{self.name}: phase {self.phase} (parity {self.phase % 2}) waits for {self.pending} of {self.count} "
                f"arrival(s) and {self.tx} byte(s)")
# endregion


# region: named_barrier_model
@dataclass
class NamedBarrier:
    """A hardware barrier of ``bar.sync id, count`` / ``bar.arrive id, count``, counted in warps (``count`` threads /
    32): a generation completes when that many warp arrivals are in; ``bar.sync`` arrives and waits for the end of
    its generation, ``bar.arrive`` does not wait. A warp that arrives twice in one generation is an error here: the
    hardware would count it twice and release the barrier before the other side came."""

    name: str
    warps: int
    generation: int = 0
    arrived: list = field(default_factory=list)

    def arrive(self, who: str) -> int:
        """Count `who`'s arrival; returns the generation it belongs to."""
        if who in self.arrived:
            raise RingError(f"{who} arrived twice at {self.name} in generation {self.generation} (arrivals so far: "
                            f"{self.arrived}): the barrier would release before the other warpgroup came")
        self.arrived.append(who)
        generation = self.generation
        if len(self.arrived) == self.warps:
            self.generation += 1
            self.arrived = []
        return generation

    def state(self) -> str:
        return f"{self.name}: generation {self.generation} has {len(self.arrived)} of {self.warps} warp arrivals"
# endregion


class Ring:
    """``stages`` slots, each with its ``full`` and ``empty`` barrier and what it holds; Q's barrier, and v3's two turn
    barriers (256 threads: 8 warps each)."""

    def __init__(self, stages: int, consumers: int = 1, empty_count: int | None = None):
        self.q_full = MBarrier("q_full", 1)
        self.q_landed = False
        self.turn = [NamedBarrier(f"turn[{c}]", 8) for c in range(2)]
        self.stages = stages
        self.full = [MBarrier(f"full[{s}]", 1) for s in range(stages)]
        self.empty = [MBarrier(f"empty[{s}]", consumers if empty_count is None else empty_count)
                      for s in range(stages)]
        self.tile_in = [None] * stages  # which tile the slot holds (None: nothing landed yet)
        self.readers_left = [0] * stages  # consumers that have not yet released the slot's tile (read, then arrive)
        self.consumers = consumers


# The instructions an agent yields to the scheduler
@dataclass(frozen=True)
class Wait:
    barrier: MBarrier
    parity: int


@dataclass(frozen=True)
class ArriveExpectTx:
    barrier: MBarrier
    nbytes: int


@dataclass(frozen=True)
class Arrive:
    barrier: MBarrier


@dataclass(frozen=True)
class Copy:
    """cp.async.bulk.tensor: tile `tile` into slot `stage`, `nbytes` delivered to `barrier` when it lands."""

    stage: int
    tile: int
    nbytes: int
    barrier: MBarrier


@dataclass(frozen=True)
class Read:
    """The slot's last use by this consumer (it arrives on ``empty`` next); stage -1: Q."""

    stage: int
    tile: int


@dataclass(frozen=True)
class Peek:
    """A use of the slot that is not its last (v3 reads K in one turn and V in the next)."""

    stage: int
    tile: int


@dataclass(frozen=True)
class BarSync:
    barrier: NamedBarrier


@dataclass(frozen=True)
class BarArrive:
    barrier: NamedBarrier


# region: ring_loops
def producer(ring: Ring, tiles: int, tile_bytes: int, *, expect_bytes: int | None = None,
             empty_parity_flip: bool = True, flip_on_wrap: bool = True, wait_empty: bool = True):
    """The producer's loop: wait for the slot to be free, announce the bytes, start the copy."""
    stage, phase = 0, 0
    for tile in range(tiles):
        if wait_empty:
            yield Wait(ring.empty[stage], phase ^ 1 if empty_parity_flip else phase)
        yield ArriveExpectTx(ring.full[stage], tile_bytes if expect_bytes is None else expect_bytes)
        yield Copy(stage, tile, tile_bytes, ring.full[stage])
        stage += 1
        if stage == ring.stages:
            stage = 0
            phase ^= 1 if flip_on_wrap else 0


def consumer(ring: Ring, tiles: int, *, flip_on_wrap: bool = True, release: bool = True, start_phase: int = 0):
    """A consumer's loop: wait for the slot's tile, compute on it, release the slot."""
    stage, phase = 0, start_phase
    for tile in range(tiles):
        yield Wait(ring.full[stage], phase)
        yield Read(stage, tile)
        if release:
            yield Arrive(ring.empty[stage])
        stage += 1
        if stage == ring.stages:
            stage = 0
            phase ^= 1 if flip_on_wrap else 0


# endregion


# region: ws_loops
# v2, v3 and v4 (flash_ws_kernel in hopper_attention.cuh): the producer loads Q once, then runs the ring; each consumer warp
# waits for Q, walks the ring and arrives on kv_empty once per tile (kv_empty counts 8 arrivals: 4 warps x 2
# consumers); all of them agree on `tiles` (key_tile_count of the block).
Q_BYTES = 32768


def ws_producer(ring: Ring, tiles: int, tile_bytes: int, **options):
    """produce_tiles: Q (one barrier), then the ring loop of :func:`producer`."""
    yield ArriveExpectTx(ring.q_full, Q_BYTES)
    yield Copy(-1, 0, Q_BYTES, ring.q_full)
    yield from producer(ring, tiles, tile_bytes, **options)


def ws_consumer_warp(ring: Ring, tiles: int, **options):
    """One warp of a v2 consumer (consume_tiles_v2): Q, then the ring loop of :func:`consumer`."""
    yield Wait(ring.q_full, 0)
    yield Read(-1, 0)
    yield from consumer(ring, tiles, **options)


def pingpong_consumer_warp(ring: Ring, tiles: int, consumer_index: int, *, first_waits: bool = False,
                           last_arrives: bool = False):
    """One warp of a v3 consumer (consume_tiles_v3): turns on the tensor cores through ring.turn[consumer_index]
    (wait) and ring.turn[1 - consumer_index] (arrive). Turn 0: S of tile 0; turn t: P V of tile t - 1 (the last use
    of its slot, released after the turn) and S of tile t; the last turn: P V of the last tile. Consumer 0 takes
    its first turn without waiting (`first_waits` makes it wait), consumer 1 does not arrive after its last
    (`last_arrives` makes it arrive)."""
    mine, other = ring.turn[consumer_index], ring.turn[1 - consumer_index]
    yield Wait(ring.q_full, 0)
    yield Read(-1, 0)
    if tiles == 0:
        return
    stage, phase = 0, 0
    yield Wait(ring.full[stage], phase)
    if consumer_index == 1 or first_waits:
        yield BarSync(mine)
    yield Peek(stage, 0)  # S = Q K^T of tile 0
    yield BarArrive(other)
    held = (stage, 0)
    stage += 1
    if stage == ring.stages:
        stage, phase = 0, phase ^ 1
    for tile in range(1, tiles):
        yield Wait(ring.full[stage], phase)
        yield BarSync(mine)
        yield Peek(stage, tile)  # S of this tile
        yield BarArrive(other)
        yield Read(*held)  # P V of the previous tile: its slot's last use
        yield Arrive(ring.empty[held[0]])
        held = (stage, tile)
        stage += 1
        if stage == ring.stages:
            stage, phase = 0, phase ^ 1
    yield BarSync(mine)
    if consumer_index == 0 or last_arrives:
        yield BarArrive(other)
    yield Read(*held)
    yield Arrive(ring.empty[held[0]])
# endregion


@dataclass
class Result:
    reads: list  # (consumer, tile) in the order they happened
    steps: int  # scheduler steps taken
    max_ahead: int  # most tiles copied but not yet read by every consumer: up to `stages` when the ring works


def run_agents(ring: Ring, agents: dict, *, seed: int = 0, copy_delay: int = 2, read_ticks: int = 0) -> Result:
    """Run `agents` ({name: generator of the instructions above}) on `ring` under one interleaving (`seed`): copies
    land `copy_delay` to `copy_delay` + 2 steps after they start, and a consumer computes on a tile it reads for
    `read_ticks` steps before its next instruction (a wgmma reading shared memory). A slot counts as being read from
    the consumer's Read until it arrives on the slot's empty barrier, so a copy landing there in between is an
    Overwrite. Raises what :func:`simulate` raises; returns the :class:`Result`."""
    return _run(ring, agents, random.Random(seed), copy_delay, read_ticks)


def _run(ring: Ring, agents: dict, rng: random.Random, copy_delay: int, read_ticks: int = 0) -> Result:
    blocked = {name: None for name in agents}  # name -> the Wait it is stuck on, or None
    busy = {name: 0 for name in agents}  # steps a consumer still computes on the tile it read
    current = {name: None for name in agents}
    copies = []  # [ticks left, Copy]
    reads, steps, ahead = [], 0, 0
    issued = [0]
    finished = set()

    def step(name) -> bool:
        """Run `name`'s next instruction; False when it is blocked on a wait."""
        if busy[name]:  # still computing on the tile it read: no instruction this step, but not stuck
            busy[name] -= 1
            return True
        instruction = current[name]
        if instruction is None:
            try:
                instruction = current[name] = next(agents[name])
            except StopIteration:
                finished.add(name)
                return True
        if isinstance(instruction, Wait):
            if not instruction.barrier.try_wait(instruction.parity):
                blocked[name] = instruction
                return False
            blocked[name] = None
        elif isinstance(instruction, ArriveExpectTx):
            instruction.barrier.arrive(instruction.nbytes)
        elif isinstance(instruction, Arrive):
            released = next((s for s, empty in enumerate(ring.empty) if instruction.barrier is empty), None)
            if released is not None:  # a consumer releases its slot
                ring.readers_left[released] = max(0, ring.readers_left[released] - 1)
            instruction.barrier.arrive()
        elif isinstance(instruction, Copy):
            copies.append([copy_delay + rng.randrange(3), instruction])
            issued[0] += instruction.stage >= 0
        elif isinstance(instruction, BarArrive):
            instruction.barrier.arrive(name)
        elif isinstance(instruction, BarSync):
            if name not in sync_generation:
                sync_generation[name] = instruction.barrier.arrive(name)
            if instruction.barrier.generation <= sync_generation[name]:
                blocked[name] = instruction
                return False
            del sync_generation[name]
            blocked[name] = None
        elif isinstance(instruction, (Read, Peek)) and instruction.stage < 0:
            if not ring.q_landed:
                raise StaleRead(f"{name} read Q before it landed ({ring.q_full.state()})")
        elif isinstance(instruction, Peek):
            if ring.tile_in[instruction.stage] != instruction.tile:
                raise StaleRead(f"{name} used slot {instruction.stage} for tile {instruction.tile}, but the slot "
                                f"holds {ring.tile_in[instruction.stage]} ({ring.full[instruction.stage].state()})")
        elif isinstance(instruction, Read):
            held = ring.tile_in[instruction.stage]
            if held != instruction.tile:
                raise StaleRead(f"{name} read slot {instruction.stage} for tile {instruction.tile}, but the slot "
                                f"holds {'nothing yet' if held is None else f'tile {held}'}: its full-barrier wait "
                                f"returned before the copy landed ({ring.full[instruction.stage].state()})")
            reads.append((name, instruction.tile))  # (the slot stays being read until the consumer releases it)
            busy[name] = read_ticks
        current[name] = None
        return True

    sync_generation = {}  # agent -> the generation of the named barrier its pending bar.sync arrived in

    def land(copy: Copy) -> None:
        if copy.stage < 0:  # Q
            ring.q_landed = True
            copy.barrier.complete_tx(copy.nbytes)
            return
        if ring.readers_left[copy.stage] > 0:
            raise Overwrite(f"tile {copy.tile} landed in slot {copy.stage} while {ring.readers_left[copy.stage]} "
                            f"consumer(s) had not yet released tile {ring.tile_in[copy.stage]} (read it and arrived on "
                            f"{ring.empty[copy.stage].name}): the producer started the copy before the slot was free "
                            f"({ring.empty[copy.stage].state()})")
        ring.tile_in[copy.stage] = copy.tile
        ring.readers_left[copy.stage] = ring.consumers
        copy.barrier.complete_tx(copy.nbytes)

    while len(finished) < len(agents) or copies:
        steps += 1
        slowest = min(sum(1 for who, tile in reads if who == name and tile >= 0) for name in agents
                      if name != "producer")
        ahead = max(ahead, issued[0] - slowest)
        for entry in copies:
            entry[0] -= 1
        for entry in [e for e in copies if e[0] <= 0]:
            copies.remove(entry)
            land(entry[1])
        runnable = [name for name in agents if name not in finished]
        rng.shuffle(runnable)
        progressed = False
        for name in runnable:
            progressed = step(name) or progressed
        if not progressed and not copies and len(finished) < len(agents):
            waiting = [f"{name} waits on {w.barrier.name}" + (f" for parity {w.parity}" if isinstance(w, Wait) else "")
                       for name, w in blocked.items() if w is not None]
            states = sorted({w.barrier.state() for w in blocked.values() if w is not None})
            raise Deadlock("no agent can move and no copy is in flight: " + "; ".join(waiting) + ". " +
                           "; ".join(states))
        if steps > 100_000:
            raise RingError("the simulation did not finish in 100,000 steps")
    unread = [(stage, ring.tile_in[stage]) for stage in range(ring.stages) if ring.readers_left[stage] > 0]
    if unread:
        raise RingError(f"tiles landed that not every consumer read (slot, tile): {unread}: the producer and the "
                        f"consumers disagree on the tile count (on the GPU a copy may still be in flight at exit)")
    open_generations = [b.state() for b in ring.turn if b.arrived]
    if open_generations:
        raise RingError("named barriers left with a generation open at the end: " + "; ".join(open_generations))
    return Result(reads, steps, ahead)


def simulate(stages: int = 2, tiles: int = 7, consumers: int = 1, *, tile_bytes: int = 16384, seeds=range(20),
             copy_delay: int = 2, empty_count: int | None = None, producer_options: dict | None = None,
             consumer_options: dict | None = None) -> Result:
    """Run one producer and `consumers` consumers over `tiles` tiles under each seed's interleaving; returns the last
    run's :class:`Result`, or raises the first :class:`RingError` any interleaving meets."""
    result = None
    for seed in seeds:
        ring = Ring(stages, consumers, empty_count)
        agents = {"producer": producer(ring, tiles, tile_bytes, **(producer_options or {}))}
        for c in range(consumers):
            agents[f"consumer {c}"] = consumer(ring, tiles, **(consumer_options or {}))
        result = _run(ring, agents, random.Random(seed), copy_delay)
        expected = sorted((f"consumer {c}", t) for c in range(consumers) for t in range(tiles))
        if sorted(result.reads) != expected:
            raise RingError(f"seed {seed}: reads {sorted(result.reads)} instead of every tile once per consumer")
    return result


def simulate_ws(version: int = 2, stages: int = 3, tiles: int = 7, *, tile_bytes: int = 65536, seeds=range(20),
                copy_delay: int = 2, producer_tiles: int | None = None, empty_count: int = 8,
                producer_options: dict | None = None, consumer_options: dict | None = None) -> Result:
    """v2 (`version` 2), v3 (3) or v4 (4) as the kernel runs it: the producer thread and the 8 consumer warps (2
    warpgroups x 4), kv_empty counting 8 arrivals, under each seed's interleaving. v4's warps run v3's sequence of
    waits and arrivals (consume_tiles_v4 splits a turn's products into two commit groups, S first, and waits for P V
    before it releases the slot, as v3 does): :func:`pingpong_consumer_warp`. `producer_tiles`: a producer that
    computes another tile count than the consumers (a mistake)."""
    if version not in (2, 3, 4):
        raise ValueError(f"simulate_ws models v2, v3 and v4, not v{version}")
    result = None
    for seed in seeds:
        ring = Ring(stages, consumers=8, empty_count=empty_count)
        agents = {"producer": ws_producer(ring, tiles if producer_tiles is None else producer_tiles, tile_bytes,
                                          **(producer_options or {}))}
        for c in range(2):
            for warp in range(4):
                if version == 2:
                    agents[f"consumer {c} warp {warp}"] = ws_consumer_warp(ring, tiles, **(consumer_options or {}))
                else:
                    agents[f"consumer {c} warp {warp}"] = pingpong_consumer_warp(ring, tiles, c,
                                                                                 **(consumer_options or {}))
        result = _run(ring, agents, random.Random(seed), copy_delay)
        expected = sorted((name, t) for name in agents if name != "producer" for t in range(tiles))
        if sorted(result.reads) != expected:
            raise RingError(f"seed {seed}: reads {sorted(result.reads)[:12]} ... instead of every tile once per warp")
    return result
