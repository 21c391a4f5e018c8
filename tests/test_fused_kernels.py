"""The round's fused bookkeeping kernels (swiftspec_kernels: tree_walk, ...) in Triton's interpreter against their
torch references, on random trees, and each one operator to a TorchDispatchMode (one kernel on a GPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from swiftspec_kernels.fused import forced, triton  # noqa: E402
from swiftspec_kernels.tree_walk import tree_walk, tree_walk_reference, tree_walk_triton  # noqa: E402

from hf_swiftspec.tools.counters import OperatorCounter  # noqa: E402

needs_triton = pytest.mark.skipif(triton is None or (not torch.cuda.is_available()
                                                       and os.environ.get("TRITON_INTERPRET") != "1"),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton's import")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_subtrees(B: int, T: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """B random verified subtrees of T slots (parents before children, a random number of real nodes, padding
    last seeing itself), tokens from a small vocabulary so siblings share tokens (the first-child rule matters)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    parents = torch.full((B, T), -1, dtype=torch.long)
    depths = torch.zeros(B, T, dtype=torch.long)
    size = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
    for b in range(B):
        for i in range(1, int(size[b])):
            p = int(torch.randint(0, i, (1,), generator=g))
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
            mask[b, i] |= mask[b, p]
    valid = torch.arange(T)[None] < size[:, None]
    tokens = torch.where(valid, tokens, 0)
    # choices that follow the tree often: each node's choice is one of its children's tokens half the time
    choices = torch.randint(0, vocab, (B, T), generator=g)
    for b in range(B):
        for i in range(1, int(size[b])):
            if torch.rand(1, generator=g) < 0.7:
                choices[b, parents[b, i]] = tokens[b, i]
    max_tokens = torch.randint(-1, T + 2, (B,), generator=g)
    eos = torch.where(torch.rand(B, 3, generator=g) < 0.5, torch.randint(0, vocab, (B, 3), generator=g), -1)
    return {k: v.to(DEVICE) for k, v in dict(choices=choices, tokens=tokens, parents=parents, valid=valid,
                                             depths=depths, mask=mask, max_tokens=max_tokens, eos=eos).items()}


def walk_by_hand(t: dict, b: int) -> tuple[list[int], list[int], bool]:
    """Row b's walk node by node in Python (the rule as generate() states it): path, emitted tokens, finished."""
    tokens, parents, valid = t["tokens"][b].tolist(), t["parents"][b].tolist(), t["valid"][b].tolist()
    choices, budget, eos = t["choices"][b].tolist(), int(t["max_tokens"][b]), set(t["eos"][b].tolist()) - {-1}
    path, emitted, node = [], [], 0
    while len(emitted) < budget:
        path.append(node)
        emitted.append(choices[node])
        if choices[node] in eos:
            return path, emitted, True
        children = [i for i in range(len(tokens)) if valid[i] and parents[i] == node and tokens[i] == choices[node]]
        if not children:
            break
        node = children[0]
    return path, emitted, len(emitted) >= budget


@pytest.mark.parametrize("seed", range(4))
def test_the_walk_reference_is_the_walk_by_hand(seed):
    t = random_subtrees(B=16, T=12, vocab=3, seed=seed)
    path, emitted, count, finished = tree_walk_reference(**t)
    for b in range(16):
        want_path, want_tokens, want_finished = walk_by_hand(t, b)
        n = len(want_path)
        assert int(count[b]) == n and bool(finished[b]) == want_finished
        assert path[b, :n].tolist() == want_path and emitted[b, :n].tolist() == want_tokens
        assert (path[b, n:] == -1).all() and (emitted[b, n:] == -1).all()


@needs_triton
@pytest.mark.parametrize("shape", [(1, 1, 0), (5, 8, 1), (16, 12, 3), (3, 33, 5)])
def test_the_walk_kernel_equals_its_reference(shape):
    B, T, E = shape
    for seed in range(3):
        t = random_subtrees(B=B, T=T, vocab=3, seed=seed)
        t["eos"] = t["eos"][:, :E].contiguous() if E <= 3 else torch.cat([t["eos"], t["eos"][:, :E - 3]], 1)
        want = tree_walk_reference(**t)
        got = tree_walk_triton(**t)
        for w, g in zip(want, got):
            assert torch.equal(w, g)


def test_a_fused_operator_is_one_operator_and_runs_the_backend_asked():
    t = random_subtrees(B=4, T=8, vocab=3, seed=0)
    with OperatorCounter() as ops:
        out = tree_walk(**t)
    assert ops.operators == {"swiftspec.tree_walk.default": 1}
    with forced("reference"):
        assert all(torch.equal(a, b) for a, b in zip(out, tree_walk(**t)))
    with pytest.raises(ValueError, match="'cuda'"):
        with forced("cuda"):
            pass
