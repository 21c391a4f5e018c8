"""The draft's growth of a round as one function of fixed-shape device tensors (a building block).

EAGLE-2 / SGLang style: from each row's root, depth by depth, the draft runs on the frontier (the root,
then the k nodes the last depth kept), and the next frontier is the top-k of all the frontier's
children by cumulative score (its draft log-probs summed from the root). The d draft forwards, the
top-k, the parents, scores, positions, ancestor bits and the next depth's attention mask are all
device ops over shapes fixed by (B rows, d, k, C cache slots): no host read, so the whole growth can
be captured as one CUDA graph and replayed with new prefix lengths and roots copied in.

Today's drafter (engine/workers.py) grows best-first from the host instead: it picks leaves
(tree.select_leaves), builds each expansion's inputs and reads the candidates back, four reads and
three boolean-mask selections a round. engine/device_sides.py (round="device") grows with this.

The KV lives in a `SlotCache` (steps/slot_cache.py): per row, the committed prefix, then node i of the
round's tree at slot prefix_len + i; a windowed draft's frontier sees what its layers' windows show it
(slot_cache.tree_attention): through dense masks, or the tree kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swiftspec_kernels.tree_level import tree_level

from ..steps.device_round import HASH_MULTIPLIER, DeviceTree
from ..steps.slot_cache import SlotCache, slot_forward, tree_attention


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
         vocab_limit: int | None = None, after_level: AfterLevel | None = None) -> Growth:
    """Grow every row's tree up to `depth` levels of `width` nodes below its root, one draft forward a level.

    cache: the draft's SlotCache, its slots [0, prefix_lens[b]) holding row b's committed KV (catch_up)
    prefix_lens: (B,) long committed tokens per row; the root sits at position prefix_lens[b]
    roots: (B,) long each row's root token (the last verified one, whose KV no model holds yet)
    vocab_limit: children are drawn from ids below it (those the target can embed; tree.top_children's)
    after_level: called with the tree and the level after each level (and with level 0 before the first); False
        stops the growth there (the host sizing the round between levels where a read is free: policy/sizing.py),
        the tree then cut to the levels grown
    Node ids are fixed by shape: the root 0, depth l's nodes 1 + (l - 1) * width ... l * width.
    """
    tree = seed_tree(cache, roots, depth, width, "grow")
    if after_level is not None:
        after_level(tree, 0)  # the catch-up, if any, has run
    B, N = tree.tokens.shape
    node_slots = prefix_lens[:, None] + torch.arange(N, device=roots.device)[None]  # (B, N)
    frontier = torch.zeros(B, 1, dtype=torch.long, device=roots.device)  # node ids (B, F), the root first
    ids = slice(0, 1)  # the frontier's ids are a fixed range (the root, then the last level's): its fields are views
    for level in range(1, depth + 1):
        positions = prefix_lens[:, None] + (level - 1)  # (B, 1): the frontier sits at depth level - 1
        seen = tree_attention(cache, prefix_lens, tree.ancestors[:, ids], positions, tree.depths, model.dtype)
        logits = slot_forward(model, cache, tree.tokens[:, ids], positions, node_slots[:, ids], seen)
        logprobs = torch.log_softmax(logits[..., :vocab_limit], dim=-1)  # (B, F, V')
        frontier, _ = add_level(tree, frontier, tree.scores[:, ids, None] + logprobs, level, width)
        ids = slice(1 + (level - 1) * width, 1 + level * width)
        if after_level is not None and not after_level(tree, level) and level < depth:
            return Growth(cut_tree(tree, level, width), prefix_lens)
    return Growth(tree, prefix_lens)


AfterLevel = Callable[[DeviceTree, int], bool]


def cut_tree(tree: DeviceTree, levels: int, width: int) -> DeviceTree:
    """The first `levels` levels of a grown tree (1 + levels * width nodes; every later node was never grown)."""
    n = 1 + levels * width
    return DeviceTree(tree.tokens[:, :n], tree.parents[:, :n], tree.depths[:, :n], tree.scores[:, :n],
                      tree.ancestors[:, :n, :n].contiguous(), torch.full_like(tree.size, n),
                      None if tree.hashes is None else tree.hashes[:, :n])


def seed_tree(cache: SlotCache, roots: torch.Tensor, depth: int, width: int, caller: str) -> DeviceTree:
    """A DeviceTree of N = 1 + depth * width nodes holding each row's root alone (node 0; the others are filled
    depth by depth by add_level), after checking the shape and that `cache` holds it behind a prefix."""
    if depth < 1 or width < 1:
        raise ValueError(f"{caller}(depth={depth}, width={width}): both must be at least 1")
    B, N, device = roots.shape[0], 1 + depth * width, roots.device
    if cache.span < N + 1:
        raise ValueError(f"SlotCache attending {cache.span} slots cannot hold a tree of {N} nodes and its scratch slot; "
                         "allocate at least the longest prefix + N + 1 slots")
    tokens = torch.zeros(B, N, dtype=torch.long, device=device)
    tokens[:, 0] = roots
    scores = torch.full((B, N), float("-inf"), dtype=torch.float32, device=device)
    scores[:, 0] = 0.0
    ancestors = torch.zeros(B, N, N, dtype=torch.bool, device=device)
    ancestors[:, 0, 0] = True
    return DeviceTree(tokens, torch.full((B, N), -1, dtype=torch.long, device=device),
                      torch.zeros(B, N, dtype=torch.long, device=device), scores, ancestors,
                      torch.full((B,), N, device=device), torch.zeros(B, N, dtype=torch.long, device=device))


def add_level(tree: DeviceTree, frontier: torch.Tensor, cumulative: torch.Tensor, level: int, width: int,
              token_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth `level`'s `width` nodes (ids 1 + (level - 1) * width ...: fixed by shape), in place: the top-k of
    cumulative (B, F, V) scores of the frontier's (B, F) children, their tokens (token_map (V,) long: a child's index
    in V to its token id; None: the index is the id), parents, depths, scores, path hashes and ancestor bits.
    Returns (the next frontier (B, k), each new node's parent (B, k)). The top-k, then one fused operator writing
    the tree (swiftspec_kernels.tree_level: a Triton kernel on a GPU, its torch reference elsewhere)."""
    best, flat = cumulative.reshape(frontier.shape[0], -1).topk(width, dim=-1)  # (B, k)
    return tree_level(tree.tokens, tree.parents, tree.hashes, tree.depths, tree.scores, tree.ancestors, frontier,
                      best, flat, token_map, cumulative.shape[-1], level, HASH_MULTIPLIER)  # below 2**63: an int64
