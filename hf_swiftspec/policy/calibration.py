"""What the policy knows of acceptance: P(a node is accepted), calibrated online per bucket (policy/goodput.py
decides from it).

A draft node's bucket is its cumulative draft score (score_bucket); a suffix node's is its match length x its
share of its parent's occurrences x its depth (suffix_bucket), with priors (suffix_priors) worth a few
observations until the target's verdicts replace them (Calibration). SuffixWatch follows a suffix proposal of an
earlier round down the tokens the target emitted since, so its nodes are judged even when they were not verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BUCKET = 0.5  # width of a draft-score bucket (nats of cumulative log-prob)
BUCKETS = 24  # scores below -BUCKET * BUCKETS share the last bucket
# P(a copied token is accepted | its parent was) before any is seen, after a 1, 2, 3, 4, 5-7, 8-15, 16+ token match
MATCH_PRIORS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
MATCH_EDGES = (1, 2, 3, 4, 5, 8, 16)  # the shortest match of each bucket
# The node's share of its parent's occurrences: < 1/3, < 2/3, < 1, all of one, all of several; and
# how much that scales the match's prior.
SUPPORT_BUCKETS = 5
SUPPORT_SCALE = (0.3, 0.6, 0.85, 1.0, 1.15)
DEPTH_BUCKETS = 4  # depth 1, 2, 3-4, 5+: once a copy is being accepted, its next token is a safer bet


@dataclass
class Calibration:
    """P(accepted) per bucket, as decayed counts plus a prior worth `prior_weight` observations.

    prior: prior probability of each bucket. Plain lists: a few dozen numbers, updated once a round.
    """

    prior: list[float]
    prior_weight: float = 2.0
    decay: float = 0.995  # older rounds count less, so the estimate follows the text
    accepted: list[float] = field(init=False)
    seen: list[float] = field(init=False)

    def __post_init__(self):
        self.accepted = [0.0] * len(self.prior)
        self.seen = [0.0] * len(self.prior)

    @property
    def rates(self) -> list[float]:
        """Estimated P(accepted) of each bucket."""
        w = self.prior_weight
        return [(a + w * p) / (n + w) for a, n, p in zip(self.accepted, self.seen, self.prior)]

    def observe(self, buckets: list[int], accepted: list[bool]) -> None:
        """Fold in outcomes: one bucket and one accepted flag per observed node."""
        self.accepted = [a * self.decay for a in self.accepted]
        self.seen = [n * self.decay for n in self.seen]
        for b, ok in zip(buckets, accepted):
            self.seen[b] += 1.0
            self.accepted[b] += float(ok)


def score_bucket(score: float) -> int:
    """Bucket of a draft score (a cumulative log-prob, <= 0)."""
    return min(int(-score / BUCKET), BUCKETS - 1)


def match_bucket(match: int) -> int:
    """Calibration of a proposal whose suffix match spanned `match` tokens (1, 2, 3, 4, 5-7, 8-15, 16+)."""
    return max(sum(match >= edge for edge in MATCH_EDGES) - 1, 0)


def suffix_bucket(match: int, count: int, parent_count: int, depth: int) -> int:
    """Calibration bucket of a suffix node: match length x share of its parent's occurrences x depth."""
    if count >= parent_count:
        support = 3 if parent_count == 1 else 4
    else:
        support = min(int(3 * count / parent_count), 2)
    depth_b = 0 if depth <= 1 else 1 if depth == 2 else 2 if depth <= 4 else 3
    return (match_bucket(match) * SUPPORT_BUCKETS + support) * DEPTH_BUCKETS + depth_b


def suffix_priors() -> list[float]:
    """Prior P(accepted | parent accepted) of every suffix bucket, in suffix_bucket's order."""
    return [
        min(0.95, match_prior * scale)
        for match_prior in MATCH_PRIORS
        for scale in SUPPORT_SCALE
        for _ in range(DEPTH_BUCKETS)
    ]


@dataclass
class SuffixWatch:
    """A suffix proposal offered in an earlier round (its nodes' tokens, parents and calibration
    buckets), followed down the tokens the target emitted since: `node` is where it stands (-1: root)."""

    tokens: list[int]
    parents: list[int]
    buckets: list[int]
    node: int = -1
    _children: dict[int, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._children = {}
        for i, p in enumerate(self.parents):
            self._children.setdefault(p, []).append(i)

    def children(self, node: int) -> list[int]:
        return self._children.get(node, [])
