"""TreeCache: a transformers Cache with a committed prefix followed by a tree region.

Every per-position tensor of every layer (keys, values, a sparse-attention indexer's keys)
lives in a preallocated buffer shared with the layers whose tensor has the same shape, so
moving the verified path behind the prefix is one gather per buffer over all its layers at
once. A model whose layers all look alike (most of them) has exactly one buffer and one gather;
multi-head latent attention (keys and values of different widths) has two. Nothing is
reallocated during a generation.

    positions [0, prefix_len)          committed tokens
    positions [prefix_len, length)     tree region: KV of tree nodes, one slot each

Every layer keeps the whole history, sliding-window layers included: which positions a query
sees is the tree mask's business (attention.py), so a window is applied exactly, also to a tree
that reaches past it. Shapes are learnt from the first forward, whose states the layers keep as
they come; `advance` then packs them into the shared buffers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

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
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (B, H, n, D) new states at [length, length + n); return views up to there."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self.owner.write(self.keys, key_states, KV_DIM)
        self.values = self.owner.write(self.values, value_states, KV_DIM)
        end = self.owner.length + key_states.shape[KV_DIM]
        return self.keys[:, :, :end], self.values[:, :, :end]

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Sparse-attention indexer keys (B, n, D), kept like keys and values; returns (B, length + n, D)."""
        if self.indexer_keys is None:
            self.indexer_keys = indexer_key_states[:, :0]
        self.indexer_keys = self.owner.write(self.indexer_keys, indexer_key_states, INDEXER_DIM)
        return self.indexer_keys[:, : self.owner.length + indexer_key_states.shape[INDEXER_DIM]]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotBuffer:
    """Per-layer tensors of one shape, positions along `dim`, stacked in one (n, ...) tensor.

    parts: the tensors as the first forward left them (length L along `dim`); they become views
        of the buffer (capacity along `dim`), with their first L positions copied over.
    """

    def __init__(self, parts: list[torch.Tensor], dim: int, capacity: int):
        shape = list(parts[0].shape)
        length, shape[dim] = shape[dim], capacity
        if length > capacity:
            raise RuntimeError(f"TreeCache overflow: {length} positions > capacity {capacity}")
        self.data = parts[0].new_zeros(len(parts), *shape)
        self.dim = dim + 1
        self.views = [self.data[i] for i in range(len(parts))]
        for view, part in zip(self.views, parts):
            view.narrow(dim, 0, length).copy_(part)

    def gather(self, src: torch.Tensor, dst_start: int) -> None:
        """Positions `src` (n,) move to [dst_start, dst_start + n) in every tensor of the buffer."""
        src = src.to(self.data.device)
        # index_select copies first, so overlapping source and destination ranges are safe.
        self.data.narrow(self.dim, dst_start, src.shape[0]).copy_(self.data.index_select(self.dim, src))


class TreeCache(Cache):
    """KV cache of one model for one generation: committed prefix + tree region.

    Args:
        num_layers: decoder layers of the model.
        capacity: positions to preallocate (prompt + new tokens + tree region).
        sliding: per layer, whether the model's own cache treats it as a sliding-window layer
            (transformers' mask helpers ask); the tree cache keeps their whole history either way.
    """

    def __init__(self, num_layers: int, capacity: int, sliding: tuple[bool, ...] | None = None):
        self.num_layers, self.capacity = num_layers, capacity
        sliding = sliding or (False,) * num_layers
        self.buffers: list[SlotBuffer] = []
        self.prefix_len = 0
        self.length = 0
        super().__init__(layers=[TreeCacheLayer(self, i, sliding[i]) for i in range(num_layers)])

    @property
    def kv(self) -> torch.Tensor | None:
        """The first shared buffer (every key and value when all layers look alike); None before a forward."""
        return self.buffers[0].data if self.buffers else None

    def write(self, stored: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
        """`stored` with `new` written at [length, length + n) along `dim`; the tensor to keep."""
        if not self.buffers:  # the first forward: keep states as they come, `pack` places them
            return torch.cat([stored, new], dim=dim)
        start, n = self.length, new.shape[dim]
        if start + n > self.capacity:
            raise RuntimeError(f"TreeCache overflow: {start + n} positions > capacity {self.capacity}")
        stored.narrow(dim, start, n).copy_(new)
        return stored

    def advance(self, n: int) -> None:
        """Account for a forward that wrote `n` positions in every layer (the first one: pack buffers)."""
        self.length += n
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
            buffer = SlotBuffer([getattr(layer, name) for layer, name in members], dim, self.capacity)
            for (layer, name), view in zip(members, buffer.views):
                setattr(layer, name, view)
            self.buffers.append(buffer)

    def commit(self, path_slots: torch.Tensor, keep_slots: torch.Tensor | None = None) -> None:
        """Move verified tree slots into the prefix and compact surviving slots behind them.

        path_slots: (m,) tree-region slots (relative to prefix_len) of the newly committed tokens,
            in sequence order; they become prefix positions [prefix_len, prefix_len + m).
        keep_slots: (K,) tree-region slots to keep as the new tree region (the draft's surviving
            subtree), in their new order; None or empty drops the rest of the tree.
        """
        src = path_slots if keep_slots is None else torch.cat([path_slots, keep_slots])
        m, n = path_slots.shape[0], src.shape[0]
        if n:
            src = src + self.prefix_len
            for buffer in self.buffers:
                buffer.gather(src, self.prefix_len)
        self.prefix_len += m
        self.length = self.prefix_len + (n - m)

    def seal_prefix(self) -> None:
        """Make everything written so far (a prefill) part of the committed prefix."""
        self.prefix_len = self.length

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (tree region included): the prefix ends there.
        Recurrent states rolled back to a snapshot (recurrent.py) then run the rest again."""
        if length > self.prefix_len:
            raise RuntimeError(f"TreeCache.truncate({length}) past the committed prefix ({self.prefix_len})")
        self.prefix_len = self.length = length
