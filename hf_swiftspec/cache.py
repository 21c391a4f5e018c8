"""TreeCache: a transformers Cache with a committed prefix followed by a tree region.

All layers live in one preallocated buffer `kv` of shape (layers, 2, B, H, capacity, D), so
moving the verified path behind the prefix is a single gather over every layer at once, and
nothing is ever reallocated during a generation.

    positions [0, prefix_len)          committed tokens (every query attends them)
    positions [prefix_len, length)     tree region: KV of tree nodes, one slot each
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class TreeCacheLayer(CacheLayerMixin):
    """One layer's view of the shared buffer; `update` appends at the cache's current length."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "TreeCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.allocate(key_states)
        self.keys = self.owner.kv[self.layer_idx, 0]
        self.values = self.owner.kv[self.layer_idx, 1]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (B, H, n, D) new states at [length, length + n); return views up to there."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self.owner.length, key_states.shape[-2]
        end = start + n
        if end > self.owner.capacity:
            raise RuntimeError(f"TreeCache overflow: {end} positions > capacity {self.owner.capacity}")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        if self.layer_idx == self.owner.num_layers - 1:
            self.owner.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity


class TreeCache(Cache):
    """KV cache of one model for one generation: committed prefix + tree region.

    Args:
        num_layers: decoder layers of the model.
        capacity: positions to preallocate (prompt + new tokens + tree region).
    """

    def __init__(self, num_layers: int, capacity: int):
        self.num_layers, self.capacity = num_layers, capacity
        self.kv: torch.Tensor | None = None  # (layers, 2, B, H, capacity, D)
        self.prefix_len = 0
        self.length = 0
        super().__init__(layers=[TreeCacheLayer(self, i) for i in range(num_layers)])

    def allocate(self, key_states: torch.Tensor) -> None:
        """Allocate the shared buffer from the first layer's (B, H, n, D) key states."""
        if self.kv is not None:
            if key_states.shape[1] != self.kv.shape[3] or key_states.shape[-1] != self.kv.shape[-1]:
                raise ValueError(
                    f"TreeCache needs the same KV heads and head dim in every layer; got {tuple(key_states.shape)} "
                    f"after {tuple(self.kv.shape)}. Models with per-layer KV shapes are not supported."
                )
            return
        B, H, _, D = key_states.shape
        self.kv = torch.zeros(
            (self.num_layers, 2, B, H, self.capacity, D), dtype=key_states.dtype, device=key_states.device
        )

    def commit(self, path_slots: torch.Tensor, keep_slots: torch.Tensor | None = None) -> None:
        """Move verified tree slots into the prefix and compact surviving slots behind them.

        path_slots: (m,) tree-region slots (relative to prefix_len) of the newly committed tokens,
            in sequence order; they become prefix positions [prefix_len, prefix_len + m).
        keep_slots: (K,) tree-region slots to keep as the new tree region (the draft's surviving
            subtree), in their new order; None or empty drops the rest of the tree.
        """
        src = path_slots if keep_slots is None else torch.cat([path_slots, keep_slots])
        m, n = path_slots.shape[0], src.shape[0]
        if n and self.kv is not None:
            src = src.to(self.kv.device) + self.prefix_len
            # index_select copies first, so overlapping source and destination ranges are safe.
            self.kv[:, :, :, :, self.prefix_len : self.prefix_len + n] = self.kv.index_select(4, src)
        self.prefix_len += m
        self.length = self.prefix_len + (n - m)

    def seal_prefix(self) -> None:
        """Make everything written so far (a prefill) part of the committed prefix."""
        self.prefix_len = self.length
