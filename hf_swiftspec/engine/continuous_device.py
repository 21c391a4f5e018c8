"""The running batch on the device round (SwiftSpecConfig round="device"): engine/continuous.py's engine with the
device sides (engine/device_sides.py) under it, rows joining and leaving between rounds.

    join:   a request is prefilled alone into 1-row slots of its own (`Prefill`), continuous.PREFILL_PIECE tokens
            per forward of each model, one piece between two rounds; its row's device state is set in the same
            copy as its prompt. Once prefilled, the sides copy its KV and state into the next free row of the running
            batch's slots (a device copy, no read: DeviceSides.absorb)
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
from collections import Counter
from dataclasses import dataclass

import torch

from ..drafters.device_drafters import device_drafter
from ..drafters.device_host import HostProposals
from ..steps.capture import capacity_bucket, capture_backend, power_of_two
from ..steps.device_round import to_device
from ..steps.slot_cache import SlotCache
from ..steps.acceptance import split_criteria
from . import continuous
from .continuous import BatchBroken, ContinuousEngine, Joining, Member, same_prefill
from .prefix_store import PrefixStore
from .device_pool import RowsOnDevice, SlotPool, Slots, row_values, set_rows
from .device_sides import EOS_WIDTH, DeviceSides, RowOnHost


class Prefill:
    """A request on its way in: its prompt but the root prefilled into 1-row slots of its own, its row's device state
    set (`row`: what the host keeps of it; `capacity`, `eos_width`: what it needs of the batch's slots)."""

    def __init__(self, sides: DeviceSides, request, prefixes: PrefixStore | None = None):
        self.sides, self.request = sides, request
        self.sequence = request.prompt_ids()[0]  # host ints (the prompt's one read, at its join)
        committed = len(self.sequence) - 1
        stops = split_criteria(request.stopping_criteria)
        self.eos_width = max(EOS_WIDTH, power_of_two(len(stops.eos)))
        self.capacity = capacity_bucket(len(self.sequence) + request.max_new_tokens + sides.tree_slots)
        sampler = request.samplers[0]
        suffix = sides.suffix.index_for(request, self.sequence) if sides.suffix is not None else None
        self.row = RowOnHost(sampler, list(self.sequence), committed, (request.keeps_scores, request.keeps_logits),
                             suffix, committed)
        width = max(committed, 1)
        (target_layers, *target_rules), (draft_layers, *draft_rules) = sides.layers()  # (window rules, attention)
        self.slots = Slots((SlotCache(target_layers, width + 1, *target_rules),
                            SlotCache(draft_layers, width + 1, *draft_rules) if draft_layers else None),
                           RowsOnDevice.empty(1, self.eos_width, sides.drafter.state_fields(width + 1), sides.device))
        state = row_values(sampler, self.sequence[-1], committed, request.max_new_tokens, len(self.sequence), stops.eos,
                           self.eos_width)
        packed = to_device([(self.sequence[:-1] or [0]) + state], sides.device)  # its prompt and state, one copy
        self.ids, self.width = packed[:, :width], width
        set_rows(self.slots.rows, packed[:, width:], 0)
        # shared prefixes' target KV (engine/prefix_store.py); not for a drafter that reads the target's states of them
        self.prefixes = None if sides.drafter.reads_target else prefixes
        self.reused = self.reuse() if self.prefixes is not None else 0  # the prompt's slots copied, not prefilled
        # a draft proposing from the host: its drafter for the row, started on the prompt (it runs at its first growth)
        self.host = sides.proposer.started(request) if sides.proposer is not None else None

    def reuse(self) -> int:
        """Copy the target's KV of the longest stored prefix of this prompt into its slots: the slots it need not
        prefill (0: none stored). The prompt's last committed token is left out of the search, so that the target
        always prefills a piece (and the drafter's catch-up over the copied slots runs with it)."""
        hit = self.prefixes.longest(self.sequence[: self.row.prefix - 1])
        if hit is None:
            return 0
        target = self.slots.caches[0]
        target.allocate(hit.stored.cache, 1)
        target.copy_rows(hit.stored.cache, slice(0, 1), at=0, slots=hit.length)
        return hit.length

    def kept_in(self) -> None:
        """Its prefill done: its prompt's target KV is kept for later requests (before the batch copies its row in)."""
        if self.prefixes is not None:
            self.prefixes.keep(self.sequence[: self.row.prefix], self.slots.caches[0])

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

    def in_pieces(self, piece: int):
        """One forward of each model per `piece` prompt tokens (a generator: the engine runs one piece between two
        rounds); a one-token prompt prefills nothing but makes the caches' buffers."""
        committed, reused = self.row.prefix, self.reused
        device = self.ids.device
        pieces = [(start, min(start + piece, reused), False) for start in range(0, reused, piece)]  # the drafter's alone
        pieces += [(start, min(start + piece, self.width), True) for start in range(reused, self.width, piece)]
        for start, end, target in pieces:  # (reused < width: the target's pieces are never none)
            count = torch.full((1,), max(min(end, committed) - start, 0), device=device)
            starts = torch.full((1,), start, device=device)
            self.sides.prefill(self.slots, self.ids[:, start:end], count, starts, end=end, target=target)
            if target:  # the drafter's catch-up over the copied slots runs with the first target piece, not alone
                yield


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
        self.pool = SlotPool(capture_backend(config.capture, target.device, config.compile), config.compile)
        self.runner = self.pool.runner
        self.host = host  # the draft's proposals from the host side (drafters/device_host.py), each batch its own
        self.drafter = device_drafter(None if host is not None else draft, target)  # a head's tap: the engine's
        self.prefixes = PrefixStore(PREFIX_POSITIONS)  # shared prompt prefixes' target KV (a server sets its own bound)
        self._capacity = 0  # the last batch's slot capacity
        self.changes = Counter()  # the batch's moves to other slots (bucket, capacity), over every batch it ran

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
        prefill = Prefill(self.sides, member.request, self.prefixes)
        self.joining.append(Joining(member, prefill, prefill.in_pieces(continuous.PREFILL_PIECE)))

    def take_in(self, joining: Joining) -> None:
        """The bucket's sides copy the prefilled row in, and once more for each request sharing its prefill (its own
        state set over the copy), new sides when the batch had emptied."""
        prefill = joining.sides
        prefill.kept_in()
        if self.sides is None:
            self.sides = self.new_sides()
        try:
            self.sides.absorb(prefill.slots, prefill.row, prefill.capacity, prefill.eos_width, prefill.host)
            for _, copy in joining.copies:
                self.sides.absorb(prefill.slots, copy.row, prefill.capacity, max(prefill.eos_width, copy.eos_width),
                                  copy.host)
                set_rows(self.sides.slots.rows, copy.state, self.sides.live - 1)
        except Exception as error:
            raise BatchBroken(error) from error
