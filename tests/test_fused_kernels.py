"""The round's fused bookkeeping kernels (swiftspec_kernels: tree_walk, ...) in Triton's interpreter against their
torch references, on random trees, and each one operator to a TorchDispatchMode (one kernel on a GPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fused_helpers import DEVICE, needs_triton  # noqa: E402
from swiftspec_kernels.fused import forced  # noqa: E402
from swiftspec_kernels.tree_walk import tree_walk, tree_walk_on_cpu, tree_walk_reference, tree_walk_triton  # noqa: E402
from swiftspec_kernels.record_walk import record_walk, record_walk_reference, record_walk_triton  # noqa: E402
from swiftspec_kernels.commit_slots import commit_slots, commit_slots_reference, commit_slots_triton  # noqa: E402
from swiftspec_kernels.advance_rows import advance_rows, advance_rows_reference, advance_rows_triton  # noqa: E402
from swiftspec_kernels.tree_mask import tree_mask, tree_mask_reference, tree_mask_triton  # noqa: E402

from hf_swiftspec.models.architectures import LayerMask  # noqa: E402
from hf_swiftspec.tools.counters import OperatorCounter  # noqa: E402



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


@pytest.mark.parametrize("shape", [(1, 1, 0), (5, 8, 1), (16, 12, 3)])
def test_the_walk_on_host_values_equals_the_reference(shape):
    """A CPU's walk (a loop over host values, what a call on the CPU runs outside the counters) is the reference's."""
    B, T, E = shape
    for seed in range(4):
        t = {k: v.cpu() for k, v in random_subtrees(B=B, T=T, vocab=3, seed=seed).items()}
        t["eos"] = t["eos"][:, :E].contiguous()
        for want, got in zip(tree_walk_reference(**t), tree_walk_on_cpu(**t)):
            assert torch.equal(want, got)


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


@needs_triton
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mask_kernel_equals_its_reference_and_tree_visible(rows, dtype):
    from hf_swiftspec.steps.slot_cache import additive_mask, tree_visible

    g = torch.Generator().manual_seed(0)
    B, R, N, span = 3, 7, 7, 40
    ancestors = (torch.rand(B, R, N, generator=g) < 0.4) | torch.eye(R, N, dtype=torch.bool)
    prefix_lens = torch.tensor([0, 5, span - N])
    index = torch.randint(0, R, (B, 4), generator=g) if rows else None
    seen = ancestors if index is None else ancestors.gather(1, index[:, :, None].expand(B, 4, N))
    want = additive_mask(tree_visible(span, prefix_lens, seen), dtype)  # the unfused functions, as before
    t = [x.to(DEVICE) if x is not None else None for x in (prefix_lens, ancestors, index)]
    assert torch.equal(tree_mask_reference(*t, span, dtype).cpu(), want)
    assert torch.equal(tree_mask_triton(*t, span, dtype).cpu(), want)
    with OperatorCounter() as ops:
        tree_mask(*t, span, dtype)
    assert ops.operators == {"swiftspec.tree_mask.default": 1}


@needs_triton
@pytest.mark.parametrize("rule", [LayerMask("sliding", 3), LayerMask("chunked", 4)], ids=["sliding", "chunked"])
@pytest.mark.parametrize("rows", [False, True])
def test_the_windowed_mask_kernel_equals_its_reference_and_the_rule(rule, rows):
    """With a window term (each query's first visible position, LayerMask.first_visible of its position), kernel and
    reference equal tree_visible's mask cut by LayerMask.visible over every slot's position (committed slot j: j; tree
    node i: prefix_len + its depth), on random trees behind prefixes shorter and longer than the window; also with one
    first position a row, (B, 1), as a growth level's frontier (one depth) passes it."""
    from hf_swiftspec.steps.slot_cache import additive_mask, tree_visible

    g = torch.Generator().manual_seed(1)
    B, N, span = 3, 9, 48
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)] for _ in range(B)]
    ancestors = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
    depths = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(1, N):
            ancestors[b, i] |= ancestors[b, parents[b][i]]
            depths[b, i] = depths[b, parents[b][i]] + 1
    prefix_lens = torch.tensor([0, 5, span - N - 1])
    index = torch.randint(0, N, (B, 4), generator=g) if rows else None
    seen = ancestors if index is None else ancestors.gather(1, index[:, :, None].expand(B, 4, N))
    q_depths = depths if index is None else depths.gather(1, index)
    positions = prefix_lens[:, None] + q_depths  # (B, Q)
    c = torch.arange(span)
    node = (c[None] - prefix_lens[:, None]).clamp(0, N - 1)
    kv_positions = torch.where(c[None] < prefix_lens[:, None], c[None], prefix_lens[:, None] + depths.gather(1, node))
    for first, q in ((rule.first_visible(positions), positions), (rule.first_visible(positions[:, :1]), positions[:, :1])):
        want = additive_mask(tree_visible(span, prefix_lens, seen) & rule.visible(q, kv_positions), torch.float32)
        t = [x.to(DEVICE) if x is not None else None for x in (prefix_lens, ancestors, index)]
        window = first.to(DEVICE), depths.to(DEVICE)
        assert torch.equal(tree_mask_reference(*t, span, torch.float32, *window).cpu(), want)
        assert torch.equal(tree_mask_triton(*t, span, torch.float32, *window).cpu(), want)
    assert not torch.equal(want, additive_mask(tree_visible(span, prefix_lens, seen), torch.float32))  # a cut made
    with OperatorCounter() as ops:
        tree_mask(*t, span, torch.float32, *window)
    assert ops.operators == {"swiftspec.tree_mask.default": 1}


@needs_triton
def test_the_advance_kernel_equals_its_reference():
    t = random_subtrees(B=6, T=9, vocab=3, seed=5)
    walk = tree_walk_reference(**t)
    g = torch.Generator().manual_seed(1)
    node_ids = torch.randint(0, 20, (6, 9), generator=g).to(DEVICE)

    def state():
        return [torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(k)).to(DEVICE) for k in range(4)] + [
            t["eos"].clone()]

    want_state, got_state = state(), state()
    want = advance_rows_reference(walk[2], walk[3], walk[1], walk[0], node_ids, t["tokens"], t["parents"], *want_state)
    got = advance_rows_triton(walk[2], walk[3], walk[1], walk[0], node_ids, t["tokens"], t["parents"], *got_state)
    assert torch.equal(want, got)
    assert all(torch.equal(w, g) for w, g in zip(want_state, got_state))
    assert (want_state[4][walk[3]] == -1).all() and (want_state[4][~walk[3]] == t["eos"][~walk[3]]).all()
    assert torch.equal(want_state[1], state()[1] + walk[2])  # prefix_lens moved on by the count
    fresh = state()
    with OperatorCounter() as ops:
        advance_rows(walk[2], walk[3], walk[1], walk[0], node_ids, t["tokens"], t["parents"], *fresh)
    assert ops.operators == {"swiftspec.advance_rows.default": 1}


@needs_triton
@pytest.mark.parametrize("layout", ["kv", "flat"])
def test_the_commit_kernel_equals_its_reference_and_commit_plan(layout):
    from hf_swiftspec.steps.cache import move_positions
    from hf_swiftspec.steps.device_round import commit_plan

    g = torch.Generator().manual_seed(3)
    B, C, M = 3, 24, 6
    shape, dim = ((4, B, 2, C, 5), 3) if layout == "kv" else ((2, B, C, 7), 2)
    data = torch.randn(shape, generator=g).to(DEVICE)
    prefix_lens = torch.tensor([0, 4, 10], device=DEVICE)
    # overlapping moves: a source of one row's later node is the destination of an earlier one
    slots = torch.stack([torch.randperm(M, generator=g)[:M] + 1 for _ in range(B)]).to(DEVICE)
    counts = torch.tensor([0, 3, 6], device=DEVICE)
    want = data.clone()
    src, dst, _, _ = commit_plan(prefix_lens, slots, counts, None, None, C - 1)
    move_positions(want, dim, src, dst)
    ref, got = data.clone(), data.clone()
    commit_slots_reference(ref, dim, prefix_lens, slots, counts, C - 1)
    commit_slots_triton(got, dim, prefix_lens, slots, counts, C - 1)
    assert torch.equal(ref, want) and torch.equal(got, want)
    with OperatorCounter() as ops:
        commit_slots(got, dim, prefix_lens, slots, counts, C - 1)
    assert ops.operators == {"swiftspec.commit_slots.default": 1}


@needs_triton
@pytest.mark.parametrize("depth", [0, 3])
def test_the_record_kernel_equals_its_reference(depth):
    t = random_subtrees(B=5, T=9, vocab=3, seed=7)
    path, _, count, _ = tree_walk_reference(**t)
    g = torch.Generator().manual_seed(2)
    node_ids = torch.randint(0, 12, (5, 9), generator=g).to(DEVICE)
    prefix_lens = torch.randint(0, 20, (5,), generator=g).to(DEVICE)
    C = 32
    history = torch.randint(0, 9, (5, C), generator=g).to(DEVICE)
    draft_lens = torch.randint(0, 20, (5,), generator=g).to(DEVICE)
    want_h, want_d, got_h, got_d = history.clone(), draft_lens.clone(), history.clone(), draft_lens.clone()
    want = record_walk_reference(want_h, want_d, prefix_lens, path, count, node_ids, t["tokens"], 7, depth)
    got = record_walk_triton(got_h, got_d, prefix_lens, path, count, node_ids, t["tokens"], 7, depth)
    assert all(torch.equal(w, g) for w, g in zip(want, got)) and torch.equal(want_d, got_d)
    assert torch.equal(want_h[:, : C - 1], got_h[:, : C - 1])  # slot C - 1: padding's, never read
    if depth == 0:
        assert torch.equal(want_d, draft_lens) and (want[1] == 0).all()
    with OperatorCounter() as ops:
        record_walk(got_h, got_d, prefix_lens, path, count, node_ids, t["tokens"], 7, depth)
    assert ops.operators == {"swiftspec.record_walk.default": 1}
