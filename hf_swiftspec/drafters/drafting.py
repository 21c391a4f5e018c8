"""The proposing side of a round: drafters behind one interface, merged into the tree the target verifies.

A drafter proposes, for each row, nodes hanging under the row's root (the last verified token), and
follows the target's verdict afterwards. Every drafter implements `Drafter`:

    start(prompts[, features])     a generation begins: each row's prompt (token ids, no padding) and, for a
                                   drafter that reads them, the target's hidden states at its positions
    accept(subtrees, verified)     the target's verdict per row (None: the row sat the round out):
                                   follow the verified tokens
    keep_rows(rows)                the rows that keep decoding (row rows[i] becomes row i)
    absorb(other)                  rows joining a running batch (other: the same drafter, started on theirs)

and offers its candidates in its own terms, which the policy calibrates into P(accepted):

    DraftModelDrafter (engine/workers.py)  a draft model's token tree, grown best-first one forward at a
                                           time (`expand`, `catch_up`) while the policy expects it to pay,
                                           re-rooted on the verdict with its KV kept; candidates are the
                                           tree's best nodes and their draft scores
    HeadDrafter (drafters/heads.py)          the same tree grown by an EAGLE-3 head or a model's MTP layer from
                                           the target's hidden states
    SuffixDrafter (here)                   continuations of the context's repeated suffix (suffix.py), no
                                           model; candidates are a SuffixTree and its match

`Drafters` is what an engine talks to: the drafters of one generation (draft-free mode: no draft-model
drafter), each row's root, the candidates of every drafter merged into one Proposal per row
(`tree.merge_suffix`), the tree size the policy picks, and the proposing side's counters.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..policy.goodput import GoodputPolicy
from ..stats import DraftCounters
from .suffix import OutputHistory, SuffixIndex, SuffixTree
from ..steps.tree import Proposal, Subtree, best_subtree, merge_suffix, ranked
from ..steps.verify import Verified


class Drafter(Protocol):
    """What every drafter does (see the module docstring)."""

    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None = None) -> None: ...

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None]) -> object: ...

    def absorb(self, other: "Drafter") -> None:
        """Take `other`'s rows (a drafter of the same kind, started on their prompts) in after this one's."""

    def keep_rows(self, rows: list[int]) -> None: ...


class SuffixDrafter:
    """Suffix proposals (suffix.py) for every row: the continuations of its context's longest repeated
    suffix, in its prompt, its output so far, a corpus and earlier calls' outputs.

    max_n: longest suffix matched; branching: False keeps proposals to chains (the models' steps must be).
    """

    def __init__(self, max_n: int, batch_size: int = 1, branching: bool = True, corpus: list[list[int]] | None = None,
                 history: OutputHistory | None = None):
        self.max_n, self.branching, self.corpus, self.history = max_n, branching, corpus or [], history
        self.indices = [SuffixIndex(max_n=max_n, branching=branching) for _ in range(batch_size)]

    def start(self, prompts: list[list[int]], features=None) -> None:
        for b, ids in enumerate(prompts):
            self.indices[b] = SuffixIndex(max_n=self.max_n, history=self.history, branching=self.branching)
            self.indices[b].add_corpus(self.corpus)
            self.indices[b].extend(ids)

    def candidates(self, b: int, max_nodes: int, max_depth: int | None) -> SuffixTree:
        """Row b's proposal for its committed sequence and root, at most `max_nodes` nodes, no deeper than
        `max_depth` (None: any depth)."""
        return self.indices[b].propose(max_nodes, max_depth)

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None]) -> None:
        for index, outcome in zip(self.indices, verified):
            if outcome is not None:
                index.extend(outcome.tokens)

    def absorb(self, other: "SuffixDrafter") -> None:
        self.indices += other.indices

    def keep_rows(self, rows: list[int]) -> None:
        self.indices = [self.indices[b] for b in rows]


class Drafters:
    """The drafters of one generation, as one proposing side (see the module docstring).

    model: the draft-model drafter, or None (draft-free mode: every proposal comes from the suffix
        drafter, and there is no expansion to run); suffix: the suffix drafter, or None (ngram_size 0).
    max_positions: both models' context; no node is placed past it.
    device: where the proposing side runs (the draft model's device; without one, the target's)
    """

    def __init__(self, model, suffix: SuffixDrafter | None, batch_size: int = 1, max_positions: int | None = None,
                 device: torch.device | str = "cpu"):
        self.model, self.suffix = model, suffix
        self.max_positions = max_positions
        self.device = model.device if model is not None else torch.device(device)
        self.roots: list[int] = [0] * batch_size  # each row's root token
        self.lengths: list[int] = [0] * batch_size  # each row's committed tokens, its root included
        self.counters = model.counters if model is not None else DraftCounters()

    @property
    def drafters(self) -> list[Drafter]:
        return [d for d in (self.model, self.suffix) if d is not None]

    @property
    def reads_features(self) -> bool:
        """Whether the draft-model side drafts from the target's hidden states (an EAGLE-3 head)."""
        return self.model is not None and self.model.reads_features

    @property
    def rows(self) -> int:
        return len(self.roots)

    # ---- a generation ----------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None = None) -> None:
        """Begin a generation: each row's prompt (token ids, no padding); its last token is the root.
        features: per row the target's hidden states at the prompt's positions, for a drafter that reads them."""
        self.roots = [ids[-1] for ids in prompts]
        self.lengths = [len(ids) for ids in prompts]
        if self.suffix is not None:
            self.suffix.start(prompts)
        if self.model is not None:
            self.model.start(prompts, features)

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None], defer: bool = False) -> int:
        """Hand every drafter the target's verdict per row (None: the row sat the round out). Returns how
        many rows' new roots the draft model's tree already held. defer: the draft model's re-roots may wait
        for settle() (DraftModelDrafter.accept)."""
        for b, outcome in enumerate(verified):
            if outcome is not None:
                self.roots[b] = outcome.tokens[-1]
                self.lengths[b] += len(outcome.tokens)
        if self.suffix is not None:
            self.suffix.accept(subtrees, verified)
        return self.model.accept(subtrees, verified, defer) if self.model is not None else 0

    def settle(self, sent: list[Subtree | None]) -> list[Subtree | None]:
        """The re-roots accept(defer=True) left, after `sent` went out; `sent` renumbered for the trees after."""
        return self.model.settle(sent) if self.model is not None else sent

    def absorb(self, other: "Drafters") -> None:
        """Take `other`'s rows (drafters of the same pair, started on their prompts) in after this one's."""
        self.roots += other.roots
        self.lengths += other.lengths
        for mine, theirs in zip(self.drafters, other.drafters):
            mine.absorb(theirs)
        if self.model is not None:
            self.counters.forwards += other.counters.forwards

    def keep_rows(self, rows: list[int]) -> None:
        self.roots = [self.roots[b] for b in rows]
        self.lengths = [self.lengths[b] for b in rows]
        for drafter in self.drafters:
            drafter.keep_rows(rows)

    # ---- growing the draft model's trees --------------------------------------------------------
    @property
    def catch_up_tokens(self) -> int:
        """Tokens the draft model runs before its next expansion (0 without one)."""
        return self.model.catch_up_tokens if self.model is not None else 0

    @property
    def fresh(self) -> bool:
        """Whether row 0's draft tree holds the root alone (always, without a draft model)."""
        return self.model is None or self.model.tree.size == 1

    def catch_up(self) -> None:
        if self.model is not None:
            self.model.catch_up()

    def expand(self, within: int | None = None, rows: list[bool] | None = None) -> int:
        """One draft forward (see DraftModelDrafter.expand); 0 without a draft model."""
        return self.model.expand(within, rows) if self.model is not None else 0

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
        model = self.model
        if model is None or model.reads_features:  # a head drafts from the target's states at each node
            return 0
        return sum(model.graft(b, subtree) for b, subtree in enumerate(subtrees) if subtree is not None)

    def top_up(self, budget: int) -> int:
        """Expand until every row's tree holds at least `budget` nodes (or cannot grow). Returns the
        expansions run."""
        if self.model is None:
            return 0
        done, trees = 0, self.model.trees
        while min(tree.size for tree in trees) < budget and self.expand(rows=[t.size < budget for t in trees]):
            done += 1
        return done

    # ---- the round's proposal -------------------------------------------------------------------
    def depth_room(self, b: int) -> int | None:
        """How deep below row b's root a node may sit before its position passes the models' context."""
        return None if self.max_positions is None else max(self.max_positions - self.lengths[b], 0)

    def suffix_trees(self, max_nodes: int, wanted: list[bool] | None = None) -> list[SuffixTree]:
        """Per row, the suffix drafter's proposal (empty without one, or where `wanted` says not this round)."""
        if self.suffix is None:
            return [SuffixTree() for _ in self.roots]
        return [
            self.suffix.candidates(b, max_nodes, self.depth_room(b)) if wanted is None or wanted[b] else SuffixTree()
            for b in range(self.rows)
        ]

    def candidates(self, policy: GoodputPolicy, suffixes: list[SuffixTree]) -> list[Proposal]:
        """Per row, every drafter's candidates merged into one tree, each node with its calibrated
        P(accepted): the draft model's best nodes (one host sync per row), the suffix proposal beside them."""
        out = []
        for b, suffix in enumerate(suffixes):
            if self.model is not None:
                draft, scores, probs = self.model.candidates(b, policy.max_budget, policy)
            else:
                draft, scores, probs = Subtree([0], [self.roots[b]], [-1]), [0.0], [1.0]
            suffix_probs, buckets = policy.suffix_probs(suffix)
            out.append(merge_suffix(draft, scores, probs, suffix.tokens, suffix.parents, suffix_probs, buckets, suffix.match))
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
