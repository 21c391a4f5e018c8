"""How many draft expansions to run per round, from measured step times."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DepthPolicy:
    """Draft depth d per round: fixed, or SwiftSpec's rule from running averages of step times.

    d = floor(t_target / t_draft) expansions fill one verification; SwiftSpec then profiles d
    and d + 1 and keeps the faster. Here both are tried during the run and the one with the
    higher measured goodput (verified tokens per second of round time) is used, re-trying the
    other every `explore_every` rounds so the choice follows the run (longer prefixes, etc.).
    Call `depth()` once per round, then `observe(...)` and `observe_round(...)` with its outcome.
    """

    fixed: int | None = None
    initial: int = 4  # used until both step times have been measured once
    max_depth: int = 16
    smoothing: float = 0.3  # weight of the newest measurement in the running averages
    explore_every: int = 8
    t_draft: float | None = None  # seconds per draft expansion
    t_target: float | None = None  # seconds per round on the target's side
    goodput: dict[int, float] = field(default_factory=dict)  # offset (0 or 1) -> tokens per second
    rounds: int = 0
    offset: int = 0  # offset used by the current round

    def depth(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if not self.t_draft or self.t_target is None:
            return self.initial
        self.rounds += 1
        self.offset = self._pick_offset()
        return max(1, min(self.max_depth, int(self.t_target / self.t_draft) + self.offset))

    def _pick_offset(self) -> int:
        for offset in (0, 1):
            if offset not in self.goodput:
                return offset
        best = max(self.goodput, key=self.goodput.get)
        return 1 - best if self.rounds % self.explore_every == 0 else best

    def observe(self, draft_seconds: float, expansions: int, target_seconds: float) -> None:
        """Fold in one round's step times: `expansions` draft forwards took `draft_seconds`."""
        if expansions:
            self.t_draft = self._average(self.t_draft, draft_seconds / expansions)
        self.t_target = self._average(self.t_target, target_seconds)

    def observe_round(self, tokens: int, seconds: float) -> None:
        """Fold in one round's outcome for the offset it used."""
        if self.fixed is None and self.rounds and seconds > 0:
            self.goodput[self.offset] = self._average(self.goodput.get(self.offset), tokens / seconds)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
