"""The walk of a verified tree, fused: from each row's root, the target's choice after each node, into the first
real child carrying it while there is one, with the EOS and length rules (hf_swiftspec/steps/acceptance.py's
walk_subtree calls it; every round's walk).

One program per row walks its T nodes in order (a node's children come after it); the reference finds the walk's
nodes at once in about forty tensor operations (no pass per node): the operators a GPU launches for a round's walk go
from those to one kernel.

    tree_walk(choices, tokens, parents, valid, depths, mask, max_tokens, eos) -> (path, emitted, count, finished)

    choices:    (B, T) long  the target's choice after each node
    tokens:     (B, T) long  each node's token; parents (B, T) long: local parent index, -1 for the root and padding
    valid:      (B, T) bool  real nodes; depths (B, T) long; mask (B, T, T) bool ancestor-or-self (the reference's)
    max_tokens: (B,) long    tokens each row may still emit
    eos:        (B, E) long  each row's EOS ids, -1 for none (E may be 0)
    path:       (B, T) long  walked nodes' local indices, root first, -1 past count
    emitted:    (B, T) long  the target's choice after each walked node, -1 past count
    count:      (B,) long    tokens emitted; finished (B,) bool: an EOS emitted or max_tokens reached
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import torch

from .fused import dispatch, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts run the reference
    triton = tl = None

__all__ = ["tree_walk", "tree_walk_on_cpu", "tree_walk_reference", "tree_walk_triton", "walk_row_on_host"]


def tree_walk_reference(choices: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                        depths: torch.Tensor, mask: torch.Tensor, max_tokens: torch.Tensor,
                        eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_walk in tensor operations: a node is on the walk when it and each of its ancestors below the root is its
    parent's first real child carrying the target's choice."""
    B, T = choices.shape
    ids = torch.arange(T, device=choices.device)[None]
    parent = parents.clamp(min=0)
    carries = valid & (parents >= 0) & (tokens == choices.gather(1, parent))  # node i carries its parent's choice
    nxt = torch.full((B, T), T, dtype=torch.long, device=choices.device).scatter_reduce(
        1, parent, torch.where(carries, ids.expand(B, T), T), reduce="amin")  # each node's first such child
    chosen = (nxt.gather(1, parent) == ids) | (ids == 0)  # (B, T) where the walk goes from its parent
    on_path = ~(mask & ~chosen[:, None, :]).any(-1) & valid  # (B, T)
    at = torch.where(on_path, depths, T)  # one walked node per depth
    path = torch.full((B, T + 1), T, dtype=torch.long, device=choices.device).scatter_(1, at, ids.expand(B, T))[:, :T]
    count = (path < T).sum(dim=1).clamp(max=max_tokens.clamp(min=0))
    emitted = choices.gather(1, path.clamp(max=T - 1))
    hits = (emitted[:, :, None] == eos[:, None, :]).any(-1) & (ids < count[:, None])
    first_stop = torch.where(hits, ids, T).amin(dim=1)  # (B,) T: none
    count = torch.minimum(count, first_stop + 1)
    finished = (first_stop < T) | (count >= max_tokens)
    inside = ids < count[:, None]
    return torch.where(inside, path, -1), torch.where(inside, emitted, -1), count, finished


def walk_row_on_host(choices: list[int], tokens: list[int], parents: list[int], real: list[bool], budget: int,
                     eos) -> tuple[list[int], list[int], bool]:
    """One row's walk on host values (the kernel's loop): its walked nodes, the tokens emitted and whether it finished
    (an EOS emitted or `budget` reached). eos: the row's EOS ids (a set or list; -1 entries match nothing)."""
    first_child = {(parents[i], tokens[i]): i for i in range(len(tokens) - 1, 0, -1) if real[i] and parents[i] >= 0}
    path, emitted, node = [], [], 0
    while real[0] and len(emitted) < budget:
        path.append(node)
        emitted.append(choices[node])
        if choices[node] in eos:
            return path, emitted, True
        node = first_child.get((node, choices[node]))
        if node is None:
            break
    return path, emitted, len(emitted) >= budget


def tree_walk_on_cpu(choices: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                     depths: torch.Tensor, mask: torch.Tensor, max_tokens: torch.Tensor,
                     eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_walk over host values (walk_row_on_host, row by row): on a CPU, where reading the tensors costs nothing,
    about four times faster than the reference's forty tensor operations at a batch of 4."""
    B, T = choices.shape
    rows = zip(choices.tolist(), tokens.tolist(), parents.tolist(), valid.tolist(), max_tokens.tolist(), eos.tolist())
    path, emitted, count, finished = [], [], [], []
    for row in rows:
        walked, tokens_out, done = walk_row_on_host(*row[:5], {e for e in row[5] if e >= 0})
        path.append(walked + [-1] * (T - len(walked)))
        emitted.append(tokens_out + [-1] * (T - len(walked)))
        count.append(len(walked))
        finished.append(done)
    device = choices.device
    return (torch.tensor(path, dtype=torch.long, device=device).view(B, T),
            torch.tensor(emitted, dtype=torch.long, device=device).view(B, T),
            torch.tensor(count, dtype=torch.long, device=device), torch.tensor(finished, device=device))


if triton is not None:

    @triton.jit
    def _tree_walk_kernel(choices_ptr, tokens_ptr, parents_ptr, valid_ptr, max_ptr, eos_ptr,
                          path_ptr, emitted_ptr, count_ptr, finished_ptr, T, E,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_T)
        inside = offs < T
        tokens = tl.load(tokens_ptr + b * T + offs, mask=inside, other=-2)
        parents = tl.load(parents_ptr + b * T + offs, mask=inside, other=-2)
        valid = tl.load(valid_ptr + b * T + offs, mask=inside, other=0) != 0
        e = tl.arange(0, BLOCK_E)
        eos = tl.load(eos_ptr + b * E + e, mask=e < E, other=-1)
        budget = tl.load(max_ptr + b)
        going = tl.load(valid_ptr + b * T) != 0  # the current node is real
        cur = tl.zeros((), dtype=tl.int64)
        count = tl.zeros((), dtype=tl.int64)
        stopped = tl.zeros((), dtype=tl.int1)
        for step in range(0, T):
            emits = going & (count < budget) & (stopped == 0)
            choice = tl.load(choices_ptr + b * T + cur)
            tl.store(path_ptr + b * T + step, tl.where(emits, cur, -1))
            tl.store(emitted_ptr + b * T + step, tl.where(emits, choice, -1))
            hit = tl.sum(((eos == choice) & (eos >= 0)).to(tl.int32), axis=0) > 0
            count += emits.to(tl.int64)
            stopped = stopped | (emits & hit)
            child = tl.min(tl.where((parents == cur) & (tokens == choice) & valid & (offs > 0), offs, BLOCK_T), axis=0)
            going = going & (child < T)
            cur = tl.where(child < T, child, cur).to(tl.int64)
        tl.store(count_ptr + b, count)
        tl.store(finished_ptr + b, (stopped | (count >= budget)).to(tl.int8))


def tree_walk_triton(choices: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                     depths: torch.Tensor, mask: torch.Tensor, max_tokens: torch.Tensor,
                     eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_walk as one Triton kernel (one program per row; depths and mask are not read: the parents say it)."""
    B, T = choices.shape
    E = eos.shape[1]
    path, emitted = torch.empty_like(choices), torch.empty_like(choices)
    count = torch.empty(B, dtype=torch.long, device=choices.device)
    finished = torch.empty(B, dtype=torch.int8, device=choices.device)
    _tree_walk_kernel[(B,)](choices.contiguous(), tokens.contiguous(), parents.contiguous(),
                            valid.to(torch.int8).contiguous(), max_tokens.long().contiguous(), eos.contiguous(),
                            path, emitted, count, finished, T, E,
                            BLOCK_T=triton.next_power_of_2(T), BLOCK_E=triton.next_power_of_2(max(E, 1)))
    return path, emitted, count, finished.bool()


@torch.library.custom_op("swiftspec::tree_walk", mutates_args=())
def tree_walk_operator(choices: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                       depths: torch.Tensor, mask: torch.Tensor, max_tokens: torch.Tensor,
                       eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiftspec::tree_walk: the Triton kernel where use_triton says, else the reference."""
    run = tree_walk_triton if use_triton(choices) else tree_walk_reference
    return run(choices, tokens, parents, valid, depths, mask, max_tokens, eos)


@tree_walk_operator.register_fake
def _fake(choices, tokens, parents, valid, depths, mask, max_tokens, eos):
    B = choices.shape[0]
    return (torch.empty_like(choices), torch.empty_like(choices), choices.new_empty(B),
            choices.new_empty(B, dtype=torch.bool))


def tree_walk(choices: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
              depths: torch.Tensor, mask: torch.Tensor, max_tokens: torch.Tensor,
              eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk (module docstring) as one operator: the Triton kernel on a GPU, the reference elsewhere."""
    return dispatch(tree_walk_operator, tree_walk_reference, choices, choices, tokens, parents, valid, depths, mask,
                    max_tokens, eos, on_cpu=tree_walk_on_cpu)
