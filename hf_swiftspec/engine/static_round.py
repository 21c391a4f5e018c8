"""The static sides of the round (engine/rounds.py): fixed tree shape, capturable steps, one host sync per
round (`compile=True`).

The loop is the adaptive round's (propose, verify, accept, observe); what differs is what its phases run
on. Every round does the same work with the same shapes, so each forward can be one compiled graph
(`static.py`) and nothing waits for the device until the walk:

    1. propose: one draft chain forward over the tokens the last round emitted (padded to depth + 1; the
                last one is the new root, whose draft children seed the tree), then depth - 1 expansions
                of the `width` best unexpanded leaves, best-first by cumulative log-prob (tree.select_leaves);
    2. verify:  one target forward over the `budget` best nodes (root included) under their tree mask; the
                one read of the round brings back the target's choice after every node (and the nodes);
                the walk and the stop rule of every round (verify.walk_path, walk_to_stop) from the root,
                along the children carrying the target's choices (padding is never entered); the path's
                target KV moves behind the prefix;
    3. accept:  the emitted tokens become the draft's next chain (the draft runs them again rather than
                keeping its tree: a fixed-size chain costs the same forward whatever was accepted);
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
    Proposal, Subtree, TokenTree, add_children, best_node_ids, clear_tree, expansion_inputs, new_tree, select_leaves,
    subtree_mask,
)
from ..verify import (
    PATH_FREE_PROCESSORS, Sampler, Verified, apply_processors, children_of, split_criteria, walk_path, walk_to_stop,
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


@dataclass
class StaticSequence:
    """Host bookkeeping of one sequence: committed slots in each cache, the draft's next chain."""

    target_prefix: int
    draft_prefix: int
    chain: list[int]
    context: torch.Tensor  # (1, L) what processors see: the prompt (padding included) and every emitted token


def run_static(target: StaticModel, draft: StaticModel, request: DecodeRequest, shape: StaticShape,
               vocab_limit: int, ngram_size: int = 0, chooser: "ShapeChooser | None" = None) -> DecodeResult:
    """The round (engine/rounds.py) on the static sides (one sequence). ngram_size: longest context suffix
    matched for the n-gram proposal (shape.suffix > 0 only); chooser: tree or plain rounds (kept across
    calls by the model; default: a new one)."""
    return run_rounds(StaticSides(target, draft, shape, vocab_limit, ngram_size, chooser or ShapeChooser()), request)


@dataclass
class StaticProposed(Proposed):
    """Phase 1's hand-off on the static sides: the nodes to verify (on the device), the kind of round, and
    how many graphs torch.compile had built when the round began (a round that built one is not observed)."""

    nodes: TreeNodes | None = None
    kind: str = "plain"
    graphs_before: int = 0


class StaticSides:
    """The round's phases over two StaticModels and the shape chooser (see the module docstring)."""

    def __init__(self, target: StaticModel, draft: StaticModel, shape: StaticShape, vocab_limit: int, ngram_size: int,
                 chooser: "ShapeChooser"):
        self.target, self.draft, self.shape, self.vocab_limit, self.chooser = target, draft, shape, vocab_limit, chooser
        self.ngram_size = ngram_size
        self.name = "static (compiled)" if target.compiled else "static"
        self.target_counters, self.draft_counters = TargetCounters(), DraftCounters()

    def start(self, request: DecodeRequest) -> None:
        target, draft, shape = self.target, self.draft, self.shape
        self.sampler = request.samplers[0]
        prompt = request.prompt_ids()[0]
        self.ngrams = SuffixDrafter(max(self.ngram_size, 1), corpus=request.corpus, history=request.history)
        self.ngrams.start([prompt])
        target.prefill(prompt[:-1])
        self.target_counters.forwards += bool(prompt[:-1])
        warm_steps(target, {shape.budget, 1 + shape.suffix, 1}, len(prompt) - 1, moves=True)
        warm_steps(draft, {shape.chain, shape.width} if shape.depth > 1 else {shape.chain}, 0)
        context = request.contexts[0] if request.contexts is not None else request.prompt
        # the draft runs the prompt when a tree round first needs it
        self.seq = StaticSequence(len(prompt) - 1, 0, list(prompt), context.to(target.device))
        self.tree = new_tree(prompt[-1], shape.nodes, draft.device)

    def propose(self, rows: BatchRows) -> StaticProposed:
        """1. a tree round: the draft's chain (caught up first if other rounds left it behind) and tree, its best
        nodes and the n-gram proposal's; an n-gram round: the root and the n-gram proposal; a plain round: the root."""
        proposed = StaticProposed([], rows=list(rows.live), graphs_before=graphs_compiled())
        shape, seq = self.shape, self.seq
        suffix = self.ngrams.candidates(0, shape.suffix, shape.depth) if shape.suffix else SuffixTree()
        proposed.kind = self.chooser.plan_round(round_kinds(bool(len(suffix))))
        if proposed.kind == "tree":
            self.draft_counters.forwards += catch_up(self.draft, seq, shape.chain) + shape.depth
            grow_tree(self.draft, self.tree, seq, shape, self.vocab_limit)
            self.draft_counters.expansions += shape.depth
            self.draft_counters.rounds += 1
            self.draft_counters.busy_s += time.perf_counter() - proposed.started
            proposed.nodes = with_suffix(best_nodes(self.tree, shape.budget - len(suffix)), suffix)
            proposed.expansions = shape.depth
            first_suffix = shape.budget - len(suffix)
        else:  # no draft: the root and the n-gram proposal, or the root alone
            suffix = suffix if proposed.kind == "ngram" else SuffixTree()
            proposed.nodes = with_suffix(root_only(seq.chain[-1], self.target.device), suffix,
                                         shape.suffix if suffix else 0)
            first_suffix = 1
        proposed.proposals = [static_proposal(proposed.nodes, first_suffix, len(suffix))]
        return proposed

    def verify(self, proposed: StaticProposed, rows: BatchRows) -> list[Verified]:
        """2-5. the target's forward over the nodes, the round's one sync, the walk, the commit."""
        verify_start, seq, nodes = time.perf_counter(), self.seq, proposed.nodes
        logits = verify_nodes(self.target, nodes, seq.target_prefix)
        scores, choice = target_choice(logits, nodes, seq.context, self.sampler)
        verified = walk(nodes, choice, scores, logits, seq.context, rows.stops, rows.budgets()[0])
        commit_path(self.target, seq, verified.path, nodes.tokens.shape[0])
        seq.context = torch.cat([seq.context, torch.tensor([verified.tokens], device=seq.context.device)], dim=1)
        self.target_counters.forwards += 1
        self.target_counters.verify_steps += 1
        self.target_counters.busy_s += time.perf_counter() - verify_start
        return [verified]

    def accept(self, proposed: StaticProposed, verified: list[Verified], keep: list[int]) -> None:
        """The emitted tokens become the draft's next chain (after a tree round, which ran the last one's), and
        the n-gram index's."""
        self.seq.chain = verified[0].tokens if proposed.kind == "tree" else self.seq.chain + verified[0].tokens
        self.ngrams.accept([None], verified)

    def observe(self, proposed: StaticProposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """4. the chooser's rate of this kind of round (a round that compiled a graph says nothing of its speed)."""
        if graphs_compiled() == proposed.graphs_before:
            self.chooser.observe_round(proposed.kind, len(verified[0].tokens), round_s)

    def keep_rows(self, order: list[int]) -> None:
        """One sequence: once it is done the call ends (never called with a row to keep)."""

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats:
        return SwiftSpecStats.collect(self.name, new_tokens, wall_s, self.target_counters, self.draft_counters)


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
    ~170 rounds apart)."""

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
            kept = self.models[role] = StaticModel.build(model, needed, compiled=True)
        return kept


def graphs_compiled() -> int:
    """How many graphs torch.compile has built in this process (dynamo's own counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def catch_up(draft: StaticModel, seq: StaticSequence, chain: int) -> int:
    """Run all but the last `chain` tokens the draft has not seen (the prompt, plain rounds' tokens) as one
    eager forward into its prefix, so that the round's chain fits its fixed size. Returns forwards run."""
    behind = seq.chain[:-chain]
    if not behind:
        return 0
    draft.extend(behind, seq.draft_prefix)
    seq.draft_prefix += len(behind)
    seq.chain = seq.chain[len(behind) :]
    return 1


def root_only(root: int, device) -> TreeNodes:
    """A plain round's nodes: the root alone."""
    one = torch.ones(1, 1, dtype=torch.bool, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return TreeNodes(torch.tensor([root], device=device), zero - 1, zero, one, one[0])


def grow_tree(draft: StaticModel, tree: TokenTree, seq: StaticSequence, shape: StaticShape, vocab_limit: int) -> None:
    """Phase 1: the chain forward (the new root's children), then depth - 1 expansions; no host sync."""
    device, C = draft.device, draft.capacity
    clear_tree(tree, seq.chain[-1])
    n, L, first = len(seq.chain), shape.chain, seq.draft_prefix
    tokens = torch.tensor([seq.chain + [0] * (L - n)], device=device)
    slots = torch.arange(first, first + L, device=device)
    logits = draft.run(tokens, slots[None], slots, chain_mask(slots, C, draft.model.dtype))
    seq.draft_prefix += n  # the chain, root included, is committed now
    region = first + L  # the tree's KV slots start after the chain's
    add_children(tree, torch.zeros(1, dtype=torch.long, device=device), *top_children(logits[n - 1 : n], shape.width, vocab_limit))
    tree.expanded[0] = True  # its KV sits in the prefix, not in the tree region
    for _ in range(shape.depth - 1):
        leaves = select_leaves(tree, shape.width, fixed=True)
        slots = torch.arange(region + tree.num_slots, region + tree.num_slots + shape.width, device=device)
        input_ids, positions, region_mask = expansion_inputs(tree, leaves, seq.draft_prefix - 1)
        mask = step_mask(seq.draft_prefix, region_mask, region, C, draft.model.dtype)
        logits = draft.run(input_ids, positions, slots, mask)
        add_children(tree, leaves, *top_children(logits, shape.width, vocab_limit))


def top_children(logits: torch.Tensor, width: int, vocab_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, tokens) (w, k) of the k = width likeliest draft tokens after each of w leaves."""
    return torch.log_softmax(logits[:, :vocab_limit], dim=-1).topk(width, dim=-1)


def best_nodes(tree: TokenTree, budget: int) -> TreeNodes:
    """Phase 1's nodes: the `budget` best by score (a connected subtree with the root: scores never rise
    along a path and ties go to the lower index, which a parent has), in index order."""
    ids, parents = best_node_ids(tree, budget)
    return TreeNodes(tree.tokens[ids], parents, tree.depths[ids], tree.ancestors[ids][:, ids],
                     torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device))


def with_suffix(nodes: TreeNodes, suffix: SuffixTree, size: int = 0) -> TreeNodes:
    """The draft's nodes followed by the n-gram proposal's, hanging from the root (host lists in, no sync),
    padded to `size` suffix nodes (padding: children of the root never accepted). A suffix node may
    repeat a draft node (same token under the same parent): both then carry the same context, so
    whichever the walk ends on, its path and KV are the same."""
    S = max(len(suffix), size)
    if not S:
        return nodes
    device, D = nodes.tokens.device, nodes.tokens.shape[0]
    pad = S - len(suffix)
    parents = suffix.parents + [-1] * pad
    ancestors, depths = subtree_mask([-1] + [p + 1 for p in parents], device)  # the root, then the suffix
    full = torch.zeros(D + S, D + S, dtype=torch.bool, device=device)
    full[:D, :D] = nodes.ancestors
    full[D:, 0] = True
    full[D:, D:] = ancestors[1:, 1:]
    parents = torch.tensor([p + D if p >= 0 else 0 for p in parents], device=device)
    tokens = torch.tensor(suffix.tokens + [0] * pad, device=device)
    proposed = torch.arange(S, device=device) < len(suffix)
    return TreeNodes(torch.cat([nodes.tokens, tokens]), torch.cat([nodes.parents, parents]),
                     torch.cat([nodes.depths, depths[1:]]), full, torch.cat([nodes.proposed, proposed]))


def verify_nodes(target: StaticModel, nodes: TreeNodes, prefix: int) -> torch.Tensor:
    """Target logits (T, V): the nodes at positions prefix + depth, in slots [prefix, prefix + T)."""
    T = nodes.tokens.shape[0]
    slots = torch.arange(prefix, prefix + T, device=target.device)
    mask = step_mask(prefix, nodes.ancestors, prefix, target.capacity, target.model.dtype)
    return target.run(nodes.tokens[None], (prefix + nodes.depths)[None], slots, mask)


def target_choice(logits: torch.Tensor, nodes: TreeNodes, context: torch.Tensor, sampler: Sampler):
    """Processed scores (T, V) and the target's token after each node (T,): its argmax, or its draw
    with the noise of the position after the node (the processors ignore the path: checked up front)."""
    scores = apply_processors(sampler.logits_processor, context, logits.clone())
    if not sampler.do_sample:
        return scores, scores.argmax(dim=-1)
    depth_room = nodes.tokens.shape[0]  # depths < T
    noise = sampler.gumbel([context.shape[1] + d for d in range(depth_room)], scores.shape[-1], scores.device)
    return scores, (scores.double() + noise[nodes.depths]).argmax(dim=-1)


def walk(nodes: TreeNodes, choice: torch.Tensor, scores, logits, context, stops: tuple, max_tokens: int) -> Verified:
    """Phase 2's walk: the round's one host sync brings back the target's choice after every node with the
    nodes' tokens, parents and padding flags, then the walk and the stop rule every round shares
    (verify.walk_path, verify.walk_to_stop)."""
    T = choice.shape[0]
    values = torch.cat([choice, nodes.tokens, nodes.parents, nodes.proposed.long()]).tolist()  # the one sync
    chosen, tokens, parents, proposed = (values[i * T : (i + 1) * T] for i in range(4))
    out = walk_path(chosen, children_of(parents, tokens, [bool(p) for p in proposed]), max_tokens)
    return walk_to_stop(out, scores, logits, context, stops, max_tokens)


def commit_path(target: StaticModel, seq: StaticSequence, path: list[int], size: int) -> None:
    """Phase 2's commit: the path's KV moves to the slots after the prefix (nothing moves for a path already
    there). The move has the round's size whatever was accepted (one compiled graph): slots past the path
    copy onto themselves."""
    m = len(path)
    if path != list(range(m)):
        index = path + list(range(m, size))
        src = seq.target_prefix + torch.tensor(index, device=target.device)
        dst = torch.arange(seq.target_prefix, seq.target_prefix + size, device=target.device)
        target.move(target.cache.buffers, src, dst)
    seq.target_prefix += m


def static_proposal(nodes: TreeNodes, first_suffix: int, suffix: int) -> Proposal:
    """What the round's statistics record: T nodes, `suffix` of them from the n-gram proposal, from
    index `first_suffix` on."""
    T = nodes.tokens.shape[0]
    buckets = [0 if first_suffix <= i < first_suffix + suffix else -1 for i in range(T)]
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
