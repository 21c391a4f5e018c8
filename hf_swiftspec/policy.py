"""How many draft expansions to run per round, from measured step times."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DepthPolicy:
    """Draft depth d per round: fixed, or d = round(t_target / t_draft) from running averages.

    SwiftSpec sizes d so that drafting one round costs about one verification; measuring on the
    run adapts to the hardware and to the prompt length without a profiling pass.
    """

    fixed: int | None = None
    initial: int = 4  # used until both step times have been measured once
    max_depth: int = 16
    smoothing: float = 0.3  # weight of the newest measurement in the running averages
    t_draft: float | None = None  # seconds per draft expansion
    t_target: float | None = None  # seconds per target verification

    def depth(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if not self.t_draft or self.t_target is None:
            return self.initial
        return max(1, min(self.max_depth, round(self.t_target / self.t_draft)))

    def observe(self, draft_seconds: float, expansions: int, target_seconds: float) -> None:
        """Fold in one round: `expansions` draft forwards took `draft_seconds` in all."""
        if expansions:
            self.t_draft = self._average(self.t_draft, draft_seconds / expansions)
        self.t_target = self._average(self.t_target, target_seconds)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
