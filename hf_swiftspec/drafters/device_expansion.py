"""SwiftSpec's growth on the device: a draft tree that lives across rounds, expanded best leaves first (a building
block of the asynchronous round: engine/device_async.py).

SwiftSpec's Algorithm 1: each expansion runs the draft on the `width` most probable leaves (a node's score:
the draft's log-probs summed from the root) and adds each one's best children; the draft keeps expanding
while the target verifies the subtree it was sent, and when the verdict comes the tree is re-rooted below the target's
next token (steps/device_round.reroot_device, slot_cache.reroot_cache), the kept nodes and their KV compacted, so what
was expanded meanwhile is not lost. The level growth of the serial round (device_growth.py) grows a fresh tree of
fixed node ids each round; this tree is compact (node ids 0 .. size - 1 in topological order, dead nodes past `size`),
so a re-rooted tree grows on where it left off.

Every step is a fixed-shape device operation (B rows, N capacity, `width` leaves): no host read. A node's KV sits at
region slot prefix_len + its id once it was expanded (the draft ran it); children join at the next free ids, none
past the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..steps.device_round import DeviceTree, path_hash, reroot_device
from ..steps.slot_cache import SlotCache, reroot_cache, slot_forward, tree_attention


@dataclass
class DraftTree:
    """B rows' draft trees across rounds, on the device.

    tree:        DeviceTree (B, N), compact (its hashes always kept)
    expanded:    (B, N) bool the nodes the draft ran (their KV at region slot prefix_lens + id, their children added)
    prefix_lens: (B,) long   the committed slots of the draft's cache behind which the tree region starts
    """

    tree: DeviceTree
    expanded: torch.Tensor
    prefix_lens: torch.Tensor

    @classmethod
    def rooted(cls, roots: torch.Tensor, prefix_lens: torch.Tensor, capacity: int) -> "DraftTree":
        """A tree of each row's root alone (roots (B,) long), nothing expanded, `capacity` nodes a row."""
        B, N, device = roots.shape[0], capacity, roots.device
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        tokens[:, 0] = roots
        scores = torch.full((B, N), float("-inf"), device=device)
        scores[:, 0] = 0.0
        ancestors = torch.zeros(B, N, N, dtype=torch.bool, device=device)
        ancestors[:, 0, 0] = True
        tree = DeviceTree(tokens, torch.full((B, N), -1, dtype=torch.long, device=device),
                          torch.zeros(B, N, dtype=torch.long, device=device), scores, ancestors,
                          torch.ones(B, dtype=torch.long, device=device),
                          torch.zeros(B, N, dtype=torch.long, device=device))
        return cls(tree, torch.zeros(B, N, dtype=torch.bool, device=device), prefix_lens.clone())


def best_leaves(draft: DraftTree, width: int, room: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` most probable leaves a row, ties to the lower id: (B, width) node ids and whether each is one (fewer
    than `width` leaves: the rest are padding, id 0). A leaf is a live node with no child: one the draft never ran,
    or one whose children all lost to better ones (run again, its KV rewritten the same, so that a tree re-rooted
    there grows on). room (B,) long: the depth below which a leaf's children still fit the models' context (None: no
    limit)."""
    tree = draft.tree
    N = tree.tokens.shape[1]
    live = torch.arange(N, device=tree.tokens.device)[None] < tree.size[:, None]
    children = torch.zeros_like(tree.parents).scatter_add_(1, tree.parents.clamp(min=0),
                                                           (live & (tree.parents >= 0)).long())
    has_child = children > 0
    leaf = live & ~has_child
    if room is not None:
        leaf &= tree.depths < room[:, None]
    ranked = torch.where(leaf, tree.scores, float("-inf"))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :width]  # (B, width)
    real = leaf.gather(1, order)
    return torch.where(real, order, 0), real


def unexpanded(draft: DraftTree, node_ids: torch.Tensor, valid: torch.Tensor,
               room: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each row's nodes `node_ids` (B, Q) (valid: (B, Q) bool, real ones), those the draft has not run, first and
    in their order: (B, Q) node ids and whether each is one (the rest padding, id 0). What the first expansion while a
    subtree is verified runs (SwiftSpec's graft): whichever path the target accepts then ends at a node whose
    children are in the tree, so the re-root finds the target's next token among them unless the draft did not rank
    it. room: best_leaves'."""
    waiting = valid & ~draft.expanded.gather(1, node_ids)
    if room is not None:
        waiting &= draft.tree.depths.gather(1, node_ids) < room[:, None]
    order = torch.sort((~waiting).to(torch.uint8), dim=1, stable=True).indices
    real = waiting.gather(1, order)
    return torch.where(real, node_ids.gather(1, order), 0), real


def expand(model, cache: SlotCache, draft: DraftTree, width: int, children: int, vocab_limit: int | None = None,
           leaves: tuple[torch.Tensor, torch.Tensor] | None = None) -> DraftTree:
    """One expansion: the draft runs on each row's `leaves` ((B, Q) node ids and which are real; default its best
    `width` leaves: best_leaves) in one forward, each at position prefix_len + its depth and slot prefix_len + its id,
    seeing the prefix and its ancestors (padding queries write the scratch slot), and each leaf's best `children`
    children (ids below vocab_limit) join the tree at its next free ids, leaf by leaf (none past the capacity).
    Returns the grown tree."""
    tree, prefix = draft.tree, draft.prefix_lens
    B, N = tree.tokens.shape
    device = tree.tokens.device
    leaves, real = best_leaves(draft, width) if leaves is None else leaves
    Q = leaves.shape[1]
    depths = tree.depths.gather(1, leaves)
    positions = prefix[:, None] + depths
    slots = torch.where(real, prefix[:, None] + leaves, cache.scratch)
    seen = tree.ancestors.gather(1, leaves[:, :, None].expand(B, Q, N)) & real[:, :, None]
    attention = tree_attention(cache, prefix, seen, positions, tree.depths, model.dtype)
    logits = slot_forward(model, cache, tree.tokens.gather(1, leaves), positions, slots, attention)
    logprobs = torch.log_softmax(logits[..., :vocab_limit], dim=-1)  # (B, Q, V')
    best, token = logprobs.topk(children, dim=-1)  # (B, Q, k), each leaf's best first
    best = (tree.scores.gather(1, leaves)[:, :, None] + best).masked_fill(~real[:, :, None], float("-inf"))
    best, token = best.reshape(B, Q * children), token.reshape(B, Q * children)
    parent = leaves[:, :, None].expand(B, Q, children).reshape(B, Q * children)
    new_ids = tree.size[:, None] + torch.arange(Q * children, device=device)[None]  # (B, Q k): leaf by leaf
    joins = (new_ids < N) & real[:, :, None].expand(B, Q, children).reshape(B, -1)  # a prefix of each row's
    at = (new_ids[:, :, None] == torch.arange(N, device=device)[None, None]) & joins[:, :, None]  # (B, Q k, N)
    hit = at.any(1)  # (B, N) the nodes written
    k = at.long().argmax(1)  # (B, N) which child each is

    def placed(values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.where(hit, values.gather(1, k), old)

    parent_rows = tree.ancestors.gather(1, parent[:, :, None].expand(B, Q * children, N)) | at
    ancestors = torch.where(hit[:, :, None], parent_rows.gather(1, k[:, :, None].expand(B, N, N)), tree.ancestors)
    grown = DeviceTree(
        tokens=placed(token, tree.tokens),
        parents=placed(parent, tree.parents),
        depths=placed(tree.depths.gather(1, parent) + 1, tree.depths),
        scores=placed(best, tree.scores),
        ancestors=ancestors,
        size=tree.size + joins.sum(1),
        hashes=placed(path_hash(tree.hashes.gather(1, parent), token), tree.hashes),
    )
    ran = ((leaves[:, :, None] == torch.arange(N, device=device)[None, None]) & real[:, :, None]).any(1)
    return DraftTree(grown, draft.expanded | ran, prefix)


@dataclass
class Rerooted:
    """A re-rooted tree whose KV has not moved yet (reroot_tree): the new tree (its prefix_lens already the new
    ones), what reroot_kv moves (each new node's old id, moved (B, N); the verified path and its count) and, per row,
    whether the draft had drafted the new root (found (B,) bool). The tree may be selected from at once; the draft
    runs nothing on it until reroot_kv has moved its cache."""

    draft: DraftTree
    moved: torch.Tensor
    found: torch.Tensor
    path: torch.Tensor
    count: torch.Tensor
    prefix_before: torch.Tensor


def reroot_tree(draft: DraftTree, path: torch.Tensor, count: torch.Tensor, token: torch.Tensor) -> Rerooted:
    """The tree after a verdict: the verified path (node ids (B, M), the root first, `count` a row) committed, the
    subtree below the child holding `token` kept (a new tree of `token` alone where there is none), what was expanded
    of it still expanded; its KV moved by reroot_kv."""
    tree, moved = reroot_device(draft.tree, path, count, token)
    expanded = draft.expanded.gather(1, moved.clamp(min=0)) & (moved >= 0)
    return Rerooted(DraftTree(tree, expanded, draft.prefix_lens + count), moved, moved[:, 0] >= 0, path, count,
                    draft.prefix_lens)


def reroot_kv(cache: SlotCache, rerooted: Rerooted) -> DraftTree:
    """The draft's cache after the re-root: the verified path's KV behind the old prefix, then the kept nodes' at their
    new ids (slot_cache.reroot_cache). The path's last node may be a leaf the draft never ran: its committed slot then
    holds no KV (`unrun` says which rows; the caller runs it before the next expansion). Returns the tree."""
    reroot_cache(cache, rerooted.prefix_before, rerooted.path, rerooted.count, rerooted.moved,
                 rerooted.draft.tree.size)
    return rerooted.draft


def reroot(cache: SlotCache, draft: DraftTree, path: torch.Tensor, count: torch.Tensor,
           token: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
    """reroot_tree then reroot_kv: the tree and its cache after a verdict, and whether each row's new root was
    drafted (B,) bool."""
    rerooted = reroot_tree(draft, path, count, token)
    return reroot_kv(cache, rerooted), rerooted.found


def unrun(draft: DraftTree, path: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows whose verified path ends at a node the draft never ran (a leaf), checked before the re-root."""
    last = path.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
    return (count > 0) & ~draft.expanded.gather(1, last[:, None])[:, 0]
