"""The round, written once: propose, verify, accept, observe, for every row still decoding.

    rows = BatchRows.start(request)
    sides.start(request)
    while rows.live:
        proposed = sides.propose(rows)             1. the drafters' candidates, as the controller sizes them
        verified = sides.verify(proposed, rows)    2. one target forward, each row's walk, the target's commit
        keep = rows.record(verified)                  (generate()'s rule: which rows are done)
        sides.accept(proposed, verified, keep)     3. the drafters follow the verified tokens
        sides.observe(proposed, verified, round_s) 4. the controller learns the round's costs and yield
        rows that finished leave both sides

`RoundSides` is what the phases run on: the adaptive sides (engine/adaptive.py: the target's worker over
its tree cache, the drafters, the goodput policy). How each forward runs, eagerly or replayed from a
captured graph, is the steps' business (step.py, capture.py), not the round's. The asynchronous engine
runs the same workers on another schedule (the draft grows while the target verifies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ..steps.cache import keep_order
from ..stats import SwiftSpecStats
from ..steps.tree import Proposal
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


def run_rounds(sides: RoundSides, request: DecodeRequest) -> DecodeResult:
    """The whole decode loop. Lossless: every emitted token is the target's own choice."""
    rows = BatchRows.start(request)
    start = time.perf_counter()
    sides.start(request)
    while rows.live:
        proposed = sides.propose(rows)
        verified = sides.verify(proposed, rows)
        keep = rows.record(verified, request.on_tokens)
        sides.accept(proposed, verified, keep)
        sides.observe(proposed, verified, time.perf_counter() - proposed.started, first=not rows.result.rounds)
        rows.result.record_round(proposed.proposals, verified, proposed.expansions)
        if len(keep) < len(verified):
            order = keep_order(keep)
            rows.keep(order)
            if order:
                sides.keep_rows(order)
    result = rows.result
    result.stats = sides.stats(result.new_tokens, time.perf_counter() - start)
    result.stats.add_rounds(result.rounds)
    return result
