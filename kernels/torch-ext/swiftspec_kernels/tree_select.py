"""The round's subtree selection, fused: each row's best T nodes by draft score (ties towards the lower index), in
index order, with their local parents, depths and ancestor-or-self mask (hf_swiftspec/steps/device_round.py's
select_device calls it; every device round).

The reference sorts (a stable descending sort over the capacity, then the picks by index) and gathers, about twenty
operators; the kernel sorts nothing: one program per row ranks each node by counting the nodes before it (a higher
score, or an equal one at a lower index: the stable sort's order, -inf dead nodes included), keeps the nodes of rank
below T and places each at its count of lower-index picks.

    tree_select(tokens, parents, depths, scores, ancestors, size, budget)
        -> (node_ids, tokens, parents, scores, valid, depths, mask)

    tokens:    (B, N) long    each node's token; parents (B, N) long: parent index, -1 for the root and dead nodes
    depths:    (B, N) long    distance from the root
    scores:    (B, N) float32 cumulative draft score, -inf for dead nodes
    ancestors: (B, N, N) bool ancestors[b, i, j]: j is i or an ancestor of i
    size:      (B,) long      live nodes per row
    budget:    int            nodes verified per row: T = min(budget, N)
    node_ids:  (B, T) long    the picks' indices in the tree, ascending
    tokens:    (B, T) long    their tokens; scores (B, T) float32 their scores
    parents:   (B, T) long    local index of each pick's parent, -1 for the root, an unpicked parent and padding
    valid:     (B, T) bool    the first min(size, T) picks
    depths:    (B, T) long    each pick's depth, 0 for padding
    mask:      (B, T, T) bool ancestor-or-self among the picks (padding sees itself alone)
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["tree_select", "tree_select_reference", "tree_select_triton"]

Selected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def tree_select_reference(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                          ancestors: torch.Tensor, size: torch.Tensor, budget: int) -> Selected:
    """tree_select in tensor operations: a stable descending sort over the whole capacity ranks dead nodes (-inf,
    higher indices) after every live one, so a row's first min(size, T) picks are its best live nodes, and sorting
    the picks by index puts that row's padding last."""
    B, N = scores.shape
    T = min(budget, N)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # (B, N)
    node_ids = order[:, :T].sort(dim=1).values  # (B, T)
    arange_t = torch.arange(T, device=node_ids.device)
    valid = arange_t[None] < size[:, None]  # (B, T)
    local = torch.full((B, N), -1, dtype=torch.long, device=node_ids.device)
    local.scatter_(1, node_ids, arange_t[None].expand(B, T))
    parent_ids = parents.gather(1, node_ids)
    local_parents = torch.where(parent_ids >= 0, local.gather(1, parent_ids.clamp(min=0)), -1)
    local_parents = torch.where(valid, local_parents, -1)
    rows = ancestors.gather(1, node_ids[:, :, None].expand(B, T, N))  # (B, T, N)
    mask = rows.gather(2, node_ids[:, None, :].expand(B, T, T))  # (B, T, T)
    mask = (mask & valid[:, :, None]) | (torch.eye(T, dtype=torch.bool, device=mask.device) & ~valid[:, :, None])
    return (node_ids, tokens.gather(1, node_ids), local_parents, scores.gather(1, node_ids), valid,
            torch.where(valid, depths.gather(1, node_ids), 0), mask)


if triton is not None:

    @triton.jit
    def _tree_select_kernel(tokens_ptr, parents_ptr, depths_ptr, scores_ptr, ancestors_ptr, size_ptr,
                            ids_ptr, tokens_out, parents_out, scores_out, valid_out, depths_out, mask_out, N, T,
                            BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_N)
        inside = i < N
        row, col = i[:, None], i[None, :]
        scores = tl.load(scores_ptr + b * N + i, mask=inside, other=float("-inf"))
        above = (scores[None, :] > scores[:, None]) | ((scores[None, :] == scores[:, None]) & (col < row))
        rank = tl.sum((above & (col < N)).to(tl.int32), axis=1)  # (BLOCK_N,) the stable descending sort's place
        picked = (rank < T) & inside
        at = tl.cumsum(picked.to(tl.int32), axis=0) - 1  # each pick's place among the picks, in index order
        valid = at < tl.load(size_ptr + b)
        parent = tl.load(parents_ptr + b * N + i, mask=inside, other=-1)
        # the parent's place when it is picked, -1 otherwise (and for -1 parents: no column matches)
        local = tl.sum(tl.where((col == parent[:, None]) & picked[None, :], at[None, :] + 1, 0), axis=1) - 1
        out = b * T + at
        tl.store(ids_ptr + out, i, mask=picked)
        tl.store(tokens_out + out, tl.load(tokens_ptr + b * N + i, mask=inside, other=0), mask=picked)
        tl.store(scores_out + out, scores, mask=picked)
        tl.store(valid_out + out, valid, mask=picked)
        tl.store(parents_out + out, tl.where(valid, local, -1), mask=picked)
        depths = tl.load(depths_ptr + b * N + i, mask=inside, other=0)
        tl.store(depths_out + out, tl.where(valid, depths, 0), mask=picked)
        both = picked[:, None] & picked[None, :]
        seen = tl.load(ancestors_ptr + b * N * N + row * N + col, mask=both, other=0) != 0
        mine = valid[:, None]
        mask = (seen & mine) | ((row == col) & ~mine)
        tl.store(mask_out + b * T * T + at[:, None] * T + at[None, :], mask, mask=both)


def tree_select_triton(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                       ancestors: torch.Tensor, size: torch.Tensor, budget: int) -> Selected:
    """tree_select as one Triton kernel (one program per row, an (N, N) block of comparisons: no sort)."""
    B, N = scores.shape
    T = min(budget, N)
    node_ids, out_tokens, out_parents, out_depths = (tokens.new_empty(B, T) for _ in range(4))
    out_scores = scores.new_empty(B, T)
    valid = torch.empty(B, T, dtype=torch.bool, device=scores.device)
    mask = torch.empty(B, T, T, dtype=torch.bool, device=scores.device)
    if T > 0:
        _tree_select_kernel[(B,)](tokens.contiguous(), parents.contiguous(), depths.contiguous(), scores.contiguous(),
                                  ancestors.contiguous(), size.contiguous(), node_ids, out_tokens, out_parents,
                                  out_scores, valid, out_depths, mask, N, T, BLOCK_N=triton.next_power_of_2(N))
    return node_ids, out_tokens, out_parents, out_scores, valid, out_depths, mask


@torch.library.custom_op("swiftspec::tree_select", mutates_args=())
def tree_select_operator(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                         ancestors: torch.Tensor, size: torch.Tensor, budget: int) -> Selected:
    """swiftspec::tree_select: the Triton kernel where use_triton says, else the reference."""
    run = tree_select_triton if use_triton(scores) else tree_select_reference
    return run(tokens, parents, depths, scores, ancestors, size, budget)


@tree_select_operator.register_fake
def _fake(tokens, parents, depths, scores, ancestors, size, budget):
    B, N = scores.shape
    T = min(budget, N)
    flat = [tokens.new_empty(B, T) for _ in range(3)]
    return (flat[0], flat[1], flat[2], scores.new_empty(B, T), scores.new_empty(B, T, dtype=torch.bool),
            tokens.new_empty(B, T), scores.new_empty(B, T, T, dtype=torch.bool))


def tree_select(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                ancestors: torch.Tensor, size: torch.Tensor, budget: int) -> Selected:
    """The selection (module docstring) as one operator: the Triton kernel on a GPU, the reference elsewhere."""
    return dispatch(tree_select_operator, tree_select_reference, scores, tokens, parents, depths, scores, ancestors,
                    size, budget)
