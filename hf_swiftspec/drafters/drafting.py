"""The proposing side of a round: drafters behind one interface, merged into the tree the target verifies.

A drafter proposes, for each row, nodes hanging under the row's root (the last verified token), and
follows the target's verdict afterwards. Every drafter implements `Drafter`:

    start(prompts[, features])     a generation begins: each row's prompt (token ids, no padding) and, for a
                                   drafter that reads them, the target's hidden states at its positions
    propose(b, max_nodes, max_depth, policy)
                                   row b's candidates: a Proposal (steps/tree.py) whose node 0 is the row's
                                   root, at most `max_nodes` nodes no deeper than `max_depth` below it, each
                                   with the policy's calibrated P(accepted)
    accept(subtrees, verified)     the target's verdict per row (None: the row sat the round out):
                                   follow the verified tokens
    keep_rows(rows)                the rows that keep decoding (row rows[i] becomes row i)
    absorb(other)                  rows joining a running batch (other: the same drafter, started on theirs)

A drafter either grows its proposal within a round (`grows`: a model's token tree, expanded one forward at a
time while the policy expects it to pay, asked again after every expansion; `GrowingDrafter` adds what
growing takes), or is asked once a round (suffix proposals: their index remembers its last proposal, so
asking twice would not propose the same).

    DraftModelDrafter (draft_model.py)  a draft model's token tree, grown best-first one forward at a time
                                        (`expand`, `catch_up`), re-rooted on the verdict with its KV kept;
                                        it proposes the tree's best nodes, calibrated from their draft scores
    HeadDrafter (heads.py)              the same tree grown by an EAGLE-3 head or a model's MTP layer from
                                        the target's hidden states
    RootOnly (here)                     draft-free mode's growing drafter: the root alone, nothing to grow
    SuffixDrafter (suffix.py)           continuations of the context's repeated suffix, no model; asked once
                                        a round

`Drafters` is what an engine talks to: the drafters of one generation, each row's root, every drafter's
proposal merged into one Proposal per row (`tree.merge_suffix`), the tree size the policy picks, and the
proposing side's counters.
"""

from __future__ import annotations

from functools import reduce
from typing import Protocol

import torch

from ..policy.goodput import GoodputPolicy
from ..stats import DraftCounters
from ..steps.tree import Proposal, Subtree, best_subtree, merge_suffix, ranked
from ..steps.verify import Verified


class Drafter(Protocol):
    """What every drafter does (see the module docstring)."""

    grows: bool  # whether its proposal grows within a round (asked again after every expansion)

    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None = None) -> None: ...

    def propose(self, b: int, max_nodes: int, max_depth: int | None, policy: GoodputPolicy) -> Proposal: ...

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None]) -> object: ...

    def absorb(self, other: "Drafter") -> None:
        """Take `other`'s rows (a drafter of the same kind, started on their prompts) in after this one's."""

    def keep_rows(self, rows: list[int]) -> None: ...


class GrowingDrafter(Drafter, Protocol):
    """A drafter whose token tree grows within a round (DraftModelDrafter, HeadDrafter, RootOnly)."""

    device: torch.device
    counters: DraftCounters
    reads_features: bool  # whether it drafts from the target's hidden states (an EAGLE-3 head)
    catch_up_tokens: int  # tokens it runs before its next expansion
    fresh: bool  # whether row 0's tree holds the root alone

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None], defer: bool = False) -> int:
        """Follow the verdict; returns how many rows' new roots its trees already held. defer: the re-roots may
        wait for settle()."""

    def settle(self, sent: list[Subtree | None]) -> list[Subtree | None]: ...

    def catch_up(self) -> None: ...

    def expand(self, within: int | None = None, rows: list[bool] | None = None) -> int: ...

    def graft(self, b: int, subtree: Subtree) -> int: ...

    def top_up(self, budget: int) -> int: ...


class RootOnly:
    """Draft-free mode's growing drafter: each row's root alone, which the other drafters' proposals hang under
    (a plain step where they propose nothing); no model, so nothing to run, grow or catch up."""

    grows = True
    reads_features = False
    catch_up_tokens = 0
    fresh = True

    def __init__(self, device: torch.device, batch_size: int = 1):
        self.device = device
        self.roots: list[int] = [0] * batch_size
        self.counters = DraftCounters()

    def start(self, prompts: list[list[int]], features=None) -> None:
        self.roots = [ids[-1] for ids in prompts]

    def propose(self, b: int, max_nodes: int, max_depth: int | None, policy: GoodputPolicy) -> Proposal:
        return Proposal(Subtree([0], [self.roots[b]], [-1]), [1.0], [0.0], [-1], 0, ([], [], []))

    def accept(self, subtrees, verified: list[Verified | None], defer: bool = False) -> int:
        for b, outcome in enumerate(verified):
            if outcome is not None:
                self.roots[b] = outcome.tokens[-1]
        return 0

    def settle(self, sent: list[Subtree | None]) -> list[Subtree | None]:
        return sent

    def catch_up(self) -> None:
        pass

    def expand(self, within: int | None = None, rows: list[bool] | None = None) -> int:
        return 0

    def graft(self, b: int, subtree: Subtree) -> int:
        return 0

    def top_up(self, budget: int) -> int:
        return 0

    def absorb(self, other: "RootOnly") -> None:
        self.roots += other.roots

    def keep_rows(self, rows: list[int]) -> None:
        self.roots = [self.roots[b] for b in rows]


def join(base: Proposal, offer: Proposal) -> Proposal:
    """`offer`'s nodes below its root merged into `base` (tree.merge_suffix): where one follows a node of
    `base` it is that node (with the higher of the two probabilities), elsewhere a node of its own."""
    sub = offer.subtree
    parents = [p - 1 for p in sub.parents[1:]]  # the offer's root is base's root (-1 in merge_suffix's terms)
    return merge_suffix(base.subtree, base.scores, base.probs, sub.tokens[1:], parents, offer.probs[1:],
                        offer.suffix[1:], offer.match)


class Drafters:
    """The drafters of one generation, as one proposing side (see the module docstring).

    model: the draft-model drafter, or None (draft-free mode: every proposal comes from the suffix
        drafter, and there is no expansion to run); suffix: the suffix drafter, or None (ngram_size 0).
    max_positions: both models' context; no node is placed past it.
    device: where the proposing side runs (the draft model's device; without one, the target's)
    """

    def __init__(self, model, suffix, batch_size: int = 1, max_positions: int | None = None,
                 device: torch.device | str = "cpu"):
        self.model, self.suffix = model, suffix
        # the drafter whose tree grows within a round, and those asked once a round
        self.growing: GrowingDrafter = model if model is not None else RootOnly(torch.device(device), batch_size)
        self.once_a_round: list[Drafter] = [suffix] if suffix is not None else []
        self.max_positions = max_positions
        self.device = self.growing.device
        self.roots: list[int] = [0] * batch_size  # each row's root token
        self.lengths: list[int] = [0] * batch_size  # each row's committed tokens, its root included
        self.counters = self.growing.counters

    @property
    def drafters(self) -> list[Drafter]:
        return self.once_a_round + [self.growing]

    @property
    def reads_features(self) -> bool:
        """Whether the growing drafter drafts from the target's hidden states (an EAGLE-3 head)."""
        return self.growing.reads_features

    @property
    def rows(self) -> int:
        return len(self.roots)

    # ---- a generation ----------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None = None) -> None:
        """Begin a generation: each row's prompt (token ids, no padding); its last token is the root.
        features: per row the target's hidden states at the prompt's positions, for a drafter that reads them."""
        self.roots = [ids[-1] for ids in prompts]
        self.lengths = [len(ids) for ids in prompts]
        for drafter in self.drafters:
            drafter.start(prompts, features)

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None], defer: bool = False) -> int:
        """Hand every drafter the target's verdict per row (None: the row sat the round out). Returns how
        many rows' new roots the growing drafter's tree already held. defer: its re-roots may wait
        for settle() (DraftModelDrafter.accept)."""
        for b, outcome in enumerate(verified):
            if outcome is not None:
                self.roots[b] = outcome.tokens[-1]
                self.lengths[b] += len(outcome.tokens)
        for drafter in self.once_a_round:
            drafter.accept(subtrees, verified)
        return self.growing.accept(subtrees, verified, defer)

    def settle(self, sent: list[Subtree | None]) -> list[Subtree | None]:
        """The re-roots accept(defer=True) left, after `sent` went out; `sent` renumbered for the trees after."""
        return self.growing.settle(sent)

    def absorb(self, other: "Drafters") -> None:
        """Take `other`'s rows (drafters of the same pair, started on their prompts) in after this one's."""
        self.roots += other.roots
        self.lengths += other.lengths
        for mine, theirs in zip(self.drafters, other.drafters):
            mine.absorb(theirs)
        self.counters.forwards += other.counters.forwards

    def keep_rows(self, rows: list[int]) -> None:
        self.roots = [self.roots[b] for b in rows]
        self.lengths = [self.lengths[b] for b in rows]
        for drafter in self.drafters:
            drafter.keep_rows(rows)

    # ---- growing the trees ----------------------------------------------------------------------
    @property
    def catch_up_tokens(self) -> int:
        """Tokens the growing drafter runs before its next expansion (0 without a draft model)."""
        return self.growing.catch_up_tokens

    @property
    def fresh(self) -> bool:
        """Whether row 0's draft tree holds the root alone (always, without a draft model)."""
        return self.growing.fresh

    def catch_up(self) -> None:
        self.growing.catch_up()

    def expand(self, within: int | None = None, rows: list[bool] | None = None) -> int:
        """One draft forward (see DraftModelDrafter.expand); 0 without a draft model."""
        return self.growing.expand(within, rows)

    def grow(self, max_expansions: int, within: int | None = None, stop=None) -> int:
        """Expand up to `max_expansions` times (only leaves among the best `within` nodes if given),
        until nothing is left to expand or `stop()` says so. Returns the expansions run."""
        done = 0
        while done < max_expansions and not (stop is not None and stop()) and self.expand(within):
            done += 1
        return done

    def graft(self, subtrees: list[Subtree | None]) -> int:
        """Bring every row's subtree, just sent, into its draft tree and run its unrun nodes (see
        DraftModelDrafter.graft): once a row's root has run, with a draft model that needs nothing but
        tokens. Returns the forwards run."""
        if self.growing.reads_features:  # a head drafts from the target's states at each node
            return 0
        return sum(self.growing.graft(b, subtree) for b, subtree in enumerate(subtrees) if subtree is not None)

    def top_up(self, budget: int) -> int:
        """Expand until every row's tree holds at least `budget` nodes (or cannot grow). Returns the
        expansions run."""
        return self.growing.top_up(budget)

    # ---- the round's proposal -------------------------------------------------------------------
    def depth_room(self, b: int) -> int | None:
        """How deep below row b's root a node may sit before its position passes the models' context."""
        return None if self.max_positions is None else max(self.max_positions - self.lengths[b], 0)

    def offers(self, policy: GoodputPolicy, wanted: list[bool] | None = None) -> list[list[Proposal]]:
        """Per row, the proposals of the drafters asked once a round (none where `wanted` says not this round:
        policy.wants_suffix), at most the policy's largest tree each."""
        return [
            [d.propose(b, policy.max_budget, self.depth_room(b), policy) for d in self.once_a_round]
            if wanted is None or wanted[b] else []
            for b in range(self.rows)
        ]

    def candidates(self, policy: GoodputPolicy, offers: list[list[Proposal]]) -> list[Proposal]:
        """Per row, the growing drafter's proposal as its tree stands (after an expansion, one host sync for the
        batch: tree.read_views; none otherwise) with the row's
        `offers` (this round's, from offers()) merged in: every drafter's candidates as one tree, each node
        with its calibrated P(accepted)."""
        out = []
        for b, row_offers in enumerate(offers):
            grown = self.growing.propose(b, policy.max_budget, self.depth_room(b), policy)
            out.append(reduce(join, row_offers, grown))
        return out

    def proposals(self, policy: GoodputPolicy, candidates: list[Proposal], spent_s: float, agree=int) -> list[Proposal]:
        """Per row, its best candidates for the tree size the policy expects the most tokens per second
        from (one size for the batch: row b verifies min(T, its candidates)).

        agree: makes every draft rank use the same tree size (identity on a lone draft worker).
        """
        orders = [ranked(c) for c in candidates]
        budget, _ = policy.best_budget([[c.probs[i] for i in order] for c, order in zip(candidates, orders)], spent_s)
        budget = agree(budget)
        return [best_subtree(c, order, budget) for c, order in zip(candidates, orders)]

    def plain(self) -> list[Proposal]:
        """Per row, a plain step's proposal: its root alone."""
        return [Proposal(Subtree([0], [root], [-1]), [1.0], [0.0], [-1]) for root in self.roots]


def offered_nothing(offers: list[Proposal]) -> bool:
    """Whether a row's once-a-round proposals hold no node beyond the root."""
    return all(len(offer.subtree) == 1 for offer in offers)
