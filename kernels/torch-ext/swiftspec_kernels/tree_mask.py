"""The attention mask of a round's tree forward, fused: each query sees its row's committed prefix and the tree
nodes its ancestor bits name (tree node i sits at slot prefix_len + i), as the additive mask a model's attention adds
(0 where seen, the dtype's lowest value elsewhere). hf_swiftspec/steps/slot_cache.py calls it for the verification
and every growth level; the reference takes eight tensor operations, the kernel one launch.

    tree_mask(prefix_lens, ancestors, rows, span, dtype, first=None, depths=None) -> (B, 1, Q, span)

    prefix_lens: (B,) long       each row's committed slots (committed slot j holds position j)
    ancestors:   (B, R, N) bool  ancestor-or-self bits over the tree's N nodes
    rows:        (B, Q) long     which of the R rows each query uses (a growth level's frontier), or None: R = Q, in order
    span:        int             slots attended (the slot cache's live bucket)
    first:       (B, Q) or (B, 1) long   a windowed layer's term: each query's first visible position (the layer's
                                 LayerMask.first_visible of its position); it sees neither a committed slot nor an
                                 ancestor placed before it. None: every position (full attention, no term)
    depths:      (B, N) long     with `first`: each node's depth (node i sits at position prefix_len + depths[i])
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["tree_mask", "tree_mask_reference", "tree_mask_triton"]


def tree_mask_reference(prefix_lens: torch.Tensor, ancestors: torch.Tensor, rows: torch.Tensor | None, span: int,
                        dtype: torch.dtype, first: torch.Tensor | None = None,
                        depths: torch.Tensor | None = None) -> torch.Tensor:
    B, _, N = ancestors.shape
    seen = ancestors if rows is None else ancestors.gather(1, rows[:, :, None].expand(B, rows.shape[1], N))
    Q = seen.shape[1]
    c = torch.arange(span, device=seen.device)
    allowed = (c[None, None] < prefix_lens[:, None, None]).expand(B, Q, span).clone()
    if first is not None:  # the window: committed slots and ancestors from each query's first visible position on
        allowed &= c[None, None] >= first[:, :, None]
        seen = seen & (prefix_lens[:, None, None] + depths[:, None, :] >= first[:, :, None])
    node_slots = prefix_lens[:, None] + torch.arange(N, device=seen.device)[None]  # (B, N)
    allowed.scatter_(2, node_slots[:, None, :].expand(B, Q, N), seen)
    zero = torch.zeros((), dtype=dtype, device=seen.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


if triton is not None:

    @triton.jit
    def _tree_mask_kernel(prefix_ptr, ancestors_ptr, rows_ptr, first_ptr, depths_ptr, out_ptr, R, N, Q, span, lowest,
                          HAS_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        q = tl.program_id(1).to(tl.int64)
        prefix = tl.load(prefix_ptr + b)
        r = q
        if HAS_ROWS:
            r = tl.load(rows_ptr + b * Q + q)
        lo = 0
        if HAS_WINDOW:
            lo = tl.load(first_ptr + b * Q + q)
        bits = ancestors_ptr + (b * R + r) * N
        out = out_ptr + (b * Q + q) * span
        for start in range(0, span, BLOCK_C):
            c = start + tl.arange(0, BLOCK_C)
            node = c - prefix
            in_tree = (node >= 0) & (node < N) & (c < span)
            seen = tl.load(bits + node, mask=in_tree, other=0) != 0
            committed = c < prefix
            if HAS_WINDOW:
                depth = tl.load(depths_ptr + b * N + node, mask=in_tree, other=0)
                seen = seen & (prefix + depth >= lo)
                committed = committed & (c >= lo)
            tl.store(out + c, tl.where(committed | seen, 0.0, lowest), mask=c < span)


def tree_mask_triton(prefix_lens: torch.Tensor, ancestors: torch.Tensor, rows: torch.Tensor | None, span: int,
                     dtype: torch.dtype, first: torch.Tensor | None = None,
                     depths: torch.Tensor | None = None) -> torch.Tensor:
    """tree_mask as one Triton kernel (a program per row and query, a loop over the span)."""
    B, R, N = ancestors.shape
    Q = R if rows is None else rows.shape[1]
    out = torch.empty(B, 1, Q, span, dtype=dtype, device=ancestors.device)
    bits = ancestors.to(torch.int8).contiguous()
    prefix = prefix_lens.long().contiguous()
    window = first is not None
    lo = first.long().expand(B, Q).contiguous() if window else prefix
    at = depths.long().contiguous() if window else prefix
    _tree_mask_kernel[(B, Q)](prefix, bits, bits if rows is None else rows.contiguous(), lo, at, out,
                              R, N, Q, span, torch.finfo(dtype).min, HAS_ROWS=rows is not None, HAS_WINDOW=window,
                              BLOCK_C=min(1024, triton.next_power_of_2(span)))
    return out


@torch.library.custom_op("swiftspec::tree_mask", mutates_args=())
def tree_mask_operator(prefix_lens: torch.Tensor, ancestors: torch.Tensor, rows: torch.Tensor | None, span: int,
                       dtype: torch.dtype, first: torch.Tensor | None, depths: torch.Tensor | None) -> torch.Tensor:
    """swiftspec::tree_mask: the Triton kernel where use_triton says, else the reference."""
    run = tree_mask_triton if use_triton(ancestors) else tree_mask_reference
    return run(prefix_lens, ancestors, rows, span, dtype, first, depths)


@tree_mask_operator.register_fake
def _fake(prefix_lens, ancestors, rows, span, dtype, first, depths):
    Q = ancestors.shape[1] if rows is None else rows.shape[1]
    return ancestors.new_empty(ancestors.shape[0], 1, Q, span, dtype=dtype)


def tree_mask(prefix_lens: torch.Tensor, ancestors: torch.Tensor, rows: torch.Tensor | None, span: int,
              dtype: torch.dtype, first: torch.Tensor | None = None, depths: torch.Tensor | None = None) -> torch.Tensor:
    """The additive mask (module docstring) as one operator: the Triton kernel on a GPU, the reference elsewhere."""
    if (first is None) != (depths is None):
        raise ValueError("tree_mask(first=..., depths=...): a window needs both each query's first visible position "
                         "and the nodes' depths (or neither, for full attention)")
    return dispatch(tree_mask_operator, tree_mask_reference, ancestors, prefix_lens, ancestors, rows, span, dtype,
                    first, depths)
