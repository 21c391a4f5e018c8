"""The round, written once: propose, verify, accept, observe, for every row still decoding.

    rows = BatchRows.start(request)
    sides.start(request)
    while rows.live:                               one_round(sides, rows):
        proposed = sides.propose(rows)             1. the drafters' candidates, as the controller sizes them
        verified = sides.verify(proposed, rows)    2. one target forward, each row's walk, the target's commit
        keep = rows.fold_round(proposed, verified)    (generate()'s rule: which rows are done)
        sides.accept(proposed, verified, keep)     3. the drafters follow the verified tokens
        sides.observe(proposed, verified, round_s) 4. the controller learns the round's costs and yield
        rows.record_round(proposed, verified)         (the round's record, for the stats)
        rows that finished leave both sides

`one_round` is the loop's body; the running batch of engine/continuous.py runs it too, over rows that join
and leave between rounds (`RoundRows`: BatchRows, or the running batch's rows). `RoundSides` is what the
phases run on: the adaptive sides (engine/adaptive.py: the target's worker over
its tree cache, the drafters, the goodput policy). How each forward runs, eagerly or replayed from a
captured graph, is the steps' business (step.py, capture.py), not the round's. The asynchronous engine
runs the same workers on another schedule (the draft grows while the target verifies).

Each round is timed phase by phase on the sides' `PhaseClock` (stats.py): one_round opens and closes the
round, the sides time their phases inside it, and the call's stats break the rounds' time down
(`SwiftSpecStats.phases`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ..steps.cache import keep_order
from ..stats import PhaseClock, SwiftSpecStats
from ..steps.tree import Proposal
from ..steps.acceptance import StopRule
from ..steps.verify import Verified
from .request import BatchRows, DecodeRequest, DecodeResult


@dataclass
class Proposed:
    """Phase 1's hand-off: each live row's proposal (what the round's record and the policy read), the rows
    (original indices, in cache order) and the draft forwards it took. Each side adds what its own phases
    need."""

    proposals: list[Proposal]
    rows: list[int] = field(default_factory=list)
    expansions: int = 0
    started: float = field(default_factory=time.perf_counter)  # the round's start (perf_counter seconds)


class RoundSides(Protocol):
    """The phases of a round over one kind of models' state (see the module docstring)."""

    name: str  # the engine named in the stats
    clock: PhaseClock  # times the round's phases (one_round opens and closes each round)
    roots_known: bool  # whether the rows' roots came with the prefill: the next round is their first

    def start(self, request: DecodeRequest) -> None:
        """Prefill the target and start the drafters on the prompts."""

    def propose(self, rows: BatchRows) -> Proposed: ...

    def verify(self, proposed: Proposed, rows: BatchRows) -> list[Verified]: ...

    def accept(self, proposed: Proposed, verified: list[Verified], keep: list[int]) -> None:
        """Follow the verified tokens of the rows in `keep` (the others are done)."""

    def observe(self, proposed: Proposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """Fold in the round (`first`: the call's first round, whose roots came with the prefill)."""

    def keep_rows(self, order: list[int]) -> None:
        """Keep only the cache rows `order` (rows that finished leave: they stop costing compute)."""

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats: ...


class RoundRows(Protocol):
    """The rows a round runs over: BatchRows (one generate() call's) or the running batch's
    (engine/continuous.py). `live`: each cache row's row, in cache order."""

    live: list[int]

    def criteria(self) -> list[StopRule]:
        """Per live row, the rule its walk stops at."""

    def budgets(self) -> list[int]:
        """Per live row, the most tokens it may still emit."""

    def fold_round(self, proposed: Proposed, verified: list[Verified]) -> list[int]:
        """Fold in the round's walks (one per live row, streamed): the cache rows that keep decoding, in order."""

    def record_round(self, proposed: Proposed, verified: list[Verified]) -> None:
        """Keep the round's RoundRecord for the stats."""


def one_round(sides: RoundSides, rows: RoundRows) -> list[int]:
    """One round over every live row (see the module docstring); returns the cache rows that keep decoding
    (the others are done: the caller drops them from the rows and the sides)."""
    clock = sides.clock
    clock.begin_round()
    first = sides.roots_known
    proposed = sides.propose(rows)
    verified = sides.verify(proposed, rows)
    with clock.phase("bookkeeping"):
        keep = rows.fold_round(proposed, verified)
    sides.accept(proposed, verified, keep)
    sides.observe(proposed, verified, time.perf_counter() - proposed.started, first=first)
    with clock.phase("bookkeeping"):
        rows.record_round(proposed, verified)
    clock.end_round()
    return keep


def run_rounds(sides: RoundSides, request: DecodeRequest) -> DecodeResult:
    """The whole decode loop. Lossless: every emitted token is the target's own choice."""
    rows = BatchRows.start(request)
    start = time.perf_counter()
    sides.start(request)
    while rows.live:
        keep = one_round(sides, rows)
        if len(keep) < len(rows.live):
            order = keep_order(keep)
            rows.keep(order)
            if order:
                sides.keep_rows(order)
    result = rows.result
    result.stats = sides.stats(result.new_tokens, time.perf_counter() - start)
    result.stats.add_rounds(result.rounds)
    return result
