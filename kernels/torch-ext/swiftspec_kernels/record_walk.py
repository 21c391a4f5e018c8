"""A draft model's bookkeeping after the walk, fused (hf_swiftspec/drafters/device_drafters.py's
DraftModelOnDevice.after_verify): which of its own tree's nodes the walk went through (their KV it holds, to commit),
how many of them come first on the walk, and every walked token recorded for its next catch-up. The reference takes
about fourteen tensor operations, the kernel one launch.

    record_walk(history, draft_lens, prefix_lens, path, count, node_ids, tokens, nodes, depth) -> (ids, ran)

    history:     (B, C) long  in place: row b's walked tokens at slots prefix_lens[b] + j, j < count[b] (padding writes
                              slot C - 1, never read: a catch-up reads below the prefix)
    draft_lens:  (B,) long    in place where depth > 0: prefix_lens + ran (the draft's committed slots)
    prefix_lens: (B,) long    each row's committed slots before this round's walk
    path, count: (B, T) long, (B,) long: the walk's (tree_walk.py)
    node_ids, tokens: (B, T) long: the verified subtree's draft-tree node ids and tokens
    nodes, depth: the draft tree's node count and depth (0: a plain round, the draft ran nothing)
    ids:         (B, T) long  the walked nodes' draft-tree ids (past count: node 0's, never read)
    ran:         (B,) long    how many walked nodes the draft ran (ids < nodes, at most depth; 0 where depth is 0)
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["record_walk", "record_walk_reference", "record_walk_triton"]


def record_walk_reference(history: torch.Tensor, draft_lens: torch.Tensor, prefix_lens: torch.Tensor,
                          path: torch.Tensor, count: torch.Tensor, node_ids: torch.Tensor, tokens: torch.Tensor,
                          nodes: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = path.shape
    C = history.shape[1]
    at = path.clamp(min=0)
    ids = node_ids.gather(1, at)
    j = torch.arange(T, device=path.device)[None]
    walked = j < count[:, None]
    if depth:
        ran = ((ids < nodes) & walked).sum(dim=1).clamp(max=depth)
        draft_lens.copy_(prefix_lens + ran)
    else:
        ran = torch.zeros_like(count)
    slots = torch.where(walked, prefix_lens[:, None] + j, C - 1).clamp(max=C - 1)
    history.scatter_(1, slots, tokens.gather(1, at))
    return ids, ran


if triton is not None:

    @triton.jit
    def _record_walk_kernel(history_ptr, draft_lens_ptr, prefix_ptr, path_ptr, count_ptr, node_ids_ptr, tokens_ptr,
                            ids_ptr, ran_ptr, T, C, nodes, depth, BLOCK_T: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_T)
        inside = j < T
        count = tl.load(count_ptr + b)
        prefix = tl.load(prefix_ptr + b)
        at = tl.maximum(tl.load(path_ptr + b * T + j, mask=inside, other=0), 0)
        ids = tl.load(node_ids_ptr + b * T + at, mask=inside, other=0)
        tl.store(ids_ptr + b * T + j, ids, mask=inside)
        walked = (j < count) & inside
        ran = tl.minimum(tl.sum(((ids < nodes) & walked).to(tl.int64), axis=0), depth)
        ran = tl.where(depth > 0, ran, 0)
        tl.store(ran_ptr + b, ran)
        if depth > 0:
            tl.store(draft_lens_ptr + b, prefix + ran)
        walked_tokens = tl.load(tokens_ptr + b * T + at, mask=inside, other=0)
        slots = tl.minimum(prefix + j, C - 1)
        tl.store(history_ptr + b * C + slots, walked_tokens, mask=walked)


def record_walk_triton(history: torch.Tensor, draft_lens: torch.Tensor, prefix_lens: torch.Tensor,
                       path: torch.Tensor, count: torch.Tensor, node_ids: torch.Tensor, tokens: torch.Tensor,
                       nodes: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """record_walk as one Triton kernel (a program per row). Padding writes nothing (the reference's padding writes
    slot C - 1, which nothing reads); history and draft_lens must be contiguous (written in place)."""
    B, T = path.shape
    if not (history.is_contiguous() and draft_lens.is_contiguous()):
        raise ValueError("record_walk: history and draft_lens must be contiguous (they are written in place)")
    ids = torch.empty_like(path)
    ran = torch.empty_like(count)
    _record_walk_kernel[(B,)](history, draft_lens, prefix_lens.contiguous(), path.contiguous(), count.contiguous(),
                              node_ids.contiguous(), tokens.contiguous(), ids, ran, T, history.shape[1], nodes, depth,
                              BLOCK_T=triton.next_power_of_2(T))
    return ids, ran


@torch.library.custom_op("swiftspec::record_walk", mutates_args=("history", "draft_lens"))
def record_walk_operator(history: torch.Tensor, draft_lens: torch.Tensor, prefix_lens: torch.Tensor, path: torch.Tensor,
                         count: torch.Tensor, node_ids: torch.Tensor, tokens: torch.Tensor, nodes: int,
                         depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """swiftspec::record_walk: the Triton kernel where use_triton says, else the reference."""
    run = record_walk_triton if use_triton(path) else record_walk_reference
    return run(history, draft_lens, prefix_lens, path, count, node_ids, tokens, nodes, depth)


@record_walk_operator.register_fake
def _fake(history, draft_lens, prefix_lens, path, count, node_ids, tokens, nodes, depth):
    return torch.empty_like(path), torch.empty_like(count)


def record_walk(history: torch.Tensor, draft_lens: torch.Tensor, prefix_lens: torch.Tensor, path: torch.Tensor,
                count: torch.Tensor, node_ids: torch.Tensor, tokens: torch.Tensor, nodes: int,
                depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's bookkeeping after the walk (module docstring) as one operator: the Triton kernel on a GPU, the
    reference elsewhere."""
    return dispatch(record_walk_operator, record_walk_reference, path, history, draft_lens, prefix_lens, path, count,
                    node_ids, tokens, nodes, depth)
