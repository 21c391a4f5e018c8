"""A fixed-shape KV cache and the forwards over it that a round on the device runs (building blocks).

Per row b of B, C slots: [0, prefix_lens[b]) the committed prefix, then the round's tree region (tree
node i, or verified node i, at slot prefix_lens[b] + i), and the last slot a scratch slot where padding
queries write. A forward writes its (B, Q) queries at the slots a (B, Q) device tensor names and attends
all C slots through an additive 4D mask (transformers passes a 4D mask through unchanged), so nothing
in it follows a length and the host reads nothing: prefix lengths are device tensors.

Models with full attention only: a sliding window or a slot rule would need the rules steps/attention.py
applies, and a recurrent state the rollback of steps/recurrent.py. engine/device_sides.py runs the device round
over two of them, the target's and the draft's (cache.TreeCache's fixed steps hold the same layout with host lengths).
"""

from __future__ import annotations

import torch

from ..models.compat import Cache, CacheLayerMixin, forward_cache_argument
from .device_round import DeviceSubtree, DeviceWalk, commit_device


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values (B, H, C, D), written at the slots its cache's `index` (B, Q) names."""

    is_compileable = False

    def __init__(self, owner: "SlotCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, _ = key_states.shape
        C = self.owner.capacity
        self.keys = key_states.new_zeros(B, H, C, key_states.shape[-1])
        self.values = value_states.new_zeros(B, H, C, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Scatter (B, H, Q, D) new states at the planned slots; return the whole (B, H, C, D) buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, Q, _ = key_states.shape
        index = self.owner.index[:, None, :, None]  # (B, 1, Q, 1)
        self.keys.scatter_(2, index.expand(B, H, Q, self.keys.shape[-1]), key_states)
        self.values.scatter_(2, index.expand(B, H, Q, self.values.shape[-1]), value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        return 0  # positions come from position_ids and visibility from the 4D mask: no length is read

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotCache(Cache):
    """A draft's fixed-shape KV cache for B rows of C slots each (slot C - 1: scratch); a forward writes
    its (B, Q) queries at `index` (B, Q) long, set before it."""

    def __init__(self, num_layers: int, capacity: int):
        self.capacity = capacity
        self.index: torch.Tensor | None = None
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    @property
    def scratch(self) -> int:
        return self.capacity - 1


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, Q, C) additive mask (0 / dtype min) from allowed (B, Q, C) bool."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def slot_forward(model, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 allowed: torch.Tensor) -> torch.Tensor:
    """One draft forward: tokens (B, Q) at positions (B, Q), their KV written at slots (B, Q), each query
    seeing the slots allowed (B, Q, C) says; returns float32 logits (B, Q, V)."""
    cache.index = slots
    out = model(input_ids=tokens, position_ids=positions, attention_mask=additive_mask(allowed, model.dtype),
                use_cache=True, **{forward_cache_argument(type(model)): cache})
    return out.logits.float()


def catch_up(model, cache: SlotCache, tokens: torch.Tensor, counts: torch.Tensor,
             starts: torch.Tensor | None = None) -> None:
    """Write each row's tokens' KV behind its committed slots: a prefill (starts 0), or the accepted tokens
    whose draft KV a round did not make (padded to a fixed width L). tokens (B, L) long, counts (B,) long
    real tokens per row, starts (B,) long each row's committed slots (token j goes at slot and position
    starts + j, seeing the committed slots and the tokens before it). Padding queries write the scratch
    slot and see slot 0 alone (their output is never read)."""
    B, L = tokens.shape
    starts = torch.zeros(B, dtype=torch.long, device=tokens.device) if starts is None else starts
    j = torch.arange(L, device=tokens.device)
    real = j[None] < counts[:, None]  # (B, L)
    at = starts[:, None] + j[None]  # (B, L)
    slots = torch.where(real, at, cache.scratch)
    c = torch.arange(cache.capacity, device=tokens.device)
    allowed = (c[None, None] <= at[:, :, None]) & real[:, :, None]  # the committed slots, then causal
    allowed = allowed | (~real[:, :, None] & (c == 0))
    slot_forward(model, cache, tokens, at, slots, allowed)


def tree_visible(capacity: int, prefix_lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """What queries see of the C slots (B, Q, C) bool: their row's committed prefix, and the tree-region
    slots their rows (B, Q, N) of ancestor bits name (tree node i at slot prefix_len + i)."""
    B, Q, N = rows.shape
    c = torch.arange(capacity, device=rows.device)
    allowed = (c[None, None] < prefix_lens[:, None, None]).expand(B, Q, capacity).clone()
    node_slots = prefix_lens[:, None] + torch.arange(N, device=rows.device)[None]  # (B, N)
    return allowed.scatter_(2, node_slots[:, None, :].expand(B, Q, N), rows)


def verify_forward(model, cache: SlotCache, prefix_lens: torch.Tensor, subtree: DeviceSubtree) -> torch.Tensor:
    """The target's verification of each row's T selected nodes (device_round.select_device): node j at
    position prefix_len + depth and slot prefix_len + j, seeing the prefix and its ancestors; returns float32
    logits (B, T, V) (row j: the target's distribution after node j). Padding nodes see themselves alone."""
    positions = prefix_lens[:, None] + subtree.depths
    slots = prefix_lens[:, None] + torch.arange(subtree.tokens.shape[1], device=prefix_lens.device)[None]
    allowed = tree_visible(cache.capacity, prefix_lens, subtree.mask)
    return slot_forward(model, cache, subtree.tokens, positions, slots, allowed)


def commit_cache(cache: SlotCache, prefix_lens: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> None:
    """Move each row's first counts[b] tree-region slots `slots` (B, M) (relative to its prefix) behind its
    prefix, in every layer (device_round.commit_device on each layer's keys and values)."""
    for layer in cache.layers:
        for buffer in (layer.keys, layer.values):
            commit_device(buffer[None], 3, prefix_lens, slots, counts)  # (1, B, H, C, D): positions at 3


def accepted_nodes(walk: DeviceWalk, subtree: DeviceSubtree) -> torch.Tensor:
    """The draft tree's node ids (B, T) of each row's walked nodes, in order (past walk.count: 0, never read);
    device_round.commit_device's path slots for a cache that holds tree node i at slot i of its region."""
    return subtree.node_ids.gather(1, walk.path.clamp(min=0))
