"""A growth level's bookkeeping, fused: after the top-k of the frontier's children, depth `level`'s k nodes written
into the tree in place (hf_swiftspec/drafters/device_growth.py's add_level calls it; every level of every device
round's growth).

The reference writes each field in turn, about fourteen operators; the kernel, one program per row, reads each new
node's parent and token from its flat top-k index and writes the node's token, parent, path hash, depth, score and
ancestor row (its parent's, with its own bit).

    tree_level(tokens, parents, hashes, depths, scores, ancestors, frontier, best, flat, token_map, vocab, level,
               multiplier) -> (new, parent)

    tokens, parents, hashes, depths: (B, N) long     the tree's fields, written in place at the new nodes
    scores:    (B, N) float32                        written in place at the new nodes
    ancestors: (B, N, N) bool                        written in place at the new nodes' rows
    frontier:  (B, F) long   the node ids whose children were ranked
    best:      (B, k) float32 the top-k cumulative scores; flat (B, k) long their indices in the (F, vocab) children
    token_map: (vocab,) long a child's index -> its token id, or None (the index is the id)
    level:     int           the new nodes' depth: node ids 1 + (level - 1) * k ... level * k (fixed by shape)
    multiplier: int          the path hash's: a node's hash is its parent's * multiplier + token + 1, wrapping int64
    new:       (B, k) long   the new nodes' ids (the next frontier); parent (B, k) long: each one's parent
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

from typing import Optional

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["tree_level", "tree_level_reference", "tree_level_triton"]

WRITTEN = ("tokens", "parents", "hashes", "depths", "scores", "ancestors")


def tree_level_reference(tokens: torch.Tensor, parents: torch.Tensor, hashes: torch.Tensor, depths: torch.Tensor,
                         scores: torch.Tensor, ancestors: torch.Tensor, frontier: torch.Tensor, best: torch.Tensor,
                         flat: torch.Tensor, token_map: Optional[torch.Tensor], vocab: int, level: int,
                         multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_level in tensor operations, field by field."""
    B, N = tokens.shape
    width = flat.shape[1]
    new = slice(1 + (level - 1) * width, 1 + level * width)
    parent = frontier.gather(1, flat // vocab)  # (B, k)
    token = flat % vocab if token_map is None else token_map[flat % vocab]
    tokens[:, new] = token
    parents[:, new] = parent
    hashes[:, new] = hashes.gather(1, parent) * multiplier + (token + 1)
    depths[:, new] = level
    scores[:, new] = best
    ancestors[:, new] = ancestors.gather(1, parent[:, :, None].expand(B, width, N))
    ancestors[:, new, new].diagonal(dim1=1, dim2=2).fill_(True)  # each node is its own ancestor
    return torch.arange(new.start, new.stop, device=frontier.device).repeat(B, 1), parent


if triton is not None:

    @triton.jit
    def _tree_level_kernel(tokens_ptr, parents_ptr, hashes_ptr, depths_ptr, scores_ptr, ancestors_ptr, frontier_ptr,
                           best_ptr, flat_ptr, map_ptr, new_out, parent_out, N, F, K, V, level, multiplier,
                           HAS_MAP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK_K)
        live = k < K
        flat = tl.load(flat_ptr + b * K + k, mask=live, other=0)
        parent = tl.load(frontier_ptr + b * F + flat // V, mask=live, other=0)
        token = tl.load(map_ptr + flat % V, mask=live, other=0) if HAS_MAP else flat % V
        node = 1 + (level - 1) * K + k
        at = b * N + node
        tl.store(tokens_ptr + at, token, mask=live)
        tl.store(parents_ptr + at, parent, mask=live)
        parent_hash = tl.load(hashes_ptr + b * N + parent, mask=live, other=0)
        tl.store(hashes_ptr + at, parent_hash * multiplier + (token + 1), mask=live)
        tl.store(depths_ptr + at, tl.zeros_like(node) + level, mask=live)
        tl.store(scores_ptr + at, tl.load(best_ptr + b * K + k, mask=live), mask=live)
        j = tl.arange(0, BLOCK_N)[None, :]
        cells = live[:, None] & (j < N)
        seen = tl.load(ancestors_ptr + b * N * N + parent[:, None] * N + j, mask=cells, other=0) != 0
        tl.store(ancestors_ptr + b * N * N + node[:, None] * N + j, seen | (j == node[:, None]), mask=cells)
        tl.store(new_out + b * K + k, node, mask=live)
        tl.store(parent_out + b * K + k, parent, mask=live)


def tree_level_triton(tokens: torch.Tensor, parents: torch.Tensor, hashes: torch.Tensor, depths: torch.Tensor,
                      scores: torch.Tensor, ancestors: torch.Tensor, frontier: torch.Tensor, best: torch.Tensor,
                      flat: torch.Tensor, token_map: Optional[torch.Tensor], vocab: int, level: int,
                      multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_level as one Triton kernel (one program per row; the tree's fields must be contiguous: written in
    place)."""
    B, N = tokens.shape
    F, K = frontier.shape[1], flat.shape[1]
    for name, field in zip(WRITTEN, (tokens, parents, hashes, depths, scores, ancestors)):
        if not field.is_contiguous():
            raise ValueError(f"tree_level writes the tree's {name} in place: they must be contiguous")
    new, parent = torch.empty_like(flat), torch.empty_like(flat)
    _tree_level_kernel[(B,)](tokens, parents, hashes, depths, scores, ancestors, frontier.contiguous(),
                             best.contiguous(), flat.contiguous(),
                             flat if token_map is None else token_map.contiguous(), new, parent,
                             N, F, K, vocab, level, multiplier, HAS_MAP=token_map is not None,
                             BLOCK_K=triton.next_power_of_2(K), BLOCK_N=triton.next_power_of_2(N))
    return new, parent


@torch.library.custom_op("swiftspec::tree_level", mutates_args=WRITTEN)
def tree_level_operator(tokens: torch.Tensor, parents: torch.Tensor, hashes: torch.Tensor, depths: torch.Tensor,
                        scores: torch.Tensor, ancestors: torch.Tensor, frontier: torch.Tensor, best: torch.Tensor,
                        flat: torch.Tensor, token_map: torch.Tensor | None, vocab: int, level: int,
                        multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """swiftspec::tree_level: the Triton kernel where use_triton says, else the reference."""
    run = tree_level_triton if use_triton(tokens) else tree_level_reference
    return run(tokens, parents, hashes, depths, scores, ancestors, frontier, best, flat, token_map, vocab, level,
               multiplier)


@tree_level_operator.register_fake
def _fake(tokens, parents, hashes, depths, scores, ancestors, frontier, best, flat, token_map, vocab, level,
          multiplier):
    return torch.empty_like(flat), torch.empty_like(flat)


def tree_level(tokens: torch.Tensor, parents: torch.Tensor, hashes: torch.Tensor, depths: torch.Tensor,
               scores: torch.Tensor, ancestors: torch.Tensor, frontier: torch.Tensor, best: torch.Tensor,
               flat: torch.Tensor, token_map: torch.Tensor | None, vocab: int, level: int,
               multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The level's bookkeeping (module docstring) as one operator writing the tree's fields in place: the Triton
    kernel on a GPU, the reference elsewhere."""
    return dispatch(tree_level_operator, tree_level_reference, tokens, tokens, parents, hashes, depths, scores,
                    ancestors, frontier, best, flat, token_map, vocab, level, multiplier)
