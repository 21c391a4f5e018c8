"""A slot cache's commit, fused: per row, the verified nodes' slots move behind the committed prefix, in every layer
of a stacked buffer at once (hf_swiftspec/steps/slot_cache.py's commit_cache: both caches' commit a round). The
reference plans the moves (about eight tensor operations) and applies them with one gather and one scatter; the
kernel plans and moves in one launch.

    commit_slots(data, dim, prefix_lens, slots, counts, scratch)   in place

    data:        (n, B, ...) the stacked layers' tensors, positions (slots) at `dim`
    prefix_lens: (B,) long   each row's committed slots (its tree region starts there)
    slots:       (B, M) long tree-region slots (relative to the prefix) to commit, in order; past counts: ignored
    counts:      (B,) long   how many of them each row commits
    scratch:     int         the slot padding moves to and from (the cache's span - 1, never attended as a real slot)
Row b's slot prefix + slots[b, j] moves to prefix + j for j < counts[b], every source read before any write.
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["commit_slots", "commit_slots_reference", "commit_slots_triton"]


def commit_slots_reference(data: torch.Tensor, dim: int, prefix_lens: torch.Tensor, slots: torch.Tensor,
                           counts: torch.Tensor, scratch: int) -> None:
    B, M = slots.shape
    j = torch.arange(M, device=slots.device)[None]
    real = j < counts[:, None]
    prefix = prefix_lens[:, None]
    src = torch.where(real, prefix + slots, scratch)
    dst = torch.where(real, prefix + j, scratch)
    by_row = data.movedim(dim, 2)  # (n, B, capacity, ...): a view, written through
    rows = torch.arange(B, device=slots.device)[:, None].expand_as(src)
    by_row[:, rows, dst] = by_row[:, rows, src]


if triton is not None:

    @triton.jit
    def _commit_slots_kernel(data_ptr, prefix_ptr, slots_ptr, counts_ptr, B, M, D, scratch,
                             s_n, s_b, s_c, s_h, s_d, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        nb = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        n, b = nb // B, nb % B
        j = tl.arange(0, BLOCK_M)
        inside = j < M
        prefix = tl.load(prefix_ptr + b)
        count = tl.load(counts_ptr + b)
        relative = tl.load(slots_ptr + b * M + j, mask=inside, other=0)
        real = (j < count) & inside
        src = tl.where(real, prefix + relative, scratch)
        dst = tl.where(real, prefix + j, scratch)
        base = data_ptr + n * s_n + b * s_b + h * s_h
        for start in range(0, D, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            both = inside[:, None] & (d < D)[None, :]
            values = tl.load(base + src[:, None] * s_c + d[None, :] * s_d, mask=both)
            tl.debug_barrier()  # every thread has read its sources before any writes (a source may be a destination)
            tl.store(base + dst[:, None] * s_c + d[None, :] * s_d, values, mask=both)
            tl.debug_barrier()


def commit_slots_triton(data: torch.Tensor, dim: int, prefix_lens: torch.Tensor, slots: torch.Tensor,
                        counts: torch.Tensor, scratch: int) -> None:
    """commit_slots as one Triton kernel: a program per (layer, row, head), the moves read whole before written.
    Layouts with more than two dimensions past the positions run the reference."""
    by_row = data.movedim(dim, 2)  # (n, B, C, ...)
    rest = by_row.shape[3:]
    if len(rest) > 2:
        return commit_slots_reference(data, dim, prefix_lens, slots, counts, scratch)
    H, D = (1, *rest) if len(rest) == 1 else rest if rest else (1, 1)
    s_h, s_d = (0, *by_row.stride()[3:]) if len(rest) == 1 else by_row.stride()[3:] if rest else (0, 0)
    n, B, M = by_row.shape[0], by_row.shape[1], slots.shape[1]
    if M == 0:
        return None
    _commit_slots_kernel[(n * B, H)](data, prefix_lens.long().contiguous(), slots.long().contiguous(),
                                     counts.long().contiguous(), B, M, D, scratch, by_row.stride(0), by_row.stride(1),
                                     by_row.stride(2), s_h, s_d, BLOCK_M=triton.next_power_of_2(M),
                                     BLOCK_D=min(64, triton.next_power_of_2(D)))
    return None


@torch.library.custom_op("swiftspec::commit_slots", mutates_args=("data",))
def commit_slots_operator(data: torch.Tensor, dim: int, prefix_lens: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                          scratch: int) -> None:
    """swiftspec::commit_slots: the Triton kernel where use_triton says, else the reference."""
    run = commit_slots_triton if use_triton(data) else commit_slots_reference
    run(data, dim, prefix_lens, slots, counts, scratch)


@commit_slots_operator.register_fake
def _fake(data, dim, prefix_lens, slots, counts, scratch):
    return None


def commit_slots(data: torch.Tensor, dim: int, prefix_lens: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                 scratch: int) -> None:
    """The commit (module docstring) as one operator: the Triton kernel on a GPU, the reference elsewhere."""
    return dispatch(commit_slots_operator, commit_slots_reference, data, data, dim, prefix_lens, slots, counts, scratch)
