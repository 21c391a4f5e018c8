"""The device round's sides (engine/rounds.py's RoundSides): a draft model and the target over fixed-shape slot
caches (steps/slot_cache.py), every phase a device op, one host read a round (SwiftSpecConfig round="device").

Per round, for all B rows at once:
  1. propose: the draft grows depth x width nodes below each root (drafters/device_growth.grow, d forwards) and
     the best T by path score are selected with their mask (device_round.select_device);
  2. verify: one target forward over them (slot_cache.verify_forward), the target's choices (argmax, or the
     sampler's Gumbel-max with noise the host draws from known positions), the walk with the EOS and length
     rules (device_round.walk_device), the target cache's commit, then the round's ONE read: counts, flags,
     paths, tokens and the verified subtrees, for streaming, stop strings, the record and the stats;
  3. accept: the draft cache's commit and its catch-up on the one accepted node it did not run, new prefix
     lengths and roots (device tensors: computed on the device, corrected from the host only where a host-side
     criterion, a stop string, cut a row's walk short);
  4. observe: the shape menu (policy/shapes.py) prices the round's shape from the tokens and the time between reads.

Exact where the caches are: full attention only, processors that ignore the path, a draft model
(check_device_round says why a call is refused). With SwiftSpecConfig.capture, the two phases (1; 2-3 up to the
read) are each replayed as one graph per shape (steps/phase_graphs.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, fields

import torch

from ..drafters.device_growth import grow
from ..drafters.eagle3 import DraftHead
from ..models.architectures import context_limit
from ..policy.shapes import Shape, ShapeMenu
from ..stats import DraftCounters, PhaseClock, SwiftSpecStats, TargetCounters
from ..steps.device_round import DeviceSubtree, greedy_choices, round_result, sampled_choices, select_device, walk_device
from ..steps.capture import capture_backend
from ..steps.phase_graphs import PhaseRunner
from ..steps.slot_cache import SlotCache, accepted_nodes, catch_up, commit_cache, verify_forward
from ..steps.tree import Proposal, Subtree
from ..steps.verify import PATH_FREE_PROCESSORS, StopRule, Verified, apply_processors
from .request import BatchRows, DecodeRequest, DecodeResult, RowResult
from .rounds import Proposed, run_rounds

MASKS_4D = ("sdpa", "eager")  # attention implementations that take the slot caches' additive 4D mask as given


def run_device(target, draft, request: DecodeRequest, config) -> DecodeResult:
    """The round (engine/rounds.py) on the device sides, its phases replayed where SwiftSpecConfig.capture says
    (CUDA graphs on CUDA, the emulating stand-in on a CPU with capture=True); check_device_round cleared the call."""
    if not request.max_new_tokens:
        return DecodeResult(rows=[RowResult() for _ in range(request.batch_size)])
    backend = capture_backend(config.capture, target.device)
    runner = PhaseRunner(backend) if backend is not None else None
    sides = DeviceSides(target, draft, config, request, runner)
    result = run_rounds(sides, request)
    how = "eager phases" if runner is None else f"replayed phases, {backend}: {len(runner.graphs)} graphs"
    if runner is not None and runner.fallbacks:
        how += f"; eager: {', '.join(sorted(runner.fallbacks))}"
    result.stats.attention = (f"device round (slot caches, 4D masks: target={target.config._attn_implementation}, "
                              f"draft={draft.config._attn_implementation}; {how})")
    result.stats.capture_s = runner.setup_s if runner is not None else 0.0
    return result


def device_round_gaps(config, target, draft, architectures, logits_processor, placement, groups,
                      joins_running_batch: bool, reasons: list[str]) -> list[str]:
    """Why round="device" cannot decode this call exactly (empty: it can). reasons: the call's batch and slot-limit
    reasons (generation.py's), which the device round would otherwise have to escape by the target's own loop."""
    gaps = list(reasons)
    if draft is None or isinstance(draft, DraftHead):
        gaps.append("it grows a draft model's tree, and this pair has " + (
            "no draft model (draft-free mode)" if draft is None else "a draft head (EAGLE-3 or MTP), not a draft model"))
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
    if config.ngram_size:
        gaps.append(f"ngram_size={config.ngram_size}: suffix proposals are not merged into the device tree; set ngram_size=0")
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

    def key(self) -> tuple:
        """What a replayed phase bakes in besides its inputs' shapes: the caches' buffers and the rows' processors."""
        buffers = tuple(t.data_ptr() for c in self.caches for layer in c.layers for t in (layer.keys, layer.values))
        return buffers, tuple(id(p) for p in self.processors), self.sample, self.keeps


def subtree_tensors(sub: DeviceSubtree) -> dict[str, torch.Tensor]:
    return {f.name: getattr(sub, f.name) for f in fields(sub)}


def grow_phase(prefix_lens: torch.Tensor, roots: torch.Tensor, *, models: RoundModels, shape: Shape) -> dict:
    """1. the draft's growth of `shape` below every root and the best T nodes with their mask (DeviceSubtree's
    fields): d draft forwards and the selection, no host read."""
    growth = grow(models.draft, models.caches[1], prefix_lens, roots, shape.depth, shape.width, models.vocab_limit)
    return subtree_tensors(select_device(growth.tree, shape.budget))


def verify_phase(prefix_lens: torch.Tensor, roots: torch.Tensor, max_tokens: torch.Tensor, eos: torch.Tensor,
                 noise: torch.Tensor | None = None, *, models: RoundModels, depth: int, **subtree) -> dict:
    """2-3. the target's verification of the subtree, its choices, the walk, both caches' commits (the draft's
    catch-up on a walked node at the last depth, which it did not run) and the rows' next prefixes and roots, no host
    read. max_tokens (B,) long, eos (B, E) long, noise (B, D, V) float64 when sampling (device_round.sampled_choices).
    Returns: result (B, 2 + 4T) long, the round's one read (counts, finished flags, tokens, then the walked path and
    the subtree's node ids, tokens and parents), prefix_lens and roots (B,) the next round's, and the walked nodes'
    scores / logits (B, T, V) where the call keeps them."""
    sub = DeviceSubtree(**subtree)
    target_cache, draft_cache = models.caches
    logits = verify_forward(models.target, target_cache, prefix_lens, sub)  # (B, T, V)
    scores = processed(logits, models.processors)
    choices = sampled_choices(scores, noise, sub.depths) if models.sample else greedy_choices(scores)
    walk = walk_device(choices, sub, max_tokens, eos)
    commit_cache(target_cache, prefix_lens, walk.path.clamp(min=0), walk.count)  # verified node j sat at slot j
    ran = walk.count.clamp(max=depth)  # walked nodes above the last depth were on a frontier: their KV is there
    commit_cache(draft_cache, prefix_lens, accepted_nodes(walk, sub), ran)
    if sub.tokens.shape[1] > depth:  # a walk can reach the last depth: catch that node up (0 or 1 token a row)
        last = sub.tokens.gather(1, walk.path[:, depth : depth + 1].clamp(min=0))  # (B, 1)
        catch_up(models.draft, draft_cache, last, walk.count - ran, prefix_lens + ran)
    emitted = walk.tokens.gather(1, (walk.count - 1).clamp(min=0)[:, None]).squeeze(1)
    out = dict(
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

    def __init__(self, target, draft, config, request: DecodeRequest, runner: PhaseRunner | None = None):
        self.target, self.draft, self.runner = target, draft, runner
        self.samplers = list(request.samplers)
        self.keeps = request.keeps_scores, request.keeps_logits
        longest = request.prompt.shape[1] + request.max_new_tokens
        limit = context_limit(target, draft)
        self.menu = ShapeMenu.of(config.draft_depth, config.draft_width, config.tree_budget,
                                 (limit - longest) if limit else longest)
        self.capacity = longest + max(s.nodes for s in self.menu.shapes) + 2  # the tree region, then scratch
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
        caches = tuple(SlotCache(m.config.get_text_config().num_hidden_layers, self.capacity)
                       for m in (self.target, self.draft))
        committed = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts], device=device)
        counts = torch.tensor([len(p) - 1 for p in prompts], device=device)
        for model, cache, counter in zip((self.target, self.draft), caches, self.counters):
            catch_up(model, cache, committed, counts)
            counter.forwards += 1
        self.rows = RowsOnDevice(counts, torch.tensor([p[-1] for p in prompts], device=device))
        self.models = self.round_models(caches)
        self.counters[0].busy_s += time.perf_counter() - start

    def round_models(self, caches: tuple[SlotCache, SlotCache]) -> RoundModels:
        return RoundModels(self.target, self.draft, caches, tuple(s.logits_processor for s in self.samplers),
                           self.samplers[0].do_sample, self.keeps, self.target.config.get_text_config().vocab_size)

    def run(self, phase, key: tuple, inputs: dict, **static) -> dict:
        """A phase over live `inputs`, replayed where the sides have a runner (its outputs are then static tensors)."""
        bound = functools.partial(phase, models=self.models, **static)
        if self.runner is None:
            return bound(**inputs)
        return self.runner.run((phase.__name__, *key, self.models.key()), bound, inputs)

    def propose(self, rows: BatchRows) -> DeviceProposed:
        """1. the draft grows the menu's shape below every root; the best T nodes are selected, on the device."""
        proposed = DeviceProposed([], rows=list(rows.live), shape=self.menu.pick())
        shape, draft_counters = proposed.shape, self.counters[1]
        inputs = dict(prefix_lens=self.rows.prefix_lens, roots=self.rows.roots)
        with self.clock.phase("expand"):
            proposed.subtree = DeviceSubtree(**self.run(grow_phase, (shape,), inputs, shape=shape))
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
        sub, depth = proposed.subtree, proposed.shape.depth
        criteria, budgets = rows.criteria(), rows.budgets()
        inputs = dict(prefix_lens=self.rows.prefix_lens, roots=self.rows.roots, max_tokens=self.tensor(budgets),
                      eos=self.eos(criteria), **subtree_tensors(sub))
        if self.models.sample:
            inputs["noise"] = self.noise(sub.tokens.shape[1], depth)
        with self.clock.phase("verify"):
            proposed.after = after = self.run(verify_phase, (depth,), inputs, depth=depth)
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
                proposed.proposals.append(Proposal(subtree, probs=[], scores=[], suffix=[-1] * T))
                outcome = Verified(tokens, path, finished=bool(finished))
                outcome.scores = [kept[0][b, j : j + 1] for j in range(count)] if kept[0] is not None else []
                outcome.logits = [kept[1][b, j : j + 1] for j in range(count)] if kept[1] is not None else []
                proposed.cut.append(self.stop_on_host(outcome, b, criteria[b]))
                self.sequences[b] += outcome.tokens
                verified.append(outcome)
        self.counters[0].forwards += 1
        self.counters[0].verify_steps += len(verified)
        self.counters[1].forwards += int(T > depth)  # the catch-up
        self.counters[0].busy_s += time.perf_counter() - start
        return verified

    def accept(self, proposed: DeviceProposed, verified: list[Verified], keep: list[int]) -> None:
        """3. every row's prefix and root move on (the verification phase computed them on the device; a row whose
        walk a host-side stop cut takes the host's instead)."""
        prefix, roots = proposed.after["prefix_lens"].clone(), proposed.after["roots"].clone()
        if any(proposed.cut):
            cut = self.tensor(proposed.cut)
            host_roots = self.tensor([v.tokens[-1] if v.tokens else 0 for v in verified])
            roots, prefix = torch.where(cut > 0, host_roots, roots), prefix - cut
        self.rows.prefix_lens, self.rows.roots = prefix, roots

    def observe(self, proposed: DeviceProposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """4. the shape menu prices the round's shape (tokens over the time between two reads)."""
        self.menu.observe(proposed.shape, sum(len(v.tokens) for v in verified), proposed.read_s)

    def keep_rows(self, order: list[int]) -> None:
        index = self.tensor(order)
        for cache in self.models.caches:
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.rows.keep(index)
        self.sequences = [self.sequences[b] for b in order]
        self.samplers = [self.samplers[b] for b in order]
        self.models = self.round_models(self.models.caches)

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats:
        return SwiftSpecStats.collect(self.name, new_tokens, wall_s, *self.counters, clock=self.clock)

    # ---- the host's part of a round

    def tensor(self, values: list[int]) -> torch.Tensor:
        """Host ints as a (n,) long device tensor: a copy to the device, never a read."""
        return torch.tensor(values, dtype=torch.long, device=self.rows.roots.device)

    def noise(self, T: int, depth: int) -> torch.Tensor:
        """(B, D, V) float64 each row's Gumbel noise for the positions its nodes may sit at (Sampler.choose_rows'
        rule: keyed by seed, row and position, drawn from the host's lengths, no read); D = min(T, depth + 1)."""
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
