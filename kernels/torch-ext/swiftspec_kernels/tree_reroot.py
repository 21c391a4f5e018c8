"""A draft tree re-rooted on a verdict, fused: the subtree below the target's new root kept and compacted, on the
device (SwiftSpec's re-root, Algorithm 1: the draft's tree lives across rounds; when the target's verdict arrives, the
tree is walked along the verified tokens, the node of the target's next token becomes the root and everything not
below it goes; a new tree where that token was never drafted).

The reference finds the new root and ranks the kept nodes in tensor operations (about forty operators, a cumulative
sum for the ranks); the kernel, one program per row, finds the root, ranks each kept node by counting the kept nodes
before it and gathers every field of its new node, out of place.

    tree_reroot(tokens, parents, depths, scores, ancestors, hashes, size, last, token, multiplier)
        -> (tokens, parents, depths, scores, ancestors, hashes, size, moved)

    tokens, parents, depths: (B, N) long  the tree (parents before children, dead nodes past `size`: parent -1)
    scores:    (B, N) float32            cumulative draft log-probs from the root, -inf for dead nodes
    ancestors: (B, N, N) bool            ancestors[b, i, j]: j is i or an ancestor of i
    hashes:    (B, N) long               each node's path hash from the root (device_round.path_hash's rule)
    size:      (B,) long                 live nodes a row
    last:      (B,) long                 the deepest tree node of the verified path (-1: the path left the tree)
    token:     (B,) long                 the target's token after it: the new root's token
    multiplier: int                      the path hash's multiplier (a node's hash: its parent's * it + token + 1)

Returns the new tree, compacted in the same (topological) order: the new root is node 0, the nodes below it follow
in their old order (a node's new id is the number of kept nodes before it), depths and scores measured from the new
root (its score 0; below a root the draft scored -inf, nothing is shifted), hashes from it (a node d levels below it: its old hash less the root's times multiplier ** d, wrapping int64),
ancestor bits among the kept nodes; dead nodes past the new size as the growth's seed leaves them. moved (B, N) long:
the old id of each new node (-1 past the new size, and the root of a new tree: no node held it), what the draft's
tree-region KV and any other per-node field follow. Where no live child of `last` has `token`, the row's new tree is
that token alone (size 1).
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["tree_reroot", "tree_reroot_reference", "tree_reroot_triton"]

Rerooted = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor]


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def tree_reroot_reference(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                          ancestors: torch.Tensor, hashes: torch.Tensor, size: torch.Tensor, last: torch.Tensor,
                          token: torch.Tensor, multiplier: int) -> Rerooted:
    """tree_reroot in tensor operations: the root by a match over the nodes, the kept nodes' new ids by a cumulative
    sum, every field gathered at `moved`."""
    B, N = tokens.shape
    device = tokens.device
    i = torch.arange(N, device=device)[None]  # (1, N)
    live = i < size[:, None]
    child = live & (parents == last[:, None]) & (tokens == token[:, None]) & (last[:, None] >= 0)
    found = child.any(1)  # (B,)
    root = torch.where(child, i, N).amin(1).clamp(max=N - 1)  # (B,) the first match (children's tokens differ)
    below = ancestors.gather(2, root[:, None, None].expand(B, N, 1))[:, :, 0]  # (B, N): the root is an ancestor
    keep = below & live & found[:, None]
    new_id = keep.long().cumsum(1) - 1  # (B, N) each kept node's new id
    new_size = torch.where(found, keep.sum(1), 1)
    moved = torch.full((B, N + 1), -1, dtype=torch.long, device=device)  # column N: where dropped nodes land
    moved.scatter_(1, torch.where(keep, new_id, N), i.expand(B, N))
    moved = moved[:, :N].contiguous()
    alive = i < new_size[:, None]
    src = moved.clamp(min=0)
    old_parent = parents.gather(1, src)
    parent_kept = (old_parent >= 0) & keep.gather(1, old_parent.clamp(min=0))
    new_parents = torch.where(alive & parent_kept, new_id.gather(1, old_parent.clamp(min=0)), -1)
    root_depth, root_score, root_hash = (t.gather(1, root[:, None]) for t in (depths, scores, hashes))
    new_depths = torch.where(alive, depths.gather(1, src) - root_depth, 0)
    shift = torch.where(root_score > float("-inf"), root_score, 0.0)  # (a root the draft ruled out: no shift)
    new_scores = torch.where(alive, scores.gather(1, src) - shift, float("-inf"))
    new_scores = torch.where(i == 0, 0.0, new_scores)
    power = torch.ones_like(new_depths)
    for d in range(1, N):  # multiplier ** depth, wrapping (a node sits at most N - 1 below the root)
        power = torch.where(new_depths >= d, power * _signed(multiplier), power)
    new_hashes = torch.where(alive, hashes.gather(1, src) - root_hash * power, 0)
    rows = ancestors.gather(1, src[:, :, None].expand(B, N, N))
    new_ancestors = rows.gather(2, src[:, None, :].expand(B, N, N)) & alive[:, :, None] & alive[:, None, :]
    new_tokens = torch.where(alive, tokens.gather(1, src), 0)
    fresh = ~found[:, None] & (i == 0)  # a new tree: the token alone, at the root
    new_tokens = torch.where(fresh, token[:, None], new_tokens)
    new_depths, new_hashes = (torch.where(fresh, 0, t) for t in (new_depths, new_hashes))
    new_ancestors = new_ancestors | (fresh[:, :, None] & (i == 0)[:, None, :])
    moved = torch.where(alive & ~fresh, moved, -1)
    return (new_tokens, new_parents, new_depths, new_scores, new_ancestors, new_hashes, new_size, moved)


if triton is not None:

    @triton.jit
    def _tree_reroot_kernel(tokens_ptr, parents_ptr, depths_ptr, scores_ptr, ancestors_ptr, hashes_ptr, size_ptr,
                            last_ptr, token_ptr, tokens_out, parents_out, depths_out, scores_out, ancestors_out,
                            hashes_out, size_out, moved_out, N, multiplier, BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_N)
        inside = i < N
        size = tl.load(size_ptr + b)
        last = tl.load(last_ptr + b)
        token = tl.load(token_ptr + b)
        live = inside & (i < size)
        parents = tl.load(parents_ptr + b * N + i, mask=inside, other=-1)
        tokens = tl.load(tokens_ptr + b * N + i, mask=inside, other=0)
        child = live & (parents == last) & (tokens == token) & (last >= 0)
        root = tl.min(tl.where(child, i, BLOCK_N), axis=0)
        found = root < N
        root = tl.minimum(root, N - 1)
        below = tl.load(ancestors_ptr + b * N * N + i * N + root, mask=inside, other=0) != 0
        keep = below & live & found
        # each kept node's new id: the kept nodes before it (a count, no scan)
        row, col = i[:, None], i[None, :]
        new_id = tl.sum((keep[None, :] & (col < row)).to(tl.int64), axis=1)  # (BLOCK_N,) indexed by old id
        new_size = tl.where(found, tl.sum(keep.to(tl.int64), axis=0), 1)
        # new node j's old id: the kept node whose new id is j (rows j, columns old ids)
        match = keep[None, :] & (new_id[None, :] == row)
        alive = inside & (i < new_size)
        fresh = (i == 0) & (found == 0)
        taken = alive & (tl.sum(match.to(tl.int32), axis=1) > 0) & (fresh == 0)
        moved = tl.where(taken, tl.sum(tl.where(match, col, 0), axis=1).to(tl.int64), -1)  # (BLOCK_N,) indexed by new id
        src = tl.maximum(moved, 0)
        old_parent = tl.load(parents_ptr + b * N + src, mask=taken, other=-1)
        # the parent's new id, where it is kept: a match over the old ids
        is_parent = keep[None, :] & (col == old_parent[:, None])
        parent_kept = tl.sum(is_parent.to(tl.int32), axis=1) > 0
        new_parent = tl.where(taken & parent_kept, tl.sum(tl.where(is_parent, new_id[None, :], 0), axis=1), -1)
        root_depth = tl.load(depths_ptr + b * N + root)
        root_score = tl.load(scores_ptr + b * N + root)
        root_hash = tl.load(hashes_ptr + b * N + root)
        depth = tl.where(taken, tl.load(depths_ptr + b * N + src, mask=taken, other=0) - root_depth, 0)
        shift = tl.where(root_score > float("-inf"), root_score, 0.0)  # (a root the draft ruled out: no shift)
        score = tl.where(taken, tl.load(scores_ptr + b * N + src, mask=taken, other=0.0) - shift, float("-inf"))
        score = tl.where(i == 0, 0.0, score)
        power = tl.full((BLOCK_N,), 1, tl.int64)
        for d in range(1, N):
            power = tl.where(depth >= d, power * multiplier, power)
        hashed = tl.where(taken, tl.load(hashes_ptr + b * N + src, mask=taken, other=0) - root_hash * power, 0)
        token_at = tl.where(taken, tl.load(tokens_ptr + b * N + src, mask=taken, other=0), 0)
        token_at = tl.where(fresh, token, token_at)
        out = b * N + i
        tl.store(tokens_out + out, token_at, mask=inside)
        tl.store(parents_out + out, new_parent, mask=inside)
        tl.store(depths_out + out, depth, mask=inside)
        tl.store(scores_out + out, score, mask=inside)
        tl.store(hashes_out + out, hashed, mask=inside)
        tl.store(moved_out + out, moved, mask=inside)
        cells = inside[:, None] & inside[None, :]
        both = taken[:, None] & taken[None, :]
        seen = tl.load(ancestors_ptr + b * N * N + src[:, None] * N + src[None, :], mask=both & cells, other=0) != 0
        seen = (seen & both) | (fresh[:, None] & (col == 0))
        tl.store(ancestors_out + b * N * N + row * N + col, seen, mask=cells)
        tl.store(size_out + b, new_size)


def tree_reroot_triton(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                       ancestors: torch.Tensor, hashes: torch.Tensor, size: torch.Tensor, last: torch.Tensor,
                       token: torch.Tensor, multiplier: int) -> Rerooted:
    """tree_reroot as one Triton kernel (one program per row, out of place)."""
    B, N = tokens.shape
    out = (torch.empty_like(tokens), torch.empty_like(parents), torch.empty_like(depths), torch.empty_like(scores),
           torch.empty_like(ancestors), torch.empty_like(hashes), torch.empty_like(size), torch.empty_like(tokens))
    _tree_reroot_kernel[(B,)](tokens.contiguous(), parents.contiguous(), depths.contiguous(), scores.contiguous(),
                              ancestors.contiguous(), hashes.contiguous(), size.contiguous(), last.contiguous(),
                              token.contiguous(), *out, N, _signed(multiplier), BLOCK_N=triton.next_power_of_2(N))
    return out


@torch.library.custom_op("swiftspec::tree_reroot", mutates_args=())
def tree_reroot_operator(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                         ancestors: torch.Tensor, hashes: torch.Tensor, size: torch.Tensor, last: torch.Tensor,
                         token: torch.Tensor, multiplier: int) -> Rerooted:
    """swiftspec::tree_reroot: the Triton kernel where use_triton says, else the reference."""
    run = tree_reroot_triton if use_triton(tokens) else tree_reroot_reference
    return run(tokens, parents, depths, scores, ancestors, hashes, size, last, token, multiplier)


@tree_reroot_operator.register_fake
def _fake(tokens, parents, depths, scores, ancestors, hashes, size, last, token, multiplier):
    return (torch.empty_like(tokens), torch.empty_like(parents), torch.empty_like(depths), torch.empty_like(scores),
            torch.empty_like(ancestors), torch.empty_like(hashes), torch.empty_like(size), torch.empty_like(tokens))


def tree_reroot(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                ancestors: torch.Tensor, hashes: torch.Tensor, size: torch.Tensor, last: torch.Tensor,
                token: torch.Tensor, multiplier: int) -> Rerooted:
    """The re-root (module docstring) as one operator: the Triton kernel on a GPU, the reference elsewhere."""
    return dispatch(tree_reroot_operator, tree_reroot_reference, tokens, tokens, parents, depths, scores, ancestors,
                    hashes, size, last, token, multiplier)
