"""A round's trees, selection and commit as pure functions of fixed-shape device tensors (building blocks); the walk
and the target's choices are acceptance.py's (every round's).

Each function here does one of the round's jobs with no host read: no `.item()`, `.tolist()`,
`bool()`, boolean-mask indexing, `nonzero` or shape that follows a value, so a round built of them
can be captured in a CUDA graph and the host reads one small tensor a round (acceptance.round_result).
Every shape depends on (B rows, N tree capacity, T verified nodes, V vocabulary, C cache slots) alone;
what varies (how many nodes are live, how many tokens were accepted) rides in tensors as counts
and padding. tests/test_device_round.py checks each against a plain reference written in the test.

engine/device_sides.py runs the round of them (SwiftSpecConfig round="device").
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from swiftspec_kernels.tree_reroot import tree_reroot
from swiftspec_kernels.tree_select import tree_select

from .tree import TokenTree


@dataclass
class DeviceTree:
    """B rows' token trees of capacity N, on the device (tree.TokenTree's fields, batched).

    tokens:    (B, N) long    token id of each node
    parents:   (B, N) long    parent index, -1 for the root and for dead nodes
    depths:    (B, N) long    distance from the root
    scores:    (B, N) float32 cumulative draft log-prob from the root; -inf for dead nodes (past a row's size)
    ancestors: (B, N, N) bool ancestors[b, i, j]: j is i or an ancestor of i (False on dead rows)
    size:      (B,) long      live nodes per row
    hashes:    (B, N) long    each node's path hash (path_hash over the tokens below the root; the root's 0), or None
                              (path_hashes makes them): what a suffix proposal's nodes are matched to draft nodes by
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    ancestors: torch.Tensor
    size: torch.Tensor
    hashes: torch.Tensor | None = None


HASH_MULTIPLIER = 0x5851F42D4C957F2D  # odd: a path's hash is a polynomial in its tokens modulo 2**64


def path_hash(parent_hashes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The hash of a node's path from the root: its parent's times HASH_MULTIPLIER plus its token + 1, wrapping in
    int64 (host_path_hash is the same on host ints). Two nodes of one hash are the same path (a collision, 2**-52 a
    pair, would only merge a proposal onto another node: the target decides every token all the same)."""
    return parent_hashes * _signed(HASH_MULTIPLIER) + (tokens + 1)


def host_path_hash(parent_hash: int, token: int) -> int:
    """path_hash on host ints (the suffix proposals' nodes), as an unsigned 64-bit value (the merge compares its
    swiftspec_kernels.tree_merge.HASH_BITS)."""
    return (parent_hash * HASH_MULTIPLIER + token + 1) & ((1 << 64) - 1)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def path_hashes(tree: DeviceTree) -> torch.Tensor:
    """(B, N) every node's path hash, for a tree built without them (nodes are in topological order: N passes, no
    host read)."""
    hashes = torch.zeros_like(tree.tokens)
    for _ in range(tree.tokens.shape[1]):
        parent = hashes.gather(1, tree.parents.clamp(min=0))
        hashes = torch.where(tree.parents >= 0, path_hash(parent, tree.tokens), 0)
    return hashes


def stack_trees(trees: list[TokenTree]) -> DeviceTree:
    """The host trees (each of capacity N) as one DeviceTree; no host read (every field is copied whole)."""
    capacity = {tree.capacity for tree in trees}
    if len(capacity) != 1:
        raise ValueError(f"stack_trees needs trees of one capacity, got {sorted(capacity)}; allocate them alike")
    device = trees[0].tokens.device
    live = torch.arange(trees[0].capacity, device=device)
    size = torch.tensor([tree.size for tree in trees], device=device)

    def stack(name: str) -> torch.Tensor:
        return torch.stack([getattr(tree, name) for tree in trees])

    alive = live[None] < size[:, None]  # fields past a row's size may hold an older tree's leftovers
    return DeviceTree(
        tokens=torch.where(alive, stack("tokens"), 0),
        parents=torch.where(alive, stack("parents"), -1),
        depths=torch.where(alive, stack("depths"), 0),
        scores=torch.where(alive, stack("scores"), float("-inf")),
        ancestors=stack("ancestors") & alive[:, :, None] & alive[:, None, :],
        size=size,
    )


@dataclass
class DeviceSubtree:
    """The T nodes each row verifies, in index order (topological), local index 0 = the root; rows with
    fewer live nodes than T are padded at the end.

    node_ids: (B, T) long    node indices in the row's tree (padding: indices of dead nodes, never entered)
    tokens:   (B, T) long    token of each node
    parents:  (B, T) long    local index of each node's parent, -1 for the root and padding
    scores:   (B, T) float32 draft score of each node (-inf for padding)
    valid:    (B, T) bool    real nodes (the first min(size, T) of each row)
    depths:   (B, T) long    each node's depth (padding: 0); its position is the root's plus this
    mask:     (B, T, T) bool ancestor-or-self mask among the T nodes (padding sees itself alone)
    """

    node_ids: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor


def select_device(tree: DeviceTree, budget: int) -> DeviceSubtree:
    """tree.best_node_ids (root 0) for every row at once, with the verifier's mask and depths (subtree_mask's).

    The best `budget` nodes by score, ties towards the lower index (a stable descending sort's order, dead -inf
    nodes after every live one), so a row's first min(size, T) picks are exactly the host's, in index order with
    that row's padding last. One fused operator (swiftspec_kernels.tree_select: a Triton kernel on a GPU, its torch
    reference elsewhere).
    """
    return DeviceSubtree(*tree_select(tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors,
                                      tree.size, budget))  # its outputs in DeviceSubtree's field order


def plain_subtree(roots: torch.Tensor) -> DeviceSubtree:
    """The plain shape's subtree: each row's root alone (T = 1), what select_device picks from a root-only tree with
    a budget of 1, made directly (no selection). roots (B,) long."""
    B, device = roots.shape[0], roots.device
    zeros = functools.partial(torch.zeros, B, 1, dtype=torch.long, device=device)
    return DeviceSubtree(zeros(), roots[:, None].clone(), zeros() - 1, torch.zeros(B, 1, device=device),
                         torch.ones(B, 1, dtype=torch.bool, device=device), zeros(),
                         torch.ones(B, 1, 1, dtype=torch.bool, device=device))


def reroot_device(tree: DeviceTree, path: torch.Tensor, count: torch.Tensor,
                  token: torch.Tensor) -> tuple[DeviceTree, torch.Tensor]:
    """Every row's tree re-rooted on its verdict (SwiftSpec's re-root: the draft's tree lives across rounds): the
    child of the path's last node that holds `token` becomes the root and the nodes below it are kept, compacted in
    their order (a new tree of `token` alone where the draft never proposed it). One fused operator
    (swiftspec_kernels.tree_reroot: a Triton kernel on a GPU, its torch reference elsewhere), no host read.

    path:  (B, M) long the verified path's node ids in the tree, the root first (past count: ignored)
    count: (B,) long   its nodes a row (at least 1: the root); 0: the path left the tree (a new tree)
    token: (B,) long   the target's token after the path: the new root's
    Returns the new tree and moved (B, N) long, each new node's old id (-1: none; reroot_cache's and any per-node
    field's gather)."""
    last = torch.where(count > 0, path.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0], -1)
    hashes = tree.hashes if tree.hashes is not None else path_hashes(tree)
    tokens, parents, depths, scores, ancestors, hashes, size, moved = tree_reroot(
        tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors, hashes, tree.size, last, token,
        HASH_MULTIPLIER)
    return DeviceTree(tokens, parents, depths, scores, ancestors, size, hashes), moved


def commit_plan(prefix_lens: torch.Tensor, path_slots: torch.Tensor, path_count: torch.Tensor,
                keep_slots: torch.Tensor | None, keep_count: torch.Tensor | None,
                scratch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where TreeCache.commit_rows moves each row's slots, as fixed-shape (source, destination) pairs.

    prefix_lens: (B,) long  each row's committed slots (its tree region starts there)
    path_slots:  (B, M) long tree-region slots (relative to the prefix) of the accepted path, in order;
                 entries past path_count are ignored (a walk's path for the target, whose node j sits in slot j)
    keep_slots:  (B, K) long tree-region slots to keep behind the path (the draft's surviving subtree),
                 entries past keep_count ignored; None: keep nothing
    scratch:     the cache's scratch slot (capacity - 1): padding moves scratch to scratch
    Returns src (B, M + K), dst (B, M + K) absolute slots, the new prefix_lens (B,) and lengths (B,).
    """
    B, M = path_slots.shape
    if keep_slots is None:  # the path alone (both caches' commit a round): half the operations
        prefix = prefix_lens[:, None]
        j = torch.arange(M, device=path_slots.device)[None]
        real = j < path_count[:, None]
        src = torch.where(real, prefix + path_slots, scratch)
        dst = torch.where(real, prefix + j, scratch)
        return src, dst, prefix_lens + path_count, prefix_lens + path_count
    K = keep_slots.shape[1]
    j = torch.arange(M + K, device=path_slots.device)[None]  # (1, M + K)
    m, n = path_count[:, None], (path_count + keep_count)[:, None]
    from_path = path_slots.gather(1, j.clamp(max=M - 1).expand(B, -1)) if M else j.expand(B, -1)
    from_keep = keep_slots.gather(1, (j - m).clamp(0, max(K - 1, 0)).expand(B, -1)) if K else from_path
    relative = torch.where(j < m, from_path, from_keep)
    real = j < n
    prefix = prefix_lens[:, None]
    src = torch.where(real, prefix + relative, scratch)
    dst = torch.where(real, prefix + j, scratch)
    return src, dst, prefix_lens + path_count, prefix_lens + path_count + keep_count


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host data (nested lists of numbers) as a tensor on `device` in one copy that never waits for the device: on
    CUDA staged in pinned memory and copied non-blocking (a `torch.tensor(list, device="cuda")` copies from pageable
    memory and then waits for the stream, as a read does). The device round's every host-to-device copy."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()  # the caching host allocator keeps it until the copy has run
    return host.to(device, non_blocking=True)
