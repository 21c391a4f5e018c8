"""The fused suffix merge (swiftspec_kernels.tree_merge): its torch reference against the merge by hand (the twin rule,
the placement of own / merged-away / padding nodes, the ancestors), the Triton kernel in Triton's interpreter against
the reference exactly on grown draft trees and hand-made ones with random suffix proposals, and the merge one operator
to a TorchDispatchMode (one kernel on a GPU)."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fused_helpers import DEVICE, needs_triton  # noqa: E402
from swiftspec_kernels.fused import forced  # noqa: E402
from swiftspec_kernels.tree_merge import (  # noqa: E402
    HASH_BITS, tree_merge, tree_merge_reference, tree_merge_triton)

from hf_swiftspec.drafters.device_growth import add_level  # noqa: E402
from hf_swiftspec.drafters.device_suffix import host_nodes, merge_suffix  # noqa: E402
from hf_swiftspec.steps.device_round import DeviceTree, path_hashes  # noqa: E402
from hf_swiftspec.tools.counters import OperatorCounter  # noqa: E402

FIELD_NAMES = ("tokens", "parents", "depths", "scores", "ancestors", "size", "hashes")


def grown_tree(g: torch.Generator, B: int, depth: int, width: int, vocab: int) -> DeviceTree:
    """B rows grown as a round grows them (device_growth.add_level, N = 1 + depth * width; depth 0: the root alone,
    draft-free mode's tree) from random log-probs, a few of them -inf (ids past a vocabulary limit): where a level
    has fewer finite children than its width the top-k keeps dead nodes (score -inf, a path hash all the same),
    which no suffix node may merge into."""
    N = 1 + depth * width
    tokens = torch.zeros(B, N, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (B,), generator=g)
    scores = torch.full((B, N), float("-inf"))
    scores[:, 0] = 0.0
    ancestors = torch.zeros(B, N, N, dtype=torch.bool)
    ancestors[:, 0, 0] = True
    tree = DeviceTree(tokens, torch.full((B, N), -1, dtype=torch.long), torch.zeros(B, N, dtype=torch.long), scores,
                      ancestors, torch.full((B,), N), torch.zeros(B, N, dtype=torch.long))
    frontier = torch.zeros(B, 1, dtype=torch.long)
    for level in range(1, depth + 1):
        logprobs = torch.log_softmax(torch.randn(B, frontier.shape[1], vocab, generator=g), dim=-1)
        logprobs = logprobs.masked_fill(torch.rand(logprobs.shape, generator=g) < 0.3, float("-inf"))
        frontier, _ = add_level(tree, frontier, tree.scores.gather(1, frontier)[:, :, None] + logprobs, level, width)
    return tree


def hand_tree(g: torch.Generator, B: int, N: int, vocab: int) -> DeviceTree:
    """B random trees of N nodes (parents before children) with siblings sharing tokens (two nodes of one path hash:
    the first grown one is the twin) and some nodes dead (-inf, their descendants too), hashes by path_hashes."""
    tokens = torch.randint(0, vocab, (B, N), generator=g)
    parents = torch.full((B, N), -1, dtype=torch.long)
    depths = torch.zeros(B, N, dtype=torch.long)
    scores = torch.zeros(B, N)
    ancestors = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
    for b in range(B):
        for i in range(1, N):
            p = int(torch.randint(0, i, (1,), generator=g))
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
            scores[b, i] = scores[b, p] + math.log(float(torch.rand(1, generator=g)) + 1e-3)
            ancestors[b, i] |= ancestors[b, p]
    dead = torch.rand(B, N, generator=g) < 0.2
    dead[:, 0] = False
    for i in range(1, N):  # a dead node's descendants are dead (scores never rise along a path)
        dead[:, i] |= dead.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0]
    scores = scores.masked_fill(dead, float("-inf"))
    tree = DeviceTree(tokens, parents, depths, scores, ancestors, torch.full((B,), N))
    tree.hashes = path_hashes(tree)
    return tree


def random_proposal(g: torch.Generator, tree: DeviceTree, b: int, nodes: int, vocab: int) -> tuple:
    """Row b's random suffix trie of `nodes` nodes (tokens, parents: -1 the root's children, scores: log-probs never
    rising along a path) most of whose nodes follow the draft's paths (twins at every depth, nodes below twins), the
    others new tokens, a few with a -inf score (not live: never a twin; nor their descendants)."""
    d_tokens, d_parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    tokens, parents, scores, where = [], [], [], []  # where: the draft node each suffix node's path ends at, or -1
    while len(tokens) < nodes:
        p = int(torch.randint(-1, len(tokens), (1,), generator=g))
        at = 0 if p < 0 else where[p]
        kids = [i for i, pp in enumerate(d_parents) if pp == at and at >= 0 and i > 0]
        if kids and float(torch.rand(1, generator=g)) < 0.7:
            t = d_tokens[kids[int(torch.randint(0, len(kids), (1,), generator=g))]]
        else:
            t = int(torch.randint(0, vocab + 2, (1,), generator=g))
        if any(pp == p and tt == t for pp, tt in zip(parents, tokens)):
            continue
        tokens.append(t), parents.append(p)
        where.append(next((i for i in kids if d_tokens[i] == t), -1))
        score = (scores[p] if p >= 0 else 0.0) + math.log(float(torch.rand(1, generator=g)) + 1e-3)
        dead = float(torch.rand(1, generator=g)) < 0.1 or (p >= 0 and scores[p] == -math.inf)  # never rising
        scores.append(-math.inf if dead else score)
    return tokens, parents, scores


def random_case(kind: str, B: int, shape: tuple[int, int], S: int, seed: int) -> tuple[DeviceTree, torch.Tensor]:
    """A draft tree of B rows ("grown": (depth, width); "hand": (N, vocab)) and a packed proposal of S nodes a row,
    as a round copies it (host_nodes), row 0 proposing nothing, the others a random number of nodes (padding)."""
    g = torch.Generator().manual_seed(seed)
    vocab = max(4, shape[1]) if kind == "grown" else shape[1]  # a level's top-k needs width children to pick from
    tree = grown_tree(g, B, *shape, vocab) if kind == "grown" else hand_tree(g, B, shape[0], shape[1])
    sizes = [0] + [int(torch.randint(1, S + 1, (1,), generator=g)) for _ in range(B - 1)]
    packed = torch.tensor([host_nodes(*random_proposal(g, tree, b, n, vocab), S) for b, n in enumerate(sizes)],
                          dtype=torch.float64)
    return tree, packed


def arguments(tree: DeviceTree, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    fields = (tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors, tree.size, tree.hashes, packed)
    return tuple(t.to(DEVICE) for t in fields)


def merge_by_hand(tree: DeviceTree, packed: torch.Tensor, b: int) -> dict:
    """Row b's merge node by node in Python (the rule as device_suffix.merge_suffix states it)."""
    N, S = tree.tokens.shape[1], packed.shape[2]
    d_hashes, d_scores = tree.hashes[b].tolist(), tree.scores[b].tolist()
    s_tokens, s_parents, s_depths, s_scores, s_hashes = (packed[b, f].tolist() for f in range(5))
    live = [s > -math.inf for s in s_scores]
    twin = [next((n for n in range(1, N) if d_hashes[n] & HASH_BITS == int(s_hashes[i]) and d_scores[n] > -math.inf),
                 -1) if live[i] else -1 for i in range(S)]
    own = [i for i in range(S) if live[i] and twin[i] < 0]
    order = own + [i for i in range(S) if i not in own]  # node N + j is suffix node order[j]
    node = {i: twin[i] if twin[i] >= 0 else N + order.index(i) for i in range(S)}
    out = dict(tokens=tree.tokens[b].tolist(), parents=tree.parents[b].tolist(), depths=tree.depths[b].tolist(),
               scores=list(d_scores), size=int(tree.size[b]) + len(own), hashes=list(d_hashes))
    for i in range(S):
        if twin[i] >= 0:
            out["scores"][twin[i]] = max(out["scores"][twin[i]], s_scores[i])
    for i in order:
        mine = i in own
        out["tokens"].append(int(s_tokens[i]) if mine else 0)
        out["parents"].append((0 if s_parents[i] < 0 else node[int(s_parents[i])]) if mine else -1)
        out["depths"].append(int(s_depths[i]) if mine else 0)
        out["scores"].append(s_scores[i] if mine else -math.inf)
        out["hashes"].append(int(s_hashes[i]) if mine else 0)
    return out


@pytest.mark.parametrize("kind,shape,S", [("grown", (3, 2), 8), ("grown", (4, 3), 16), ("hand", (9, 3), 7)])
def test_the_merge_reference_is_the_merge_by_hand(kind, shape, S):
    """Every field of the reference's merge is the node-by-node rule's: twins (the first grown draft node of the
    hash, never the root, only for live suffix nodes) keep the higher score; own nodes at N, N + 1, ... in their
    order below their parent's node, the merged-away and the padding after them, dead; a live node's ancestors are
    its parents' chain and a dead node sees nothing."""
    for seed in range(3):
        tree, packed = random_case(kind, 6, shape, S, seed)
        merged = dict(zip(FIELD_NAMES, tree_merge_reference(*arguments(tree, packed))))
        assert int((merged["size"] - tree.size).sum()) < int((packed[:, 3] > -math.inf).sum())  # some merged away
        for b in range(6):
            want = merge_by_hand(tree, packed, b)
            for name in ("tokens", "parents", "depths", "scores", "hashes"):
                assert merged[name][b].tolist() == pytest.approx(want[name]), name
            assert int(merged["size"][b]) == want["size"]
            size = want["size"]
            for i in range(len(want["parents"])):
                chain, node = set(), i
                while i < size and node >= 0:
                    chain.add(node)
                    node = want["parents"][node]
                assert set(merged["ancestors"][b, i].nonzero().flatten().tolist()) == chain


@needs_triton
@pytest.mark.parametrize("kind,shape,S", [("grown", (0, 1), 6), ("grown", (1, 1), 1), ("grown", (2, 2), 5),
                                          ("grown", (3, 2), 8), ("grown", (4, 4), 17), ("grown", (7, 9), 32),
                                          ("hand", (9, 3), 7), ("hand", (33, 2), 12)])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_the_merge_kernel_equals_its_reference(kind, shape, S, B):
    for seed in range(2):
        args = arguments(*random_case(kind, B, shape, S, seed))
        for name, want, got in zip(FIELD_NAMES, tree_merge_reference(*args), tree_merge_triton(*args)):
            assert torch.equal(want, got), name


def test_merge_suffix_is_one_operator_and_runs_the_backend_asked():
    tree, packed = random_case("grown", 4, (3, 2), 8, seed=0)
    with OperatorCounter() as ops:
        merged = merge_suffix(tree, packed)
    assert ops.operators == {"swiftspec.tree_merge.default": 1}
    with forced("reference"):
        again = tree_merge(*arguments(tree, packed))
    assert all(torch.equal(getattr(merged, name), field) for name, field in zip(FIELD_NAMES, again))
