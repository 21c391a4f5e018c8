"""The end of a verification, fused: the rows' state moved on by the walk, in place, and the round's one read packed
(hf_swiftspec/engine/device_phases.py's verify_phase). The reference takes about fourteen tensor operations, the
kernel one launch.

    advance_rows(count, finished, emitted, path, node_ids, tokens, parents, roots, prefix_lens, budgets, positions, eos)
        -> result (B, 2 + 5T) long: per row [count, finished, emitted (T), path (T), node_ids (T), tokens (T), parents (T)]

    count, finished:     (B,) long, (B,) bool      the walk's (tree_walk.py)
    emitted, path:       (B, T) long               the walk's emitted tokens and walked nodes (-1 past count)
    node_ids, tokens, parents: (B, T) long         the verified subtree's
    in place:  roots (B,) the last emitted token where one was (the next root), prefix_lens / positions (B,) + count,
               budgets (B,) - count, eos (B, E) all -1 on a finished row (a finished row that decodes on stops at
               nothing)
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["advance_rows", "advance_rows_reference", "advance_rows_triton"]

MUTATES = ("roots", "prefix_lens", "budgets", "positions", "eos")


def advance_rows_reference(count: torch.Tensor, finished: torch.Tensor, emitted: torch.Tensor, path: torch.Tensor,
                           node_ids: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, roots: torch.Tensor,
                           prefix_lens: torch.Tensor, budgets: torch.Tensor, positions: torch.Tensor,
                           eos: torch.Tensor) -> torch.Tensor:
    last = emitted.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
    roots.copy_(torch.where(count > 0, last, roots))
    prefix_lens.add_(count)
    budgets.sub_(count)
    positions.add_(count)
    eos.masked_fill_(finished[:, None], -1)
    return torch.cat([count[:, None], finished.long()[:, None], emitted, path, node_ids, tokens, parents], dim=1)


if triton is not None:

    @triton.jit
    def _advance_rows_kernel(count_ptr, finished_ptr, emitted_ptr, path_ptr, node_ids_ptr, tokens_ptr, parents_ptr,
                             roots_ptr, prefix_ptr, budgets_ptr, positions_ptr, eos_ptr, result_ptr, T, E,
                             BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        count = tl.load(count_ptr + b)
        finished = tl.load(finished_ptr + b) != 0
        j = tl.arange(0, BLOCK_T)
        inside = j < T
        out = result_ptr + b * (2 + 5 * T)
        tl.store(out, count)
        tl.store(out + 1, finished.to(tl.int64))
        emitted = tl.load(emitted_ptr + b * T + j, mask=inside, other=0)
        tl.store(out + 2 + j, emitted, mask=inside)
        tl.store(out + 2 + T + j, tl.load(path_ptr + b * T + j, mask=inside), mask=inside)
        tl.store(out + 2 + 2 * T + j, tl.load(node_ids_ptr + b * T + j, mask=inside), mask=inside)
        tl.store(out + 2 + 3 * T + j, tl.load(tokens_ptr + b * T + j, mask=inside), mask=inside)
        tl.store(out + 2 + 4 * T + j, tl.load(parents_ptr + b * T + j, mask=inside), mask=inside)
        last = tl.sum(tl.where(j == tl.maximum(count - 1, 0), emitted, 0), axis=0)
        root = tl.load(roots_ptr + b)
        tl.store(roots_ptr + b, tl.where(count > 0, last, root))
        tl.store(prefix_ptr + b, tl.load(prefix_ptr + b) + count)
        tl.store(budgets_ptr + b, tl.load(budgets_ptr + b) - count)
        tl.store(positions_ptr + b, tl.load(positions_ptr + b) + count)
        e = tl.arange(0, BLOCK_E)
        clear = (e < E) & ((tl.zeros((BLOCK_E,), tl.int32) + finished.to(tl.int32)) != 0)
        tl.store(eos_ptr + b * E + e, tl.full((BLOCK_E,), -1, tl.int64), mask=clear)


def advance_rows_triton(count: torch.Tensor, finished: torch.Tensor, emitted: torch.Tensor, path: torch.Tensor,
                        node_ids: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, roots: torch.Tensor,
                        prefix_lens: torch.Tensor, budgets: torch.Tensor, positions: torch.Tensor,
                        eos: torch.Tensor) -> torch.Tensor:
    """advance_rows as one Triton kernel (a program per row); the rows' state must be contiguous long tensors (it is
    written in place)."""
    B, T = emitted.shape
    E = eos.shape[1]
    for name, t in zip(MUTATES, (roots, prefix_lens, budgets, positions, eos)):
        if t.dtype != torch.long or not t.is_contiguous():
            raise ValueError(f"advance_rows: {name} must be a contiguous long tensor, got {t.dtype}, {t.stride()}")
    result = torch.empty(B, 2 + 5 * T, dtype=torch.long, device=emitted.device)
    _advance_rows_kernel[(B,)](count.contiguous(), finished.to(torch.int8).contiguous(), emitted.contiguous(),
                               path.contiguous(), node_ids.contiguous(), tokens.contiguous(), parents.contiguous(),
                               roots, prefix_lens, budgets, positions, eos, result, T, E,
                               BLOCK_T=triton.next_power_of_2(T), BLOCK_E=triton.next_power_of_2(max(E, 1)))
    return result


@torch.library.custom_op("swiftspec::advance_rows", mutates_args=MUTATES)
def advance_rows_operator(count: torch.Tensor, finished: torch.Tensor, emitted: torch.Tensor, path: torch.Tensor,
                          node_ids: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, roots: torch.Tensor,
                          prefix_lens: torch.Tensor, budgets: torch.Tensor, positions: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """swiftspec::advance_rows: the Triton kernel where use_triton says, else the reference."""
    run = advance_rows_triton if use_triton(emitted) else advance_rows_reference
    return run(count, finished, emitted, path, node_ids, tokens, parents, roots, prefix_lens, budgets, positions, eos)


@advance_rows_operator.register_fake
def _fake(count, finished, emitted, path, node_ids, tokens, parents, roots, prefix_lens, budgets, positions, eos):
    B, T = emitted.shape
    return emitted.new_empty(B, 2 + 5 * T)


def advance_rows(count: torch.Tensor, finished: torch.Tensor, emitted: torch.Tensor, path: torch.Tensor,
                 node_ids: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, roots: torch.Tensor,
                 prefix_lens: torch.Tensor, budgets: torch.Tensor, positions: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """The rows moved on and the round's read packed (module docstring) as one operator: the Triton kernel on a GPU,
    the reference elsewhere."""
    return dispatch(advance_rows_operator, advance_rows_reference, emitted, count, finished, emitted, path, node_ids,
                    tokens, parents, roots, prefix_lens, budgets, positions, eos)
