"""The suffix merge, fused: the draft's tree (N nodes) and the host's suffix proposal (S nodes, one packed tensor) as
one tree of N + S (hf_swiftspec/drafters/device_suffix.py's merge_suffix calls it; every round with suffix proposals).

A suffix node whose path the draft grew (the same path hash: its twin, the FIRST draft node n >= 1 of that hash that
is grown, score > -inf, the suffix node being live) is that draft node, which keeps the higher of the two scores. The
others ("own" nodes) become nodes N, N + 1, ... in their order, each below its parent (the draft's twin or an own
node), its ancestors those of its deepest twinned ancestor's twin (the root where none is) and its own; the merged-away
suffix nodes and the padding follow, dead (-inf, past the row's size, seeing nothing).

One program per row does it in registers (one-hot gathers, a prefix sum for the placement); the reference is the same
in about sixty tensor operations: the operators a GPU launches for a round's merge go from those to one kernel.

    tree_merge(tokens, parents, depths, scores, ancestors, size, hashes, packed)
        -> (tokens, parents, depths, scores, ancestors, size, hashes) of the merged tree, N + S nodes

    tokens:    (B, N) long     the draft tree's token ids; parents (B, N) long: -1 for the root and dead nodes
    depths:    (B, N) long     distance from the root; scores (B, N) float32: cumulative log-prob, -inf dead
    ancestors: (B, N, N) bool  ancestors[b, i, j]: j is i or an ancestor of i
    size:      (B,) long       live nodes per row; hashes (B, N) long: each node's path hash (the root's 0)
    packed:    (B, FIELDS + S, S) float64  the host's proposals (device_suffix.host_nodes' layout): rows 0-4 each
               node's token (padding 0), parent among the S (-1: a child of the root, and padding), depth (padding 0),
               score (log P(accepted), -inf padding) and path hash (HASH_BITS of it, -1 padding); then row FIELDS + k
               holds, for each node i, whether k is i or an ancestor of i
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["FIELDS", "HASH_BITS", "tree_merge", "tree_merge_reference", "tree_merge_triton"]

FIELDS = 5  # the packed tensor's rows per proposal: tokens, parents, depths, scores, hashes (then ancestor bits)
HASH_BITS = (1 << 52) - 1  # the hash bits compared (the host's hashes travel as float64, exact to 53 bits)

Merged = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def unpack_suffix(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The packed proposals (B, FIELDS + S, S) float64 as (tokens, parents, depths, hashes: (B, S) long; scores:
    (B, S) float32; ancestors: (B, S, S) bool, ancestors[b, i, k]: k is i or an ancestor of i)."""
    return (packed[:, 0].long(), packed[:, 1].long(), packed[:, 2].long(), packed[:, 3].float(), packed[:, 4].long(),
            packed[:, FIELDS:].transpose(1, 2) > 0)


def tree_merge_reference(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                         ancestors: torch.Tensor, size: torch.Tensor, hashes: torch.Tensor,
                         packed: torch.Tensor) -> Merged:
    """tree_merge in tensor operations: a fixed number of them whatever S (no pass per node or depth)."""
    B, N = tokens.shape
    s_tokens, s_parents, s_depths, s_scores, s_hashes, s_ancestors = unpack_suffix(packed)
    S = s_tokens.shape[1]
    live = s_scores > float("-inf")
    grown = scores > float("-inf")  # (B, N)
    same = ((hashes & HASH_BITS)[:, None, :] == s_hashes[:, :, None]) & live[:, :, None] & grown[:, None, :]
    same[:, :, 0] = False  # the root is no suffix node's twin
    twin = torch.where(same.any(-1), same.long().argmax(-1), -1)  # (B, S) the draft node it is, -1: none
    twinned = twin >= 0
    own = live & ~twinned  # (B, S) nodes of their own
    count = own.sum(dim=1)  # (B,)
    place = torch.where(own, own.long().cumsum(1) - 1, count[:, None] + (~own).long().cumsum(1) - 1)  # a permutation
    at = s_parents.clamp(min=0)
    merged_parents = torch.where(s_parents < 0, 0, torch.where(twinned.gather(1, at), twin.gather(1, at),
                                                               N + place.gather(1, at)))
    # each own node's draft ancestors: those of its deepest twinned ancestor (the root where none is)
    reach = s_ancestors & twinned[:, None, :]  # (B, S, S)
    deepest = (reach * s_depths[:, None, :]).argmax(-1)  # (B, S)
    attach = torch.where(reach.any(-1), twin.gather(1, deepest), 0)
    rows = torch.cat([ancestors.gather(1, attach[:, :, None].expand(B, S, N)),
                      torch.zeros(B, S, S, dtype=torch.bool, device=twin.device).scatter_(
                          2, place[:, None, :].expand(B, S, S), s_ancestors & own[:, None, :])], dim=2)
    rows = rows & own[:, :, None]  # (B, S, N + S) merged-away and padding rows see nothing
    merged_ancestors = torch.cat([torch.cat([ancestors, ancestors.new_zeros(B, N, S)], dim=2),
                                  torch.zeros_like(rows).scatter_(1, place[:, :, None].expand_as(rows), rows)], dim=1)

    def placed(values: torch.Tensor, fill) -> torch.Tensor:
        return torch.full_like(values, fill).scatter_(1, place, torch.where(own, values, fill))

    draft_scores = torch.cat([scores, scores.new_full((B, 1), float("-inf"))], dim=1).scatter_reduce(
        1, torch.where(twinned, twin, N), s_scores, reduce="amax")[:, :N]
    return (torch.cat([tokens, placed(s_tokens, 0)], dim=1),
            torch.cat([parents, placed(merged_parents, -1)], dim=1),
            torch.cat([depths, placed(s_depths, 0)], dim=1),
            torch.cat([draft_scores, placed(s_scores, float("-inf"))], dim=1),
            merged_ancestors,
            size + count,
            torch.cat([hashes, placed(s_hashes, 0)], dim=1))


if triton is not None:

    @triton.jit
    def _gather(values, index, BLOCK: tl.constexpr):
        """values[index] for a (BLOCK,) vector `values` and any-sized `index` vector, by a one-hot sum (index in
        [0, BLOCK))."""
        k = tl.arange(0, BLOCK)
        return tl.sum(tl.where(index[:, None] == k[None, :], values[None, :], 0), axis=1)

    @triton.jit
    def _tree_merge_kernel(tokens_ptr, parents_ptr, depths_ptr, scores_ptr, anc_ptr, size_ptr, hashes_ptr, packed_ptr,
                           o_tokens_ptr, o_parents_ptr, o_depths_ptr, o_scores_ptr, o_anc_ptr, o_size_ptr,
                           o_hashes_ptr, N, S, hash_bits,
                           FIELDS_: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        M = N + S
        n = tl.arange(0, BLOCK_N)
        i = tl.arange(0, BLOCK_S)
        in_n = n < N
        in_s = i < S
        # the draft's row, copied into the first N nodes
        d_tokens = tl.load(tokens_ptr + b * N + n, mask=in_n, other=0)
        d_parents = tl.load(parents_ptr + b * N + n, mask=in_n, other=0)
        d_depths = tl.load(depths_ptr + b * N + n, mask=in_n, other=0)
        d_scores = tl.load(scores_ptr + b * N + n, mask=in_n, other=float("-inf"))
        d_hashes = tl.load(hashes_ptr + b * N + n, mask=in_n, other=0)
        tl.store(o_tokens_ptr + b * M + n, d_tokens, mask=in_n)
        tl.store(o_parents_ptr + b * M + n, d_parents, mask=in_n)
        tl.store(o_depths_ptr + b * M + n, d_depths, mask=in_n)
        tl.store(o_hashes_ptr + b * M + n, d_hashes, mask=in_n)
        # the suffix proposal's fields (float64 rows: the reference's .long() truncates, .float() rounds)
        row = packed_ptr + b * (FIELDS_ + S) * S
        s_tokens = tl.load(row + 0 * S + i, mask=in_s, other=0.0).to(tl.int64)
        s_parents = tl.load(row + 1 * S + i, mask=in_s, other=-1.0).to(tl.int64)
        s_depths = tl.load(row + 2 * S + i, mask=in_s, other=0.0).to(tl.int64)
        s_scores = tl.load(row + 3 * S + i, mask=in_s, other=float("-inf")).to(tl.float32)
        s_hashes = tl.load(row + 4 * S + i, mask=in_s, other=-1.0).to(tl.int64)
        k = i  # a second name for the suffix index along columns
        in_ik = in_s[:, None] & in_s[None, :]
        s_anc = tl.load(row + (FIELDS_ + k[None, :]) * S + i[:, None], mask=in_ik, other=0.0) > 0  # [i, k]
        live = s_scores > float("-inf")
        # twin: the first grown draft node n >= 1 of the same hash, for a live suffix node
        grown = (d_scores > float("-inf")) & in_n & (n > 0)
        same = ((d_hashes & hash_bits)[None, :] == s_hashes[:, None]) & live[:, None] & grown[None, :]  # (S, N)
        first = tl.min(tl.where(same, n[None, :], BLOCK_N), axis=1)
        twin = tl.where(first < BLOCK_N, first, -1).to(tl.int64)
        twinned = twin >= 0
        own = live & ~twinned & in_s
        rest = ~own & in_s
        count = tl.sum(own.to(tl.int64), axis=0)
        # place: own nodes first in their order, then the others in theirs (a permutation of 0..S-1)
        upto = (k[None, :] <= i[:, None])  # [i, k]: k at or before i
        own_before = tl.sum(tl.where(upto & own[None, :], 1, 0), axis=1).to(tl.int64)
        rest_before = tl.sum(tl.where(upto & rest[None, :], 1, 0), axis=1).to(tl.int64)
        place = tl.where(own, own_before - 1, count + rest_before - 1)
        # parents: the root for the root's children, the parent's twin, or the parent's own place
        at = tl.maximum(s_parents, 0)
        parent_twin = _gather(twin, at, BLOCK_S)
        parent_place = _gather(place, at, BLOCK_S)
        m_parents = tl.where(s_parents < 0, 0, tl.where(parent_twin >= 0, parent_twin, N + parent_place))
        # attach: the twin of the deepest twinned ancestor (the first of the deepest, as argmax picks), else the root
        reach = s_anc & twinned[None, :]  # [i, k]
        weight = tl.where(reach, s_depths[None, :], 0)
        weight = tl.where(in_s[None, :], weight, -1)  # block padding never wins the argmax
        best = tl.max(weight, axis=1)
        deepest = tl.min(tl.where(weight == best[:, None], k[None, :], BLOCK_S), axis=1)
        has = tl.sum(reach.to(tl.int32), axis=1) > 0
        attach = tl.where(has, _gather(twin, deepest, BLOCK_S), 0)
        # the draft nodes' scores: each the higher of its own and its twinned suffix nodes'
        twin_scores = tl.max(tl.where(twin[:, None] == n[None, :], s_scores[:, None], float("-inf")), axis=0)
        tl.store(o_scores_ptr + b * M + n, tl.maximum(d_scores, twin_scores), mask=in_n)
        # the suffix nodes at N + place: own ones as they are, the others dead
        out = b * M + N + place
        tl.store(o_tokens_ptr + out, tl.where(own, s_tokens, 0), mask=in_s)
        tl.store(o_parents_ptr + out, tl.where(own, m_parents, -1), mask=in_s)
        tl.store(o_depths_ptr + out, tl.where(own, s_depths, 0), mask=in_s)
        tl.store(o_scores_ptr + out, tl.where(own, s_scores, float("-inf")), mask=in_s)
        tl.store(o_hashes_ptr + out, tl.where(own, s_hashes, 0), mask=in_s)
        tl.store(o_size_ptr + b, tl.load(size_ptr + b) + count)
        # ancestors: the draft's N x N block, nothing to the right of it
        in_nn = in_n[:, None] & in_n[None, :]
        d_anc = tl.load(anc_ptr + b * N * N + n[:, None] * N + n[None, :], mask=in_nn, other=0)
        o_anc = o_anc_ptr + b * M * M
        tl.store(o_anc + n[:, None] * M + n[None, :], d_anc, mask=in_nn)
        tl.store(o_anc + n[:, None] * M + N + k[None, :], tl.zeros((BLOCK_N, BLOCK_S), dtype=tl.int1),
                 mask=in_n[:, None] & in_s[None, :])
        # suffix row N + place[i]: its attach node's draft ancestors, then its own ancestors at their places
        in_sn = in_s[:, None] & in_n[None, :]
        a_anc = tl.load(anc_ptr + b * N * N + attach[:, None] * N + n[None, :], mask=in_sn, other=0) != 0
        tl.store(o_anc + (N + place[:, None]) * M + n[None, :], a_anc & own[:, None], mask=in_sn)
        tl.store(o_anc + (N + place[:, None]) * M + N + place[None, :], s_anc & own[None, :] & own[:, None],
                 mask=in_ik)


def tree_merge_triton(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                      ancestors: torch.Tensor, size: torch.Tensor, hashes: torch.Tensor,
                      packed: torch.Tensor) -> Merged:
    """tree_merge as one Triton kernel (one program per row)."""
    B, N = tokens.shape
    S = packed.shape[2]
    M = N + S
    new = dict(dtype=torch.long, device=tokens.device)
    out = (torch.empty(B, M, **new), torch.empty(B, M, **new), torch.empty(B, M, **new),
           torch.empty(B, M, dtype=scores.dtype, device=tokens.device),
           torch.empty(B, M, M, dtype=torch.bool, device=tokens.device), torch.empty(B, **new),
           torch.empty(B, M, **new))
    _tree_merge_kernel[(B,)](tokens.contiguous(), parents.contiguous(), depths.contiguous(), scores.contiguous(),
                             ancestors.contiguous(), size.contiguous(), hashes.contiguous(), packed.contiguous(),
                             *out, N, S, HASH_BITS,
                             FIELDS_=FIELDS, BLOCK_N=triton.next_power_of_2(N), BLOCK_S=triton.next_power_of_2(S))
    return out


@torch.library.custom_op("swiftspec::tree_merge", mutates_args=())
def tree_merge_operator(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                        ancestors: torch.Tensor, size: torch.Tensor, hashes: torch.Tensor, packed: torch.Tensor) -> Merged:
    """swiftspec::tree_merge: the Triton kernel where use_triton says, else the reference."""
    run = tree_merge_triton if use_triton(tokens) else tree_merge_reference
    return run(tokens, parents, depths, scores, ancestors, size, hashes, packed)


@tree_merge_operator.register_fake
def _fake(tokens, parents, depths, scores, ancestors, size, hashes, packed):
    B, N = tokens.shape
    M = N + packed.shape[2]
    return (tokens.new_empty(B, M), tokens.new_empty(B, M), tokens.new_empty(B, M), scores.new_empty(B, M),
            ancestors.new_empty(B, M, M), tokens.new_empty(B), tokens.new_empty(B, M))


def tree_merge(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
               ancestors: torch.Tensor, size: torch.Tensor, hashes: torch.Tensor, packed: torch.Tensor) -> Merged:
    """The merge (module docstring) as one operator: the Triton kernel on a GPU, the reference elsewhere."""
    return dispatch(tree_merge_operator, tree_merge_reference, tokens, tokens, parents, depths, scores, ancestors,
                    size, hashes, packed)
