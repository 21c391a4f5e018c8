"""How the goodput policy (goodput.py) sizes a round of the device sides (engine/device_sides.py): whether the drafter
grows, how many levels, and how many nodes T a row verifies. The rule is the policy's own (grow while one more
expansion is expected to raise the batch's tokens per second, then the T of the best goodput, under the latency guard
for a running batch); here it meets the device round's tree.

Two strategies of the same phases, chosen by how the phases run (`RoundSizing.between_levels`):

    between levels  the phases run eagerly (a CPU, where a read is free): after each growth level the host reads that
                    level's scores and path hashes, the policy sees every row's candidates (the root, the suffix
                    proposal's nodes and the draft's, merged by path as the device merges them) and decides the next
                    level, then T
    ahead           the phases replay as graphs (CUDA): the levels and T are fixed before the growth, from the
                    candidates in hand and the gain the policy expects of each expansion; no read but the round's one

A setting the user fixed (draft_depth, tree_budget) needs no read either way. The round's verdict reaches the policy
as every round's does: observe_round (its costs) and observe_outcomes (each row's Proposal, rebuilt here from the
round's read: which nodes the draft grew, which the suffix proposal holds, their calibrated P(accepted)).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from swiftspec_kernels.tree_merge import HASH_BITS

from ..steps.capture import power_of_two
from ..steps.device_round import DeviceTree, host_path_hash
from ..steps.tree import Proposal, Subtree, SuffixTree
from .goodput import GoodputPolicy


@dataclass
class Offer:
    """A row's host proposal this round: the suffix index's tree, or a host drafter's with it merged in
    (drafters/device_host.py), with each node's calibrated P(accepted) and suffix calibration bucket (-1: not the
    suffix proposal's) and its path hash (HASH_BITS of device_round.host_path_hash: the device merges it onto the
    draft node of the same hash).

    scores: each node's draft score where a host drafter proposed it (None: the suffix proposal's alone); empty: none
    suffix: the suffix proposal's own nodes (tokens, parents, buckets) where a host drafter's joined them; None: the
            whole tree is the suffix proposal
    """

    tree: SuffixTree
    probs: list[float]
    buckets: list[int]
    hashes: list[int] = field(default_factory=list)
    scores: list[float | None] = field(default_factory=list)
    suffix: tuple[list[int], list[int], list[int]] | None = None

    @classmethod
    def of(cls, tree: SuffixTree, policy: GoodputPolicy) -> "Offer":
        probs, buckets = policy.suffix_probs(tree)
        return cls(tree, probs, buckets, offer_hashes(tree))

    @classmethod
    def of_proposal(cls, proposal: Proposal) -> "Offer":
        """A proposal (root first, parents before children: a host drafter's, the suffix proposal merged in by
        tree.merge_suffix) as the offer of its nodes below the root."""
        sub = proposal.subtree
        tree = SuffixTree(list(sub.tokens[1:]), [p - 1 for p in sub.parents[1:]], match=proposal.match)
        return cls(tree, list(proposal.probs[1:]), list(proposal.suffix[1:]), offer_hashes(tree),
                   list(proposal.scores[1:]), proposal.offered)

    def child(self, parent: int, token: int) -> int | None:
        """The node below `parent` (-1: the root) carrying `token`, or None."""
        tree = self.tree
        return next((i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p == parent and t == token), None)

    def score(self, k: int) -> float | None:
        """Node k's draft score (None: no host drafter proposed it)."""
        return self.scores[k] if self.scores else None

    @property
    def offered(self) -> tuple[list[int], list[int], list[int]]:
        """The whole suffix proposal as the policy follows it down the emitted tokens (Proposal.offered)."""
        if self.suffix is not None:
            return tuple(list(part) for part in self.suffix)
        return list(self.tree.tokens), list(self.tree.parents), list(self.buckets)


def offer_hashes(tree: SuffixTree) -> list[int]:
    """Each node's path hash below the root, HASH_BITS of it (what the device merges by)."""
    full: list[int] = []
    for parent, token in zip(tree.parents, tree.tokens):
        full.append(host_path_hash(full[parent] if parent >= 0 else 0, token))
    return [h & HASH_BITS for h in full]


@dataclass
class RoundSizing:
    """One round's sizing over its live rows (the module docstring).

    offers:  per live row, its suffix proposal (None: none this round)
    width:   the nodes a growth level adds per row
    lag:     tokens the drafter runs before its first level (a draft model's catch-up; what that level costs more)
    between_levels: the strategy (the module docstring)
    """

    policy: GoodputPolicy
    offers: list[Offer | None]
    width: int
    lag: int = 0
    between_levels: bool = True
    started: float = field(default_factory=time.perf_counter)
    grown: list[dict[int, float]] = field(default_factory=list)  # per row: path hash -> P(accepted) of a grown node
    levels: int = 0  # levels grown so far
    caught_up_at: float | None = None  # when the catch-up ended (the first level began)
    levels_s: float = 0.0  # seconds the levels took (catch-up excluded)
    predicted: list[list[float]] | None = None  # (ahead) each row's candidates as expected after the growth

    def __post_init__(self):
        self.grown = self.grown or [{} for _ in self.offers]

    @property
    def probing(self) -> bool:
        return self.policy.plan.probing

    def spent(self) -> float:
        return time.perf_counter() - self.started

    def candidates(self) -> list[list[float]]:
        """Each row's candidates' P(accepted), best first: the root (1), then the suffix proposal's nodes and the grown
        ones, a node both hold counted once at the higher of the two (the device's merge)."""
        rows = []
        for offer, grown in zip(self.offers, self.grown):
            merged = dict(grown)
            if offer is not None:
                for h, p in zip(offer.hashes, offer.probs):
                    merged[h] = max(merged.get(h, 0.0), p)
            rows.append([1.0] + sorted(merged.values(), reverse=True))
        return rows

    # ---- between levels
    def wants_growth(self) -> bool:
        """Whether the drafter grows a first level this round (its catch-up first)."""
        return self.policy.keep_expanding(0, self.spent(), self.candidates(), self.probing, self.lag)

    def reads_levels(self) -> bool:
        """Whether the host must see each level to decide (between levels, and neither setting fixed by the user)."""
        return self.between_levels and not self.policy.fixed

    def after_level(self, tree: DeviceTree, level: int) -> bool:
        """The growth's hook (device_growth.grow): level 0 marks the catch-up's end; after level l, that level's nodes
        join each row's candidates (one read of their scores and hashes), the policy learns the level's gain, and
        decides whether level l + 1 runs."""
        now = time.perf_counter()
        if level == 0:
            self.caught_up_at = now
            return True
        self.levels_s = now - self.caught_up_at
        self.levels = level
        before = self.candidates()
        ids = slice(1 + (level - 1) * self.width, 1 + level * self.width)
        rows = len(self.offers)
        scores = tree.scores[:rows, ids].tolist()
        hashes = (tree.hashes[:rows, ids] & HASH_BITS).tolist()
        for grown, row_scores, row_hashes in zip(self.grown, scores, hashes):
            for h, p in zip(row_hashes, self.policy.draft_probs(row_scores)):
                grown[h] = max(grown.get(h, 0.0), p)
        after = self.candidates()
        spent = self.spent()
        self.policy.observe_gain(level - 1, before, after, spent)
        return self.policy.keep_expanding(level, spent, after, self.probing)

    def budget(self) -> int:
        """The T the policy expects the most tokens per second from, over the candidates seen (between levels) or
        expected (ahead: rounded up to a power of two, the sizes replayed graphs are captured for)."""
        if self.predicted is not None:
            T, _ = self.policy.best_budget(self.predicted, self.spent())
            return min(power_of_two(T), self.policy.max_budget)
        return self.policy.best_budget(self.candidates(), self.spent())[0]

    # ---- ahead
    def levels_ahead(self, max_levels: int) -> int:
        """The levels the policy would grow if each one added the gain it expects of it (GoodputPolicy.gains: one more
        candidate per row of that P), decided before the growth; the expected candidates kept for budget()."""
        rows, done = self.candidates(), 0
        while done < max_levels and self.policy.keep_expanding(done, self.spent(), rows, self.probing,
                                                               self.lag if done == 0 else 0):
            gain = self.policy.gains[min(done, len(self.policy.gains) - 1)]
            rows = [sorted(r + [min(gain, 1.0)], reverse=True) for r in rows]
            done += 1
        self.predicted = rows
        return done

    # ---- after the read
    def proposal(self, b: int, node_ids: list[int], tokens: list[int], parents: list[int], drafted: list[float],
                 grown_nodes: int) -> Proposal:
        """Row b's verified subtree as the policy judges it (observe_outcomes): each node's calibrated P(accepted), its
        draft score where the drafter grew it (node id below `grown_nodes`; None for the suffix proposal's own) and
        its suffix bucket where the proposal holds it (-1 where not). drafted: each node's draft score."""
        offer = self.offers[b] if b < len(self.offers) else None
        where: list[int | None] = [None] * len(tokens)  # each node's index in the offer
        probs, scores, suffix = [1.0], [0.0], [-1]
        for i in range(1, len(tokens)):
            parent = parents[i]
            at = where[parent] if parent > 0 else -1
            k = offer.child(at, tokens[i]) if offer is not None and at is not None else None
            where[i] = k
            score = drafted[i] if node_ids[i] < grown_nodes else offer.score(k) if k is not None else None
            p = 0.0 if score is None else self.policy.draft_probs([score])[0]
            if k is not None:
                p = max(p, offer.probs[k])
            probs.append(min(p, probs[parent]))
            scores.append(score)
            suffix.append(offer.buckets[k] if k is not None else -1)
        match = offer.tree.match if offer is not None and len(offer.tree) else 0
        offered = offer.offered if offer is not None else ([], [], [])
        return Proposal(Subtree(list(node_ids), list(tokens), list(parents)), probs, scores, suffix, match, offered)
