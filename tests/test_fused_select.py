"""The round's subtree selection (swiftspec_kernels.tree_select) as a fused operator: the kernel in Triton's
interpreter against its torch reference on random trees (tied scores, -inf live and dead nodes, padding rows), the
reference against a selection by hand, and one operator to a TorchDispatchMode (one kernel on a GPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from swiftspec_kernels.fused import forced, triton  # noqa: E402
from swiftspec_kernels.tree_select import tree_select, tree_select_reference, tree_select_triton  # noqa: E402

from hf_swiftspec.steps.device_round import DeviceTree, select_device  # noqa: E402
from hf_swiftspec.tools.counters import OperatorCounter  # noqa: E402

needs_triton = pytest.mark.skipif(triton is None or (not torch.cuda.is_available()
                                                       and os.environ.get("TRITON_INTERPRET") != "1"),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton's import")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_trees(B: int, N: int, seed: int) -> dict[str, torch.Tensor]:
    """B random trees of capacity N as a DeviceTree's fields (parents before children, a random size, dead nodes
    past it: parent -1, depth 0, score -inf, no ancestor bits), scores from a few values so ties are common, and
    some live nodes -inf too (a ruled-out child), tied with the dead ones."""
    g = torch.Generator().manual_seed(seed)
    size = torch.randint(1, N + 1, (B,), generator=g)
    tokens = torch.randint(0, 50, (B, N), generator=g)
    parents = torch.full((B, N), -1, dtype=torch.long)
    depths = torch.zeros(B, N, dtype=torch.long)
    scores = torch.full((B, N), float("-inf"))
    ancestors = torch.zeros(B, N, N, dtype=torch.bool)
    values = torch.tensor([-0.5, -1.0, -1.5, -2.0, float("-inf")])
    for b in range(B):
        scores[b, 0] = 0.0
        ancestors[b, 0, 0] = True
        for i in range(1, int(size[b])):
            p = int(torch.randint(0, i, (1,), generator=g))
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
            scores[b, i] = scores[b, p] + values[int(torch.randint(0, len(values), (1,), generator=g))]
            ancestors[b, i] = ancestors[b, p]
            ancestors[b, i, i] = True
    tokens = torch.where(torch.arange(N)[None] < size[:, None], tokens, 0)
    return {k: v.to(DEVICE) for k, v in dict(tokens=tokens, parents=parents, depths=depths, scores=scores,
                                             ancestors=ancestors, size=size).items()}


def select_by_hand(t: dict, b: int, budget: int) -> dict[str, list]:
    """Row b's selection in Python: the best min(budget, N) nodes by score, ties to the lower index, in index order;
    local parents (-1 for none picked), the first `size` picks real, padding at depth 0 seeing itself alone."""
    scores, parents = t["scores"][b].tolist(), t["parents"][b].tolist()
    N, size = len(scores), int(t["size"][b])
    T = min(budget, N)
    ids = sorted(sorted(range(N), key=lambda i: (-scores[i], i))[:T])
    local = {node: j for j, node in enumerate(ids)}
    valid = [j < size for j in range(T)]
    anc = t["ancestors"][b].tolist()
    return dict(
        node_ids=ids, tokens=[t["tokens"][b, i].item() for i in ids], scores=[scores[i] for i in ids], valid=valid,
        parents=[local.get(parents[i], -1) if valid[j] else -1 for j, i in enumerate(ids)],
        depths=[t["depths"][b, i].item() if valid[j] else 0 for j, i in enumerate(ids)],
        mask=[[anc[i][k] if valid[j] else j == m for m, k in enumerate(ids)] for j, i in enumerate(ids)])


FIELDS = ("node_ids", "tokens", "parents", "scores", "valid", "depths", "mask")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [1, 5, 12, 40])
def test_the_selection_reference_is_the_selection_by_hand(seed, budget):
    t = random_trees(B=6, N=12, seed=seed)
    got = dict(zip(FIELDS, tree_select_reference(**t, budget=budget)))
    for b in range(6):
        want = select_by_hand(t, b, budget)
        for name in FIELDS:
            assert got[name][b].tolist() == want[name], (b, name)


@needs_triton
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 4), (4, 7, 3), (5, 13, 8), (3, 16, 16), (2, 33, 9), (6, 12, 40)])
def test_the_selection_kernel_equals_its_reference(shape):
    B, N, budget = shape
    for seed in range(3):
        t = random_trees(B, N, seed)
        for want, got in zip(tree_select_reference(**t, budget=budget), tree_select_triton(**t, budget=budget)):
            assert want.dtype == got.dtype and torch.equal(want, got)


def test_select_device_is_one_operator_and_its_fields_are_the_references():
    t = random_trees(B=4, N=9, seed=0)
    tree = DeviceTree(**t)
    with OperatorCounter() as ops:
        sub = select_device(tree, 6)
    assert ops.operators == {"swiftspec.tree_select.default": 1}
    with forced("reference"):
        want = tree_select(**t, budget=6)
    for name, w in zip(FIELDS, want):
        assert torch.equal(getattr(sub, name), w), name
