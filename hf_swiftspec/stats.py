"""What one `generate(swiftspec=True)` call did, kept on `model.swiftspec_stats` afterwards.

Each worker keeps its own counters (`TargetCounters`, `DraftCounters`) whatever the engine;
`SwiftSpecStats.collect` is the one place they become the call's statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TargetCounters:
    """What the target worker did in one generation."""

    forwards: int = 0  # every target forward, prefill included
    verify_steps: int = 0  # tree verifications
    busy_s: float = 0.0  # forward + walk + commit
    idle_s: float = 0.0  # waiting for a subtree (asynchronous engines)
    replayed_tokens: int = 0  # accepted tokens run again to roll recurrent states back (recurrent.py)


@dataclass
class DraftCounters:
    """What the draft worker did in one generation (crosses process groups as one message)."""

    forwards: int = 0
    rounds: int = 0  # subtrees proposed
    expansions: int = 0  # tree expansions (draft forwards over tree leaves)
    in_flight_expansions: int = 0  # expansions run while a verification was in flight
    reroot_hits: int = 0  # the new root was already in the tree
    reroot_misses: int = 0  # a fresh tree was started
    busy_s: float = 0.0


@dataclass(frozen=True)
class RoundRecord:
    """One round: the tree the policy chose and what the target accepted of it."""

    budget: int  # T: nodes verified, root included (1: plain decoding)
    expansions: int  # draft forwards run for this round
    accepted: int  # proposed tokens accepted over all rows (the target adds one of its own per row)
    ngram_accepted: int  # of those, proposed by the n-gram chain
    rows: int = 1  # sequences verified in the round (batch rows still decoding)


@dataclass
class SwiftSpecStats:
    """Counters and timings of one speculative generation.

    target_forwards counts every target forward (prefill included); verify_steps counts the tree
    verifications alone, so tau = new_tokens / verify_steps is the mean number of tokens each
    verification produced (accepted draft tokens plus the target's own next token).
    """

    engine: str = "serial"
    attention: str = "sdpa"
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    verify_steps: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    draft_depth: float = 0.0  # mean draft expansions per round, whatever the schedule
    reroot_hits: int = 0
    reroot_misses: int = 0
    target_idle_s: float = 0.0  # target waiting for a subtree (async engines)
    in_flight_expansions: int = 0  # draft expansions run while a verification was in flight
    replayed_tokens: int = 0  # accepted tokens the target ran again to roll recurrent states back
    rounds: list[RoundRecord] = field(default_factory=list)  # the policy's choice per round
    row_tau: list[float] = field(default_factory=list)  # a batch's rows: each row's tokens per verification it took part in
    draft_model: bool = True  # False in draft-free mode: every proposal came from the suffix index

    @classmethod
    def collect(
        cls, engine: str, new_tokens: int, wall_time_s: float, target: TargetCounters, draft: DraftCounters
    ) -> "SwiftSpecStats":
        """The statistics of one generation from its workers' counters."""
        return cls(
            engine=engine,
            new_tokens=new_tokens,
            wall_time_s=wall_time_s,
            target_forwards=target.forwards,
            verify_steps=target.verify_steps,
            target_time_s=target.busy_s,
            target_idle_s=target.idle_s,
            draft_forwards=draft.forwards,
            draft_time_s=draft.busy_s,
            draft_depth=draft.expansions / max(draft.rounds, 1),
            in_flight_expansions=draft.in_flight_expansions,
            reroot_hits=draft.reroot_hits,
            reroot_misses=draft.reroot_misses,
            replayed_tokens=target.replayed_tokens,
        )

    def add_rounds(self, rounds: list[RoundRecord]) -> None:
        self.rounds = list(rounds)

    @property
    def plain_rounds(self) -> int:
        """Rounds the policy decoded plainly (T = 1: the target alone, nothing proposed)."""
        return sum(r.budget == 1 for r in self.rounds)

    @property
    def mean_tree_budget(self) -> float:
        return sum(r.budget for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def ngram_share(self) -> float:
        """Fraction of accepted proposed tokens that the n-gram chain proposed."""
        accepted = sum(r.accepted for r in self.rounds)
        return sum(r.ngram_accepted for r in self.rounds) / accepted if accepted else 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def target_idle_fraction(self) -> float:
        return self.target_idle_s / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    def summary(self) -> str:
        """One line for logs and the command line; the policy's trees only where rounds were recorded
        (the distributed engine does not bring them back from the draft's rank).

        "proposing" is the time spent building proposals (draft forwards, suffix lookups, the policy's
        choice), "verifying" the target's (its forwards, the walks, the commits).
        """
        rows = f" (per row: {', '.join(f'{t:.2f}' for t in self.row_tau)})" if len(self.row_tau) > 1 else ""
        drafter = f"draft forwards={self.draft_forwards}" if self.draft_model else "no draft model (suffix proposals only)"
        line = (
            f"{self.new_tokens} tokens in {self.wall_time_s:.2f}s ({self.tokens_per_second:.1f} tok/s), "
            f"tau={self.tau:.2f}{rows}, target forwards={self.target_forwards}, {drafter}, "
            f"proposing {self.draft_time_s:.2f}s / verifying {self.target_time_s:.2f}s, "
            f"target idle {100 * self.target_idle_fraction:.0f}%, engine={self.engine}, attention={self.attention}"
        )
        if not self.rounds:
            return line
        return (
            f"{line}, mean tree {self.mean_tree_budget:.1f} nodes, {self.plain_rounds} plain rounds, "
            f"n-gram share {100 * self.ngram_share:.0f}%"
        )
