"""Host proposals in the device round (engine/device_sides.py, round="device"): a draft model whose tree cannot grow on
the device grows it on the host side of each round, as the host round's drafter it is, and offers its best nodes in
the target's tokens, merged with the row's suffix proposal into one trie (policy/sizing.Offer) that
device_suffix.SuffixProposals.pack copies to the device in the round's one pinned copy. The device side of the round
is then draft-free (device_drafters.RootOnly): the root, the offered nodes merged below it by path hash
(swiftspec_kernels.tree_merge), the best T selected, verified, walked and committed as every device round's.

Two drafts propose this way (`on_host`):

    another tokenizer   drafters/translated.TranslatedDrafter: its tree grows in its own tokens from the text, and its
                        branches become target tokens through their text (drafters/vocabulary.py), one trie a row
    a shorter context   drafters/draft_model.DraftModelDrafter with its `window`: it reads the text in windows of its
                        own positions (the last part of a prompt that does not fit; the last half of its context again
                        each time the text fills it). Chosen over windowing the device drafter's slot cache: the slot
                        cache places every token at its slot in the target's positions, and a window needs positions
                        of the draft's own (a re-read of the window at positions 0.., a slot map for the catch-up, the
                        growth and the commit, in every phase); the host drafter has it, exact and tested already.

Per round, on the host (`grow`): the growth loop of the host round (grow while one more expansion is expected to raise
the batch's tokens per second: policy.keep_expanding, its gain observed; draft_depth and tree_budget as set), each
row's candidates its drafter's best nodes (each with the policy's P(accepted) of its draft score, as the host round
prices them) with the suffix proposal merged in (tree.merge_suffix, the host round's merge), cut to the S nodes the
packed tensor holds. The round's read brings the verified tokens; the drafter follows them (`accept`: its text, its
cache, its tree re-rooted along them) next to the suffix index's extend (DeviceSides.accept).

The drafter's own forwards, its tree's reads and its tokenizer calls are the host side of the round, apart from the
device round's one read and one copy; they run eagerly (its own attention, no replayed steps), as the host round runs
a draft with another tokenizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..models.architectures import context_limit
from ..policy.goodput import GoodputPolicy
from ..policy.sizing import Offer, RoundSizing
from ..stats import DraftCounters
from ..steps.tree import best_subtree, merge_suffix, ranked
from ..steps.verify import Verified
from .draft_model import DraftModelDrafter, window_for
from .eagle3 import DraftHead


def on_host(draft, target, vocabularies=None) -> str | None:
    """Why `draft` proposes from the host side of the device round (the module docstring), or None where it grows on
    the device (or there is no draft model)."""
    if draft is None or isinstance(draft, DraftHead):
        return None
    if vocabularies is not None:
        return "another tokenizer"
    own, target_positions = context_limit(draft), context_limit(target)
    if window_for(own, target_positions) is not None:
        return f"its context of {own} positions, shorter than the target's, read in windows"
    return None


@dataclass
class HostGrowth:
    """One round's host growth: each live row's offer (None: nothing), the expansions run and their seconds, and the
    draft's catch-up on tokens it had not run (its seconds and tokens)."""

    offers: list[Offer | None]
    expansions: int = 0
    expanding_s: float = 0.0
    catch_up_s: float = 0.0
    caught_up: int = 0


@dataclass
class HostProposals:
    """The host drafter of the device sides' live rows (the module docstring).

    build: a request -> the host round's drafter for its rows (engine/launch.draft_model_drafter's), unstarted
    why:   on_host's reason (the call's stats)
    counters: what the drafter did (the sides' draft counters: every drafter of theirs counts into it)
    """

    build: Callable[[object], DraftModelDrafter]
    why: str
    drafter: DraftModelDrafter | None = None
    counters: DraftCounters = field(default_factory=DraftCounters)

    def fresh(self) -> "HostProposals":
        """The same drafts' proposals for other rows (a new running batch), nothing started yet."""
        return HostProposals(self.build, self.why)

    def started(self, request) -> DraftModelDrafter:
        """A drafter for the request's rows, started on their prompts (their padding left out)."""
        drafter = self.build(request)
        drafter.counters = self.counters
        drafter.start(request.prompt_ids())
        return drafter

    def start(self, request) -> None:
        self.drafter = self.started(request)

    def absorb(self, joining: DraftModelDrafter) -> None:
        """A joining row's drafter (`started` on its request) as the last row (the running batch)."""
        joining.counters = self.counters  # (started for sides that may have ended since)
        if self.drafter is None:
            self.drafter = joining
        else:
            self.drafter.absorb(joining)

    def keep_rows(self, order: list[int]) -> None:
        self.drafter.keep_rows(order)

    def accept(self, verified: list[Verified | None]) -> None:
        """Per live row, the verified tokens (None: the row leaves): its text and cache follow them."""
        self.drafter.follow(verified)

    def describe(self) -> str:
        drafter = self.drafter
        attention = drafter.attention if drafter is not None else "its own"
        return f"draft={attention} on the host ({self.why})"

    # ---- the round's proposals
    def offers(self, policy: GoodputPolicy, suffix: list[Offer | None], depths: list[int | None],
               nodes: int) -> list[Offer | None]:
        """Per live row, its drafter's best nodes as its tree stands, none deeper than depths[b] below the root, with
        the row's suffix offer merged in, cut to its best `nodes` (ties to the lower index, parents first: still one
        connected trie); None where neither holds a node."""
        out = []
        for b, (row_suffix, depth) in enumerate(zip(suffix, depths)):
            grown = self.drafter.propose(b, policy.max_budget, depth, policy)
            merged = grown if row_suffix is None else merge_suffix(
                grown.subtree, grown.scores, grown.probs, row_suffix.tree.tokens, row_suffix.tree.parents,
                row_suffix.probs, row_suffix.buckets, row_suffix.tree.match)
            if len(merged.subtree) > nodes + 1:
                merged = best_subtree(merged, ranked(merged), nodes + 1)
            out.append(Offer.of_proposal(merged) if len(merged.subtree) > 1 else None)
        return out

    def grow(self, policy: GoodputPolicy, suffix: list[Offer | None], depths: list[int | None], nodes: int,
             probing: bool) -> HostGrowth:
        """The round's host growth (the module docstring): expansions while the policy expects one more to pay (its
        catch-up on tokens the draft has not run first), then with both tree settings fixed every row's tree topped
        up to the largest tree; each row's offer as the last expansion left it."""
        start = time.perf_counter()
        drafter = self.drafter
        grown = HostGrowth(self.offers(policy, suffix, depths, nodes))
        while policy.keep_expanding(grown.expansions, time.perf_counter() - start, candidates(policy, grown.offers),
                                    probing, drafter.catch_up_tokens):
            before = time.perf_counter()
            if drafter.catch_up_tokens:  # tokens the draft has not run: no expansion's cost
                grown.caught_up = drafter.catch_up_tokens
                drafter.catch_up()
                grown.catch_up_s += time.perf_counter() - before
                before = time.perf_counter()
            if not drafter.expand(within=policy.max_budget):
                break
            grown.expanding_s += time.perf_counter() - before
            offers = self.offers(policy, suffix, depths, nodes)
            policy.observe_gain(grown.expansions, candidates(policy, grown.offers), candidates(policy, offers),
                                before - start)
            grown.offers, grown.expansions = offers, grown.expansions + 1
        if policy.fixed:  # both tree settings given: every tree holds tree_budget nodes where it can
            grown.expansions += drafter.top_up(policy.max_budget)
            grown.offers = self.offers(policy, suffix, depths, nodes)
        return grown


def candidates(policy: GoodputPolicy, offers: list[Offer | None]) -> list[list[float]]:
    """Each row's candidates' P(accepted), best first (the root first): RoundSizing's, with nothing grown."""
    return RoundSizing(policy, offers, 0).candidates()

