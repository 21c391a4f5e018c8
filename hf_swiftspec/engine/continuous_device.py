"""The running batch on the device round (SwiftSpecConfig round="device"): engine/continuous.py's engine with
the device sides (engine/device_sides.py) under it, rows joining and leaving between rounds, the cache rows padded
to a bucket so the replayed phases see a few row counts only.

    join:   a request is prefilled alone (its prompt but the root) into small slot caches of its own,
            continuous.PREFILL_PIECE tokens per forward, one forward between two rounds; once prefilled, its
            KV is copied into the next free row of the running batch's caches (a device copy, no read)
    round:  engine/rounds.py's one_round over every cache row of the bucket: live rows first, then dead
            padding rows, which propose and verify like the others but with max_tokens 0 (the walk emits
            nothing, both commits move nothing) at prefix 0: a row writes its own cache row only, so a dead
            row never touches a live row's KV or tokens; the round's one host read is the verification's
    leave:  the rows that stay are moved down over the holes (keep_order: few moves, in place); the freed rows
            are dead padding from then on

Buckets: the live rows' count rounded up to a power of two (1, 2, 4, 8, ...). Each bucket has its own pair of
slot caches, allocated once and kept (`SlotPool`): their buffers' addresses are what a replayed phase bakes
in, so a bucket's graphs, captured the first time a batch of that bucket runs, replay whenever the batch comes
back to it. Changing bucket copies the live rows' KV into the other bucket's caches. Capacity: every row of
every bucket has C slots; a request needing more (prompt + max_new_tokens + the largest tree + scratch) grows
C to the next power of two, which re-allocates every bucket's caches and so drops every graph (counted:
`SlotPool.capacity_changes`).

Per row: its own sampler (greedy and sampled rows share a round: a greedy row's noise is zero), EOS ids,
budget and stop strings (DeviceSides applies stop strings on the host after the read).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..drafters.device_heads import DeviceHead
from ..drafters.device_suffix import proposal_tensor
from ..drafters.eagle3 import DraftHead
from ..drafters.suffix import SuffixIndex
from ..models.architectures import context_limit
from ..policy.goodput import GoodputPolicy
from ..policy.shapes import ShapeMenu
from ..stats import DraftCounters, PhaseClock, TargetCounters
from ..steps.capture import capture_backend
from ..steps.phase_graphs import PhaseRunner
from ..steps.slot_cache import SlotCache, catch_up
from ..steps.verify import NO_STOPS, Sampler, StopRule, Verified
from . import continuous
from .continuous import BatchBroken, ContinuousEngine, Joining, Member
from .device_sides import DeviceProposed, DeviceSides, RoundModels, RowsOnDevice, processors_signature
from .request import DecodeRequest

NO_ROOM = 1 << 30  # a model with no position limit: room for any shape


def running_batch_gaps(config, draft) -> list[str]:
    """What the running batch on the device round does not take, beside device_round_gaps' (a lone call's device
    round does): draft-free mode. With its fix."""
    if draft is None:
        return ["it grows a draft's trees, and this pair has none (draft-free mode); give a draft model or head"]
    return []


@dataclass
class BucketSuffix:
    """The running batch's suffix proposals (device_sides' DeviceSuffix, per cache row): each live row's SuffixIndex
    (its prompt, the request's corpus and the pair's earlier outputs), None for a dead row, which proposes nothing.

    nodes: S, the suffix nodes a row proposes a round; limit: the models' context, or None
    """

    ngram_size: int
    nodes: int
    limit: int | None
    device: torch.device
    indices: list = field(default_factory=list)
    policy: GoodputPolicy = field(default_factory=GoodputPolicy)  # its priors score the nodes (DeviceSuffix's)

    def join(self, row: int, request: DecodeRequest, sequence: list[int]) -> None:
        index = SuffixIndex(max_n=self.ngram_size, history=request.history, branching=True)
        index.add_corpus(request.corpus or [])
        index.extend(sequence)
        self.indices[row] = index

    def propose(self) -> torch.Tensor:
        """(bucket, FIELDS, S) float64 every cache row's proposal, in one host-to-device copy."""
        return proposal_tensor(self.indices, self.nodes, self.limit, self.policy, self.device)

    def accept(self, tokens: list[list[int]]) -> None:
        for index, new in zip(self.indices, tokens):
            if index is not None:
                index.extend(new)


def bucket_for(rows: int) -> int:
    """The cache rows a batch of `rows` live rows runs on: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(rows - 1, 0).bit_length()


@dataclass(frozen=True)
class BucketModels(RoundModels):
    """RoundModels for a bucket of the running batch: the key names the bucket and the rows' processors by their
    settings, so rows joining and leaving a bucket replay its graphs (a new processor object is no new graph)."""

    signature: tuple = ()

    def key(self) -> tuple:
        buffers = tuple(t.data_ptr() for c in self.caches for layer in c.layers for t in (layer.keys, layer.values))
        return len(self.processors), self.caches[0].capacity, buffers, self.signature, self.sample, self.keeps


@dataclass
class SlotPool:
    """The running batch's slot caches, one (target, draft) pair per bucket, kept across batches; each row C slots.

    layouts: per model, per layer, (H, D, dtype, device) of its keys and values (from the first prefill)
    """

    capacity: int = 0
    caches: dict[int, tuple[SlotCache, SlotCache]] = field(default_factory=dict)
    layouts: tuple | None = None
    capacity_changes: int = 0  # times C grew (each drops every bucket's caches and graphs)

    def fit(self, slots: int, runner: PhaseRunner | None) -> bool:
        """Make room for rows of `slots` slots: C grows to the next power of two past it. True if it grew (the
        buckets' caches are gone: the running rows must move to new ones, and the graphs are dropped)."""
        if slots <= self.capacity:
            return False
        grown = self.capacity > 0
        self.capacity = 1 << (slots - 1).bit_length()
        self.caches.clear()
        if runner is not None:
            runner.graphs.clear()
        self.capacity_changes += grown
        return grown

    def learn_layout(self, fresh: tuple[SlotCache, SlotCache]) -> None:
        if self.layouts is None:
            self.layouts = tuple(tuple((layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3],
                                        layer.keys.dtype, layer.keys.device) for layer in cache.layers) for cache in fresh)

    def for_bucket(self, bucket: int) -> tuple[SlotCache, SlotCache]:
        """The bucket's caches (allocated on first use, then kept: its graphs bake their addresses)."""
        if bucket not in self.caches:
            made = []
            for layout in self.layouts:
                cache = SlotCache(len(layout), self.capacity)
                for layer, (heads, key_dim, value_dim, dtype, device) in zip(cache.layers, layout):
                    layer.keys = torch.zeros(bucket, heads, self.capacity, key_dim, dtype=dtype, device=device)
                    layer.values = torch.zeros(bucket, heads, self.capacity, value_dim, dtype=dtype, device=device)
                    layer.is_initialized = True
                made.append(cache)
            self.caches[bucket] = tuple(made)
        return self.caches[bucket]


def copy_rows(source: tuple[SlotCache, SlotCache], into: tuple[SlotCache, SlotCache], rows: slice,
              at: int = 0, slots: int | None = None) -> None:
    """Copy cache rows `rows` of `source` (their first `slots` slots, default all the smaller capacity holds) into
    rows at, at + 1, ... of `into`, in place (a device copy: the destination buffers keep their addresses)."""
    for src_cache, dst_cache in zip(source, into):
        n = slots if slots is not None else min(src_cache.capacity, dst_cache.capacity)
        for src, dst in zip(src_cache.layers, dst_cache.layers):
            for a, b in ((src.keys, dst.keys), (src.values, dst.values)):
                part = a[rows, :, :n]
                b[at : at + part.shape[0], :, :n].copy_(part)


def models_limit(target, draft, head: DeviceHead | None) -> int | None:
    """The positions the pair places (a head's rope places any: the target's alone)."""
    return context_limit(target) if head is not None else context_limit(target, draft)


class Prefill:
    """A request on its way in: its prompt but the root prefilled into 1-row slot caches of its own.

    slots: what its row needs of the running batch's capacity (prompt + max_new_tokens + the largest tree + scratch)
    room:  positions the models place past its last token (the deepest shape it may grow)
    """

    def __init__(self, target, draft, request: DecodeRequest, tree_slots: int, head: DeviceHead | None = None):
        self.request, self.head = request, head
        self.sequence = request.prompt_ids()[0]  # host ints (the prompt's one read, at its join)
        self.committed = len(self.sequence) - 1
        self.slots = len(self.sequence) + request.max_new_tokens + tree_slots
        limit = models_limit(target, draft, head)
        self.room = limit - len(self.sequence) - request.max_new_tokens if limit else NO_ROOM
        width = max(self.committed, 1)
        self.caches = tuple(SlotCache(1 if head is not None and m is draft else m.config.get_text_config().num_hidden_layers,
                                      width + 1) for m in (target, draft))
        self.models = target, draft
        self.root_input: torch.Tensor | None = None  # a head's (1, H): the target's fused state before the root

    def in_pieces(self, piece: int):
        """One forward per model per `piece` prompt tokens (a generator: the engine runs one step between two
        rounds); a one-token prompt prefills nothing but makes the caches' buffers."""
        device = self.request.prompt.device
        ids = torch.tensor([self.sequence[:-1] or [0]], device=device)
        if self.head is not None:  # the head's prefill reads the target's states at every prompt token: one piece
            counts = torch.tensor([self.committed], device=device)
            with self.head.tap:
                catch_up(self.models[0], self.caches[0], ids, counts)
                self.root_input = self.head.prefill(self.caches[1], ids, counts)
            yield
            return
        for start in range(0, max(self.committed, 1), piece):
            end = min(start + piece, max(self.committed, 1))
            count = torch.tensor([max(min(end, self.committed) - start, 0)], device=device)
            starts = torch.tensor([start], device=device)
            for model, cache in zip(self.models, self.caches):
                catch_up(model, cache, ids[:, start:end], count, starts)
            yield


class DevicePaddedRows:
    """The running batch's rows as the device sides' phases see them: the live rows' criteria and budgets, then
    each dead padding row's (no stops, budget 0: its walk emits nothing and its commits move nothing)."""

    def __init__(self, rows, bucket: int):
        self.rows, self.bucket = rows, bucket
        self.live = list(rows.live) + [-1] * (bucket - len(rows.live))

    def criteria(self) -> list[StopRule]:
        return self.rows.criteria() + [NO_STOPS] * (self.bucket - len(self.rows.live))

    def budgets(self) -> list[int]:
        return self.rows.budgets() + [0] * (self.bucket - len(self.rows.live))


class BucketSides(DeviceSides):
    """DeviceSides over the running batch's bucket (module docstring): rows absorbed from Prefills, rows kept in
    place, the cache rows padded to the bucket with dead rows."""

    def __init__(self, target, draft, config, pool: SlotPool, runner: PhaseRunner | None,
                 head: DeviceHead | None = None):
        self.target, self.draft, self.runner, self.pool, self.config = target, draft, runner, pool, config
        self.counters = TargetCounters(), DraftCounters()
        self.last_read: float | None = None
        self.clock = PhaseClock.on(target.device)
        self.live = 0  # live rows (cache rows 0 .. live - 1)
        self.bucket = 0
        self.samplers: list[Sampler | None] = []  # per cache row (None: dead)
        self.sequences: list[list[int]] = []
        self.keeps_rows: list[tuple[bool, bool]] = []
        self.rooms: list[int] = []
        self.menu: ShapeMenu | None = None
        self.bucket_changes = 0
        self.rows = RowsOnDevice(torch.zeros(0, dtype=torch.long, device=target.device),
                                 torch.zeros(0, dtype=torch.long, device=target.device))
        self.models: BucketModels | None = None
        self.head = head  # a draft head's growth and catch-up (device_heads.py), or None: a draft model
        self.root_inputs: torch.Tensor | None = None  # a head's (bucket, H) per cache row (zeros: dead)
        unbounded = ShapeMenu.of(config.draft_depth, config.draft_width, config.tree_budget, NO_ROOM)
        nodes = max(s.budget for s in unbounded.shapes) - 1 if config.ngram_size else 0
        limit = models_limit(target, draft, head)
        self.suffix = BucketSuffix(config.ngram_size, nodes, limit, target.device) if nodes else None

    # ---- joining and leaving (between rounds)
    def absorb(self, prefill: Prefill) -> None:
        """The prefilled request's row joins as cache row `live` (the bucket grows if it is full)."""
        self.pool.learn_layout(prefill.caches)
        n = self.live
        self.resize(n + 1)
        copy_rows(prefill.caches, self.models.caches, slice(0, 1), at=n, slots=prefill.committed)
        at = torch.tensor([n], device=self.rows.roots.device)
        self.rows.prefix_lens.index_fill_(0, at, prefill.committed)
        self.rows.roots.index_fill_(0, at, prefill.sequence[-1])
        request = prefill.request
        self.samplers[n], self.sequences[n] = request.samplers[0], list(prefill.sequence)
        self.keeps_rows[n], self.rooms[n] = (request.keeps_scores, request.keeps_logits), prefill.room
        if self.suffix is not None:
            self.suffix.join(n, request, prefill.sequence)
        if self.head is not None:
            self.root_inputs[n] = prefill.root_input[0]
        self.menu = self.shapes_for(min(self.rooms[: n + 1]))
        self.models = self.round_models(self.models.caches)

    def shapes_for(self, room: int) -> ShapeMenu:
        """The menu for the batch's rows (the deepest shape the row with the least room can grow), its prices kept."""
        config = self.config
        menu = ShapeMenu.of(config.draft_depth, config.draft_width, config.tree_budget, room)
        if self.menu is not None:
            menu.prices = {s: p for s, p in self.menu.prices.items() if s in menu.shapes}
            menu.rounds = self.menu.rounds
        return menu

    def keep_rows(self, order: list[int]) -> None:
        """Keep cache rows `order` (keep_order's: each hole below len(order) filled from beyond it) as rows
        0 .. len(order) - 1, in place; the rest are dead from now on (and the bucket may shrink)."""
        index = self.tensor(order)
        n = len(order)
        for cache in self.models.caches:
            for layer in cache.layers:
                for buffer in (layer.keys, layer.values):
                    buffer[:n] = buffer[index]
        self.rows.prefix_lens[:n] = self.rows.prefix_lens[index]
        self.rows.roots[:n] = self.rows.roots[index]
        for name in ("samplers", "sequences", "keeps_rows", "rooms"):
            kept = getattr(self, name)
            setattr(self, name, [kept[b] for b in order] + kept[n:])
        if self.suffix is not None:
            kept = self.suffix.indices
            self.suffix.indices = [kept[b] for b in order] + kept[n:]
        if self.head is not None:
            self.root_inputs[:n] = self.root_inputs[index]
        self.live = n
        self.resize(n)
        self.models = self.round_models(self.models.caches)

    def resize(self, live: int) -> None:
        """Run `live` rows (0 .. live - 1 hold them) on their bucket: change to its caches if it is another (the
        live rows' KV copied over), and mark every row past them dead (prefix 0, root 0, no sampler)."""
        bucket = bucket_for(live)
        old = self.models.caches if self.models is not None else None
        caches = self.pool.for_bucket(bucket)
        if old is not None and caches is not old:
            copy_rows(old, caches, slice(0, min(live, self.live)))
        if bucket != self.bucket:
            self.bucket_changes += self.bucket > 0
        kept = min(live, self.live)
        device = self.rows.roots.device
        pad = torch.zeros(bucket - kept, dtype=torch.long, device=device)
        self.rows = RowsOnDevice(torch.cat([self.rows.prefix_lens[:kept], pad]), torch.cat([self.rows.roots[:kept], pad]))
        dead = bucket - kept
        self.samplers = self.samplers[:kept] + [None] * dead
        self.sequences = self.sequences[:kept] + [[] for _ in range(dead)]
        self.keeps_rows = self.keeps_rows[:kept] + [(False, False)] * dead
        self.rooms = self.rooms[:kept] + [NO_ROOM] * dead
        if self.suffix is not None:
            self.suffix.indices = self.suffix.indices[:kept] + [None] * dead
        if self.head is not None:
            H = self.head.head.hidden_size
            old_inputs = self.root_inputs if self.root_inputs is not None else torch.zeros(0, H, device=device,
                                                                                            dtype=self.head.head.dtype)
            self.root_inputs = torch.cat([old_inputs[:kept], old_inputs.new_zeros(dead, H)])
        self.live, self.bucket = live, bucket
        self.models = self.round_models(caches)

    def move_to(self, caches: tuple[SlotCache, SlotCache]) -> None:
        """The pool's capacity grew: the live rows' KV moves to the new caches of their bucket."""
        copy_rows(self.models.caches, caches, slice(0, self.live))
        self.models = self.round_models(caches)

    def round_models(self, caches: tuple[SlotCache, SlotCache]) -> BucketModels:
        processors = tuple(s.logits_processor if s is not None else () for s in self.samplers)
        live = [s for s in self.samplers if s is not None]
        keeps = tuple(any(k[i] for k in self.keeps_rows) for i in (0, 1))
        return BucketModels(self.target, self.draft, caches, processors, any(s.do_sample for s in live), keeps,
                            self.target.config.get_text_config().vocab_size,
                            head=self.head, signature=tuple(processors_signature(p) for p in processors))

    # ---- the round's phases over the bucket (DeviceSides'), the dead rows' results dropped
    def verify(self, proposed: DeviceProposed, rows) -> list[Verified]:
        verified = super().verify(proposed, DevicePaddedRows(rows, self.bucket))
        n = len(rows.live)
        del proposed.proposals[n:]
        self.counters[0].verify_steps -= self.bucket - n
        return verified[:n]

    def accept(self, proposed: DeviceProposed, verified: list[Verified], keep: list[int]) -> None:
        dead = [Verified([], []) for _ in range(self.bucket - len(verified))]
        super().accept(proposed, verified + dead, keep)

    def noise(self, T: int, depth: int) -> torch.Tensor:
        """(B, D, V) float64: each sampled row's Gumbel noise (DeviceSides.noise), zero for greedy and dead rows
        (argmax of the scores plus zero is the greedy choice)."""
        deepest = min(T, depth + 1)
        vocab = self.target.get_output_embeddings().weight.shape[0]
        device = self.rows.roots.device
        return torch.stack([
            s.gumbel([len(seq) + d for d in range(deepest)], vocab, device) if s is not None and s.do_sample
            else torch.zeros(deepest, vocab, dtype=torch.float64, device=device)
            for s, seq in zip(self.samplers, self.sequences)
        ])


class DeviceContinuousEngine(ContinuousEngine):
    """ContinuousEngine (engine/continuous.py) whose rounds are the device round's over bucketed cache rows (see
    the module docstring). config: the pair's SwiftSpecConfig (round="device"; its capture, shapes)."""

    on_device = True

    def __init__(self, target, draft, policy, config, finish=None):
        super().__init__(target, draft, policy, build=None, finish=finish, latency_guard=False)  # no policy sizes its trees
        self.config = config
        backend = capture_backend(config.capture, target.device)
        self.runner = PhaseRunner(backend) if backend is not None else None
        self.pool = SlotPool()
        self.head = DeviceHead.of(draft, target) if isinstance(draft, DraftHead) else None  # its tap: the engine's
        unbounded = ShapeMenu.of(config.draft_depth, config.draft_width, config.tree_budget, NO_ROOM)
        suffix = max(s.budget for s in unbounded.shapes) - 1 if config.ngram_size else 0
        self.tree_slots = max(s.nodes for s in unbounded.shapes) + suffix + 2  # the tree region, then scratch
        self.bucket_changes = 0  # over every batch the engine ran

    def graphs_by_bucket(self) -> Counter:
        """Replayed phases captured, by the bucket they run (the number of cache rows their key names)."""
        return Counter(key[-1][0] for key in self.runner.graphs) if self.runner is not None else Counter()

    def join(self, member: Member) -> None:
        """Start prefilling the request alone; the pool's capacity grows first if its row needs more slots."""
        prefill = Prefill(self.target, self.draft, member.request, self.tree_slots, self.head)
        ShapeMenu.of(self.config.draft_depth, self.config.draft_width, self.config.tree_budget, prefill.room)
        if self.pool.fit(prefill.slots, self.runner) and self.sides is not None:
            try:
                self.sides.move_to(self.pool.for_bucket(self.sides.bucket))
            except Exception as error:
                raise BatchBroken(error) from error
        self.joining.append(Joining(member, prefill, prefill.in_pieces(continuous.PREFILL_PIECE)))

    def take_in(self, joining: Joining) -> None:
        """The bucket's sides copy the prefilled row in (made on the first join)."""
        if self.sides is None:
            self.sides = BucketSides(self.target, self.draft, self.config, self.pool, self.runner, self.head)
        try:
            before = self.sides.bucket_changes
            self.sides.absorb(joining.sides)
            self.bucket_changes += self.sides.bucket_changes - before
        except Exception as error:
            raise BatchBroken(error) from error

    def leave(self, keep: list[int]) -> None:
        before = self.sides.bucket_changes if self.sides is not None else 0
        sides = self.sides
        super().leave(keep)
        if sides is not None:
            self.bucket_changes += sides.bucket_changes - before
