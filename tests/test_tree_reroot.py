"""A draft tree re-rooted on a verdict (swiftspec_kernels.tree_reroot; steps/device_round.reroot_device and
slot_cache.reroot_cache): the reference against a re-root by hand on random trees (a kept subtree, a token the draft
never proposed, a path that left the tree, a leaf), the Triton kernel in the interpreter against the reference, one
operator to a TorchDispatchMode, and on a tree a tiny draft grew in a slot cache: the kept nodes' tokens, scores and
KV against fresh causal forwards of the draft along each kept branch, with no host read."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fused_helpers import DEVICE, needs_triton  # noqa: E402
from swiftspec_kernels.fused import forced  # noqa: E402
from swiftspec_kernels.tree_reroot import tree_reroot, tree_reroot_reference, tree_reroot_triton  # noqa: E402
from test_fused_select import random_trees  # noqa: E402

from hf_swiftspec.drafters.device_growth import grow  # noqa: E402
from hf_swiftspec.steps.device_round import HASH_MULTIPLIER, DeviceTree, host_path_hash, path_hashes  # noqa: E402
from hf_swiftspec.steps.device_round import reroot_device  # noqa: E402
from hf_swiftspec.steps.slot_cache import SlotCache, catch_up, reroot_cache  # noqa: E402
from hf_swiftspec.steps.tree import subtree_mask  # noqa: E402
from hf_swiftspec.tools.counters import OperatorCounter  # noqa: E402
from hf_swiftspec.tools.models import tiny_model  # noqa: E402
from sync_counter import SyncCounter  # noqa: E402

OUT = ("tokens", "parents", "depths", "scores", "ancestors", "hashes", "size", "moved")


def signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def with_hashes(t: dict) -> dict:
    """The trees' path hashes from the root, by host ints (host_path_hash), node by node."""
    B, N = t["tokens"].shape
    hashes = [[0] * N for _ in range(B)]
    for b in range(B):
        for i in range(1, int(t["size"][b])):
            hashes[b][i] = signed(host_path_hash(hashes[b][int(t["parents"][b, i])] & ((1 << 64) - 1),
                                                 int(t["tokens"][b, i])))
    return dict(t, hashes=torch.tensor(hashes, dtype=torch.long, device=DEVICE))


def reroot_by_hand(t: dict, b: int, last: int, token: int) -> dict:
    """Row b re-rooted in Python: the first live child of `last` holding `token` is the root, its descendants (by
    following parents) kept in index order; else a tree of the token alone."""
    N, size = t["tokens"].shape[1], int(t["size"][b])
    tokens, parents = t["tokens"][b].tolist(), t["parents"][b].tolist()
    depths, scores, hashes = t["depths"][b].tolist(), t["scores"][b].tolist(), t["hashes"][b].tolist()
    root = next((i for i in range(size) if last >= 0 and parents[i] == last and tokens[i] == token), None)

    def below(i: int) -> bool:
        while i >= 0:
            if i == root:
                return True
            i = parents[i]
        return False

    kept = [i for i in range(size) if root is not None and below(i)] or [None]
    new = {old: j for j, old in enumerate(kept)}
    out = dict(tokens=[0] * N, parents=[-1] * N, depths=[0] * N, scores=[float("-inf")] * N, hashes=[0] * N,
               moved=[-1] * N, ancestors=[[False] * N for _ in range(N)], size=len(kept))
    for j, old in enumerate(kept):
        if old is None:  # a new tree
            out["tokens"][0], out["scores"][0], out["ancestors"][0][0] = token, 0.0, True
            continue
        d = depths[old] - depths[root]
        out["tokens"][j], out["depths"][j], out["moved"][j] = tokens[old], d, old
        out["parents"][j] = new.get(parents[old], -1) if old != root else -1
        out["scores"][j] = 0.0 if old == root else scores[old] - (scores[root] if scores[root] > float("-inf") else 0)
        out["hashes"][j] = signed((hashes[old] - hashes[root] * HASH_MULTIPLIER ** d) & ((1 << 64) - 1))
        for k, other in enumerate(kept):
            out["ancestors"][j][k] = bool(t["ancestors"][b, old, other])
    return out


def verdicts(t: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row a (last, token): a live node and one of its children's tokens (a kept subtree), a token none of its
    children hold (a new tree), -1 (the path left the tree) or a node with no child, by turns."""
    g = torch.Generator().manual_seed(seed)
    B = t["tokens"].shape[0]
    last, token = [], []
    for b in range(B):
        size = int(t["size"][b])
        parents, tokens = t["parents"][b, :size].tolist(), t["tokens"][b, :size].tolist()
        node = int(torch.randint(0, size, (1,), generator=g))
        children = [i for i in range(size) if parents[i] == node]
        case = (b + seed) % 4
        if case == 0 and children:
            last.append(node), token.append(tokens[children[int(torch.randint(0, len(children), (1,), generator=g))]])
        elif case == 1:
            last.append(node), token.append(99)  # random_trees' tokens are below 50
        elif case == 2:
            last.append(-1), token.append(tokens[children[0]] if children else 5)
        else:
            leaf = max(i for i in range(size) if i not in parents)
            last.append(leaf), token.append(tokens[0])
    return torch.tensor(last, device=DEVICE), torch.tensor(token, device=DEVICE)


ARGS = ("tokens", "parents", "depths", "scores", "ancestors", "hashes", "size")
SHAPES = [(1, 1), (4, 6), (6, 9), (5, 16), (3, 33)]


@pytest.mark.parametrize("B,N", SHAPES)
def test_the_reroot_reference_is_the_reroot_by_hand(B, N):
    for seed in range(4):
        t = with_hashes(random_trees(B, N, seed))
        last, token = verdicts(t, seed)
        got = dict(zip(OUT, tree_reroot_reference(*(t[k] for k in ARGS), last, token, HASH_MULTIPLIER)))
        for b in range(B):
            want = reroot_by_hand(t, b, int(last[b]), int(token[b]))
            assert int(got["size"][b]) == want["size"], (seed, b)
            for name in ("tokens", "parents", "depths", "hashes", "moved", "ancestors"):
                assert got[name][b].tolist() == want[name], (seed, b, name)
            assert got["scores"][b].tolist() == pytest.approx(want["scores"]), (seed, b)


@needs_triton
@pytest.mark.parametrize("B,N", SHAPES)
def test_the_reroot_kernel_equals_its_reference(B, N):
    for seed in range(3):
        t = with_hashes(random_trees(B, N, seed))
        last, token = verdicts(t, seed)
        want = tree_reroot_reference(*(t[k] for k in ARGS), last, token, HASH_MULTIPLIER)
        got = tree_reroot_triton(*(t[k] for k in ARGS), last, token, HASH_MULTIPLIER)
        for name, w, g in zip(OUT, want, got):
            assert w.dtype == g.dtype and torch.equal(w, g), (seed, name)


def test_the_reroot_is_one_operator_and_runs_the_backend_asked():
    t = with_hashes(random_trees(3, 7, 0))
    last, token = verdicts(t, 0)
    with OperatorCounter() as ops:
        tree_reroot(*(t[k] for k in ARGS), last, token, HASH_MULTIPLIER)
    assert ops.operators == {"swiftspec.tree_reroot.default": 1}
    with forced("reference"):
        out = tree_reroot(*(t[k] for k in ARGS), last, token, HASH_MULTIPLIER)
    for a, b in zip(out, tree_reroot_reference(*(t[k] for k in ARGS), last, token, HASH_MULTIPLIER)):
        assert torch.equal(a, b)


CAPACITY = 64


def branch(tree: DeviceTree, b: int, node: int) -> list[int]:
    """The tokens from row b's root down to `node`, the root's included."""
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def test_a_grown_tree_rerooted_keeps_the_draft_s_kv_and_scores_below_the_verdict():
    """A tiny draft grows 4 levels of 3 below each of two roots (rows of different prompts), the verdict accepts a
    path (the root and one or two nodes) and names a drafted child as the next token; after reroot_device and
    reroot_cache: the new tree is the old subtree below that child (tokens by branch, ancestor bits and depths by
    its parents, hashes recomputed from its tokens), its scores the draft's log-probs from the new root and every
    kept node the draft ran has the KV a fresh causal forward of the prompt and its branch gives, as has the
    committed path: no host read."""
    draft = tiny_model("llama", seed=3)
    prompts = [[5, 17, 33, 9, 60], [70, 12, 8]]
    roots, depth, width = torch.tensor([11, 40]), 4, 3
    tokens = torch.tensor([p + [0] * (5 - len(p)) for p in prompts])
    prefix = torch.tensor([len(p) for p in prompts])
    cache = SlotCache(draft.config.num_hidden_layers, CAPACITY)
    with torch.no_grad():
        catch_up(draft, cache, tokens, prefix)
        tree = grow(draft, cache, prefix, roots, depth, width).tree
    # row 0 accepts the root and its best level-1 node, then a level-2 child of it; row 1 the root alone, then a
    # level-1 node
    parents = tree.parents.tolist()
    fertile = lambda b, lv: [i for i in range(1 + (lv - 1) * width, 1 + lv * width) if i in parents[b]]  # noqa: E731
    r0 = fertile(0, 2)[0]
    a, r1 = parents[0][r0], fertile(1, 1)[-1]
    path = torch.tensor([[0, a], [0, 0]])
    count = torch.tensor([2, 1])
    token = torch.tensor([int(tree.tokens[0, r0]), int(tree.tokens[1, r1])])
    old = DeviceTree(**{k: getattr(tree, k).clone() for k in DeviceTree.__dataclass_fields__})
    with torch.no_grad(), SyncCounter() as reads:
        new, moved = reroot_device(tree, path, count, token)
        new_prefix = reroot_cache(cache, prefix, path, count, moved, new.size)
    assert sum(reads.calls.values()) == 0, reads.calls
    assert new_prefix.tolist() == [prefix[0] + 2, prefix[1] + 1]
    for b, (root, committed) in enumerate(((r0, [0, a]), (r1, [0]))):
        size = int(new.size[b])
        kept = [i for i in range(old.tokens.shape[1]) if bool(old.ancestors[b, i, root])]
        assert moved[b, :size].tolist() == kept and size == len(kept) > 1
        parents = new.parents[b, :size].tolist()
        mask, depths = subtree_mask(parents, "cpu")
        assert torch.equal(new.ancestors[b, :size, :size], mask) and torch.equal(new.depths[b, :size], depths)
        assert torch.equal(new.hashes[b, :size], path_hashes(new)[b, :size])
        stem = prompts[b] + [branch(old, b, c)[-1] for c in committed]  # the committed prompt and path
        for j, i in enumerate(kept):
            below = branch(new, b, j)
            assert branch(old, b, i)[-len(below):] == below
            sequence = torch.tensor([stem + below])
            with torch.no_grad():
                out = draft(input_ids=sequence, use_cache=True)
            if j:  # the draft's log-prob of each token of the branch below the new root, summed
                logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
                score = sum(float(logprobs[len(stem) - 1 + k, t]) for k, t in enumerate(below) if k)
                torch.testing.assert_close(float(new.scores[b, j]), score, atol=1e-4, rtol=1e-4)
            if int(old.depths[b, i]) < depth:  # the draft ran it (the last level's nodes it never did)
                slot, position = int(new_prefix[b]) + j, len(sequence[0]) - 1
                for layer, mine in zip(out.past_key_values.layers, cache.layers):
                    torch.testing.assert_close(mine.keys[b, :, slot], layer.keys[0, :, position], atol=1e-5, rtol=1e-4)
                    torch.testing.assert_close(mine.values[b, :, slot], layer.values[0, :, position], atol=1e-5,
                                               rtol=1e-4)
        with torch.no_grad():
            out = draft(input_ids=torch.tensor([stem]), use_cache=True)
        for layer, mine in zip(out.past_key_values.layers, cache.layers):  # the prompt and the committed path
            torch.testing.assert_close(mine.keys[b, :, : len(stem)], layer.keys[0], atol=1e-5, rtol=1e-4)
