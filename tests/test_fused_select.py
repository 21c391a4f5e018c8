"""The round's subtree selection and a growth level's bookkeeping (swiftspec_kernels.tree_select, tree_level) as
fused operators: each kernel in Triton's interpreter against its torch reference on random trees (for the selection:
tied scores, -inf live and dead nodes, padding rows; for the level: several levels, widths and vocabularies, with and
without a token map), each reference against a version by hand, and each one operator to a TorchDispatchMode (one
kernel on a GPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fused_helpers import DEVICE, needs_triton  # noqa: E402
from swiftspec_kernels.fused import forced  # noqa: E402
from swiftspec_kernels.tree_level import tree_level, tree_level_reference, tree_level_triton  # noqa: E402
from swiftspec_kernels.tree_select import tree_select, tree_select_reference, tree_select_triton  # noqa: E402

from hf_swiftspec.drafters.device_growth import add_level  # noqa: E402
from hf_swiftspec.steps.device_round import HASH_MULTIPLIER, DeviceTree, host_path_hash, select_device  # noqa: E402
from hf_swiftspec.tools.counters import OperatorCounter  # noqa: E402



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


TREE = ("tokens", "parents", "hashes", "depths", "scores", "ancestors")


def seeded(B: int, depth: int, width: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """A growth's tree before its first level (device_growth.seed_tree's: the root alone at node 0), with a random
    root token and a random root hash (any int64: the hashes wrap)."""
    g = torch.Generator().manual_seed(seed)
    N = 1 + depth * width
    tokens = torch.zeros(B, N, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (B,), generator=g)
    hashes = torch.zeros(B, N, dtype=torch.long)
    hashes[:, 0] = torch.randint(-(1 << 62), 1 << 62, (B,), generator=g) * 2
    scores = torch.full((B, N), float("-inf"))
    scores[:, 0] = 0.0
    ancestors = torch.zeros(B, N, N, dtype=torch.bool)
    ancestors[:, 0, 0] = True
    return {k: v.to(DEVICE) for k, v in dict(tokens=tokens, parents=torch.full((B, N), -1), hashes=hashes,
                                             depths=torch.zeros(B, N, dtype=torch.long), scores=scores,
                                             ancestors=ancestors).items()}


def ranked(B: int, F: int, vocab: int, width: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A level's top-k (best, flat) of random cumulative (B, F, vocab) scores, ties and -inf among them."""
    cumulative = torch.randint(-4, 1, (B, F, vocab), generator=g).float()
    cumulative = cumulative.masked_fill(torch.rand(B, F, vocab, generator=g) < 0.2, float("-inf")).to(DEVICE)
    return cumulative.reshape(B, -1).topk(width, dim=-1)


def level_by_hand(before: dict, after: dict, frontier: torch.Tensor, best: torch.Tensor, flat: torch.Tensor,
                  token_map, vocab: int, level: int) -> None:
    """Row by row in Python: each new node's token, parent, depth, score, path hash (host_path_hash's) and ancestor
    row (its parent's and itself) written, every other entry of the tree as it was."""
    B, k = flat.shape
    changed = {name: before[name].clone() for name in TREE}
    for b in range(B):
        for j in range(k):
            node, f, child = 1 + (level - 1) * k + j, int(flat[b, j]) // vocab, int(flat[b, j]) % vocab
            parent = int(frontier[b, f])
            token = child if token_map is None else int(token_map[child])
            want = host_path_hash(int(changed["hashes"][b, parent]) & ((1 << 64) - 1), token)
            assert int(after["hashes"][b, node]) & ((1 << 64) - 1) == want
            changed["hashes"][b, node] = after["hashes"][b, node]
            changed["tokens"][b, node], changed["parents"][b, node] = token, parent
            changed["depths"][b, node], changed["scores"][b, node] = level, best[b, j]
            changed["ancestors"][b, node] = changed["ancestors"][b, parent]
            changed["ancestors"][b, node, node] = True
    for name in TREE:
        assert torch.equal(after[name], changed[name]), name


def grow_levels(run, B: int, depth: int, width: int, vocab: int, mapped: bool, seed: int):
    """`depth` levels of random top-k's through `run` (a tree_level), each level's tree and outputs in a list."""
    g = torch.Generator().manual_seed(seed + 100)
    tree = seeded(B, depth, width, vocab, seed)
    token_map = torch.randint(0, 1000, (vocab,), generator=g).to(DEVICE) if mapped else None
    frontier = torch.zeros(B, 1, dtype=torch.long, device=DEVICE)
    seen = []
    for level in range(1, depth + 1):
        before = {name: field.clone() for name, field in tree.items()}
        best, flat = ranked(B, frontier.shape[1], vocab, width, g)
        new, parent = run(**tree, frontier=frontier, best=best, flat=flat, token_map=token_map, vocab=vocab,
                          level=level, multiplier=HASH_MULTIPLIER)
        seen.append((before, {name: field.clone() for name, field in tree.items()}, frontier, best, flat, token_map,
                     new, parent))
        frontier = new
    return seen


LEVELS = [(1, 1, 1, 1, False), (3, 3, 2, 7, False), (2, 4, 5, 6, True), (4, 2, 6, 11, True), (2, 3, 4, 40, True)]


@pytest.mark.parametrize("shape", LEVELS)
def test_the_level_reference_is_the_level_by_hand(shape):
    B, depth, width, vocab, mapped = shape
    for level, (before, after, frontier, best, flat, token_map, new, parent) in enumerate(
            grow_levels(tree_level_reference, B, depth, width, vocab, mapped, seed=0), start=1):
        level_by_hand(before, after, frontier, best, flat, token_map, vocab, level)
        assert new.tolist() == [list(range(1 + (level - 1) * width, 1 + level * width))] * B
        assert torch.equal(parent, after["parents"][:, new[0]])


@needs_triton
@pytest.mark.parametrize("shape", LEVELS)
def test_the_level_kernel_equals_its_reference(shape):
    for seed in range(3):
        want = grow_levels(tree_level_reference, *shape, seed=seed)
        got = grow_levels(tree_level_triton, *shape, seed=seed)
        for (_, w_tree, *w_rest), (_, g_tree, *g_rest) in zip(want, got):
            for name in TREE:
                assert torch.equal(w_tree[name], g_tree[name]), name
            for w, g in zip(w_rest[-2:], g_rest[-2:]):
                assert torch.equal(w, g)


def test_add_level_is_the_topk_and_one_operator_writing_the_tree():
    tree = DeviceTree(size=torch.full((3,), 9, device=DEVICE), **seeded(B=3, depth=2, width=4, vocab=10, seed=0))
    logprobs = torch.randn(3, 1, 10, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    token_map, root = torch.arange(10, device=DEVICE) * 3, torch.zeros(3, 1, dtype=torch.long, device=DEVICE)
    with OperatorCounter() as ops:
        new, parent = add_level(tree, root, logprobs, 1, 4, token_map)
    assert ops.operators == {"aten.topk.default": 1, "swiftspec.tree_level.default": 1}
    assert torch.equal(tree.tokens[:, 1:5], logprobs[:, 0].topk(4).indices * 3)
    assert torch.equal(new, torch.arange(1, 5, device=DEVICE).expand(3, 4)) and (parent == 0).all()
