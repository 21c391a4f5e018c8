"""A round's selection, walk and commit as pure functions of fixed-shape device tensors (building blocks).

The host round (engine/adaptive.py) reads the device once for its walk and once more after each draft
expansion, where the goodput policy decides from the new candidates whether to grow again
(tests/test_host_reads.py). Each function here does one of the round's jobs with no host read: no `.item()`, `.tolist()`,
`bool()`, boolean-mask indexing, `nonzero` or shape that follows a value, so a round built of them
can be captured in a CUDA graph and the host reads one small tensor a round (`round_result`).
Every shape depends on (B rows, N tree capacity, T verified nodes, V vocabulary, C cache slots) alone;
what varies (how many nodes are live, how many tokens were accepted) rides in tensors as counts
and padding. tests/test_device_round.py checks each against a plain reference written in the test.

engine/device_sides.py runs the round of them (SwiftSpecConfig round="device").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
HASH_BITS = (1 << 52) - 1  # the bits compared (the host's hashes travel as float64, exact to 53 bits)


def path_hash(parent_hashes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The hash of a node's path from the root: its parent's times HASH_MULTIPLIER plus its token + 1, wrapping in
    int64 (host_path_hash is the same on host ints). Two nodes of one hash are the same path (a collision, 2**-52 a
    pair, would only merge a proposal onto another node: the target decides every token all the same)."""
    return parent_hashes * _signed(HASH_MULTIPLIER) + (tokens + 1)


def host_path_hash(parent_hash: int, token: int) -> int:
    """path_hash on host ints (the suffix proposals' nodes), as an unsigned 64-bit value (compare its HASH_BITS)."""
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

    The best `budget` nodes by score, ties towards the lower index: a stable descending sort over the whole
    capacity ranks dead nodes (-inf, higher indices) after every live one, so a row's first min(size, T)
    picks are exactly the host's, and sorting the picks by index puts that row's padding last.
    """
    B, N = tree.scores.shape
    T = min(budget, N)
    order = torch.sort(tree.scores, dim=1, descending=True, stable=True).indices  # (B, N)
    node_ids = order[:, :T].sort(dim=1).values  # (B, T)
    arange_t = torch.arange(T, device=node_ids.device)
    valid = arange_t[None] < tree.size[:, None]  # (B, T)
    local = torch.full((B, N), -1, dtype=torch.long, device=node_ids.device)
    local.scatter_(1, node_ids, arange_t[None].expand(B, T))
    parent_ids = tree.parents.gather(1, node_ids)
    parents = torch.where(parent_ids >= 0, local.gather(1, parent_ids.clamp(min=0)), -1)
    parents = torch.where(valid, parents, -1)
    rows = tree.ancestors.gather(1, node_ids[:, :, None].expand(B, T, N))  # (B, T, N)
    mask = rows.gather(2, node_ids[:, None, :].expand(B, T, T))  # (B, T, T)
    mask = (mask & valid[:, :, None]) | (torch.eye(T, dtype=torch.bool, device=mask.device) & ~valid[:, :, None])
    return DeviceSubtree(
        node_ids=node_ids,
        tokens=tree.tokens.gather(1, node_ids),
        parents=parents,
        scores=tree.scores.gather(1, node_ids),
        valid=valid,
        depths=torch.where(valid, tree.depths.gather(1, node_ids), 0),
        mask=mask,
    )


def greedy_choices(scores: torch.Tensor) -> torch.Tensor:
    """The target's greedy choice (B, T) after every node, from processed scores (B, T, V)."""
    return scores.argmax(dim=-1)


def sampled_choices(scores: torch.Tensor, noise: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """The target's sampled choice (B, T) after every node: verify.Sampler.choose_rows' rule, Gumbel-max with
    each row's noise for the node's position, `(scores.double() + noise[depth]).argmax()`.

    scores: (B, T, V) processed scores (the path-free processors applied; others need the host's walk)
    noise:  (B, D, V) float64 Gumbel noise of each row for positions context length + d, d < D
            (Sampler.gumbel of the row's sampler: it depends on the seed, the row and the position alone,
            so the host draws it before the round from what it already knows, with no read)
    depths: (B, T) long each node's depth (< D)
    """
    B, T, V = scores.shape
    per_node = noise.gather(1, depths[:, :, None].expand(B, T, V))  # (B, T, V)
    return (scores.double() + per_node).argmax(dim=-1)


@dataclass
class DeviceWalk:
    """Each row's accepted path (B rows, T nodes verified).

    path:     (B, T) long local indices of the walked nodes, root first; -1 past `count`
    tokens:   (B, T) long the emitted tokens (the target's choice after each walked node); -1 past `count`
    count:    (B,) long   tokens emitted (>= 1 when max_tokens >= 1); the last one is the next root
    finished: (B,) bool   an EOS was emitted or max_tokens reached (verify.walk_to_stop's `finished`)
    """

    path: torch.Tensor
    tokens: torch.Tensor
    count: torch.Tensor
    finished: torch.Tensor


def next_nodes(choices: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Where the walk goes from each node (B, T) long: its first real child (lowest index) carrying the
    target's choice after it, else T (no such child): verify.children_of's lookup for every node at once."""
    B, T = tokens.shape
    arange_t = torch.arange(T, device=tokens.device)[None].expand(B, T)
    parent = parents.clamp(min=0)
    accepted = valid & (parents >= 0) & (tokens == choices.gather(1, parent))  # node i carries its parent's choice
    nxt = torch.full((B, T), T, dtype=torch.long, device=tokens.device)
    return nxt.scatter_reduce(1, parent, torch.where(accepted, arange_t, T), reduce="amin")


def walk_device(choices: torch.Tensor, subtree: DeviceSubtree, max_tokens: torch.Tensor,
                eos: torch.Tensor | None = None) -> DeviceWalk:
    """verify.walk_path then walk_to_stop's EOS and length rules, for every row at once.

    choices:    (B, T) long the target's choice after each node (greedy_choices / sampled_choices)
    max_tokens: (B,) long tokens each row may still emit; fold max_length in on the host
                (min(max_new_tokens left, max_length - sequence length)): walk_to_stop's length rule is that cut
    eos:        (E,) long EOS ids, or (B, E) each row's (-1: no id; a row that is done and decodes on has none),
                or None. Other stopping criteria (stop strings, max_time, custom ones) read
                the decoded text or the clock: the host applies them to the read result, as walk_to_stop does.
    The walk's nodes are found at once, no read and no pass per node: a node is on it when it and each of its
    ancestors below the root is its parent's first child carrying the target's choice (subtree.mask: ancestors).
    """
    B, T = choices.shape
    ids = torch.arange(T, device=choices.device)[None]
    nxt = next_nodes(choices, subtree.tokens, subtree.parents, subtree.valid)
    chosen = (nxt.gather(1, subtree.parents.clamp(min=0)) == ids) | (ids == 0)  # (B, T) where the walk goes from its parent
    on_path = ~(subtree.mask & ~chosen[:, None, :]).any(-1) & subtree.valid  # (B, T)
    at = torch.where(on_path, subtree.depths, T)  # one walked node per depth
    path = torch.full((B, T + 1), T, dtype=torch.long, device=choices.device).scatter_(1, at, ids.expand(B, T))[:, :T]
    j = torch.arange(T, device=choices.device)[None]
    count = (path < T).sum(dim=1).clamp(max=max_tokens.clamp(min=0))
    emitted = choices.gather(1, path.clamp(max=T - 1))
    if eos is not None and eos.numel():
        hits = torch.isin(emitted, eos) if eos.dim() == 1 else (emitted[:, :, None] == eos[:, None, :]).any(-1)
        stops = hits & (j < count[:, None])
        first_stop = torch.where(stops, j, T).amin(dim=1)  # (B,) T: none
        count = torch.minimum(count, first_stop + 1)
        finished = first_stop < T
    else:
        finished = torch.zeros(B, dtype=torch.bool, device=choices.device)
    finished = finished | (count >= max_tokens)
    inside = j < count[:, None]
    return DeviceWalk(torch.where(inside, path, -1), torch.where(inside, emitted, -1), count, finished)


def round_result(walk: DeviceWalk) -> torch.Tensor:
    """The round's one host read: (B, 2 + T) long, per row [count, finished, tokens...]."""
    return torch.cat([walk.count[:, None], walk.finished.long()[:, None], walk.tokens], dim=1)


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
