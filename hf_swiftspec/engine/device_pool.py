"""The device round's replayed phases kept across a pair's generate() calls, with the slot caches they were
captured over (steps/capture.py's Captures.device): a later call of as many rows, whose length fits a kept
capacity, replays the earlier call's graphs instead of capturing its own (on CUDA a capture costs far more than
a round).

A replayed phase bakes in the caches' buffers (steps/phase_graphs.py keys a graph by their addresses), so the
pool keeps the caches too: each call's rows get the pool's caches for (rows, capacity bucket, layers), the
capacity rounded up to a power of two so calls of nearby lengths share them; when rows finish, the rows that
stay move into the pool's caches of their count, whose graphs a later call's finishing rows replay too. Their slots past a row's prefix may
hold an earlier call's KV: no mask lets a query see a slot beyond its row's prefix and its own tree
(slot_cache.tree_visible), and the prefill overwrites the prefix. At most KEPT cache sets are kept, each with its
graphs (their memory stays held between calls: up to KEPT times a call's KV at the pooled capacity); graphs over
caches the pool no longer keeps are dropped.

A call with a draft head is not pooled: its phases read the target's states through the call's own tap.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..steps.phase_graphs import PhaseRunner
from ..steps.slot_cache import SlotCache

KEPT = 4  # cache sets (with their graphs) a pair keeps between calls: a batch of 4 whose rows finish one by one
SMALLEST = 256  # the smallest pooled capacity, in slots


def capacity_bucket(slots: int) -> int:
    """The pooled capacity for a call that needs `slots`: the next power of two, at least SMALLEST."""
    return max(SMALLEST, 1 << max(slots - 1, 0).bit_length())


def buffers_of(caches: tuple[SlotCache, ...]) -> tuple[int, ...]:
    """The caches' buffer addresses, as RoundModels.key() names them (none for a layer no forward has written yet)."""
    return tuple(t.data_ptr() for c in caches for layer in c.layers if layer.is_initialized
                 for t in (layer.keys, layer.values))


@dataclass
class DevicePool:
    """One pair's device-round graphs and caches (module docstring). backend: the runner's (capture.py's)."""

    backend: str
    runner: PhaseRunner = None
    caches: OrderedDict = field(default_factory=OrderedDict)  # (rows, capacity, layers) -> tuple[SlotCache, ...]

    def __post_init__(self):
        if self.runner is None:
            self.runner = PhaseRunner(self.backend)

    def slot_caches(self, rows: int, capacity: int, layers: tuple[int, ...]) -> tuple[SlotCache, ...]:
        """The pool's caches for `rows` rows of `capacity` slots (capacity_bucket's), one per model (`layers`
        each); made, and the oldest set with its graphs dropped past KEPT, when there are none."""
        key = (rows, capacity, layers)
        if key in self.caches:
            self.caches.move_to_end(key)
            return self.caches[key]
        self.caches[key] = tuple(SlotCache(n, capacity) for n in layers)
        while len(self.caches) > KEPT:
            self.caches.popitem(last=False)
        self.drop_unkept_graphs()
        return self.caches[key]

    def drop_unkept_graphs(self) -> None:
        """Drop the graphs captured over caches the pool does not keep (their buffers are no longer any call's)."""
        kept = {buffers_of(c) for c in self.caches.values()}
        for key in [k for k in self.runner.graphs if k[-1][0] not in kept]:
            del self.runner.graphs[key]
