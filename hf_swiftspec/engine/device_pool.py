"""The device round's slot caches and row state, kept with the graphs replayed over them (engine/device_sides.py):
one pool serves a lone generate() call (the pair's Captures keep it across calls, steps/capture.py) and the server's
running batch (its engine keeps one) alike.

A replayed phase bakes in the buffers it reads and writes (steps/phase_graphs.py keys a graph by their addresses):
the two models' slot caches and the rows' device state. So the pool keeps them together, one `Slots` per (rows,
capacity, layers): rows a power of two (a batch of 3 runs in the 4-row slots, one row dead: `bucket_for`), capacity
a power of two of at least 256 slots (capture.capacity_bucket, the host round's replayed caches' too), so calls and batches of nearby sizes share them and
their graphs. When rows finish or join, the rows that stay move into the slots of their bucket (a device copy), whose
graphs replay too. Slots past a row's prefix may hold an earlier call's KV: no mask lets a query see a slot beyond its
row's prefix and its own tree (slot_cache.tree_attention), and a prefill overwrites the prefix. At most KEPT sets are
kept, each with its graphs (their memory stays held: up to KEPT times a batch's KV at the pooled capacity); the graphs
over sets the pool no longer keeps are dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..steps.capture import power_of_two
from ..steps.phase_graphs import PhaseRunner
from ..steps.slot_cache import SlotCache

KEPT = 8  # slot sets (with their graphs) a pool keeps: the running batch's buckets 1 .. 32 and a few capacities


def bucket_for(rows: int) -> int:
    """The cache rows a batch of `rows` live rows runs on: the next power of two (1, 2, 4, 8, ...)."""
    return power_of_two(rows)


@dataclass
class RowsOnDevice:
    """Every cache row's state between rounds, on the device (B rows: the live rows first, then dead padding rows,
    which verify with a budget of 0: they emit nothing and commit nothing). The verification phase updates it in place
    (its buffers are what a replayed phase bakes in).

    prefix_lens: (B,) long    slots committed in both caches (every token but the root)
    roots:       (B,) long    each row's last verified token, whose KV neither model holds yet
    budgets:     (B,) long    tokens each row may still emit (max_new_tokens left; 0 for a dead row)
    eos:         (B, E) long  each row's EOS ids, -1 padding (none for a row that is done and decodes on)
    positions:   (B,) long    each row's sequence length as generate() counts it (left padding included): the
                              position its next token's sampling noise is drawn for
    seeds:       (B,) long    each row's sampling seed (Sampler.seed), and noise_rows (B,) long its row number
    sampled:     (B,) bool    whether the row samples (greedy and dead rows: no noise)
    drafter:     per-row state the drafter keeps (device_drafters.DeviceDrafter.state_fields): (B, *shape) each
    """

    prefix_lens: torch.Tensor
    roots: torch.Tensor
    budgets: torch.Tensor
    eos: torch.Tensor
    positions: torch.Tensor
    seeds: torch.Tensor
    noise_rows: torch.Tensor
    sampled: torch.Tensor
    drafter: dict[str, torch.Tensor] = field(default_factory=dict)
    fills: dict[str, float] = field(default_factory=dict)  # a drafter field's value in a dead row

    @classmethod
    def empty(cls, rows: int, eos_width: int, drafter_fields: dict, device) -> "RowsOnDevice":
        """drafter_fields: name -> (shape past the rows, dtype, fill) (DeviceDrafter.state_fields')."""
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(rows, **long), torch.zeros(rows, **long), torch.zeros(rows, **long),
                   torch.full((rows, eos_width), -1, **long), torch.zeros(rows, **long), torch.zeros(rows, **long),
                   torch.zeros(rows, **long), torch.zeros(rows, dtype=torch.bool, device=device),
                   {name: torch.full((rows, *shape), fill, dtype=dtype, device=device)
                    for name, (shape, dtype, fill) in drafter_fields.items()},
                   {name: fill for name, (_, _, fill) in drafter_fields.items()})

    def fields(self) -> list[torch.Tensor]:
        return [self.prefix_lens, self.roots, self.budgets, self.eos, self.positions, self.seeds, self.noise_rows,
                self.sampled, *self.drafter.values()]

    def field_fills(self) -> list[float]:
        return [0, 0, 0, -1, 0, 0, 0, False, *self.fills.values()]

    def copy_rows(self, source: "RowsOnDevice", index: torch.Tensor | slice, count: int, at: int = 0) -> None:
        """Rows `index` of `source` (count of them) into rows at .. at + count - 1, in place. A field of another width
        here (EOS ids, a drafter's per-slot state at another capacity) keeps the columns both have, the rest filled."""
        for mine, theirs, fill in zip(self.fields(), source.fields(), self.field_fills()):
            part = theirs[index]
            if mine.dim() > 1 and part.shape[1] != mine.shape[1]:
                width = min(part.shape[1], mine.shape[1])
                mine[at : at + count, width:] = fill
                mine, part = mine[:, :width], part[:, :width]
            mine[at : at + count] = part

    def kill(self, rows: slice) -> None:
        """Rows `rows` become dead: budget 0, no EOS, greedy, prefix 0 (they write their own cache rows only), the
        drafter's state at its fill."""
        for tensor, fill in zip(self.fields(), self.field_fills()):
            tensor[rows] = fill


@dataclass
class Slots:
    """A bucket's buffers: the target's and the drafter's slot caches (None: a drafter keeps none) and the rows' device
    state, at fixed addresses."""

    caches: tuple[SlotCache, SlotCache | None]
    rows: RowsOnDevice

    def addresses(self) -> tuple[int, ...]:
        """What a replayed phase over these buffers bakes in (its key; none for a layer no forward has written yet)."""
        caches = tuple(b.data.data_ptr() for c in self.caches if c is not None for b in c.buffers)
        return caches + tuple(t.data_ptr() for t in self.rows.fields())


@dataclass
class SlotPool:
    """The slot sets and the graphs over them (module docstring). backend: the runner's (steps/capture.py's), None
    where phases run eagerly. compile: the phases' forwards run the models' decoder layers through torch.compile
    (SwiftSpecConfig.compile), whose compiled calls `compiled` keeps (capture.compiled_layers', by layer)."""

    backend: str | None
    compile: bool = False
    runner: PhaseRunner | None = None
    compiled: dict = field(default_factory=dict)
    sets: OrderedDict = field(default_factory=OrderedDict)  # (rows, capacity, layers, eos width) -> Slots

    def __post_init__(self):
        if self.runner is None and self.backend is not None:
            self.runner = PhaseRunner(self.backend)

    def slots(self, rows: int, capacity: int, layers: tuple[tuple, tuple], eos_width: int, drafter_fields: dict,
              device, like: "Slots | None" = None) -> Slots:
        """The pool's slots for `rows` cache rows of `capacity` slots (made, and the oldest set with its graphs dropped
        past KEPT, when there are none). layers: each cache's (layers, window rules, attention) (DeviceSides.layers; 0
        layers: none). like: slots whose caches have run a forward, whose layout new caches take (else a new set's caches are
        made by their first forward)."""
        key = (rows, capacity, layers, eos_width)
        if key in self.sets:
            self.sets.move_to_end(key)
            return self.sets[key]
        caches = tuple(SlotCache(n, capacity, architecture, attention) if n else None
                       for n, architecture, attention in layers)
        if like is not None:
            for mine, theirs in zip(caches, like.caches):
                if mine is not None and theirs is not None and theirs.buffers:
                    mine.allocate(theirs, rows)
        made = Slots(caches, RowsOnDevice.empty(rows, eos_width, drafter_fields, device))  # (fields at this capacity)
        self.sets[key] = made
        while len(self.sets) > KEPT:
            self.sets.popitem(last=False)
        self.drop_unkept_graphs()
        return made

    def drop_unkept_graphs(self) -> None:
        """Drop the graphs captured over slots the pool does not keep (their buffers are no longer any call's)."""
        if self.runner is None:
            return
        kept = {s.addresses() for s in self.sets.values()}
        for key in [k for k in self.runner.graphs if k[-1] not in kept]:
            del self.runner.graphs[key]

    def drop_smaller(self, capacity: int) -> None:
        """Drop the sets of less than `capacity` slots and their graphs (a running batch whose capacity grew never
        comes back to them)."""
        for key in [k for k in self.sets if k[1] < capacity]:
            del self.sets[key]
        self.drop_unkept_graphs()


STATE_FIELDS = ("prefix_lens", "roots", "budgets", "positions", "seeds", "noise_rows", "sampled")


def row_values(sampler, root: int, committed: int, budget: int, context: int, eos: set[int],
               eos_width: int) -> list[int]:
    """A row's device state as host ints, in set_rows' order: STATE_FIELDS, then its EOS ids padded to eos_width (a
    row has at most eos_width: the sides size it to the call's)."""
    sampled = bool(sampler is not None and sampler.do_sample)
    ids = sorted(eos)
    return [committed, root, budget, context, sampler.draw_seed() if sampled else 0,
            sampler.row if sampler is not None else 0, int(sampled), *ids, *[-1] * (eos_width - len(ids))]


def set_rows(rows: RowsOnDevice, state: torch.Tensor, at: int) -> None:
    """Rows at, at + 1, ... of `rows` from state (n, 7 + E) long (row_values' layout; E at most the rows' EOS width, the
    rest of their EOS ids cleared), in place."""
    n = state.shape[0]
    for i, name in enumerate(STATE_FIELDS):
        target = getattr(rows, name)
        target[at : at + n] = state[:, i].to(target.dtype)
    eos = state[:, len(STATE_FIELDS) :]
    rows.eos[at : at + n, eos.shape[1] :] = -1
    rows.eos[at : at + n, : eos.shape[1]] = eos
