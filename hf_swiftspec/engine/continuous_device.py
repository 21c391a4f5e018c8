"""The running batch on the device round (SwiftSpecConfig round="device"): engine/continuous.py's engine with the
device sides (engine/device_sides.py) under it, rows joining and leaving between rounds.

    join:   the requests joining between two rounds are prefilled in groups (`PrefillGroup`: rows of slots of their
            own, one forward of each model per continuous.PREFILL_PIECE tokens for every row of a group, each row its
            own tokens, count and start, one piece between two rounds); which prompts share a forward, the padding of
            the shorter ones against a forward's fixed cost, is `PrefillCosts`' (fitted from the forwards timed on a
            CPU; every prompt in one on CUDA). A row's device state is set in the same copy as its prompt. Once its
            group's last piece has run, the sides copy each row's KV and state into the next free row of the running
            batch's slots (a device copy, no read: DeviceSides.absorb), before the next round. Where no row decodes, the
            target's last piece runs each prompt's root too and keeps its logits: the batch the group starts runs a
            plain first round with no forward (DeviceSides.starts_plain), so a request on an idle server streams its
            first token with its prefill, as transformers' server does, not after a tree round
    round:  engine/rounds.py's one_round over every cache row of the bucket (the live rows, then dead padding rows
            with a budget of 0, which emit and commit nothing); the round's one host read is the verification's
    leave:  the rows that stay are moved down over the holes (keep_order: few moves, in place); the freed rows are
            dead from then on, and the batch moves to a smaller bucket's slots where it fits one

The slots of every bucket, and the graphs replayed over them, are the engine's pool's (engine/device_pool.py): a
bucket's graphs, captured the first time a batch of its size runs, replay whenever the batch comes back to it.
A request needing more slots than the capacity (prompt + max_new_tokens + the largest tree + scratch) moves the
batch to slots of the next power of two.

Per row: its own sampler (greedy and sampled rows share a round: a greedy row's noise is zero), EOS ids, budget and
stop strings (DeviceSides applies stop strings on the host after the read).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..drafters.device_drafters import device_drafter
from ..drafters.device_host import HostProposals
from ..steps.capture import capacity_bucket, capture_backend, capture_gap, power_of_two
from ..steps.device_round import to_device
from ..steps.slot_cache import SlotCache
from ..steps.acceptance import split_criteria
from . import continuous
from .continuous import BatchBroken, ContinuousEngine, Joining, Member, same_prefill
from .prefix_store import PrefixHit, PrefixStore
from .device_pool import RowsOnDevice, SlotPool, Slots, row_values, set_rows
from .device_sides import EOS_WIDTH, DeviceSides, RowOnHost, models_described


class Prefill:
    """A request on its way in (its host side): its prompt, what the host keeps of its row (`row`), what it needs of the
    batch's slots (`capacity`, `eos_width`), the stored prefix it reuses (`hit`, looked up when it is grouped); its
    slots are row `index` of its group's (PrefillGroup) once one takes it."""

    def __init__(self, sides: DeviceSides, request, prefixes: PrefixStore | None = None):
        self.sides, self.request = sides, request
        self.sequence = request.prompt_ids()[0]  # host ints (the prompt's one read, at its join)
        committed = len(self.sequence) - 1
        self.stops = split_criteria(request.stopping_criteria)
        self.eos_width = max(EOS_WIDTH, power_of_two(len(self.stops.eos)))
        self.capacity = capacity_bucket(len(self.sequence) + request.max_new_tokens + sides.tree_slots)
        sampler = request.samplers[0]
        suffix = sides.suffix.index_for(request, self.sequence) if sides.suffix is not None else None
        self.row = RowOnHost(sampler, list(self.sequence), committed, (request.keeps_scores, request.keeps_logits),
                             suffix, committed)
        self.width = max(committed, 1)  # the tokens it prefills (a one-token prompt: one padding column, count 0)
        # shared prefixes' target KV (engine/prefix_store.py); not for a drafter that reads the target's states of them
        self.prefixes = None if sides.drafter.reads_target else prefixes
        self.hit: PrefixHit | None = None
        self.reused = 0  # the prompt's slots copied from `hit`, not prefilled by the target
        self.root_logits: torch.Tensor | None = None  # (1, 1, V) its root's, where its group ran the roots
        self.slots: Slots | None = None
        self.index = 0
        self.grouped_with = 1  # the prompts prefilled in its group
        # a draft proposing from the host: its drafter for the row, started on the prompt (it runs at its first growth)
        self.host = sides.proposer.started(request) if sides.proposer is not None else None

    def look_up(self) -> None:
        """The longest stored prefix of this prompt (none: nothing reused). The prompt's last committed token is left
        out of the search, so that the target always prefills a piece (and the drafter's catch-up over the copied slots
        runs with it)."""
        if self.prefixes is not None:
            self.hit = self.prefixes.longest(self.sequence[: self.row.prefix - 1])
            self.reused = self.hit.length if self.hit is not None else 0

    def state(self, eos_width: int) -> list[int]:
        """Its row's device state as host ints (row_values', EOS ids padded to eos_width)."""
        return row_values(self.row.sampler, self.sequence[-1], self.row.prefix, self.request.max_new_tokens,
                          len(self.sequence), self.stops.eos, eos_width)

    def windows(self, drafts: bool) -> tuple[int, int]:
        """Where each model's prefill starts (target, drafter): past the copied slots for the target, from the start
        for a draft model (its KV and state are its own)."""
        return self.reused, 0 if drafts else self.reused

    def kept_in(self) -> None:
        """Its prefill done: its prompt's target KV is kept for later requests (before the batch copies its row in)."""
        if self.prefixes is not None:
            self.prefixes.keep(self.sequence[: self.row.prefix], self.slots.caches[0],
                               row=self.index if self.grouped_with > 1 else None)

    def copy_for(self, request) -> "RowCopy":
        """The row of another request for the same prompt and length (a request's n answers: continuous.same_prefill),
        which shares this prefill: its own sampler, stop rule, suffix index and device state, the prompt's KV
        copied from this one's slots when the batch takes them in."""
        stops = split_criteria(request.stopping_criteria)
        eos_width = max(EOS_WIDTH, power_of_two(len(stops.eos)))
        sampler, committed = request.samplers[0], self.row.prefix
        suffix = self.sides.suffix.index_for(request, self.sequence) if self.sides.suffix is not None else None
        row = RowOnHost(sampler, list(self.sequence), committed, (request.keeps_scores, request.keeps_logits), suffix,
                        committed)
        state = row_values(sampler, self.sequence[-1], committed, request.max_new_tokens, len(self.sequence), stops.eos,
                           eos_width)
        host = self.sides.proposer.started(request) if self.sides.proposer is not None else None  # its own drafter
        return RowCopy(row, to_device([state], self.sides.device), eos_width, host)


class PrefillGroup:
    """Joining requests prefilled together, between two rounds: their rows of one set of slots (its prompts and states
    set in one copy), one forward of each model per piece for every row, each row its own tokens, count and start (the
    shorter rows padded: their padding writes the scratch slot). `PrefillCosts.groups` says which prompts share one.
    roots: the target runs each prompt's root too, in its last piece, and keeps its logits (`Prefill.root_logits`), so
    that a batch these rows start runs a plain first round, no forward: their first tokens come out with the prefill
    (DeviceSides.starts_plain; the engine asks for it where no row decodes)."""

    def __init__(self, sides: DeviceSides, prefills: list[Prefill], roots: bool = False):
        self.sides, self.prefills, self.roots = sides, prefills, roots
        width = max(p.width for p in prefills)
        eos_width = max(p.eos_width for p in prefills)
        (target_layers, *target_rules), (draft_layers, *draft_rules) = sides.layers()  # (window rules, attention)
        k = len(prefills)
        capacity = width + 2  # the prompt but its root, the root's slot, the scratch slot
        self.slots = Slots((SlotCache(target_layers, capacity, *target_rules),
                            SlotCache(draft_layers, capacity, *draft_rules) if draft_layers else None),
                           RowsOnDevice.empty(k, eos_width, sides.drafter.state_fields(capacity), sides.device))
        packed = to_device([p.sequence + [0] * (width + 1 - len(p.sequence)) + p.state(eos_width) for p in prefills],
                           sides.device)  # the prompts (their roots too) and the rows' state, one copy
        self.ids, self.width = packed[:, : width + 1], width
        self.root_logits = None  # (k, 1, V) each row's root's logits, as its last piece makes them (roots)
        self.done = False  # its last piece has run (in_pieces)
        self.joining: list[Joining] = []  # the engine's, one per prefill (its members: the requests it answers)
        set_rows(self.slots.rows, packed[:, width + 1 :], 0)
        target = self.slots.caches[0]
        for b, p in enumerate(prefills):
            p.slots, p.index, p.grouped_with = self.slots, b, k
            if p.hit is not None:  # the prompt's slots copied, not prefilled
                if not target.buffers:
                    target.allocate(p.hit.stored.cache, k)
                target.copy_rows(p.hit.stored.cache, slice(0, 1), at=b, slots=p.hit.length)

    @property
    def members(self) -> list[Member]:
        return [m for j in self.joining for m in j.members]

    def in_pieces(self, piece: int):
        """One forward of each model per `piece` prompt tokens of every row (a generator: the engine runs one piece
        between two rounds); the target's rows start past their copied slots, a draft model's from the start. With
        roots, the target's rows end past their roots, right-aligned in each piece (the last column's logits are the
        roots' of the rows whose prompt ends in that piece)."""
        drafts = self.sides.drafter.model is not None
        starts = [list(p.windows(drafts)) for p in self.prefills]  # each row's next (target, drafter) slot
        committed = [p.row.prefix for p in self.prefills]
        ends = [(c + 1 if self.roots else p.width, p.width) for p, c in zip(self.prefills, committed)]
        limits = [(c + self.roots, c) for c in committed]  # the real tokens each model runs of a row
        while any(s < e for row, end in zip(starts, ends) for s, e in zip(row, end)):
            windows = []  # per model: each row's (start, end) this piece
            for m in (0, 1):
                windows.append([(s[m], min(s[m] + piece, e[m])) for s, e in zip(starts, ends)])
            runs = [any(a < b for a, b in w) for w in windows]
            L = [max(b - a for a, b in w) for w in windows]
            values = [[a for a, _ in w] + [max(min(b, c[m]) - a, 0) for (a, b), c in zip(w, limits)]
                      for m, w in enumerate(windows)]
            packed = to_device(values, self.ids.device)  # both models' starts and counts, one copy
            pieces, k = [], len(self.prefills)
            for m in (0, 1):
                at, count = packed[m, :k], packed[m, k:]
                lead = max(L[m], 1) - count if m == 0 and self.roots else None  # the target's rows right-aligned
                j = torch.arange(max(L[m], 1), device=at.device)[None]
                columns = at[:, None] + (j if lead is None else j - lead[:, None])
                pieces.append((self.ids.gather(1, columns.clamp(min=0, max=self.width)), count, at, lead))
            end = max(b for w in windows for _, b in w)
            if runs[0]:
                same = windows[0] == windows[1] and not self.roots
                *target, lead = pieces[0]
                logits = self.sides.prefill(self.slots, *target, end=end, lead=lead, drafter=runs[1],
                                            drafter_piece=None if same or not runs[1] else pieces[1][:3])
                if self.roots:
                    self.keep_root_logits(logits, windows[0], ends)
            else:  # the drafter alone, over slots whose target KV was copied
                self.sides.prefill(self.slots, *pieces[1][:3], end=end, target=False)
            starts = [[t, d] for (_, t), (_, d) in zip(*windows)]
            self.done = not any(s < e for row, end in zip(starts, ends) for s, e in zip(row, end))
            yield

    def keep_root_logits(self, logits: torch.Tensor, windows: list[tuple[int, int]], ends: list[tuple[int, int]]):
        """The roots' logits (1, 1, V) of the rows whose target window ended at their root this piece, each kept as its
        Prefill's root_logits (a device copy)."""
        if self.root_logits is None:
            self.root_logits = torch.zeros_like(logits)
        for b, ((a, e), end) in enumerate(zip(windows, ends)):
            if a < e == end[0]:
                self.root_logits[b].copy_(logits[b])
                self.prefills[b].root_logits = self.root_logits[b : b + 1]


PREFILL_TOKENS = 4096  # prompt tokens (the padding included) one prefill forward runs at most, for every row of it
FIXED_TOKENS = 32  # a prefill forward's fixed cost in prompt tokens' worth until PrefillCosts has measured it (CPU)
COST_SAMPLES = 32  # the last prefill forwards PrefillCosts fits


@dataclass
class PrefillCosts:
    """What a prefill forward costs, seconds = fixed + per_token x tokens (every row's piece padded to the longest),
    fitted by least squares over the last COST_SAMPLES forwards, and which joining prompts therefore share one: a row
    joins a forward where the padding it adds costs less than a forward of its own. On CUDA the forwards are not timed
    (a timing would wait for the stream) and cost little beside their launch: every prompt shares one, up to
    PREFILL_TOKENS."""

    timed: bool = True
    samples: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        if self.timed:
            self.samples = (self.samples + [(tokens, seconds)])[-COST_SAMPLES:]

    def fixed_tokens(self) -> float:
        """A forward's fixed cost in tokens' worth (fixed / per_token): FIXED_TOKENS until two sizes were timed."""
        if not self.timed:
            return float(PREFILL_TOKENS)
        n = len(self.samples)
        if n < 4:
            return float(FIXED_TOKENS)
        mx = sum(t for t, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        var = sum((t - mx) ** 2 for t, _ in self.samples)
        if var == 0:
            return float(FIXED_TOKENS)
        per_token = sum((t - mx) * (s - my) for t, s in self.samples) / var
        fixed = my - per_token * mx
        if per_token <= 0:  # noise: no slope to price padding by
            return float(FIXED_TOKENS)
        return min(max(fixed / per_token, 0.0), float(PREFILL_TOKENS))

    def groups(self, lengths: list[int]) -> list[list[int]]:
        """The prompts of `lengths` (each one's longest window this piece) in groups of one forward each: the partition
        of the prompts sorted by length into runs that costs least, a run costing fixed + rows x its longest (in
        tokens), none past PREFILL_TOKENS. Returns indices into `lengths`, each group in arrival order, groups by their
        first arrival."""
        fixed = self.fixed_tokens()
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        best = [0.0] + [float("inf")] * len(order)  # best[j]: the cheapest partition of the first j
        cut = [0] * (len(order) + 1)
        for j in range(1, len(order) + 1):
            for i in range(j - 1, -1, -1):  # the run order[i:j], whose longest is order[i]'s (ties: the shorter run)
                rows, longest = j - i, max(lengths[order[i]], 1)
                if rows > 1 and rows * longest > PREFILL_TOKENS:
                    continue
                cost = best[i] + fixed + rows * longest
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        groups, j = [], len(order)
        while j:
            groups.append(sorted(order[cut[j] : j]))
            j = cut[j]
        return sorted(groups)


@dataclass
class RowCopy:
    """A request sharing another's prefill (Prefill.copy_for): its row on the host and its row's device state (1, 7 + E)
    long (row_values' layout), set over the copied row's; its host drafter where the draft proposes from the host."""

    row: RowOnHost
    state: torch.Tensor
    eos_width: int
    host: object = None


PREFIX_POSITIONS = 8192  # slots of shared prompt prefixes kept by default (engine/prefix_store.py)


class DeviceContinuousEngine(ContinuousEngine):
    """ContinuousEngine (engine/continuous.py) whose rounds are the device round's over bucketed cache rows (see
    the module docstring). config: the pair's SwiftSpecConfig (round="device"; its capture, shapes)."""

    on_device = True

    def __init__(self, target, draft, policy, config, finish=None, latency_guard: bool = True,
                 host: HostProposals | None = None):
        super().__init__(target, draft, policy, build=None, finish=finish, latency_guard=latency_guard)
        self.config = config
        self.host = host  # the draft's proposals from the host side (drafters/device_host.py), each batch its own
        self.drafter = device_drafter(None if host is not None else draft, target)  # a head's tap: the engine's
        # phases replayed where capture says and the models allow (capture_gap: rules by slot run eagerly, each forward
        # over the live length, which a rule of a key budget or an indexer's top-k needs: run_device's rule)
        eager = any(a is not None and capture_gap(a) for a in models_described(target, self.drafter))
        backend = None if eager else capture_backend(config.capture, target.device, config.compile)
        self.pool = SlotPool(backend, config.compile)
        self.runner = self.pool.runner
        self.prefixes = PrefixStore(PREFIX_POSITIONS)  # shared prompt prefixes' target KV (a server sets its own bound)
        self._capacity = 0  # the last batch's slot capacity
        self.changes = Counter()  # the batch's moves to other slots (bucket, capacity), over every batch it ran
        self.groups: list[PrefillGroup] = []  # joining requests' prefills under way, one forward of each model a group
        self.costs = PrefillCosts(timed=target.device.type != "cuda")

    @property
    def bucket_changes(self) -> int:
        return self.changes["bucket"]

    @property
    def capacity_changes(self) -> int:
        return self.changes["capacity"]

    def graphs_by_slots(self) -> Counter:
        """Replayed phases captured, by the (bucket, span) they run (the cache rows and live length their key names)."""
        if self.runner is None:
            return Counter()
        return Counter((key[1], dict(key[3])["span"]) for key in self.runner.graphs)

    def new_sides(self) -> DeviceSides:
        """Sides for a new batch, at the capacity the last one reached (its slots and graphs are the pool's)."""
        sides = DeviceSides(self.target, self.drafter, self.config, self.pool, self.policy, self.changes,
                            guard=self.latency_guard, host=self.host.fresh() if self.host is not None else None)
        sides.capacity = self.capacity
        return sides

    @property
    def capacity(self) -> int:
        return self.sides.capacity if self.sides is not None else self._capacity

    def end_batch(self) -> None:
        if self.sides is not None:
            self._capacity = self.sides.capacity
        super().end_batch()

    def join(self, member: Member) -> None:
        """Start prefilling the request alone; or, where a request joining meanwhile prefills the same prompt for as
        many tokens, share its prefill (its copy's row: Prefill.copy_for)."""
        if self.sides is None:
            self.sides = self.new_sides()
        if self.routes is None:  # the models attend as the sides say (the tree kernel: routed) until the batch ends
            self.routes = contextlib.ExitStack()
            self.routes.enter_context(self.sides.attending.routed())
        leader = next((j for j in self.joining if same_prefill(j.member.request, member.request)), None)
        if leader is not None:
            leader.copies.append((member, leader.sides.copy_for(member.request)))
            return
        self.joining.append(Joining(member, Prefill(self.sides, member.request, self.prefixes), None))

    def prefill_pieces(self) -> None:
        """One prefill forward of each model for each group of requests joining (the ones not yet in a group grouped
        first: PrefillCosts.groups), then once more while no row decodes; a group whose last piece ran joins the running
        sides at once."""
        while self.joining:
            self.group_joining()
            for group in list(self.groups):
                self.guarded(lambda g=group: self.prefill_piece(g), members=group.members)
                if any(m.done.is_set() for m in group.members):  # it failed
                    self.drop_group(group)
            if self.rows.live:
                return
        if not self.rows.live:
            self.end_batch()

    def group_joining(self) -> None:
        """The requests joining that no group prefills yet, grouped (each prompt's reused prefix looked up first)."""
        new = [j for j in self.joining if j.sides.slots is None and not any(j in g.joining for g in self.groups)]
        if not new:
            return
        drafts = self.drafter.model is not None
        for joining in new:
            joining.sides.look_up()
        lengths = [min(j.sides.width - min(j.sides.windows(drafts)), continuous.PREFILL_PIECE) for j in new]
        for indices in self.costs.groups(lengths):
            joinings = [new[i] for i in indices]

            def start(joinings=joinings) -> None:
                # where no row decodes, the target runs the roots too: the batch they start runs a plain first round
                roots = not self.rows.live and self.sides.starts_plain
                group = PrefillGroup(self.sides, [j.sides for j in joinings], roots=roots)
                group.joining = joinings
                group.pieces = group.in_pieces(continuous.PREFILL_PIECE)
                self.groups.append(group)

            self.guarded(start, members=[m for j in joinings for m in j.members])
            for joining in joinings:
                if joining.member.done.is_set():  # its group failed to start
                    self.joining.remove(joining)

    def prefill_piece(self, group: PrefillGroup) -> None:
        """One forward of each model over the group's rows (timed for PrefillCosts); after its last, its requests join
        the running sides, in arrival order."""
        start = time.perf_counter()
        next(group.pieces)
        self.costs.observe(len(group.prefills) * group.width, time.perf_counter() - start)
        if not group.done:
            return
        self.drop_group(group)
        for joining in group.joining:
            self.take_in(joining)
            for member in joining.members:
                self.rows.members[member.row_id] = member
                self.rows.live.append(member.row_id)

    def drop_group(self, group: PrefillGroup) -> None:
        """The group and its requests leave the joining (done, or failed: once either way)."""
        if group in self.groups:
            self.groups.remove(group)
        for joining in group.joining:
            if joining in self.joining:
                self.joining.remove(joining)

    def take_in(self, joining: Joining) -> None:
        """The bucket's sides copy the prefilled row in, and once more for each request sharing its prefill (its own
        state set over the copy), new sides when the batch had emptied."""
        prefill = joining.sides
        prefill.kept_in()
        if self.sides is None:
            self.sides = self.new_sides()
        try:
            self.sides.absorb(prefill.slots, prefill.row, prefill.capacity, prefill.eos_width, prefill.host,
                              prefill.index, prefill.root_logits)
            for _, copy in joining.copies:
                self.sides.absorb(prefill.slots, copy.row, prefill.capacity, max(prefill.eos_width, copy.eos_width),
                                  copy.host, prefill.index, prefill.root_logits)
                set_rows(self.sides.slots.rows, copy.state, self.sides.live - 1)
        except Exception as error:
            raise BatchBroken(error) from error
