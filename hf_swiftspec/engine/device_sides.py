"""The device round's sides (engine/rounds.py's RoundSides): a draft (a draft model, or a draft head: an
EAGLE-3 head or an MTP layer, drafters/device_heads.py) and the target over fixed-shape slot caches
(steps/slot_cache.py), every phase a device op, one host read a round (SwiftSpecConfig round="device").

Per round, for all B rows at once:
  1. propose: the draft grows depth x width nodes below each root (drafters/device_growth.grow, d forwards), the
     host's suffix proposals join them (drafters/device_suffix.py: one host-to-device copy; draft-free mode: the
     root and the suffix nodes alone) and the best T by path score are selected with their mask
     (device_round.select_device);
  2. verify: one target forward over them (slot_cache.verify_forward), the target's choices (argmax, or the
     sampler's Gumbel-max with noise the host draws from known positions), the walk with the EOS and length
     rules (device_round.walk_device), the target cache's commit, then the round's ONE read: counts, flags,
     paths, tokens and the verified subtrees, for streaming, stop strings, the record and the stats;
  3. accept: the draft cache's commit and its catch-up on the accepted nodes it did not run (the last depth's, the
     suffix's; device_suffix.follow_walk), the suffix index's new tokens (on the host), new prefix
     lengths and roots (device tensors: computed on the device, corrected from the host only where a host-side
     criterion, a stop string, cut a row's walk short); a head instead re-runs the whole verified chain with the
     target's states (DeviceHead.after_verify, inside the verification's graph) and keeps the next root's input;
  4. observe: the shape menu (policy/shapes.py) prices the round's shape from the tokens and the time between reads.

Exact where the caches are: full attention only, processors that ignore the path, a draft (a draft model or a
draft head) or suffix proposals (check_device_round says why a call is refused). With SwiftSpecConfig.capture, the two phases (1; 2-3 up to the
read) are each replayed as one graph per shape (steps/phase_graphs.py).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field, fields

import torch

from ..drafters.device_growth import grow
from ..drafters.device_heads import DeviceHead, head_gaps
from ..drafters.device_suffix import (DeviceSuffix, SuffixNodes, catch_up_width, draft_free_menu, follow_walk,
                                      merge_suffix, root_tree)
from ..drafters.eagle3 import DraftHead
from ..models.architectures import context_limit
from ..policy.shapes import Shape, ShapeMenu
from ..stats import DraftCounters, PhaseClock, SwiftSpecStats, TargetCounters
from ..steps.device_round import DeviceSubtree, greedy_choices, round_result, sampled_choices, select_device, walk_device
from ..steps.capture import capture_backend
from ..steps.phase_graphs import PhaseRunner
from .device_pool import DevicePool, capacity_bucket
from ..steps.slot_cache import SlotCache, catch_up, commit_cache, verify_forward
from ..steps.tree import Proposal, Subtree
from ..steps.verify import PATH_FREE_PROCESSORS, StopRule, Verified, apply_processors
from .request import BatchRows, DecodeRequest, DecodeResult, RowResult
from .rounds import Proposed, run_rounds

MASKS_4D = ("sdpa", "eager")  # attention implementations that take the slot caches' additive 4D mask as given


def run_device(target, draft, request: DecodeRequest, config, captures=None) -> DecodeResult:
    """The round (engine/rounds.py) on the device sides, its phases replayed where SwiftSpecConfig.capture says
    (CUDA graphs on CUDA, the emulating stand-in on a CPU with capture=True); check_device_round cleared the call.
    captures: the pair's Captures (steps/capture.py), whose device pool keeps the graphs and their caches for the
    next call (engine/device_pool.py); None: this call's own."""
    if not request.max_new_tokens:
        return DecodeResult(rows=[RowResult() for _ in range(request.batch_size)])
    backend = capture_backend(config.capture, target.device)
    pool = device_pool(captures, backend) if not isinstance(draft, DraftHead) else None
    runner = pool.runner if pool is not None else PhaseRunner(backend) if backend is not None else None
    captured_before, setup_before = (runner.captured, runner.setup_s) if runner is not None else (0, 0.0)
    sides = DeviceSides(target, draft, config, request, runner, pool)
    result = run_rounds(sides, request)
    if pool is not None:
        pool.drop_unkept_graphs()
    how = "eager phases" if runner is None else (
        f"replayed phases, {backend}: {len(runner.graphs)} graphs, {runner.captured - captured_before} "
        f"captured by this call")
    if runner is not None and runner.fallbacks:
        how += f"; eager: {', '.join(sorted(runner.fallbacks))}"
    drafted = ("no draft model" if draft is None else
               f"draft={'sdpa (a draft head)' if sides.head else draft.config._attn_implementation}")
    result.stats.attention = (f"device round (slot caches, 4D masks: target={target.config._attn_implementation}, "
                              f"{drafted}; {how})")
    result.stats.capture_s = runner.setup_s - setup_before if runner is not None else 0.0
    return result


def device_pool(captures, backend: str | None) -> DevicePool | None:
    """The pair's device pool (Captures.device), made for `backend` on first use; None where nothing replays."""
    if captures is None or backend is None:
        return None
    if captures.device is None or captures.device.backend != backend:
        captures.device = DevicePool(backend)
    return captures.device


def device_round_gaps(config, target, draft, architectures, logits_processor, placement, groups,
                      joins_running_batch: bool, reasons: list[str]) -> list[str]:
    """Why round="device" cannot decode this call exactly (empty: it can). reasons: the call's batch and slot-limit
    reasons (generation.py's), which the device round would otherwise have to escape by the target's own loop."""
    gaps = list(reasons)
    if draft is None and not config.ngram_size:
        gaps.append("draft-free mode (no draft model) proposes suffix nodes alone, and ngram_size=0 turns them off; "
                    "set ngram_size > 0 or give a draft model")
    if isinstance(draft, DraftHead):
        gaps += head_gaps(draft, MASKS_4D)
    elif draft is not None and context_limit(draft, target) != context_limit(target):
        gaps.append(f"the draft's context ({context_limit(draft)} positions) is shorter than the target's "
                    f"({context_limit(target)}): the host round has it read the text in windows of its own; use "
                    "round='host'")
    for role, model, architecture in (("target", target, architectures[0]), ("draft", draft, architectures[1])):
        if model is None or architecture is None or isinstance(model, DraftHead):
            continue
        if architecture.windowed or architecture.slot_limits:
            gaps.append(f"the {role} ({architecture.model_type}) has sliding-window or slot-limited layers; its slot cache "
                        "attends every committed position")
        if architecture.recurrent or architecture.shape == "chain":
            gaps.append(f"the {role} ({architecture.model_type}) needs chains or recurrent rollback "
                        f"({architecture.chain_reason})")
        if model.config._attn_implementation not in MASKS_4D:
            gaps.append(f"the {role} attends with {model.config._attn_implementation!r}, which does not take an additive "
                        f"4D mask; load it with attn_implementation='sdpa'")
    path_bound = sorted({type(p).__name__ for p in logits_processor or () if type(p) not in PATH_FREE_PROCESSORS})
    if path_bound:
        gaps.append(f"the logits processors {', '.join(path_bound)} read the path before each node (the host's "
                    "node-by-node walk)")
    if config.compile or config.attention == "kernel":
        gaps.append("its forwards run the models' own attention over 4D masks, uncompiled: compile=True and "
                    "attention='kernel' are not honoured; leave them at their defaults")
    if (placement is not None and placement.mode != "serial") or groups is not None or (
        draft is not None and draft.device != target.device
    ):
        gaps.append("it runs both models on one device, serially; load the pair with placement='serial'")
    if joins_running_batch:
        gaps.append("this running batch runs the host round; a pair with round='device' makes a device one "
                    "(continuous_engine(): engine/continuous_device.py)")
    return gaps


def check_device_round(*args, **kwargs) -> None:
    """round="device" where it cannot be exact: ValueError naming why and the fix (never a silent fallback)."""
    gaps = device_round_gaps(*args, **kwargs)
    if gaps:
        raise ValueError(f"SwiftSpecConfig.round='device' cannot decode this call exactly: {'; '.join(gaps)}. "
                         "Fix that, or use round='host' (the default), which decodes it exactly.")


@dataclass
class RowsOnDevice:
    """Every live row's state between rounds, on the device (B rows in cache order).

    prefix_lens: (B,) long slots committed in both caches (every token but the root)
    roots:       (B,) long each row's last verified token, whose KV neither model holds yet
    """

    prefix_lens: torch.Tensor
    roots: torch.Tensor

    def keep(self, index: torch.Tensor) -> None:
        self.prefix_lens, self.roots = self.prefix_lens[index], self.roots[index]


@dataclass(frozen=True)
class RoundModels:
    """What a round's phases run on, fixed for a call: the two models and their caches, each row's processors (the
    path-free ones) and whether the round samples, keeps each token's scores / logits."""

    target: object
    draft: object
    caches: tuple[SlotCache, SlotCache]
    processors: tuple
    sample: bool
    keeps: tuple[bool, bool]
    vocab_limit: int
    head: DeviceHead | None = None  # a draft head's growth and catch-up (drafters/device_heads.py); None: a draft model

    def key(self) -> tuple:
        """What a replayed phase bakes in besides its inputs' shapes: the caches' buffers and the rows' processors."""
        buffers = tuple(t.data_ptr() for c in self.caches for layer in c.layers for t in (layer.keys, layer.values))
        return buffers, tuple(processors_signature(p) for p in self.processors), self.sample, self.keeps


def processors_signature(processors) -> tuple:
    """What a replayed verification bakes in of a row's processors: each one's type and settings where they are
    plain values (two requests with top_k=20 share graphs), else the object itself (captured for it alone)."""
    out = []
    for p in processors or ():
        state = vars(p)
        plain = all(isinstance(v, (int, float, str, bool, type(None))) for v in state.values())
        out.append((type(p).__name__, tuple(sorted(state.items()))) if plain else ("object", id(p)))
    return tuple(out)


def copy_kept_rows(source: SlotCache, into: SlotCache, index: torch.Tensor) -> None:
    """`source`'s rows `index` (B',) long into `into`, a cache of B' rows and the same capacity, in place where its
    buffers exist (their addresses are what its graphs replay over)."""
    for mine, theirs in zip(into.layers, source.layers):
        if not theirs.is_initialized:
            continue
        if mine.is_initialized:
            mine.keys.copy_(theirs.keys[index])
            mine.values.copy_(theirs.values[index])
        else:
            mine.keys, mine.values, mine.is_initialized = theirs.keys[index], theirs.values[index], True


def kept_rows(cache: SlotCache, index: torch.Tensor) -> SlotCache:
    """A new SlotCache of `cache`'s rows `index` (B',) long (the pool's caches are never narrowed in place)."""
    kept = SlotCache(len(cache.layers), cache.capacity)
    for mine, theirs in zip(kept.layers, cache.layers):
        if theirs.is_initialized:
            mine.keys, mine.values, mine.is_initialized = theirs.keys[index], theirs.values[index], True
    return kept


def subtree_tensors(sub: DeviceSubtree) -> dict[str, torch.Tensor]:
    return {f.name: getattr(sub, f.name) for f in fields(sub)}


def grow_phase(prefix_lens: torch.Tensor, roots: torch.Tensor, suffix: torch.Tensor | None = None,
               root_inputs: torch.Tensor | None = None, *, models: RoundModels, shape: Shape) -> dict:
    """1. the draft's growth of `shape` below every root (draft-free: the root alone), the suffix nodes merged in
    (suffix: (B, 4, S) the host's proposals, drafters/device_suffix.py) and the best T nodes with their mask
    (DeviceSubtree's fields): d draft forwards and the selection, no host read. root_inputs (B, H): a draft head's
    (device_heads.py)."""
    if shape.depth == 0:  # the plain shape (or draft-free): no growth
        tree = root_tree(roots)
    elif models.head is not None:
        tree = models.head.grow(models.caches[1], prefix_lens, roots, root_inputs, shape.depth, shape.width,
                                models.vocab_limit).tree
    elif models.draft is not None:
        tree = grow(models.draft, models.caches[1], prefix_lens, roots, shape.depth, shape.width, models.vocab_limit).tree
    else:
        raise ValueError(f"a shape of depth {shape.depth} needs a draft to grow it")
    if suffix is not None:
        tree = merge_suffix(tree, SuffixNodes.unpack(suffix), shape.depth)
    return subtree_tensors(select_device(tree, shape.budget))


def verify_phase(prefix_lens: torch.Tensor, roots: torch.Tensor, max_tokens: torch.Tensor, eos: torch.Tensor,
                 noise: torch.Tensor | None = None, root_inputs: torch.Tensor | None = None, *, models: RoundModels,
                 depth: int, nodes: int, lag: int, deepest: int, **subtree) -> dict:
    """2-3. the target's verification of the subtree, its choices, the walk, both caches' commits (the draft's
    catch-up on the walked nodes it did not run: at the last depth, the suffix's) and the rows' next prefixes and
    roots, no host read. max_tokens (B,) long, eos (B, E) long, noise (B, D, V) float64 when sampling
    (device_round.sampled_choices); nodes: the draft tree's N (node ids from N on are the suffix's own nodes), lag:
    the draft's catch-up width (device_suffix.catch_up_width).
    Returns: result (B, 2 + 4T) long, the round's one read (counts, finished flags, tokens, then the walked path and
    the subtree's node ids, tokens and parents), prefix_lens and roots (B,) the next round's, and the walked nodes'
    scores / logits (B, T, V) where the call keeps them; with a draft head, root_inputs (B, H) in and out, and
    path_inputs (DeviceHead.after_verify's)."""
    sub = DeviceSubtree(**subtree)
    target_cache = models.caches[0]
    logits = verify_forward(models.target, target_cache, prefix_lens, sub)  # (B, T, V)
    scores = processed(logits, models.processors)
    choices = sampled_choices(scores, noise, sub.depths) if models.sample else greedy_choices(scores)
    walk = walk_device(choices, sub, max_tokens, eos)
    commit_cache(target_cache, prefix_lens, walk.path.clamp(min=0), walk.count)  # verified node j sat at slot j
    head_out = {}
    if models.head is not None:  # a head: the tree's KV dropped, the walked chain re-run with the target's states
        head_out = models.head.after_verify(models.caches[1], prefix_lens, sub, walk, root_inputs, deepest)
    elif models.draft is not None:  # its commit of the nodes it ran, its catch-up on the last depth's and the suffix's
        follow_walk(models.draft, models.caches[1], walk, sub, prefix_lens, depth, nodes, lag)
    emitted = walk.tokens.gather(1, (walk.count - 1).clamp(min=0)[:, None]).squeeze(1)
    out = dict(
        **head_out,
        result=torch.cat([round_result(walk), walk.path, sub.node_ids, sub.tokens, sub.parents], dim=1),
        prefix_lens=prefix_lens + walk.count,
        roots=torch.where(walk.count > 0, emitted, roots),
    )
    for name, rows, keep in (("scores", scores, models.keeps[0]), ("logits", logits, models.keeps[1])):
        if keep:
            out[name] = along_path(rows, walk.path)
    return out


def processed(logits: torch.Tensor, processors: tuple) -> torch.Tensor:
    """Each row's processed scores (B, T, V): its path-free processors over its T nodes at once."""
    if not any(processors):
        return logits
    return torch.stack([apply_processors(p, None, logits[b].clone()) for b, p in enumerate(processors)])


def along_path(rows: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """(B, T, V) the rows of `rows` (B, T, V) at each walked node, in walk order (past the count: node 0's)."""
    B, T, V = rows.shape
    return rows.gather(1, path.clamp(min=0)[:, :, None].expand(B, T, V))


@dataclass
class DeviceProposed(Proposed):
    """A device round's hand-off: the shape it ran, the verified subtree (device tensors), the verification phase's
    outputs, and what the round's one read told the host (the cut the host's stop criteria made)."""

    shape: Shape | None = None
    subtree: DeviceSubtree | None = None
    after: dict = field(default_factory=dict)  # verify_phase's outputs
    cut: list[int] = field(default_factory=list)  # per row: tokens the device walked past a host-side stop
    read_s: float | None = None  # seconds since the previous round's read (None: the first round)


class DeviceSides:
    """The round's phases over a draft model and the target, each with a SlotCache (see the module docstring).
    runner: the phases' replayed graphs (steps/phase_graphs.py), or None to run them eagerly."""

    name = "device"
    roots_known = False  # the prefill leaves each prompt's last token as the root: round 1 verifies it

    def __init__(self, target, draft, config, request: DecodeRequest, runner: PhaseRunner | None = None,
                 pool: DevicePool | None = None):
        self.target, self.draft, self.runner, self.pool = target, draft, runner, pool
        self.head = DeviceHead.of(draft, target) if isinstance(draft, DraftHead) else None
        self.root_inputs: torch.Tensor | None = None  # a head's (B, H): the fused target state before each root
        self.samplers = list(request.samplers)
        self.keeps = request.keeps_scores, request.keeps_logits
        longest = request.prompt.shape[1] + request.max_new_tokens
        # a head's rope places any position: the target's limit alone
        limit = context_limit(*((target,) if self.head else (m for m in (target, draft) if m is not None)))
        self.menu = ShapeMenu.of(config.draft_depth, config.draft_width, config.tree_budget,
                                 (limit - longest) if limit else longest) if draft is not None else draft_free_menu(config)
        # the suffix proposals (none with ngram_size 0): S nodes a round, enough to fill the largest tree
        S = max(s.budget for s in self.menu.shapes) - 1 if config.ngram_size else 0
        self.suffix = DeviceSuffix(config, request, S, limit, request.prompt.device) if S else None
        self.capacity = longest + max(s.nodes for s in self.menu.shapes) + S + 2  # the tree region, then scratch
        if pool is not None:  # a capacity calls of nearby lengths share, with their caches and graphs
            self.capacity = capacity_bucket(self.capacity)
        self.counters = TargetCounters(), DraftCounters()
        self.sequences: list[list[int]] = []  # each live row's sequence (generate's, left padding included)
        self.last_read: float | None = None
        # the round's phases: growth with selection timed as "expand", the verification phase (the target's
        # forward, the walk and both commits, one graph) as "verify", the read and the host's part as "walk"
        self.clock = PhaseClock.on(request.prompt.device)

    def start(self, request: DecodeRequest) -> None:
        """Prefill both caches with every prompt but its last token (each row's root); a prompt of one token
        prefills nothing, but the caches' buffers are made here all the same (before any phase bakes them in)."""
        start = time.perf_counter()
        self.sequences = [c[0].tolist() for c in request.contexts] if request.contexts else request.prompt.tolist()
        prompts = request.prompt_ids()
        width = max(max(len(p) for p in prompts) - 1, 1)
        device = request.prompt.device
        models = (self.target,) if self.draft is None else (self.target, self.draft)
        layers = tuple(1 if m is self.draft and self.head else m.config.get_text_config().num_hidden_layers
                       for m in models)
        caches = (self.pool.slot_caches(len(prompts), self.capacity, layers) if self.pool is not None
                  else tuple(SlotCache(n, self.capacity) for n in layers))
        committed = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts], device=device)
        counts = torch.tensor([len(p) - 1 for p in prompts], device=device)
        with self.tapped():
            for model, cache, counter in zip(models, caches, self.counters):
                if model is self.draft and self.head is not None:  # from the tap's states of the target's prefill
                    self.root_inputs = self.head.prefill(cache, committed, counts)
                else:
                    catch_up(model, cache, committed, counts)
                counter.forwards += 1
        self.rows = RowsOnDevice(counts, torch.tensor([p[-1] for p in prompts], device=device))
        self.models = self.round_models(caches)
        self.counters[0].busy_s += time.perf_counter() - start

    def tapped(self):
        """The draft head's tap on the target (hooks on for the target's forwards of this phase alone: the user's
        model keeps none between them), or nothing for a draft model."""
        return self.head.tap if self.head is not None else contextlib.nullcontext()

    def round_models(self, caches: tuple[SlotCache, SlotCache]) -> RoundModels:
        return RoundModels(self.target, self.draft, caches, tuple(s.logits_processor for s in self.samplers),
                           self.samplers[0].do_sample, self.keeps, self.target.config.get_text_config().vocab_size,
                           self.head)

    def run(self, phase, key: tuple, inputs: dict, **static) -> dict:
        """A phase over live `inputs`, replayed where the sides have a runner (its outputs are then static tensors)."""
        bound = functools.partial(phase, models=self.models, **static)
        if self.runner is None:
            return bound(**inputs)
        return self.runner.run((phase.__name__, *key, self.models.key()), bound, inputs)

    def propose(self, rows: BatchRows) -> DeviceProposed:
        """1. the draft grows the menu's shape below every root, the suffix proposals join it; the best T nodes are
        selected, on the device."""
        proposed = DeviceProposed([], rows=list(rows.live), shape=self.menu.pick())
        shape, draft_counters = proposed.shape, self.counters[1]
        inputs = dict(prefix_lens=self.rows.prefix_lens, roots=self.rows.roots)
        if self.suffix is not None:
            inputs["suffix"] = self.suffix.propose()  # the round's one host-to-device copy
        if self.head is not None:
            inputs["root_inputs"] = self.root_inputs
        with self.clock.phase("expand"):
            proposed.subtree = DeviceSubtree(**self.run(grow_phase, (shape, self.suffix_nodes), inputs, shape=shape))
        proposed.expansions = shape.depth
        draft_counters.forwards += shape.depth
        draft_counters.expansions += shape.depth
        draft_counters.rounds += 1
        draft_counters.busy_s += time.perf_counter() - proposed.started
        return proposed

    def verify(self, proposed: DeviceProposed, rows: BatchRows) -> list[Verified]:
        """2. the target verifies every row's subtree, walks it and commits the path in both caches, then the round's
        one read."""
        start = time.perf_counter()
        sub, depth, S = proposed.subtree, proposed.shape.depth, self.suffix_nodes
        lag = catch_up_width(sub.tokens.shape[1], depth, S) if self.draft is not None and self.head is None else 0
        criteria, budgets = rows.criteria(), rows.budgets()
        inputs = dict(prefix_lens=self.rows.prefix_lens, roots=self.rows.roots, max_tokens=self.tensor(budgets),
                      eos=self.eos(criteria), **subtree_tensors(sub))
        if self.models.sample:
            inputs["noise"] = self.noise(sub.tokens.shape[1], max(depth, S))
        if self.head is not None:
            inputs["root_inputs"] = self.root_inputs
        with self.clock.phase("verify"), self.tapped():
            proposed.after = after = self.run(verify_phase, (proposed.shape, S), inputs, depth=depth,
                                              nodes=proposed.shape.nodes, lag=lag, deepest=max(depth, S))
        with self.clock.phase("walk"):
            read = after["result"].tolist()
            now = time.perf_counter()
            proposed.read_s, self.last_read = (None if self.last_read is None else now - self.last_read), now
            T = sub.tokens.shape[1]
            kept = [after[name].clone() if name in after else None for name in ("scores", "logits")]  # replays overwrite
            verified = []
            for b, (count, finished, *rest) in enumerate(read):
                count = min(count, budgets[b])  # the walk's own cut: the host holds it to it, so a row always ends
                finished = finished or count == budgets[b]
                tokens, path = rest[:count], rest[T : T + count]
                subtree = Subtree(rest[2 * T : 3 * T], rest[3 * T : 4 * T], rest[4 * T :])
                suffix = [0 if i >= proposed.shape.nodes else -1 for i in subtree.node_ids]  # the suffix's own nodes
                proposed.proposals.append(Proposal(subtree, probs=[], scores=[], suffix=suffix))
                outcome = Verified(tokens, path, finished=bool(finished))
                outcome.scores = [kept[0][b, j : j + 1] for j in range(count)] if kept[0] is not None else []
                outcome.logits = [kept[1][b, j : j + 1] for j in range(count)] if kept[1] is not None else []
                proposed.cut.append(self.stop_on_host(outcome, b, criteria[b]))
                self.sequences[b] += outcome.tokens
                verified.append(outcome)
        self.counters[0].forwards += 1
        self.counters[0].verify_steps += len(verified)
        self.counters[1].forwards += int(lag > 0 or self.head is not None)  # the catch-up
        self.counters[0].busy_s += time.perf_counter() - start
        return verified

    def accept(self, proposed: DeviceProposed, verified: list[Verified], keep: list[int]) -> None:
        """3. every row's prefix and root move on (the verification phase computed them on the device; a row whose
        walk a host-side stop cut takes the host's instead)."""
        prefix, roots = proposed.after["prefix_lens"].clone(), proposed.after["roots"].clone()
        cut = self.tensor(proposed.cut) if any(proposed.cut) else None
        if cut is not None:
            host_roots = self.tensor([v.tokens[-1] if v.tokens else 0 for v in verified])
            roots, prefix = torch.where(cut > 0, host_roots, roots), prefix - cut
        if self.head is not None:
            self.root_inputs = self.head.next_root_inputs(proposed.after, cut)
        self.rows.prefix_lens, self.rows.roots = prefix, roots
        if self.suffix is not None:
            self.suffix.accept([v.tokens for v in verified])

    def observe(self, proposed: DeviceProposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """4. the shape menu prices the round's shape (tokens over the time between two reads)."""
        self.menu.observe(proposed.shape, sum(len(v.tokens) for v in verified), proposed.read_s)

    def keep_rows(self, order: list[int]) -> None:
        index = self.tensor(order)
        if self.pool is not None:  # the rows that stay move into the pool's caches of their count (graphs kept)
            layers = tuple(len(cache.layers) for cache in self.models.caches)
            caches = self.pool.slot_caches(len(order), self.capacity, layers)
            for source, into in zip(self.models.caches, caches):
                copy_kept_rows(source, into, index)
        else:
            caches = tuple(kept_rows(cache, index) for cache in self.models.caches)
        self.rows.keep(index)
        if self.head is not None:
            self.root_inputs = self.root_inputs[index]
        self.sequences = [self.sequences[b] for b in order]
        if self.suffix is not None:
            self.suffix.keep_rows(order)
        self.samplers = [self.samplers[b] for b in order]
        self.models = self.round_models(caches)

    @property
    def suffix_nodes(self) -> int:
        """S: the suffix nodes each row proposes a round (0: none)."""
        return self.suffix.nodes if self.suffix is not None else 0

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats:
        return SwiftSpecStats.collect(self.name, new_tokens, wall_s, *self.counters, clock=self.clock)

    # ---- the host's part of a round

    def tensor(self, values: list[int]) -> torch.Tensor:
        """Host ints as a (n,) long device tensor: a copy to the device, never a read."""
        return torch.tensor(values, dtype=torch.long, device=self.rows.roots.device)

    def noise(self, T: int, depth: int) -> torch.Tensor:
        """(B, D, V) float64 each row's Gumbel noise for the positions its nodes may sit at (Sampler.choose_rows'
        rule: keyed by seed, row and position, drawn from the host's lengths, no read); D = min(T, depth + 1), depth:
        the deepest a node may sit (the draft's depth, or the suffix's S)."""
        deepest = min(T, depth + 1)  # a selected node is at most `depth` below its root, and T - 1
        vocab = self.target.get_output_embeddings().weight.shape[0]
        return torch.stack([s.gumbel([len(seq) + d for d in range(deepest)], vocab, self.rows.roots.device)
                            for s, seq in zip(self.samplers, self.sequences)])

    def eos(self, criteria: list[StopRule]) -> torch.Tensor:
        """(B, E) each row's EOS ids (-1 padding; none for a row that is done and decodes on)."""
        ids = [sorted(rule.eos) for rule in criteria]
        width = max([1] + [len(i) for i in ids])
        return self.tensor([i + [-1] * (width - len(i)) for i in ids]).reshape(len(ids), width)

    def stop_on_host(self, outcome: Verified, b: int, rule: StopRule) -> int:
        """Apply the criteria the device cannot (stop strings, max_time, custom ones) to each prefix of the row's
        walk, as verify.walk_to_stop does; cut the outcome there. Returns the tokens cut."""
        if not rule.others or not outcome.tokens:
            return 0
        sequence = torch.tensor([self.sequences[b] + outcome.tokens])  # on the host: calling the criteria reads nothing
        base = len(self.sequences[b])
        for j in range(len(outcome.tokens)):
            scores = outcome.scores[j] if outcome.scores else None
            if bool(rule.others(sequence[:, : base + j + 1], scores).any()):
                cut = len(outcome.tokens) - j - 1
                del outcome.tokens[j + 1 :], outcome.path[j + 1 :], outcome.scores[j + 1 :], outcome.logits[j + 1 :]
                outcome.finished = True
                return cut
        return 0
