"""Which fixed round shape the device round (engine/device_sides.py) runs: a small menu of (depth, width, T)
shapes, each priced by the tokens per second its own measured rounds made.

The device round cannot grow node by node while an expansion is expected to pay (that needs the host to read
the tree each expansion); it runs one whole shape a round instead, as SGLang switches among pre-captured draft
depths. The menu is priced from what the host already knows after each round's one read: the tokens the round
emitted and the seconds between two reads. Every shape runs once before any is preferred; then the best
measured one runs, and the others run again every `retry` rounds so a price that drifted (the text got harder)
is seen. The menu holds the plain shape too (depth 0, T = 1: no growth, the roots alone verified), so a call
whose draft does not pay on this text and machine decodes at about the target's own pace rather than below it.

A shape's price is its average over the text; the suffix proposals' worth changes round by round (a long match, then
none). So with suffix proposals on, each round's proposal is built before its shape is picked, and a draft-free shape
(depth 0) is valued from it (`ShapeMenu.values`): the tokens it expects (the nodes' prior P(accepted), calibrated by
what such rounds gained against what they promised) over its measured cost per round, against the draft's shapes at
their measured rates; a round with nothing proposed runs plain or a draft's shape. The host round sizes each round
from its proposal the same way (policy/goodput.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# (depth, width, T): d draft forwards of k nodes each, the best T nodes (root included) verified; the last is plain.
MENU = ((1, 2, 2), (2, 2, 4), (3, 2, 6), (4, 4, 8), (0, 0, 1))
PLAIN = (0, 0, 1)
MAX_RETRY = 512  # rounds between re-prices at most
DECAY = 0.9  # a shape's earlier rounds weigh this much less at each of its new ones
SUFFIX_ONLY = ((0, 0, 8), (0, 0, 16))  # with suffix proposals on: no growth, the best 8 or 16 of the root and the suffix nodes verified


def suffix_shapes(rows: int) -> tuple[tuple[int, int, int], ...]:
    """The suffix proposals' own shapes for a bucket of `rows`: 16 nodes for one row only (a batch verifying 16 a row
    pays for 16 B queries in one forward, measured slower than the 8-node shape on a CPU at 4 rows, 0.6-0.8x
    target.generate, where one row gains from long suffix chains)."""
    return SUFFIX_ONLY if rows <= 1 else SUFFIX_ONLY[:1]


@dataclass(frozen=True)
class Shape:
    """One round's fixed shape: `depth` draft forwards growing `width` nodes each, the best `budget` verified
    (depth 0: no growth; the root and, where suffix proposals are on, their nodes)."""

    depth: int
    width: int
    budget: int

    @property
    def nodes(self) -> int:
        """Nodes the growth makes, the root included (each one's KV slot sits in the tree region)."""
        return 1 + self.depth * self.width


CALIBRATION_PRIOR = 1.0  # tokens of pseudo-count on both sides of the calibration (gained + 1) / (promised + 1)


@dataclass
class Price:
    """What one shape's measured rounds made: tokens emitted over all rows and seconds between reads; of a draft-free
    shape's rounds also the tokens beyond one a row their proposals promised (uncalibrated) and those they gained. All
    but `rounds` decay (DECAY a round of the shape)."""

    rounds: int = 0
    tokens: float = 0
    seconds: float = 0.0
    weight: float = 0.0  # rounds, decayed as tokens and seconds are
    promised: float = 0.0
    gained: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cost(self) -> float:
        """Seconds a round of the shape takes."""
        return self.seconds / (self.weight or self.rounds or 1)


@dataclass
class Hand:
    """The round's suffix proposals as the host built them, before the shape is fixed.

    gains: each live row's nodes' prior P(accepted), best first (a row proposing nothing: [])
    guard: rows are priced by the slowest (the running batch's latency guard; ShapeMenu prices rows x its tokens)
    """

    gains: list[list[float]]
    guard: bool = False

    @property
    def rows(self) -> int:
        return len(self.gains)

    def promise(self, budget: int) -> float:
        """Tokens beyond one a row a shape verifying `budget` nodes a row (root included) expects from the proposal:
        each row's best budget - 1 nodes' P(accepted) summed (the expected accepted length of a tree is the sum of its
        nodes' P(on the accepted path)); over the rows, summed, or the slowest row's times rows under the guard."""
        each = [sum(g[: budget - 1]) for g in self.gains]
        if not each:
            return 0.0
        return len(each) * min(each) if self.guard else sum(each)


@dataclass
class ShapeMenu:
    """The shapes a call may run and their prices. `prices` may be shared: the device round keeps them with the pair,
    per row bucket (engine/device_pool.py), so a call starts from what earlier calls measured instead of trying every
    shape again; each price decays (DECAY per round of its shape), so it follows the text."""

    shapes: tuple[Shape, ...]
    retry_every: int = 32  # rounds between two runs of a shape that is not the best priced, while they pay
    prices: dict[Shape, Price] = field(default_factory=dict)
    rounds: int = 0
    retry: int = 0  # the current interval (retry_every, doubled after each re-price that did not pay)
    next_retry: int = 0  # the round of the next re-price
    retries: int = 0
    pending: Shape | None = None  # the re-price in flight

    def __post_init__(self):
        self.retry = self.retry or self.retry_every
        self.next_retry = self.next_retry or self.retry

    @classmethod
    def of(cls, depth: int | None, width: int, budget: int | None, room: int, suffix: bool = False,
           rows: int = 1) -> "ShapeMenu":
        """The shapes for a call: the one the settings fix (draft_depth and tree_budget both given, with draft_width),
        else MENU (and suffix_shapes(rows) where suffix proposals join the tree: a round may take them alone, the draft
        idle);
        only shapes whose deepest node stays within `room` positions past the call's last token."""
        shapes = (Shape(depth, width, budget),) if depth is not None and budget is not None else tuple(
            Shape(*s) for s in MENU + (suffix_shapes(rows) if suffix else ()))
        fitting = tuple(s for s in shapes if s.depth <= room)
        if not fitting:
            raise ValueError(
                f"round='device' grows {min(s.depth for s in shapes)} or more positions past the call's last token, "
                f"but the models place only {room} more; ask for fewer new tokens or use round='host'"
            )
        return cls(fitting)

    def pick(self, hand: Hand | None = None) -> Shape:
        """The next round's shape: an unpriced one first, a periodic re-price, else the best value (`values`). The
        re-prices come `retry` rounds apart while they pay, twice as far apart after each one that does not (up to
        MAX_RETRY): where only the plain round pays, a draft's shape costs a round in hundreds, not one in 32. With a
        proposal in hand a draft-free shape is re-priced only where the proposal has something for it to verify
        (its calibration learns from it: a bad stretch of text does not price the suffix shapes out for good)."""
        self.rounds += 1
        for shape in self.shapes:
            if shape not in self.prices:
                return shape
        values = self.values(hand)
        best = max(values, key=values.get)
        if self.rounds < self.next_retry:
            return best
        others = [s for s in self.shapes if s != best and (hand is None or s.depth or s.budget == 1
                                                            or hand.promise(s.budget) > 0)]
        if not others:
            return best
        self.retries += 1
        self.pending = others[self.retries % len(others)]
        self.next_retry = self.rounds + self.retry
        return self.pending

    def values(self, hand: Hand | None) -> dict[Shape, float]:
        """Tokens a second each shape is expected to make this round: its measured rate; with a proposal in hand, a
        draft-free shape's (depth 0) rows + calibration x promise over its cost per round instead, a larger one only
        where it promises more than every smaller one (a round proposing nothing is plain: T = 1 verifies the roots
        for the same tokens)."""
        values = {s: self.prices[s].rate for s in self.shapes if s.depth or hand is None}
        if hand is None:
            return values
        scale, last = self.calibration(), -1.0
        for shape in sorted((s for s in self.shapes if not s.depth), key=lambda s: s.budget):
            promise = hand.promise(shape.budget)
            if promise > last:  # else it verifies more queries for no more expected tokens
                values[shape] = (hand.rows + scale * promise) / max(self.prices[shape].cost, 1e-9)
                last = promise
        return values

    def calibration(self) -> float:
        """How far the draft-free shapes' rounds gained what their proposals promised (1: as promised)."""
        free = [p for s, p in self.prices.items() if not s.depth]
        gained, promised = sum(p.gained for p in free), sum(p.promised for p in free)
        return (gained + CALIBRATION_PRIOR) / (promised + CALIBRATION_PRIOR)

    def observe(self, shape: Shape, tokens: int, seconds: float | None, promised: float | None = None,
                gained: float = 0.0) -> None:
        """Fold in one round of `shape` (seconds None: not timed, e.g. the first round after the prefill); a
        draft-free round run from a proposal in hand also the tokens beyond one a row it `promised` and `gained`."""
        if seconds is None:
            return
        price = self.prices.setdefault(shape, Price())
        if shape == self.pending:  # a re-price: the next one as soon if it beat the best, else twice as late
            best = max(self.prices.values(), key=lambda p: p.rate)
            paid = seconds > 0 and tokens / seconds >= best.rate
            self.retry = self.retry_every if paid else min(2 * self.retry, MAX_RETRY)
            self.next_retry, self.pending = self.rounds + self.retry, None
        price.rounds = price.rounds + 1
        price.tokens, price.seconds = DECAY * price.tokens + tokens, DECAY * price.seconds + seconds
        price.weight = DECAY * price.weight + 1
        if promised is not None:
            price.promised, price.gained = DECAY * price.promised + promised, DECAY * price.gained + gained
