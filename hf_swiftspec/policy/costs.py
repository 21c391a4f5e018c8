"""What a verification costs: seconds per T-node verification at one batch size, as measured.

The goodput policy (policy.py) keeps one CostModel per batch size and asks it what a tree of T
nodes per row would cost; a batch size it never saw borrows the nearest one's curve.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..config import MAX_BUDGET


@dataclass
class CostModel:
    """Seconds per draft expansion, and per round outside the draft (a T-node verification plus the
    round's bookkeeping) for each tree size T, as running averages of what was measured.

    Verification time is not a line in T: on a CPU a 2-row GEMM can cost half again a 1-row one
    while 4 rows cost less than 3, so a size is priced by what it was measured at. A size never
    measured is interpolated between the nearest measured sizes around it (below the smallest: the
    smallest's cost); above every measured size, the slope between the two largest measured sizes
    (at least 1% of the smallest one's cost per node), or with one size measured, `prior_slope`.
    A batch size's model borrows the curve of another batch size (`shape`): below the sizes it measured
    itself, its cost follows that curve's shape, scaled to its own smallest measurement (so a batch
    size that only ever verified trees still knows what a plain step would cost); above them, with
    fewer than two sizes of its own, it grows by that curve's cost per node and row times its own
    rows (a node more per row is `batch` more query rows: at 16 rows it costs 16 times what it does
    at one).
    """

    batch: int = 1  # rows this model's verifications carry
    smoothing: float = 0.2
    prior_slope: float = 0.1  # cost per node beyond the one size measured so far, relative to it
    expand_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)
    quiet_s: float | None = None  # seconds a quiet round takes (plain, no proposal built): the batch decoding plainly
    shape: "CostModel | None" = None  # another batch size's model: how cost grows past the sizes measured here
    given: bool = False  # the costs were set by the caller (a test's fixed prices): what rounds measure leaves them
    version: int = 0  # bumped by every verification measured, so prices cached from it are renewed
    _times: list[float] | None = None
    _priced: tuple[int, int] = (-1, -1)  # (version, shape's version) the cached prices came from

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    @property
    def expand_cost(self) -> float | None:
        """Seconds per expansion: measured here, else as measured at the batch size this borrows from."""
        if self.expand_s is None and self.shape is not None:
            return self.shape.expand_cost
        return self.expand_s

    @property
    def measured(self) -> bool:
        """Whether both an expansion and a verification were measured (here or where this borrows from)."""
        return self.expand_cost is not None and bool(self.verify_s or (self.shape is not None and self.shape.measured))

    def observe_expansions(self, seconds: float, count: int) -> None:
        if count and not self.given:
            self.expand_s = self._average(self.expand_s, seconds / count)

    def observe_verify(self, budget: int, seconds: float) -> None:
        if self.given:
            return
        self.verify_s[budget] = self._average(self.verify_s.get(budget), seconds)
        self.version += 1

    def observe_quiet(self, seconds: float) -> None:
        """A quiet round's seconds (GoodputPolicy.plan_round: plain, building no proposal): what the latency guard
        prices the batch decoding plainly by, where a plain round that built its proposals (verify_s[1]) costs more."""
        if not self.given:
            self.quiet_s = self._average(self.quiet_s, seconds)

    def verify_times(self, max_budget: int) -> list[float]:
        """Predicted seconds for T = 1..max_budget (index T - 1); relative units until measured."""
        priced = (self.version, self.shape.version if self.shape is not None else -1)
        if self._times is None or len(self._times) < max_budget or priced != self._priced:
            self._times, self._priced = self.price(max(max_budget, MAX_BUDGET)), priced
        return self._times[:max_budget]

    def node_slope(self) -> float | None:
        """Seconds per node (per row) above the largest measured size: the slope between the two largest
        measured (at least 1% of the smallest's cost per node); None with fewer than two measured."""
        if len(self.verify_s) < 2:
            return None
        sizes = sorted(self.verify_s)
        previous, largest = sizes[-2], sizes[-1]
        slope = (self.verify_s[largest] - self.verify_s[previous]) / (largest - previous)
        return max(slope, 0.01 * self.verify_s[sizes[0]])

    def price(self, max_budget: int) -> list[float]:
        """Seconds for T = 1..max_budget: measured sizes as measured, the others as the class says."""
        borrowed = self.shape.verify_times(max_budget) if self.shape is not None and self.shape.verify_s else None
        if not self.verify_s:
            if borrowed is not None:
                return list(borrowed)
            return [1.0 + self.prior_slope * (t - 1) for t in range(1, max_budget + 1)]
        sizes = sorted(self.verify_s)
        base, largest = self.verify_s[sizes[0]], sizes[-1]
        slope = self.node_slope()  # per node above the largest size
        if slope is None:
            shape_slope = self.shape.node_slope() if self.shape is not None else None
            slope = self.prior_slope * base if shape_slope is None else shape_slope * self.batch / self.shape.batch
        times = []
        for t in range(1, max_budget + 1):  # (bisect: this runs once per round, for 32 sizes)
            i, j = bisect.bisect_right(sizes, t), bisect.bisect_left(sizes, t)
            below = sizes[i - 1] if i else None  # the largest measured size <= t
            above = sizes[j] if j < len(sizes) else None  # the smallest >= t
            if below is None and borrowed is not None:  # smaller than measured here: as the other batch size's
                times.append(self.verify_s[above] * borrowed[t - 1] / borrowed[above - 1])  # curve, scaled to ours
            elif below is None:
                times.append(self.verify_s[above])
            elif above is None:
                times.append(self.verify_s[largest] + slope * (t - largest))
            elif below == above:
                times.append(self.verify_s[t])
            else:
                share = (t - below) / (above - below)
                times.append((1 - share) * self.verify_s[below] + share * self.verify_s[above])
        return times
