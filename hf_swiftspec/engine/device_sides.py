"""The device round's sides (engine/rounds.py's RoundSides): a drafter (drafters/device_drafters.py: a draft model,
an EAGLE-3 head or an MTP layer, or none) and the target over fixed-shape slot caches (steps/slot_cache.py), every
phase a device op, one host read a round (SwiftSpecConfig round="device").

The sides hold B cache rows (a power of two, engine/device_pool.py): the live rows first, then dead padding rows,
which run every phase with a budget of 0 (they emit and commit nothing, and write their own cache rows only). A lone
generate() call prefills its rows into them at the start (`start`); the server's running batch
(engine/continuous_device.py) copies each joining row in once it is prefilled (`absorb`); rows leave between
rounds (`keep_rows`). Everything a row needs between rounds lives on the device (RowsOnDevice: prefix, root, budget,
EOS ids, sampling seed and position, the drafter's state), so a round copies no host data in but the suffix
proposals (one pinned, non-blocking copy) and reads the device once.

Per round, for all B rows at once:
  1. propose: the drafter grows the menu's shape (policy/shapes.py) below every root (depth 0: nothing grown), the
     suffix proposals join it (drafters/device_suffix.py) and the best T by path score are selected with their mask
     (device_round.select_device);
  2. verify: one target forward over them (slot_cache.verify_forward), the target's choices (argmax, or Gumbel-max
     with noise drawn on the device from each row's seed and positions: verify.gumbel_noise), the walk with each row's
     EOS ids and budget (acceptance.walk_subtree), the target cache's commit, the drafter's commit and catch-up, the
     rows' state moved on (prefix, root, budget, position; EOS ids cleared for rows that finished), then the round's
     ONE read: counts, flags, paths, tokens and the verified subtrees, for streaming, stop strings, the record and
     the stats;
  3. accept: the suffix index's new tokens (on the host); a row whose walk a host-side criterion (a stop string) cut
     short and that decodes on has its state corrected (rare: one copy);
  4. observe: the shape menu prices the round's shape from the tokens and the time between reads (a round that
     captured a graph is not priced).

Each forward attends the live length (`span`: the rows' longest prefix and the tree, rounded up to a power of two)
rather than the slot capacity. With SwiftSpecConfig.capture, the two phases (1; 2 up to the read) are each replayed as
one graph per shape and span (steps/phase_graphs.py). Models that place tokens by cache slot or keep recurrent states
run chains (`chain`: engine/device_chains.py), eagerly. Exact where the caches are: no sliding windows, processors
that ignore the path (check_device_round says why a call is refused).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..drafters.device_drafters import DeviceDrafter, RoundFacts, device_drafter, model_gaps
from ..drafters.device_suffix import SuffixProposals, draft_free_menu
from ..drafters.eagle3 import DraftHead
from ..models.architectures import context_limit
from ..policy.shapes import Hand, Shape, ShapeMenu
from ..stats import DraftCounters, PhaseClock, SwiftSpecStats, TargetCounters
from ..steps.capture import capacity_bucket, capture_backend, capture_gap, power_of_two
from ..steps.probes import describe
from ..steps.acceptance import StopRule, cut_at_criteria, split_criteria
from ..steps.device_round import DeviceSubtree, to_device
from ..steps.slot_cache import catch_up, span_bucket
from ..steps.tree import Proposal, Subtree
from ..steps.verify import PATH_FREE_PROCESSORS, Verified
from .device_chains import Chains
from .device_phases import RoundModels, grow_phase, read_once, subtree_tensors, verify_phase
from .device_pool import SlotPool, Slots, bucket_for, row_values, set_rows
from .request import DecodeRequest, DecodeResult, RowResult
from .rounds import Proposed, run_rounds

MASKS_4D = ("sdpa", "eager")  # attention implementations that take the slot caches' additive 4D mask as given
EOS_WIDTH = 4  # EOS ids a row holds on the device, at least (more: the next power of two)
NO_ROOM = 1 << 30  # a model with no position limit: room for any shape


def run_device(target, draft, request: DecodeRequest, config, captures=None, architectures=None) -> DecodeResult:
    """The round (engine/rounds.py) on the device sides, its phases replayed where SwiftSpecConfig.capture says
    (CUDA graphs on CUDA, the emulating stand-in on a CPU with capture=True) and the models allow; check_device_round
    cleared the call. captures: the pair's Captures (steps/capture.py), whose device pool keeps the slots and graphs for
    the next call; None: this call's own. architectures: the target's and the draft's (probes.describe), where the
    caller has them."""
    if not request.max_new_tokens:
        return DecodeResult(rows=[RowResult() for _ in range(request.batch_size)])
    drafter = device_drafter(draft, target)
    architectures = architectures or models_described(target, drafter)
    eager = next((f"{role}: {gap}" for role, a in zip(("target", "draft"), architectures)
                  if a is not None and (gap := capture_gap(a))), None)  # steps/capture.py's rule: they run eagerly
    backend = None if eager else capture_backend(config.capture, target.device)
    # slots of the call's own where a model reads its cache's length (chains) or rules by slot: nothing pooled
    pool = device_pool(captures, backend) if drafter.poolable and not eager else SlotPool(backend)
    runner = pool.runner
    captured_before, setup_before = (runner.captured, runner.setup_s) if runner is not None else (0, 0.0)
    sides = DeviceSides(target, drafter, config, pool, architectures=architectures)
    result = run_rounds(sides, request)
    pool.drop_unkept_graphs()
    how = (f"eager phases ({eager})" if eager else "eager phases") if runner is None else (
        f"replayed phases, {backend}: {len(runner.graphs)} graphs, {runner.captured - captured_before} "
        f"captured by this call")
    if runner is not None and runner.fallbacks:
        how += f"; eager: {', '.join(sorted(runner.fallbacks))}"
    drafted = drafter.describe()
    masks = (f"chains for this call ({sides.chain.reason}), the slot caches read by the row's length"
             if sides.chain else "slot caches, 4D masks over the live length")
    result.stats.attention = (f"device round ({masks}: target={target.config._attn_implementation}, {drafted}; "
                              f"{how})")
    result.stats.capture_s = runner.setup_s - setup_before if runner is not None else 0.0
    return result


def models_described(target, drafter: DeviceDrafter) -> tuple:
    """The target's and the draft model's probes.describe (None without a draft model: a head's or none)."""
    model = drafter.model
    return describe(target, "target"), (describe(model, "draft") if model is not None and not isinstance(
        model, DraftHead) else None)


def device_pool(captures, backend: str | None) -> SlotPool:
    """The pair's device pool (Captures.device), made for `backend` on first use; a call's own without captures."""
    if captures is None:
        return SlotPool(backend)
    if captures.device is None or captures.device.backend != backend:
        captures.device = SlotPool(backend)
    return captures.device


def device_round_gaps(config, target, draft, architectures, logits_processor, placement, groups,
                      joins_running_batch: bool, reasons: list[str]) -> list[str]:
    """Why round="device" cannot decode this call exactly (empty: it can). reasons: the call's batch and slot-limit
    reasons (generation.py's), which the device round would otherwise have to escape by the target's own loop."""
    gaps = list(reasons)
    if draft is None and not config.ngram_size:
        gaps.append("draft-free mode (no draft model) proposes suffix nodes alone, and ngram_size=0 turns them off; "
                    "set ngram_size > 0 or give a draft model")
    gaps += model_gaps("target", target, architectures[0], MASKS_4D)
    drafter = device_drafter(draft, target)
    gaps += drafter.gaps(architectures[1], MASKS_4D)
    chained = [a for a in architectures if a is not None and a.shape == "chain"]
    if chained and drafter.reads_target:
        gaps.append(f"the target's steps must be chains ({chained[0].chain_reason}), which the device round runs with "
                    "a draft model or the suffix proposals, not a draft head (it reads the target's states of a "
                    "tree); use round='host'")
    if drafter.context_model is not None and context_limit(drafter.context_model, target) != context_limit(target):
        gaps.append(f"the draft's context ({context_limit(draft)} positions) is shorter than the target's "
                    f"({context_limit(target)}): the host round has it read the text in windows of its own; use "
                    "round='host'")
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


def choose_round(config, target, *args, **kwargs) -> tuple[str, str]:
    """The round this call runs, "host" or "device", and why (SwiftSpecStats.round_choice). round="device": the device
    round, or a ValueError naming why it cannot be exact (check_device_round); "host": the host round; "auto": the
    device round on CUDA where it decodes the call exactly (its one read a round and replayed phases are what a GPU
    rewards), else the host round (on a CPU it is the faster one: settings.md). args: device_round_gaps'."""
    if config.round == "device":
        check_device_round(config, target, *args, **kwargs)
        return "device", "asked for (round='device')"
    if config.round == "host":
        return "host", "asked for (round='host')"
    if target.device.type != "cuda":
        return "host", f"round='auto' on {target.device.type}: the host round (the device round pays on CUDA)"
    gaps = device_round_gaps(config, target, *args, **kwargs)
    if gaps:
        return "host", f"round='auto' on CUDA, host round: the device round cannot decode this call exactly ({gaps[0]})"
    return "device", "round='auto' on CUDA: the device round"


def check_device_round(*args, **kwargs) -> None:
    """round="device" where it cannot be exact: ValueError naming why and the fix (never a silent fallback)."""
    gaps = device_round_gaps(*args, **kwargs)
    if gaps:
        raise ValueError(f"SwiftSpecConfig.round='device' cannot decode this call exactly: {'; '.join(gaps)}. "
                         "Fix that, or use round='host', which decodes it exactly.")


@dataclass
class RowOnHost:
    """What the host keeps of a cache row between rounds (None for a dead row's sampler): its sampler (processors and
    stop rules), its sequence as generate() sees it (stop strings read it), its committed slots (the host's mirror of
    the device's prefix_lens, which sizes each round's span), whether its call keeps scores / logits, and the
    positions the models place past its last token (the deepest shape it may grow), and its suffix index (None: no
    suffix proposals, or a dead row)."""

    sampler: object = None
    sequence: list[int] = field(default_factory=list)
    prefix: int = 0
    keeps: tuple[bool, bool] = (False, False)
    room: int = NO_ROOM
    suffix: object = None
    drafted: int = 0  # of its committed slots, those the drafter has run (a drafter that defers its catch-up)


@dataclass
class DeviceProposed(Proposed):
    """A device round's hand-off: the shape it ran, the verified subtree (device tensors), the verification phase's
    outputs, and what the round's one read told the host (the cut the host's stop criteria made)."""

    shape: Shape | None = None
    span: int = 0
    subtree: DeviceSubtree | None = None
    after: dict = field(default_factory=dict)  # verify_phase's outputs
    cut: list[int] = field(default_factory=list)  # per live row: tokens the device walked past a host-side stop
    read_s: float | None = None  # seconds since the previous round's read (None: the first round)
    captured: bool = False  # the round captured a graph (its time prices no shape)
    promised: float | None = None  # a draft-free round's tokens beyond one a row expected from its proposal in hand


class DeviceSides:
    """The round's phases over a drafter and the target on B cache rows (see the module docstring), for a lone call
    (`start`) and the running batch (`absorb`) alike."""

    name = "device"
    roots_known = False  # a prefill leaves each prompt's last token as the root: round 1 verifies it

    def __init__(self, target, drafter: DeviceDrafter, config, pool: SlotPool, changes: Counter | None = None,
                 guard: bool = False, architectures: tuple | None = None):
        self.target, self.drafter, self.config, self.pool = target, drafter, config, pool
        self.architectures = architectures or models_described(target, drafter)  # (target's, draft model's or None)
        # This call's rounds are chains (device_chains.py: width 1, one suffix path, slot = position), or None: trees.
        # Set from the architectures here; `start` sets it too where the call's forwards reach a rule by slot.
        self.chain: Chains | None = Chains.of(self.architectures)
        self.guard = guard  # the latency guard prices shapes (observe): a running batch of requests
        self.runner = pool.runner
        self.device = target.device
        self.vocab_limit = target.config.get_text_config().vocab_size
        self.limit = context_limit(*(m for m in (target, drafter.context_model) if m is not None))
        self.host: list[RowOnHost] = []  # per cache row
        self.menu: ShapeMenu | None = None
        self.menu = self.menu_for(NO_ROOM, schedule="none")  # until rows come (start, absorb)
        self.size_trees(2)  # a running batch's trees (a lone call sizes its own: start)
        self.counters = TargetCounters(), DraftCounters()
        self.clock = PhaseClock.on(self.device)
        self.slots: Slots | None = None
        self.models: RoundModels | None = None
        self.live = 0
        self.capacity = 0
        self.eos_width = EOS_WIDTH
        self.last_read: float | None = None
        self.first: Shape | None = None  # round 1's shape, where start picked it
        self.root_logits: torch.Tensor | None = None  # (B, 1, V) the roots' logits, where the prefill ran the roots
        self.changes = Counter() if changes is None else changes  # moves to other slots: bucket, capacity

    @property
    def bucket(self) -> int:
        return len(self.host)

    def layers(self) -> tuple[int, int]:
        return self.target.config.get_text_config().num_hidden_layers, self.drafter.layers

    def shapes_for(self, rows: int, room: int) -> ShapeMenu:
        """The menu of shapes a bucket of `rows` whose rows have `room` positions left may run (not yet priced). A chain
        call's (`chain`) are chains: width 1, no suffix shapes beside a draft's (the one place its shapes are
        restricted; size_trees makes its suffix proposals one path)."""
        config = self.config
        if self.drafter.model is None:
            return draft_free_menu(config, rows)
        if self.chain:
            return Chains.menu(ShapeMenu.of(config.draft_depth, 1, config.tree_budget, room, False, rows))
        return ShapeMenu.of(config.draft_depth, config.draft_width, config.tree_budget, room, config.ngram_size > 0,
                            rows)

    def size_trees(self, rows: int) -> None:
        """The tree region and the suffix proposals for the shapes a bucket of `rows` may run: S suffix nodes a round,
        enough to fill its largest tree (none with ngram_size 0), then the tree's slots and scratch."""
        shapes = self.shapes_for(rows, NO_ROOM).shapes
        # a chain call's suffix proposals are one path, and none beside a draft's chain (the two would branch)
        proposes = self.config.ngram_size and not (self.chain and self.drafter.model is not None)
        self.suffix_nodes = max(s.budget for s in shapes) - 1 if proposes else 0
        self.tree_slots = max(s.nodes for s in shapes) + self.suffix_nodes + 2
        self.suffix = (SuffixProposals(self.config.ngram_size, self.suffix_nodes, self.limit, self.device,
                                       branching=not self.chain) if self.suffix_nodes else None)

    def menu_for(self, room: int, schedule: str = "menu") -> ShapeMenu:
        """The shapes rows with `room` positions left can grow, priced by what this pool measured for the bucket.
        schedule: whose re-price schedule goes on: "menu" (this call's, as rows join and leave), "pool" (a new call:
        the last call's of this bucket) or "none" (a menu only looked at, not kept)."""
        bucket = max(self.bucket, 1)
        menu = self.shapes_for(bucket, room)
        menu.prices = self.pool.prices.setdefault(bucket, {})  # the pair's, for this many rows
        earlier = {"menu": self.menu, "pool": self.pool.schedules.get(bucket), "none": None}[schedule]
        if earlier is not None:  # the re-price schedule goes on, across calls too: re-prices that did not pay stay rare
            for name in ("rounds", "retry", "next_retry", "retries", "pending"):
                setattr(menu, name, getattr(earlier, name))
        if schedule != "none":
            self.pool.schedules[bucket] = menu
        return menu

    def room(self, prompt: int, new_tokens: int) -> int:
        """Positions the models place past a row's last token (NO_ROOM: no limit)."""
        return self.limit - prompt - new_tokens if self.limit else NO_ROOM

    # ---- rows in and out (between rounds)
    def start(self, request: DecodeRequest) -> None:
        """A lone call: every prompt but its last token (each row's root) prefilled into the rows of its bucket, every
        row's state set (one copy)."""
        start = time.perf_counter()
        prompts = request.prompt_ids()
        n, L = len(prompts), request.prompt.shape[1]
        self.size_trees(bucket_for(n))
        reached = None if self.chain else Chains.reaching(self.architectures[0], L + request.max_new_tokens +
                                                          self.tree_slots)
        if reached:  # the call's forwards reach a rule the target applies by slot: chains, from its start
            self.chain = self.chains_for(reached, n)
            self.size_trees(bucket_for(n))
        self.capacity = capacity_bucket(L + request.max_new_tokens + self.tree_slots)
        stops = split_criteria(request.stopping_criteria)
        self.eos_width = max(EOS_WIDTH, power_of_two(len(stops.eos)))
        sequences = [c[0].tolist() for c in request.contexts] if request.contexts else request.prompt.tolist()
        keeps = request.keeps_scores, request.keeps_logits
        room = self.room(L, request.max_new_tokens)
        if room < 0:
            raise ValueError(
                f"round='device': the prompt ({L} tokens, padding included) plus max_new_tokens "
                f"({request.max_new_tokens}) come to {L + request.max_new_tokens} positions, past the models' context "
                f"of {self.limit}; ask for at most {max(self.limit - L, 0)} new tokens, cut the prompt, or use "
                "round='host'")
        self.host = [RowOnHost(sampler, sequence, len(ids) - 1, keeps, room,
                               self.suffix.index_for(request, ids) if self.suffix is not None else None, len(ids) - 1)
                     for sampler, sequence, ids in zip(request.samplers, sequences, prompts)]
        self.live = n
        self.slots = None
        self.move_rows(None, n, bucket_for(n))
        self.menu = self.menu_for(room, schedule="pool")
        self.first = self.menu.pick()  # round 1's shape, picked before the prefill: it decides what the prefill runs
        # A plain first round verifies the roots alone: the target's prefill runs them too and keeps their logits (as
        # generate's prefill does), so round 1 runs no forward; else round 1 verifies each root with its tree.
        roots = self.first.budget == 1 and not self.drafter.reads_target
        width = max(len(p) for p in prompts)
        pad = [[0] * (width - len(ids)) for ids in prompts]
        # each prompt left-aligned (its root a padding column), then, where the prefill runs the roots, right-aligned
        values = [[*ids, *gap, *((*gap, *ids) if roots else ()),
                   *row_values(row.sampler, ids[-1], row.prefix, request.max_new_tokens, len(row.sequence), stops.eos,
                               self.eos_width)] for row, ids, gap in zip(self.host, prompts, pad)]
        packed = to_device(values, self.device)  # the prompts and the rows' state, one copy
        taken = width * (2 if roots else 1)
        set_rows(self.slots.rows, packed[:, taken:], 0)
        tokens = torch.cat([packed[:, :taken], packed.new_zeros(self.bucket - n, taken)])  # dead rows: nothing
        # (a chain's one row runs no padding column, the root's: a recurrent state would run it too)
        self.prefill(self.slots, tokens[:, : width - bool(self.chain)], self.slots.rows.prefix_lens, end=width,
                     roots=tokens[:, width:] if roots else None)
        self.models = self.round_models()
        self.counters[0].busy_s += time.perf_counter() - start

    def prefill(self, slots: Slots, tokens: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor | None = None,
                end: int | None = None, roots: torch.Tensor | None = None) -> None:
        """Both models over tokens (B, L) long (counts (B,) per row, token j of a row at slot starts + j: a prompt but
        its root, or a piece of it), each forward attending the live length (`end`: the furthest slot written).
        roots (B, L) long: each row's whole prompt right-aligned (its root in the last column), which the target runs
        instead, keeping the roots' logits for round 1 (`root_logits`)."""
        B, L = tokens.shape
        starts = torch.zeros_like(counts) if starts is None else starts
        need = (L if end is None else end) + 1
        for cache in slots.caches:
            if cache is not None:
                cache.span = min(span_bucket(need) if self.runner is not None else need, cache.capacity)
        with self.drafter.tapped():
            if roots is None:
                catch_up(self.target, slots.caches[0], tokens, counts, starts)
            else:
                lead = roots.shape[1] - 1 - counts  # each row's padding columns before its prompt
                self.root_logits = catch_up(self.target, slots.caches[0], roots, counts + 1, starts, lead=lead,
                                            last_logits=True)[:, None]  # (B, 1, V)
            self.drafter.prefill(slots.caches[1], tokens, counts, starts, slots.rows.drafter)
        self.counters[0].forwards += 1
        self.counters[1].forwards += int(self.drafter.model is not None)

    def absorb(self, joining: Slots, row: RowOnHost, capacity: int, eos_width: int) -> None:
        """A prefilled request's row (its own 1-row slots, its state set) joins as cache row `live`; the rows move first
        to a larger bucket, or to slots of a wider capacity or EOS width, where it needs one."""
        n = self.live
        if self.slots is None or n + 1 > self.bucket or capacity > self.capacity or eos_width > self.eos_width:
            self.changes["capacity"] += 0 < self.capacity < capacity
            self.capacity = max(self.capacity, capacity)
            self.eos_width = max(self.eos_width, eos_width)
            self.move_rows(None, n, bucket_for(n + 1), like=joining)
            self.pool.drop_smaller(self.capacity)
        for mine, theirs in zip(self.slots.caches, joining.caches):
            if mine is not None:
                mine.copy_rows(theirs, slice(0, 1), at=n, slots=row.prefix)
        self.slots.rows.copy_rows(joining.rows, slice(0, 1), 1, at=n)
        self.host[n] = row
        self.live = n + 1
        self.menu = self.menu_for(min(h.room for h in self.host[: self.live]))
        self.models = self.round_models()

    def keep_rows(self, order: list[int]) -> None:
        """Keep cache rows `order` (keep_order's) as rows 0 .. len(order) - 1; the rest are dead from now on (and the
        bucket may shrink)."""
        self.host = [self.host[b] for b in order] + self.host[len(order):]
        self.move_rows(to_device(order, self.device), len(order), bucket_for(max(len(order), 1)))
        self.live = len(order)
        self.menu = self.menu_for(min([h.room for h in self.host[: self.live]] or [NO_ROOM]))
        self.models = self.round_models()

    def move_rows(self, index: torch.Tensor | None, count: int, bucket: int, like: Slots | None = None) -> None:
        """Rows index[i] (count of them; None: the first count, in place) become rows 0 .. count - 1 of the slots for
        `bucket` rows at the sides' capacity and EOS width (the same slots, moved in place, where they are the ones);
        every row past them is dead. like: slots whose layout new caches take."""
        old = self.slots
        new = self.slots_for(bucket, like=old if old is not None and old.caches[0].buffers else like)
        if old is None:
            new.rows.kill(slice(0, None))
        else:
            rows = slice(0, count) if index is None else index
            for mine, theirs in zip(new.caches, old.caches):
                if mine is not None and (new is not old or index is not None):
                    mine.copy_rows(theirs, rows)
            new.rows.copy_rows(old.rows, rows, count)
            new.rows.kill(slice(count, None))
            self.changes["bucket"] += bucket != self.bucket and self.bucket > 0
        self.slots = new
        self.host = (self.host[:count] + [RowOnHost() for _ in range(bucket)])[:bucket]

    def slots_for(self, bucket: int, like: Slots | None = None) -> Slots:
        slots = self.pool.slots(bucket, self.capacity, self.layers(), self.eos_width,
                                self.drafter.state_fields(self.capacity), self.device, like)
        if self.chain:
            self.chain.adopt(slots)
        return slots

    def chains_for(self, reason: str, rows: int) -> Chains:
        """The strategy for a call that `reason` says must run chains, or a ValueError where it cannot."""
        if rows > 1 or self.drafter.reads_target:
            what = f"a batch of {rows} rows" if rows > 1 else "a draft head, which reads the target's states of a tree,"
            raise ValueError(f"round='device' runs {what} where chains are needed ({reason}), and chains are one "
                             "draft model's or the suffix proposals' path for one row; use round='host'")
        return Chains.of(self.architectures, reason)

    def round_models(self) -> RoundModels:
        live = [h.sampler for h in self.host if h.sampler is not None]
        processors = tuple(h.sampler.logits_processor if h.sampler is not None else () for h in self.host)
        keeps = tuple(any(h.keeps[i] for h in self.host) for i in (0, 1))
        return RoundModels(self.target, self.drafter, processors, any(s.do_sample for s in live), keeps, self.vocab_limit)

    # ---- the round's phases
    def run(self, phase, static: dict, inputs: dict) -> dict:
        """A phase over live `inputs`, replayed where the sides have a runner (its outputs are then static tensors)."""
        bound = functools.partial(phase, models=self.models, slots=self.slots, **static)
        if self.runner is None:
            return bound(**inputs)
        key = (self.bucket, phase.__name__, tuple(sorted(static.items())), self.models.key(), self.slots.addresses())
        return self.runner.run(key, bound, inputs)

    def catch_up(self, shape: Shape) -> int:
        """The width of the catch-up a drafter that defers it runs before growing `shape` (0: none): the live rows'
        largest lag, rounded up to a power of two (a replayed growth is captured per width). The rows have run it
        by the growth's end."""
        if not (self.drafter.defers and shape.depth):
            return 0
        live = self.host[: self.live]
        lag = max((h.prefix - h.drafted for h in live), default=0)
        for h in live:
            h.drafted = h.prefix
        if self.chain:  # one row, and no padding token a draft's recurrent state would run
            return lag
        return power_of_two(lag) if lag else 0

    def round_span(self) -> int:
        """The live length this round's forwards attend: every live row's prefix and the largest tree (and scratch),
        rounded up to a power of two where the phases replay (a graph per span), exactly where they run eagerly."""
        need = max((h.prefix for h in self.host[: self.live]), default=0) + self.tree_slots
        return min(span_bucket(need) if self.runner is not None else need, self.capacity)

    def propose(self, rows) -> DeviceProposed:
        """1. the drafter grows the menu's shape below every root, the suffix proposals join it; the best T nodes are
        selected, on the device."""
        shape, self.first, inputs, hand = self.first, None, {}, None
        if self.suffix is not None:  # the proposal in hand prices the draft-free shapes (policy/shapes.py)
            trees = self.suffix.build([h.suffix for h in self.host])
            hand = Hand([sorted(probs, reverse=True) for *_, probs in trees[: self.live]], guard=self.guard)
        shape = shape or self.menu.pick(hand)
        if self.suffix is not None and shape.budget > 1:  # (a plain round verifies the roots alone)
            inputs["suffix"] = self.suffix.pack(trees)  # the round's one host-to-device copy
        promised = hand.promise(shape.budget) if hand is not None and not shape.depth else None
        proposed = DeviceProposed([], rows=list(rows.live), shape=shape, span=self.round_span(), promised=promised)
        if self.chain:
            self.chain.before_grow(self.slots, self.host[0].drafted)
        lag = self.catch_up(proposed.shape)
        captured = self.runner.captured if self.runner is not None else 0
        with self.clock.phase("expand"):
            proposed.subtree = DeviceSubtree(**self.run(grow_phase, dict(shape=proposed.shape, span=proposed.span,
                                                                         lag=lag), inputs))
        proposed.captured = self.runner is not None and self.runner.captured > captured
        if self.chain:  # its live nodes alone: the draft's chain, or the root and its suffix path
            live = shape.budget if shape.depth or self.suffix is None else 1 + len(trees[0][0])
            proposed.subtree = Chains.first(proposed.subtree, min(live, shape.budget))
        depth = proposed.shape.depth
        proposed.expansions = depth
        draft = self.counters[1]
        draft.forwards += depth + (lag > 0)
        draft.expansions += depth
        draft.rounds += 1
        draft.busy_s += time.perf_counter() - proposed.started
        return proposed

    def verify(self, proposed: DeviceProposed, rows) -> list[Verified]:
        """2. the target verifies every row's subtree, walks it and commits the path in both caches, then the round's
        one read."""
        start = time.perf_counter()
        captured = self.runner.captured if self.runner is not None else 0
        sub, shape, S = proposed.subtree, proposed.shape, self.suffix_nodes
        T = sub.tokens.shape[1]
        lag = self.drafter.catch_up_width(T, shape.depth, S)
        facts = RoundFacts(shape.depth, shape.nodes, lag, max(shape.depth, S))
        known, self.root_logits = self.root_logits, None  # round 1's roots, where the prefill ran them: no forward
        if self.chain:
            self.chain.before_verify(self.target, self.slots, self.host[0].prefix, self.counters[0])
        with self.clock.phase("verify"), self.drafter.tapped():
            if known is None:
                proposed.after = after = self.run(verify_phase, dict(facts=facts, span=proposed.span),
                                                  subtree_tensors(sub))
            else:  # once a call: eagerly (a graph of its own would be one more capture per span)
                proposed.after = after = verify_phase(models=self.models, slots=self.slots, facts=facts,
                                                      span=proposed.span, known=known, **subtree_tensors(sub))
        proposed.captured = proposed.captured or (self.runner is not None and self.runner.captured > captured)
        with self.clock.phase("walk"):
            read = read_once(after["result"])
            now = time.perf_counter()
            proposed.read_s, self.last_read = (None if self.last_read is None else now - self.last_read), now
            kept = [after[name].clone() if name in after else None for name in ("scores", "logits")]  # replays overwrite
            criteria = rows.criteria()
            verified = []
            for b in range(self.live):
                count, finished, *rest = read[b]
                tokens, path = rest[:count], rest[T : T + count]
                subtree = Subtree(rest[2 * T : 3 * T], rest[3 * T : 4 * T], rest[4 * T :])
                suffix = [0 if i >= shape.nodes else -1 for i in subtree.node_ids]  # the suffix's own nodes
                proposed.proposals.append(Proposal(subtree, probs=[], scores=[], suffix=suffix))
                outcome = Verified(tokens, path, finished=bool(finished))
                outcome.scores = [kept[0][b, j : j + 1] for j in range(count)] if kept[0] is not None else []
                outcome.logits = [kept[1][b, j : j + 1] for j in range(count)] if kept[1] is not None else []
                cut = self.stop_on_host(outcome, b, criteria[b])
                proposed.cut.append(cut)
                row = self.host[b]
                if shape.depth:  # the walked nodes the drafter ran: its own tree's, above the last depth
                    ran = sum(1 for j in path if subtree.node_ids[j] < shape.nodes)
                    row.drafted = row.prefix + min(ran, shape.depth)
                row.sequence += outcome.tokens
                row.prefix += count - cut
                row.drafted = min(row.drafted, row.prefix)
                verified.append(outcome)
            if self.chain:  # recurrent states back on the accepted path
                self.chain.after_read(self.slots, sub.tokens, self.host[0].prefix, self.host[0].drafted,
                                      known is None, shape.depth > 0, self.counters[0])
        self.counters[0].forwards += known is None
        self.counters[0].verify_steps += len(verified)
        self.counters[1].forwards += int(lag > 0)  # the catch-up
        self.counters[0].busy_s += time.perf_counter() - start
        return verified

    def accept(self, proposed: DeviceProposed, verified: list[Verified], keep: list[int]) -> None:
        """3. the suffix indices take the new tokens; rows that a host-side stop cut and that decode on are corrected
        (those that leave need nothing)."""
        for row, outcome in zip(self.host, verified):
            if row.suffix is not None:
                row.suffix.extend(outcome.tokens)
        staying = set(keep)
        cuts = [c if b in staying else 0 for b, c in enumerate(proposed.cut)]
        if any(cuts):
            roots = [v.tokens[-1] if v.tokens else 0 for v in verified]
            self.apply_cuts(proposed.after, cuts, roots)

    def apply_cuts(self, after: dict, cuts: list[int], roots: list[int]) -> None:
        """Rows whose walk a host-side stop cut by cuts[b] tokens, and that decode on: their prefix, root, budget and
        position moved back to the cut (their KV past it is never seen), their EOS ids cleared (they finished), the
        drafter's state at the cut (one copy, only in a round with such a row)."""
        pad = self.bucket - len(cuts)
        packed = to_device([cuts + [0] * pad, roots + [0] * pad], self.device)
        cut, root = packed[0], packed[1]
        rows = self.slots.rows
        stopped = cut > 0
        kept = after["result"][:, 0] - cut
        rows.prefix_lens.sub_(cut)
        rows.budgets.add_(cut)
        rows.positions.sub_(cut)
        rows.roots.copy_(torch.where(stopped, root, rows.roots))
        rows.eos.masked_fill_(stopped[:, None], -1)
        self.drafter.cut(rows, after, kept, cut)

    def observe(self, proposed: DeviceProposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """4. the shape menu prices the round's shape (tokens over the time between two reads), unless the round
        captured a graph (its time is the capture's, not the shape's). Under the latency guard (a running batch of
        requests) by its slowest row's tokens, as many times as rows: a shape wins only where every row gains from it,
        so no request decodes slower than a plain batch would decode it (policy/guard.py's rule for the host round)."""
        if proposed.captured or not verified:
            return
        tokens = [len(v.tokens) for v in verified]
        made = len(tokens) * min(tokens) if self.guard else sum(tokens)
        self.menu.observe(proposed.shape, made, proposed.read_s, proposed.promised, made - len(tokens))

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats:
        return SwiftSpecStats.collect(self.name, new_tokens, wall_s, *self.counters, clock=self.clock)

    def stop_on_host(self, outcome: Verified, b: int, rule: StopRule) -> int:
        """Apply the criteria the device cannot (stop strings, max_time, custom ones) to each prefix of the row's
        walk (acceptance.cut_at_criteria, every round's rule); cut the outcome there. Returns the tokens cut."""
        cut = cut_at_criteria(outcome.tokens, self.host[b].sequence, rule, outcome.scores or None)
        if cut is None:
            return 0
        keep = len(outcome.tokens) - cut
        del outcome.tokens[keep:], outcome.path[keep:], outcome.scores[keep:], outcome.logits[keep:]
        outcome.finished = True
        return cut
