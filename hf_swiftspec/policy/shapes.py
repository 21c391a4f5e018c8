"""Which fixed round shape the device round (engine/device_sides.py) runs: a small menu of (depth, width, T)
shapes, each priced by the tokens per second its own measured rounds made.

The device round cannot grow node by node while an expansion is expected to pay (that needs the host to read
the tree each expansion); it runs one whole shape a round instead, as SGLang switches among pre-captured draft
depths. The menu is priced from what the host already knows after each round's one read: the tokens the round
emitted and the seconds between two reads. Every shape runs once before any is preferred; then the best
measured one runs, and the others run again every `retry` rounds so a price that drifted (the text got harder)
is seen. The menu holds the plain shape too (depth 0, T = 1: no growth, the roots alone verified), so a call
whose draft does not pay on this text and machine decodes at about the target's own pace rather than below it.
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


@dataclass
class Price:
    """What one shape's measured rounds made: tokens emitted over all rows and seconds between reads."""

    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


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

    def pick(self) -> Shape:
        """The next round's shape: an unpriced one first, a periodic re-price, else the best measured rate. The re-prices
        come `retry` rounds apart while they pay, twice as far apart after each one that does not (up to
        MAX_RETRY): where only the plain round pays, a draft's shape costs a round in hundreds, not one in 32."""
        self.rounds += 1
        for shape in self.shapes:
            if shape not in self.prices:
                return shape
        best = max(self.shapes, key=lambda s: self.prices[s].rate)
        others = [s for s in self.shapes if s != best]
        if others and self.rounds >= self.next_retry:
            self.retries += 1
            self.pending = others[self.retries % len(others)]
            self.next_retry = self.rounds + self.retry
            return self.pending
        return best

    def observe(self, shape: Shape, tokens: int, seconds: float | None) -> None:
        """Fold in one round of `shape` (seconds None: not timed, e.g. the first round after the prefill)."""
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
