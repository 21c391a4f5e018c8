"""TreeCache: a transformers Cache with, per batch row, a committed prefix followed by a tree region.

Every per-position tensor of every layer (keys, values, a sparse-attention indexer's keys)
lives in a preallocated buffer shared with the layers whose tensor has the same shape, so
moving the verified paths behind the prefixes is one gather per buffer over all its layers and
rows at once. A model whose layers all look alike (most of them) has exactly one buffer;
multi-head latent attention (keys and values of different widths) has two. Nothing is
reallocated during a generation.

Rows are ragged: each row b keeps the layout a single sequence would, at its own lengths,

    slots [0, start[b])                  left padding of a batched prefill (never attended)
    slots [start[b], prefix_len[b])      committed tokens, at positions slot - start[b]
    slots [prefix_len[b], length[b])     tree region: KV of tree nodes, one slot each
    slots [length[b], capacity - 1)      free (or stale: beyond the row's length, never attended)
    slot  capacity - 1                   scratch: where padding queries of a batched step write

A forward over B rows feeds every row Q queries, of which row b's first counts[b] are real (the
rest pad the batch to a rectangle). `plan_step(counts)` decides once per forward where each row's
queries write: at [length[b], length[b] + Q) for every row when all rows have the same length
(one copy), else each real query at its row's next free slot and each padding query into the
scratch slot (one scatter). Which slots a query sees is the attention mask's business
(attention.py builds it from these lengths). Every layer keeps the whole history,
sliding-window layers included: a window is applied by the mask, exactly, also to a tree that
reaches past it. Shapes are learnt from the first forward, whose states the layers keep as
they come; `advance` then packs them into the shared buffers.

A step planned `fixed` (capture.py replays it as a CUDA graph) has shapes that depend on (B, Q) and
the capacity alone: every query writes at the slot a (B, Q) device tensor names, and every layer
returns its whole buffers, so the step attends all `capacity` slots and its mask says which count.
Buffers taken from a `BufferPool` keep their addresses across generate() calls, which the graphs
captured over them need.
"""

from __future__ import annotations

import torch

from ..models.compat import Cache, CacheLayerMixin

KV_DIM = 2  # positions in (B, H, L, D) keys and values
INDEXER_DIM = 1  # positions in (B, L, D) indexer keys


class TreeCacheLayer(CacheLayerMixin):
    """One layer's keys (B, H, capacity, Dk) and values (B, H, capacity, Dv): views of shared buffers."""

    is_compileable = False

    def __init__(self, owner: "TreeCache", layer_idx: int, is_sliding: bool = False):
        super().__init__()
        self.owner, self.layer_idx, self.is_sliding = owner, layer_idx, is_sliding
        self.indexer_keys: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (B, H, Q, D) new states where the step's plan says; return views up to the step's end."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self.owner.write(self.keys, key_states, KV_DIM)
        self.values = self.owner.write(self.values, value_states, KV_DIM)
        end = self.owner.step_end(key_states.shape[KV_DIM])
        return self.keys[:, :, :end], self.values[:, :, :end]

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Sparse-attention indexer keys (B, Q, D), kept like keys and values; returns (B, end, D)."""
        if self.indexer_keys is None:
            self.indexer_keys = indexer_key_states[:, :0]
        self.indexer_keys = self.owner.write(self.indexer_keys, indexer_key_states, INDEXER_DIM)
        return self.indexer_keys[:, : self.owner.step_end(indexer_key_states.shape[INDEXER_DIM])]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.owner.capacity


class BufferPool:
    """Buffers that outlive one generation, by (shape, dtype, device): a TreeCache packs into the one of
    its shape instead of allocating, so forwards captured over it (capture.py) stay valid across calls.
    Whoever holds the pool holds the memory."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def take(self, shape: list[int], like: torch.Tensor) -> torch.Tensor:
        key = (tuple(shape), like.dtype, like.device)
        if key not in self.buffers:
            self.buffers[key] = like.new_zeros(shape)
        return self.buffers[key]


def move_positions(data: torch.Tensor, dim: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place: per row b, positions src[b] (B, P) of `data` (n, B, ...) (positions at `dim`) move to dst[b]; the
    sources are read before any write (one gather and one scatter for every layer and row)."""
    by_row = data.movedim(dim, 2)  # (n, B, capacity, ...): a view, written through
    rows = torch.arange(src.shape[0], device=src.device)[:, None].expand_as(src)
    by_row[:, rows, dst] = by_row[:, rows, src]


class SlotBuffer:
    """Per-layer tensors of one shape, positions along `dim`, stacked in one (n, B, ...) tensor.

    parts: the tensors as the first forward left them (length L along `dim`); they become views
        of the buffer (capacity along `dim`), with their first L positions copied over.
    members: (layer, attribute) holding each part, re-pointed when rows are dropped.
    pool: where the buffer comes from when it must keep its address across generations.
    """

    def __init__(self, parts: list[torch.Tensor], dim: int, capacity: int, members: list[tuple[object, str]],
                 pool: BufferPool | None = None):
        shape = list(parts[0].shape)
        length, shape[dim] = shape[dim], capacity
        if length > capacity:
            raise RuntimeError(f"TreeCache overflow: {length} positions > capacity {capacity}")
        shape = [len(parts), *shape]
        self.data = pool.take(shape, parts[0]) if pool is not None else parts[0].new_zeros(shape)
        self.base = self.data  # rows beyond data's are room for rows that join (absorb)
        self.dim = dim + 1  # positions; the batch is dim 1
        self.members = members
        self.point_members()
        for view, part in zip(self.views, parts):
            view.narrow(dim, 0, length).copy_(part)

    def point_members(self) -> None:
        self.views = [self.data[i] for i in range(self.data.shape[0])]
        for (layer, name), view in zip(self.members, self.views):
            setattr(layer, name, view)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per row b, positions src[b] (B, K) move to dst[b] (B, K), in every tensor of the buffer: the one move of
        both caches' commits (TreeCache.commit_rows; slot_cache.commit_cache, planned by device_round.commit_plan).
        The sources are read before anything is written, so overlapping ranges are safe."""
        move_positions(self.data, self.dim, src, dst)

    def keep_rows(self, order: list[int], used: int) -> None:
        """Keep only the batch rows `order` (R of them), as rows 0..R-1, in place; only their first `used`
        positions hold anything. Only the rows that change place are copied (keep_order moves as few
        as there are holes)."""
        for i, j in enumerate(order):  # sources lie beyond every destination: no copy reads a written row
            if i != j:  # (index_copy_ into a strided view rewrote the whole buffer: 32 ms for one row)
                self.data[:, i].narrow(self.dim - 1, 0, used).copy_(self.data[:, j].narrow(self.dim - 1, 0, used))
        self.data = self.data.narrow(1, 0, len(order))
        self.point_members()

    def absorb(self, other: torch.Tensor | None, new_rows: int, used: int, other_used: int, capacity: int) -> None:
        """Append `new_rows` rows after this buffer's: `other`'s data (n, new_rows, ...) (a buffer of the same
        layers, maybe wider, holding anything in its first `other_used` positions only), or empty rows (None).
        This buffer's rows hold anything in their first `used` positions only. They are not copied while
        the buffer has room (it reserves twice the rows it needs when it grows) and other's positions fit;
        else everything moves to a new buffer once. Every row then has `capacity` positions (at least)."""
        rows = self.data.shape[1]
        capacity = max(self.data.shape[self.dim], capacity)
        self.reserve(rows + new_rows, capacity, keep=used)
        rows_view = self.base.narrow(1, 0, rows + new_rows)
        if other is not None:
            into = rows_view.narrow(1, rows, new_rows).narrow(self.dim, 0, other_used)
            into.copy_(other.narrow(self.dim, 0, other_used))
        self.data = rows_view.narrow(self.dim, 0, capacity)
        self.point_members()

    def reserve(self, rows: int, capacity: int, keep: int) -> None:
        """Make the underlying buffer hold `rows` rows of `capacity` positions, moving the current rows' first
        `keep` positions if it must grow (to twice the rows asked for)."""
        if rows <= self.base.shape[1] and capacity <= self.base.shape[self.dim]:
            return
        shape = list(self.base.shape)
        shape[1], shape[self.dim] = 2 * rows, max(capacity, shape[self.dim])
        base = self.base.new_zeros(shape)
        current = self.data.shape[1]
        base.narrow(1, 0, current).narrow(self.dim, 0, keep).copy_(self.data.narrow(self.dim, 0, keep))
        self.base = base


class TreeCache(Cache):
    """KV cache of one model for one generation of `batch_size` rows: per row, committed prefix + tree region.

    Args:
        num_layers: decoder layers of the model.
        capacity: positions per row to preallocate (padded prompt + new tokens + tree region + 1 scratch slot).
        sliding: per layer, whether the model's own cache treats it as a sliding-window layer
            (transformers' mask helpers ask); the tree cache keeps their whole history either way.
        batch_size: rows.
        pool: where to take the shared buffers from (they keep their addresses across generations).

    Per-row bookkeeping is host ints: `starts`, `prefix_lens`, `lengths` (see the module docstring).
    """

    def __init__(self, num_layers: int, capacity: int, sliding: tuple[bool, ...] | None = None, batch_size: int = 1,
                 pool: BufferPool | None = None):
        self.num_layers, self.capacity, self.pool = num_layers, capacity, pool
        sliding = sliding or (False,) * num_layers
        self.buffers: list[SlotBuffer] = []
        self.starts = [0] * batch_size
        self.prefix_lens = [0] * batch_size
        self.lengths = [0] * batch_size
        self._counts: list[int] | None = None  # real queries per row of the forward in flight
        self._index: torch.Tensor | None = None  # (B, Q) slot of each query, when rows write apart
        self._fixed = False  # the step in flight attends every slot (capture.py)
        super().__init__(layers=[TreeCacheLayer(self, i, sliding[i]) for i in range(num_layers)])

    # ---- the batch-1 view, kept for a single sequence's code and messages
    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def prefix_len(self) -> int:
        """Row 0's committed length (the only row of a single sequence)."""
        return self.prefix_lens[0]

    @property
    def length(self) -> int:
        return self.lengths[0]

    @property
    def kv(self) -> torch.Tensor | None:
        """The first shared buffer (every key and value when all layers look alike); None before a forward."""
        return self.buffers[0].data if self.buffers else None

    @property
    def scratch(self) -> int:
        return self.capacity - 1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths)

    # ---- one forward
    def plan_step(self, counts: list[int], queries: int, device: torch.device | str, fixed: bool = False) -> None:
        """Plan where the next forward of `queries` queries per row writes; counts[b]: row b's real ones.
        fixed: every query writes through the (B, Q) index and the step attends every slot (capture.py)."""
        if len(counts) != self.batch_size:
            raise RuntimeError(f"a step planned {len(counts)} rows for a TreeCache of {self.batch_size}")
        self._counts = list(counts)
        ends = [n + c for n, c in zip(self.lengths, counts)]
        if max(ends) > self.scratch or (
            not fixed and len(set(self.lengths)) == 1 and self.lengths[0] + queries > self.capacity
        ):
            raise RuntimeError(f"TreeCache overflow: {max(ends)} positions > capacity {self.scratch}")
        self._index = None
        self._fixed = fixed and bool(self.buffers)
        if self._fixed or (len(set(self.lengths)) > 1 and self.buffers):
            slots = [[n + j if j < c else self.scratch for j in range(queries)] for n, c in zip(self.lengths, counts)]
            self._index = torch.tensor(slots, device=device)

    # ---- what a replayed step (capture.py) reads and sets
    def step_slots(self) -> torch.Tensor | None:
        """The (B, Q) slot each query of the planned step writes (None: every row writes at one length, one
        copy)."""
        return self._index

    def write_through(self, slots: torch.Tensor) -> None:
        """The planned step writes through `slots` instead: a replayed step's static copy of step_slots(),
        whose address its graph holds."""
        if self._index is None or slots.shape != self._index.shape:
            raise RuntimeError(f"a replayed step's slots {tuple(slots.shape)} do not fit the planned step's "
                               f"{None if self._index is None else tuple(self._index.shape)}: plan_step(fixed=True) first")
        self._index = slots

    def host_state(self) -> tuple[list[int], list[int], list[int], list[int] | None]:
        """The host-side bookkeeping a forward reads (row starts, prefix lengths, lengths, the planned step's
        real queries per row): what an emulated replay saves at capture and puts back around a replay."""
        counts = list(self._counts) if self._counts is not None else None
        return list(self.starts), list(self.prefix_lens), list(self.lengths), counts

    def set_host_state(self, state: tuple[list[int], list[int], list[int], list[int] | None]) -> None:
        """Put back what host_state() returned."""
        starts, prefix_lens, lengths, counts = state
        self.starts, self.prefix_lens, self.lengths = list(starts), list(prefix_lens), list(lengths)
        self._counts = list(counts) if counts is not None else None

    def step_end(self, queries: int) -> int:
        """The KV length the forward in flight attends: up to the furthest row's last new slot (every
        slot in a fixed step)."""
        if self._fixed:
            return self.capacity
        if self._index is None:
            return self.lengths[0] + queries if len(set(self.lengths)) == 1 else max(self.lengths) + queries
        return max(n + c for n, c in zip(self.lengths, self._counts))

    def write(self, stored: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
        """`stored` with `new` (B, ..., Q, ...) written where the plan says along `dim`; the tensor to keep."""
        if not self.buffers:  # the first forward: keep states as they come, `pack` places them
            return torch.cat([stored, new], dim=dim)
        if self._index is None:  # every row at the same length: one copy
            start, n = self.lengths[0], new.shape[dim]
            if start + n > self.capacity:
                raise RuntimeError(f"TreeCache overflow: {start + n} positions > capacity {self.capacity}")
            stored.narrow(dim, start, n).copy_(new)
            return stored
        shape = [1] * new.dim()
        shape[0], shape[dim] = self._index.shape
        stored.scatter_(dim, self._index.view(shape).expand_as(new), new)
        return stored

    def advance(self, n: int | None = None) -> None:
        """Account for the forward in flight: each row's real queries now hold its next slots (the
        first forward also packs the buffers). `n`: queries per row, when no step was planned."""
        counts = self._counts if self._counts is not None else [n] * self.batch_size
        self.lengths = [length + c for length, c in zip(self.lengths, counts)]
        self._counts, self._index, self._fixed = None, None, False
        if not self.buffers:
            self.pack()

    def pack(self) -> None:
        """Move every per-position tensor into a shared buffer of its shape, dtype and device."""
        groups: dict[tuple, list[tuple[TreeCacheLayer, str]]] = {}
        for layer in self.layers:
            for name, dim in (("keys", KV_DIM), ("values", KV_DIM), ("indexer_keys", INDEXER_DIM)):
                part = getattr(layer, name, None)
                if part is not None:
                    shape = part.shape[:dim] + part.shape[dim + 1 :]
                    groups.setdefault((shape, dim, part.dtype, part.device), []).append((layer, name))
        for (_, dim, _, _), members in groups.items():
            parts = [getattr(layer, name) for layer, name in members]
            self.buffers.append(SlotBuffer(parts, dim, self.capacity, members, self.pool))

    # ---- between forwards
    def commit(self, path_slots: torch.Tensor, keep_slots: torch.Tensor | None = None) -> None:
        """commit_rows for a single sequence (row 0)."""
        self.commit_rows([path_slots], [keep_slots])

    def commit_rows(self, paths: list[torch.Tensor | list[int] | None], keeps: list[torch.Tensor | None] | None = None) -> None:
        """Per row, move verified tree slots into the prefix and compact surviving slots behind them.

        paths[b]: (m,) tree-region slots (relative to prefix_lens[b]) of row b's newly committed tokens,
            in sequence order (a tensor, or host ints); they become its prefix positions
            [prefix_len, prefix_len + m). None: row b is left as it is.
        keeps[b]: (K,) tree-region slots to keep as row b's new tree region (the draft's surviving
            subtree), in their new order (a tensor, or host ints); None or empty drops the rest of the row's tree.
        One move per buffer for all rows; nothing read from the device.
        """
        keeps = keeps or [None] * len(paths)
        moves: list[tuple[int, torch.Tensor, int]] = []  # (row, source slots, first destination slot)
        device = self.buffers[0].data.device if self.buffers else "cpu"
        for b, (path, keep) in enumerate(zip(paths, keeps)):
            if path is None:
                continue
            keep = keep if keep is not None and len(keep) else None
            if isinstance(path, list) and not isinstance(keep, torch.Tensor):
                # host ints (the target's walk, the draft's path facts): a row already in place (a plain step's
                # root) moves nothing, known without reading the device
                src = path + (keep or [])
                m, n, prefix = len(path), len(src), self.prefix_lens[b]
                if src != list(range(n)):
                    moves.append((b, torch.tensor(src, dtype=torch.long, device=device) + prefix, prefix))
            else:  # slots on the device: moved (a move in place copies a few slots onto themselves) unread
                path = torch.as_tensor(path, dtype=torch.long, device=device)
                src = path if keep is None else torch.cat([path, torch.as_tensor(keep, dtype=torch.long, device=device)])
                m, n, prefix = path.shape[0], src.shape[0], self.prefix_lens[b]
                if n:
                    moves.append((b, src + prefix, prefix))
            self.prefix_lens[b] = prefix + m
            self.lengths[b] = prefix + n
        if moves and self.buffers:
            self.move_slots(moves)

    def move_slots(self, moves: list[tuple[int, torch.Tensor, int]]) -> None:
        """Per (row, src, first) move slots src (n,) to [first, first + n) of the row: one move per buffer,
        rows padded with scratch-to-scratch moves."""
        width = max(src.shape[0] for _, src, _ in moves)
        device = moves[0][1].device
        src = torch.full((self.batch_size, width), self.scratch, dtype=torch.long, device=device)
        dst = src.clone()
        for b, slots, first in moves:
            src[b, : slots.shape[0]] = slots
            dst[b, : slots.shape[0]] = torch.arange(first, first + slots.shape[0], device=device)
        for buffer in self.buffers:
            buffer.move(src, dst)

    def seal_prefix(self) -> None:
        """Make everything written so far (a prefill) part of the committed prefix, in every row."""
        self.prefix_lens = list(self.lengths)

    def truncate(self, length: int, row: int = 0) -> None:
        """Forget every position of `row` from slot `length` on (tree region included): its prefix ends
        there. Recurrent states rolled back to a snapshot (recurrent.py) then run the rest again."""
        if length > self.prefix_lens[row]:
            raise RuntimeError(f"TreeCache.truncate({length}) past row {row}'s committed prefix ({self.prefix_lens[row]})")
        self.prefix_lens[row] = self.lengths[row] = length

    def absorb(self, other: "TreeCache") -> None:
        """Append `other`'s rows (the same model's cache, its forwards run, no step in flight) after this
        one's: rows joining a running batch. Both take the larger capacity (a wider one moves every row
        once; the scratch slot moves to its end)."""
        if other.buffers and len(other.buffers) != len(self.buffers):  # (a running target's cache has run its
            raise RuntimeError(  # prefills; a joining draft's has run nothing yet)
                f"TreeCache.absorb: {len(other.buffers)} buffers into {len(self.buffers)} (rows that ran a forward "
                "join a cache that has run one too)"
            )
        used, other_used = max(self.lengths, default=0), max(other.lengths, default=0)
        self.capacity = max(self.capacity, other.capacity)
        for b, mine in enumerate(self.buffers):
            theirs = other.buffers[b].data if other.buffers else None
            mine.absorb(theirs, other.batch_size, used, other_used, self.capacity)
        for name in ("starts", "prefix_lens", "lengths"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every batch row not in `rows`; row rows[i] becomes row i."""
        if rows == list(range(self.batch_size)):
            return
        if self.buffers:
            used = max(self.lengths[b] for b in rows)
            for buffer in self.buffers:
                buffer.keep_rows(rows, used)
        for name in ("starts", "prefix_lens", "lengths"):
            values = getattr(self, name)
            setattr(self, name, [values[b] for b in rows])


def keep_order(keep: list[int]) -> list[int]:
    """The order to keep rows `keep` (increasing) in, moving as few as possible: each row that leaves a
    hole below len(keep) is replaced by a kept row from beyond it; the others stay where they are."""
    staying = set(keep)
    movers = [b for b in keep if b >= len(keep)]
    return [i if i in staying else movers.pop() for i in range(len(keep))]
