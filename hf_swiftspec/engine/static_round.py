"""The static sides of the round (engine/rounds.py): fixed tree shape, capturable steps, one host sync per
round (`compile=True`).

The loop is the adaptive round's (propose, verify, accept, observe), and so is the sides' make-up: a
target (`SlotVerifier`, TargetWorker's counterpart), drafters behind drafting.Drafter (`SlotTreeDrafter`,
DraftModelDrafter's counterpart, and the same SuffixDrafter) and a controller (`ShapeChooser`, the goodput
policy's). What differs is what the phases run on. Every round does the same work with the same shapes,
so each forward can be one compiled graph (`static.py`) and nothing waits for the device until the walk:

    1. propose: one draft chain forward over the tokens the last round emitted (padded to depth + 1; the
                last one is the new root, whose draft children seed the tree), then depth - 1 expansions
                of the `width` best unexpanded leaves, best-first by cumulative log-prob (tree.select_leaves,
                tree.top_children, tree.add_children: the adaptive drafter's); the best nodes
                (tree.best_node_ids) and the suffix proposal hung under the root by tree.merge_suffix;
    2. verify:  one target forward over the `budget` best nodes (root included) under their tree mask; the
                one read of the round brings back the target's choice after every node (and the nodes);
                the walk and the stop rule of every round (verify.walk_path, walk_to_stop) from the root,
                along the children carrying the target's choices (padding is never entered); the path's
                target KV moves behind the prefix;
    3. accept:  every drafter follows the emitted tokens; the draft model's become its next chain (it runs
                them again rather than keeping its tree: a fixed-size chain costs the same forward whatever
                was accepted);
    4. observe: the shape chooser's rates.

A round is one of three kinds, each of one shape: a tree round (the above, the n-gram proposal's
nodes among the budget), an n-gram round (the root and the n-gram proposal padded to a fixed size,
no draft forward) or a plain round (the root alone). `ShapeChooser` picks the kind between rounds
from the tokens per second each has made; the draft catches up on tokens it skipped before its next
tree round.

Lossless as the adaptive walk (verify.py): every emitted token is the target's argmax, or its
Gumbel-max draw with the noise of that sequence position, so greedy output equals target.generate's
and a seed draws the same tokens as the adaptive round does. It serves what can be walked on the
device: one sequence, processors that ignore the path, EOS / length criteria; `static_round_gaps`
names anything else, and generate() refuses it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..architectures import FULL
from ..eagle3 import DraftHead
from ..config import STATIC_BUDGET, STATIC_DEPTH
from ..probes import describe
from ..static import StaticModel, bucket_capacity, chain_mask, step_mask, warm_steps
from ..stats import DraftCounters, SwiftSpecStats, TargetCounters
from ..drafting import SuffixDrafter
from ..suffix import SuffixTree
from ..tree import (
    Proposal, Subtree, add_children, best_node_ids, clear_tree, expansion_inputs, merge_suffix, new_tree,
    select_leaves, subtree_mask, top_children,
)
from ..verify import (
    PATH_FREE_PROCESSORS, Sampler, Verified, children_of, split_criteria, walk_path, walk_to_stop,
)
from .request import BatchRows, DecodeRequest, DecodeResult
from .rounds import Proposed, run_rounds

PROBE_SHARE = 0.03  # the most time the shape chooser's losing probes may cost


@dataclass(frozen=True)
class StaticShape:
    """The round's fixed shape: `budget` nodes verified (root included), `depth` draft forwards,
    `width` leaves per expansion and children per leaf, at most `suffix` of the verified nodes from
    the n-gram proposal (0: none), never deeper than the draft's tree."""

    budget: int
    depth: int
    width: int
    suffix: int = 0

    @property
    def chain(self) -> int:
        """Queries of the draft's first forward: the most tokens one round can emit."""
        return self.depth + 1

    @property
    def nodes(self) -> int:
        """Tree size after a round's draft forwards."""
        return 1 + self.width + (self.depth - 1) * self.width * self.width

    def draft_slots(self, committed: int) -> int:
        """Draft cache slots a sequence of `committed` tokens needs (prefix, chain, tree region)."""
        return committed + self.chain + (self.depth - 1) * self.width

    def target_slots(self, committed: int) -> int:
        return committed + self.budget


@dataclass
class TreeNodes:
    """The nodes the target verifies, on the device (T of them, topological order, root first).

    tokens (T,) long, parents (T,) long local index (-1 for the root), depths (T,) long,
    ancestors (T, T) bool: ancestors[i, j] when j is i or one of its ancestors,
    proposed (T,) bool: False for padding, which keeps a round's size fixed and is never accepted.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    proposed: torch.Tensor


def run_static(target: StaticModel, draft: StaticModel, request: DecodeRequest, shape: StaticShape,
               vocab_limit: int, ngram_size: int = 0, chooser: "ShapeChooser | None" = None) -> DecodeResult:
    """The round (engine/rounds.py) on the static sides (one sequence). ngram_size: longest context suffix
    matched for the n-gram proposal (shape.suffix > 0 only); chooser: tree or plain rounds (kept across
    calls by the model; default: a new one)."""
    sides = StaticSides(SlotVerifier(target, shape), SlotTreeDrafter(draft, shape, vocab_limit), ngram_size,
                        chooser or ShapeChooser())
    return run_rounds(sides, request)


@dataclass
class StaticProposed(Proposed):
    """Phase 1's hand-off on the static sides: the nodes to verify (on the device), the kind of round, and
    how many graphs torch.compile had built when the round began (a round that built one is not observed)."""

    nodes: TreeNodes | None = None
    kind: str = "plain"
    graphs_before: int = 0


class StaticSides:
    """The round's phases over the static target, the drafters (the draft model's tree and the suffix
    proposals, both `drafting.Drafter`s) and the shape chooser: the adaptive sides' composition (a
    TargetWorker, Drafters, the goodput policy) on capturable steps (see the module docstring)."""

    def __init__(self, target: "SlotVerifier", drafter: "SlotTreeDrafter", ngram_size: int, chooser: "ShapeChooser"):
        self.target, self.drafter, self.chooser, self.shape = target, drafter, chooser, target.shape
        self.ngram_size = ngram_size
        self.name = "static (compiled)" if target.model.compiled else "static"

    def start(self, request: DecodeRequest) -> None:
        prompt = request.prompt_ids()[0]
        self.ngrams = SuffixDrafter(max(self.ngram_size, 1), corpus=request.corpus, history=request.history)
        self.drafters = [self.drafter, self.ngrams]
        context = request.contexts[0] if request.contexts is not None else request.prompt
        self.target.prefill(prompt, context, request.samplers[0])
        for drafter in self.drafters:
            drafter.start([prompt])

    def propose(self, rows: BatchRows) -> StaticProposed:
        """1. a tree round: the draft's tree (tokens it sat out caught up first), its best nodes and the
        n-gram proposal's; an n-gram round: the root and the n-gram proposal; a plain round: the root."""
        proposed = StaticProposed([], rows=list(rows.live), graphs_before=graphs_compiled())
        shape = self.shape
        suffix = self.ngrams.candidates(0, shape.suffix, shape.depth) if shape.suffix else SuffixTree()
        proposed.kind = self.chooser.plan_round(round_kinds(bool(len(suffix))))
        if proposed.kind == "tree":
            self.drafter.grow()
            draft_nodes, size = self.drafter.nodes(shape.budget - len(suffix)), 0
            proposed.expansions = shape.depth
        else:  # no draft: the root and the n-gram proposal (padded to its fixed size), or the root alone
            suffix = suffix if proposed.kind == "ngram" else SuffixTree()
            draft_nodes, size = root_only(self.target.root, self.target.model.device), shape.suffix if len(suffix) else 0
        merged = merge_suffix(Subtree([0], [self.target.root], [-1]), [0.0], [1.0], suffix.tokens, suffix.parents,
                              [1.0] * len(suffix), [0] * len(suffix), suffix.match)  # the suffix's nodes, under the root
        proposed.nodes = with_suffix(draft_nodes, merged, size)
        proposed.proposals = [static_proposal(draft_nodes, merged, proposed.nodes)]
        counters = self.drafter.counters
        counters.rounds += 1
        counters.busy_s += time.perf_counter() - proposed.started
        return proposed

    def verify(self, proposed: StaticProposed, rows: BatchRows) -> list[Verified]:
        """2. the target's forward over the nodes, the round's one sync, the walk, the commit."""
        return [self.target.verify(proposed.nodes, rows.stops, rows.budgets()[0])]

    def accept(self, proposed: StaticProposed, verified: list[Verified], keep: list[int]) -> None:
        """3. every drafter follows the emitted tokens (the draft model runs them as its next chain)."""
        for drafter in self.drafters:
            drafter.accept([None], verified)

    def observe(self, proposed: StaticProposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """4. the chooser's rate of this kind of round (a round that compiled a graph says nothing of its speed)."""
        if graphs_compiled() == proposed.graphs_before:
            self.chooser.observe_round(proposed.kind, len(verified[0].tokens), round_s)

    def keep_rows(self, order: list[int]) -> None:
        """One sequence: once it is done the call ends (never called with a row to keep)."""

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats:
        return SwiftSpecStats.collect(self.name, new_tokens, wall_s, self.target.counters, self.drafter.counters)


class SlotVerifier:
    """The target on the static sides (TargetWorker's counterpart): the prefill, then per round one forward
    over the round's nodes under their tree mask, the round's one read, the walk, the commit.

    prefix: committed target slots; root: the last emitted token (the next round's node 0);
    context (1, L): what processors see, the prompt (padding included) and every emitted token.
    """

    def __init__(self, model: StaticModel, shape: StaticShape):
        self.model, self.shape = model, shape
        self.counters = TargetCounters()

    def prefill(self, prompt: list[int], context: torch.Tensor, sampler: Sampler) -> None:
        """Run all but the prompt's last token (the first root); compile the round's steps now."""
        self.sampler, self.context = sampler, context.to(self.model.device)
        self.prefix, self.root = len(prompt) - 1, prompt[-1]
        self.model.prefill(prompt[:-1])
        self.counters.forwards += bool(prompt[:-1])
        warm_steps(self.model, {self.shape.budget, 1 + self.shape.suffix, 1}, self.prefix, moves=True)

    def verify(self, nodes: TreeNodes, stops, max_tokens: int) -> Verified:
        started = time.perf_counter()
        logits = verify_nodes(self.model, nodes, self.prefix)
        # every node's choice at once, as the adaptive walk does for path-free processors (checked up front);
        # the depths stay on the device (processors may write into their scores: a copy)
        choice, scores = self.sampler.choose_rows(self.context, logits.clone(), nodes.depths)
        verified = walk(nodes, choice, scores, logits, self.context, stops, max_tokens)
        self.prefix = commit_path(self.model, self.prefix, verified.path, nodes.tokens.shape[0])
        self.root = verified.tokens[-1]
        emitted = torch.tensor([verified.tokens], device=self.context.device)
        self.context = torch.cat([self.context, emitted], dim=1)
        self.counters.forwards += 1
        self.counters.verify_steps += 1
        self.counters.busy_s += time.perf_counter() - started
        return verified


class SlotTreeDrafter:
    """The draft model's token tree on the static sides (a `drafting.Drafter`, DraftModelDrafter's
    counterpart). A tree round runs the tokens it has not run, the root last, as one chain padded to a
    fixed size (the root's draft children seed the tree), then depth - 1 expansions of the `width` best
    leaves (tree.select_leaves, tree.top_children); nothing waits for the device. It keeps no tree across
    rounds: the verified tokens run as the next round's chain (a fixed-size chain costs the same forward
    whatever was accepted).

    prefix: committed draft slots; unrun: committed tokens the draft has not run, the root last (the
    prompt at the start, then every emitted token since the last tree round).
    """

    def __init__(self, model: StaticModel, shape: StaticShape, vocab_limit: int):
        self.model, self.shape, self.vocab_limit = model, shape, vocab_limit
        self.counters = DraftCounters()

    def start(self, prompts: list[list[int]], features=None) -> None:
        shape = self.shape
        warm_steps(self.model, {shape.chain, shape.width} if shape.depth > 1 else {shape.chain}, 0)
        self.prefix, self.unrun = 0, list(prompts[0])  # the prompt runs when a tree round first needs it
        self.tree = new_tree(prompts[0][-1], shape.nodes, self.model.device)

    def grow(self) -> None:
        """Phase 1 of a tree round: catch up, the chain forward, then depth - 1 expansions; no host sync."""
        self.catch_up()
        region = self.run_chain()
        for _ in range(self.shape.depth - 1):
            self.expand(region)
        self.counters.forwards += self.shape.depth
        self.counters.expansions += self.shape.depth

    def catch_up(self) -> None:
        """Run all but the last `chain` unrun tokens (the prompt, plain rounds' tokens) as one eager forward
        into the prefix, so that the round's chain fits its fixed size."""
        behind = self.unrun[: -self.shape.chain]
        if behind:
            self.model.extend(behind, self.prefix)
            self.prefix += len(behind)
            self.unrun = self.unrun[len(behind) :]
            self.counters.forwards += 1

    def run_chain(self) -> int:
        """The unrun tokens as one chain of the fixed size; the root's children become the tree's first level.
        Returns the first slot of the tree's region (after the padded chain's)."""
        model, tree, L = self.model, self.tree, self.shape.chain
        clear_tree(tree, self.unrun[-1])
        n, first, device = len(self.unrun), self.prefix, model.device
        tokens = torch.tensor([self.unrun + [0] * (L - n)], device=device)
        slots = torch.arange(first, first + L, device=device)
        logits = model.run(tokens, slots[None], slots, chain_mask(slots, model.capacity, model.model.dtype))
        self.prefix, self.unrun = first + n, []  # the chain, root included, is committed now
        add_children(tree, torch.zeros(1, dtype=torch.long, device=device),
                     *top_children(logits[n - 1 : n], self.shape.width, self.vocab_limit))
        tree.expanded[0] = True  # its KV sits in the prefix, not in the tree region
        return first + L

    def expand(self, region: int) -> None:
        """One expansion of the `width` best unexpanded leaves, their KV in the tree region from `region` on."""
        model, tree, width = self.model, self.tree, self.shape.width
        leaves = select_leaves(tree, width, fixed=True)
        slots = torch.arange(region + tree.num_slots, region + tree.num_slots + width, device=model.device)
        input_ids, positions, region_mask = expansion_inputs(tree, leaves, self.prefix - 1)
        mask = step_mask(self.prefix, region_mask, region, model.capacity, model.model.dtype)
        logits = model.run(input_ids, positions, slots, mask)
        add_children(tree, leaves, *top_children(logits, width, self.vocab_limit))

    def nodes(self, budget: int) -> TreeNodes:
        """The `budget` best nodes (tree.best_node_ids: a connected subtree with the root), in index order."""
        tree = self.tree
        ids, parents = best_node_ids(tree, budget)
        return TreeNodes(tree.tokens[ids], parents, tree.depths[ids], tree.ancestors[ids][:, ids],
                         torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device))

    def accept(self, subtrees, verified: list[Verified | None]) -> None:
        """The emitted tokens join the unrun ones (the next tree round's chain)."""
        self.unrun = self.unrun + verified[0].tokens

    def keep_rows(self, rows: list[int]) -> None:
        """One sequence: never called with a row to drop."""


def round_kinds(suffix: bool) -> list[str]:
    """The kinds of round possible now, in the order the chooser first tries them: a tree (the draft's
    nodes and the n-gram proposal's), the n-gram proposal alone (when there is one: no draft forward),
    the root alone."""
    return ["tree", "ngram", "plain"] if suffix else ["tree", "plain"]


@dataclass
class ShapeChooser:
    """The static round's controller, with the goodput policy's calls (start_generation, plan_round,
    observe_round): which kind of round to run (`round_kinds`): the one that has made the most tokens per second,
    judged between rounds from what the round's sync brought back (no sync of its own), kept across
    generate() calls by the model. Each kind is tried first (rounds that compiled a graph are not
    observed). Every `probe_after` rounds of the best kind another is tried once (the one tried least
    recently); a probe that loses sets the wait so that such probes cost at most PROBE_SHARE of the
    time (a tree round of a draft that never helps costs 5x a plain step of a 30-layer model on a CPU:
    ~170 rounds apart).

    Why a controller of its own, not the goodput policy: the policy sizes a round from the draft's scores,
    read on the host while the tree grows; this round reads nothing before its verification, so all it
    can choose is among kinds of round of fixed shapes, by what each has made. The engines make the same
    calls of both (start_generation per call, plan_round per round, observe_round after it); what the calls
    carry differs."""

    rates: dict = field(default_factory=dict)  # kind -> tokens per second: the mean of its first rounds, then
    counts: dict = field(default_factory=dict)  # a moving average (weight 0.3) over the rounds observed
    round_s: dict = field(default_factory=dict)  # kind -> seconds per round, averaged alike
    last_round: dict = field(default_factory=dict)  # kind -> the round it was last observed in
    rounds: int = 0
    streak: int = 0  # rounds of the best kind since the last probe
    probe_after: int = 4
    best: str | None = None  # the best kind possible in the round last chosen for (None: a kind untried)

    def start_generation(self, new_tokens: int | None = None) -> None:
        """Nothing of one call's rows is kept: what it measured per kind of round carries over."""

    def plan_round(self, kinds: list[str]) -> str:
        """The kind of round to run now, of `kinds` (round_kinds' order)."""
        untried = [k for k in kinds if k not in self.rates]
        if untried:
            self.best = None
            return untried[0]
        self.best = max(kinds, key=lambda k: self.rates[k])
        others = [k for k in kinds if k != self.best]
        if others and self.streak >= self.probe_after:
            return min(others, key=lambda k: self.last_round[k])
        return self.best

    def observe_round(self, kind: str, tokens: int, seconds: float) -> None:
        """Fold in one round of `kind` that made `tokens` in `seconds`."""
        best = self.best
        self.streak = self.streak + 1 if kind == best else 0
        self.rounds += 1
        self.last_round[kind] = self.rounds
        self.counts[kind] = n = self.counts.get(kind, 0) + 1
        weight = max(1 / n, 0.3)
        self.rates[kind] = (1 - weight) * self.rates.get(kind, 0.0) + weight * tokens / max(seconds, 1e-9)
        self.round_s[kind] = (1 - weight) * self.round_s.get(kind, 0.0) + weight * seconds
        if best is not None and kind != best:  # a probe
            lost_s = seconds - tokens / self.rates[best]  # over making its tokens at the best kind's rate
            if self.rates[kind] >= self.rates[best] or lost_s <= 0:
                self.probe_after = 4
            else:
                self.probe_after = min(max(math.ceil(lost_s / (PROBE_SHARE * self.round_s[best])), 4), 256)


@dataclass
class StaticRounds:
    """What compile=True keeps with the model between generate() calls: the shape chooser's measurements,
    and each model's StaticModel, whose slot cache the compiled graphs (CUDA graphs above all) need at
    the same addresses every call. It holds both models' slot caches while the model lives."""

    chooser: ShapeChooser = field(default_factory=ShapeChooser)
    models: dict = field(default_factory=dict)  # role -> StaticModel

    def static_model(self, role: str, model, needed: int) -> StaticModel:
        """The compiled StaticModel of `model` for `needed` slots: the one kept, unless its capacity differs."""
        kept = self.models.get(role)
        if kept is None or kept.model is not model or kept.capacity != bucket_capacity(needed):
            self.models.pop(role, None)  # free its buffers before allocating the new ones
            headless = describe(model, role).headless
            kept = self.models[role] = StaticModel.build(model, needed, compiled=True, headless=headless)
        return kept


def graphs_compiled() -> int:
    """How many graphs torch.compile has built in this process (dynamo's own counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def root_only(root: int, device) -> TreeNodes:
    """A plain round's nodes: the root alone."""
    one = torch.ones(1, 1, dtype=torch.bool, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return TreeNodes(torch.tensor([root], device=device), zero - 1, zero, one, one[0])


def with_suffix(nodes: TreeNodes, suffix: Proposal, size: int = 0) -> TreeNodes:
    """The draft's nodes (on the device) followed by the suffix proposal's, as tree.merge_suffix hung them
    under the root alone (host lists in, no sync), padded to `size` suffix nodes (padding: children of
    the root never accepted). A suffix node may repeat a draft node (same token under the same parent):
    both then carry the same context, so whichever the walk ends on, its path and KV are the same."""
    tokens, parents = suffix.subtree.tokens[1:], [p - 1 for p in suffix.subtree.parents[1:]]  # -1: the root
    S = max(len(tokens), size)
    if not S:
        return nodes
    device, D = nodes.tokens.device, nodes.tokens.shape[0]
    pad = S - len(tokens)
    parents = parents + [-1] * pad
    ancestors, depths = subtree_mask([-1] + [p + 1 for p in parents], device)  # the root, then the suffix
    full = torch.zeros(D + S, D + S, dtype=torch.bool, device=device)
    full[:D, :D] = nodes.ancestors
    full[D:, 0] = True
    full[D:, D:] = ancestors[1:, 1:]
    parents = torch.tensor([p + D if p >= 0 else 0 for p in parents], device=device)
    tokens = torch.tensor(tokens + [0] * pad, device=device)
    proposed = torch.arange(S, device=device) < S - pad
    return TreeNodes(torch.cat([nodes.tokens, tokens]), torch.cat([nodes.parents, parents]),
                     torch.cat([nodes.depths, depths[1:]]), full, torch.cat([nodes.proposed, proposed]))


def verify_nodes(target: StaticModel, nodes: TreeNodes, prefix: int) -> torch.Tensor:
    """Target logits (T, V): the nodes at positions prefix + depth, in slots [prefix, prefix + T)."""
    T = nodes.tokens.shape[0]
    slots = torch.arange(prefix, prefix + T, device=target.device)
    mask = step_mask(prefix, nodes.ancestors, prefix, target.capacity, target.model.dtype)
    return target.run(nodes.tokens[None], (prefix + nodes.depths)[None], slots, mask)


def walk(nodes: TreeNodes, choice: torch.Tensor, scores, logits, context, stops: tuple, max_tokens: int) -> Verified:
    """Phase 2's walk: the round's one host sync brings back the target's choice after every node with the
    nodes' tokens, parents and padding flags, then the walk and the stop rule every round shares
    (verify.walk_path, verify.walk_to_stop)."""
    T = choice.shape[0]
    values = torch.cat([choice, nodes.tokens, nodes.parents, nodes.proposed.long()]).tolist()  # the one sync
    chosen, tokens, parents, proposed = (values[i * T : (i + 1) * T] for i in range(4))
    out = walk_path(chosen, children_of(parents, tokens, [bool(p) for p in proposed]), max_tokens)
    return walk_to_stop(out, scores, logits, context, stops, max_tokens)


def commit_path(target: StaticModel, prefix: int, path: list[int], size: int) -> int:
    """Phase 2's commit: the path's KV moves to the slots after the `prefix` committed ones (nothing moves
    for a path already there); returns the new prefix. The move has the round's size whatever was accepted
    (one compiled graph): slots past the path copy onto themselves."""
    m = len(path)
    if path != list(range(m)):
        index = path + list(range(m, size))
        src = prefix + torch.tensor(index, device=target.device)
        dst = torch.arange(prefix, prefix + size, device=target.device)
        target.move(target.cache.buffers, src, dst)
    return prefix + m


def static_proposal(draft: TreeNodes, suffix: Proposal, nodes: TreeNodes) -> Proposal:
    """What the round's statistics record of the T `nodes`: the draft's first (D of them), then the suffix
    proposal's (their merge_suffix buckets), then padding."""
    D, T = draft.tokens.shape[0], nodes.tokens.shape[0]
    buckets = [-1] * D + suffix.suffix[1:]
    buckets += [-1] * (T - len(buckets))
    return Proposal(Subtree([-1] * T, [0] * T, [-1] * T), [0.0] * T, [None] * T, buckets)


def static_shape(config, draft) -> StaticShape:
    """The round's shape from the settings: tree_budget (default 8) nodes, draft_depth (default 4)
    forwards of draft_width leaves, up to half the nodes from the n-gram proposal (ngram_size > 0)."""
    budget, depth = config.tree_budget or STATIC_BUDGET, config.draft_depth or STATIC_DEPTH
    return StaticShape(budget, depth, config.draft_width, budget // 2 if config.ngram_size > 0 else 0)


def static_round_gaps(target, draft, request: DecodeRequest, placement, config) -> list[str]:
    """Why the static round cannot decode this request exactly (empty: it can)."""
    gaps = []
    if draft is None:
        gaps.append("it needs a draft model (draft-free mode grows no draft tree)")
    elif isinstance(draft, DraftHead):
        kind = "an EAGLE-3 head" if draft.kind == "eagle3" else "a model's own MTP layer (mtp head)"
        gaps.append(f"the draft is {kind} (it drafts in the adaptive round only)")
        draft = None
    if request.batch_size > 1:
        gaps.append(f"it decodes one sequence (got {request.batch_size} rows)")
    if request.attention_mask is not None:
        gaps.append("the prompt is left-padded")
    if placement is not None and placement.mode != "serial":
        gaps.append(f"placement {placement.mode!r} (it runs both models on one device, serially)")
    if config.attention == "kernel":
        gaps.append("attention='kernel' (its steps attend through the model's own attention with a dense mask)")
    for role, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        arch = describe(model, role)
        if arch.shape != "tree" or arch.recurrent or arch.rules != (FULL,):
            kind = "a chain-shaped" if arch.shape != "tree" else "a recurrent" if arch.recurrent else "a windowed"
            gaps.append(f"the {role} ({arch.model_type}) is {kind} model")
        for limit in arch.slot_limits:  # its slots never follow positions, so no such rule holds there
            gaps.append(f"the {role} ({arch.model_type}) {limit.reason}")
    path_bound = [type(p).__name__ for p in request.sampler.logits_processor if type(p) not in PATH_FREE_PROCESSORS]
    if path_bound:
        gaps.append(f"logits processors that read the path ({', '.join(path_bound)})")
    _, _, others = split_criteria(request.stopping_criteria)
    if others:
        gaps.append(f"stopping criteria other than EOS and max_length ({', '.join(type(c).__name__ for c in others)})")
    return gaps
