"""The draft's growth of a round as one function of fixed-shape device tensors (a building block).

EAGLE-2 / SGLang style: from each row's root, depth by depth, the draft runs on the frontier (the root,
then the k nodes the last depth kept), and the next frontier is the top-k of all the frontier's
children by cumulative score (its draft log-probs summed from the root). The d draft forwards, the
top-k, the parents, scores, positions, ancestor bits and the next depth's attention mask are all
device ops over shapes fixed by (B rows, d, k, C cache slots): no host read, so the whole growth can
be captured as one CUDA graph and replayed with new prefix lengths and roots copied in.

Today's drafter (engine/workers.py) grows best-first from the host instead: it picks leaves
(tree.select_leaves), builds each expansion's inputs and reads the candidates back, four reads and
three boolean-mask selections a round. Not yet used by the round: the next step wires this in.

The KV lives in a `SlotCache`: per row, slots [0, prefix_len) the committed prefix, then node i of
the round's tree at slot prefix_len + i, and the last slot a scratch slot where padding queries write.
Every forward attends all C slots through an additive 4D mask (transformers passes a 4D mask
through unchanged), so nothing in it follows a length. Models with full attention only (a window
or a recurrent state would need the rules steps/attention.py applies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.compat import Cache, CacheLayerMixin, forward_cache_argument
from ..steps.device_round import DeviceTree


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


def catch_up(model, cache: SlotCache, tokens: torch.Tensor, counts: torch.Tensor) -> None:
    """Write each row's committed tokens' KV at slots [0, counts[b]) (a prefill, or the tokens a round
    accepted, padded to a fixed width L): tokens (B, L) long, counts (B,) long. Padding queries write
    the scratch slot and see slot 0 alone (their output is never read)."""
    B, L = tokens.shape
    j = torch.arange(L, device=tokens.device)
    real = j[None] < counts[:, None]  # (B, L)
    slots = torch.where(real, j[None], cache.scratch)
    c = torch.arange(cache.capacity, device=tokens.device)
    allowed = (c[None, None] <= j[None, :, None]) & real[:, :, None]  # causal over the row's own tokens
    allowed = allowed | (~real[:, :, None] & (c == 0))
    slot_forward(model, cache, tokens, j[None].expand(B, L), slots, allowed)


@dataclass
class Growth:
    """A grown round: the tree (N = 1 + depth * width nodes, all live; node i's KV at slot prefix_len + i)
    and each row's prefix length it was grown behind.

    tree:        DeviceTree (B, N) (device_round.select_device picks the verified subtree from it)
    prefix_lens: (B,) long
    """

    tree: DeviceTree
    prefix_lens: torch.Tensor


def grow(model, cache: SlotCache, prefix_lens: torch.Tensor, roots: torch.Tensor, depth: int, width: int,
         vocab_limit: int | None = None) -> Growth:
    """Grow every row's tree `depth` levels of `width` nodes below its root, with `depth` draft forwards.

    cache: the draft's SlotCache, its slots [0, prefix_lens[b]) holding row b's committed KV (catch_up)
    prefix_lens: (B,) long committed tokens per row; the root sits at position prefix_lens[b]
    roots: (B,) long each row's root token (the last verified one, whose KV no model holds yet)
    vocab_limit: children are drawn from ids below it (those the target can embed; tree.top_children's)
    Node ids are fixed by shape: the root 0, depth l's nodes 1 + (l - 1) * width ... l * width.
    """
    if depth < 1 or width < 1:
        raise ValueError(f"grow(depth={depth}, width={width}): both must be at least 1")
    B = roots.shape[0]
    N = 1 + depth * width
    device = roots.device
    if cache.capacity < N + 2:
        raise ValueError(f"SlotCache of {cache.capacity} slots cannot hold a tree of {N} nodes behind a prefix; "
                         "allocate at least the longest prefix + N + 1 slots")
    tokens = torch.zeros(B, N, dtype=torch.long, device=device)
    tokens[:, 0] = roots
    parents = torch.full((B, N), -1, dtype=torch.long, device=device)
    depths = torch.zeros(B, N, dtype=torch.long, device=device)
    scores = torch.full((B, N), float("-inf"), dtype=torch.float32, device=device)
    scores[:, 0] = 0.0
    ancestors = torch.zeros(B, N, N, dtype=torch.bool, device=device)
    ancestors[:, 0, 0] = True
    node_slots = prefix_lens[:, None] + torch.arange(N, device=device)[None]  # (B, N)
    frontier = torch.zeros(B, 1, dtype=torch.long, device=device)  # node ids (B, F), the root first
    for level in range(1, depth + 1):
        logits = slot_forward(model, cache, tokens.gather(1, frontier), prefix_lens[:, None] + level - 1,
                              node_slots.gather(1, frontier), visible(cache, prefix_lens, ancestors, frontier, node_slots))
        logprobs = torch.log_softmax(logits[..., :vocab_limit], dim=-1)  # (B, F, V')
        V = logprobs.shape[-1]
        cumulative = scores.gather(1, frontier)[:, :, None] + logprobs  # (B, F, V')
        best, flat = cumulative.reshape(B, -1).topk(width, dim=-1)  # (B, k)
        new = slice(1 + (level - 1) * width, 1 + level * width)  # this depth's node ids, fixed by shape
        parent = frontier.gather(1, flat // V)  # (B, k)
        tokens[:, new] = flat % V
        parents[:, new] = parent
        depths[:, new] = level
        scores[:, new] = best
        ancestors[:, new] = ancestors.gather(1, parent[:, :, None].expand(B, width, N))
        ancestors[:, new, new].diagonal(dim1=1, dim2=2).fill_(True)  # each node is its own ancestor
        frontier = torch.arange(new.start, new.stop, device=device)[None].expand(B, width)
    tree = DeviceTree(tokens, parents, depths, scores, ancestors, torch.full((B,), N, device=device))
    return Growth(tree, prefix_lens)


def visible(cache: SlotCache, prefix_lens: torch.Tensor, ancestors: torch.Tensor, frontier: torch.Tensor,
            node_slots: torch.Tensor) -> torch.Tensor:
    """What each frontier node (B, F) sees of the C slots (B, F, C) bool: its row's committed prefix and
    the slots of its ancestors and itself."""
    B, F = frontier.shape
    N = ancestors.shape[1]
    c = torch.arange(cache.capacity, device=frontier.device)
    allowed = (c[None, None] < prefix_lens[:, None, None]).expand(B, F, cache.capacity).clone()
    rows = ancestors.gather(1, frontier[:, :, None].expand(B, F, N))  # (B, F, N)
    return allowed.scatter_(2, node_slots[:, None, :].expand(B, F, N), rows)
