"""The round's device-side selection and commit (steps/device_round.py) against the host round's code
(tree.best_node_ids / select_subtree / subtree_mask, cache.TreeCache.commit_rows), and the one walk every round runs
(steps/acceptance.py's walk_subtree) against a plain walk written here, on random trees and caches, and a composed
round's host reads."""

import random

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from hf_swiftspec.steps.cache import TreeCache, move_positions
from hf_swiftspec.steps.acceptance import greedy_choices, round_result, sampled_choices, walk_subtree
from hf_swiftspec.steps.device_round import commit_plan, plain_subtree, select_device, stack_trees
from hf_swiftspec.steps.tree import (
    add_children, best_node_ids, new_tree, reroot, select_leaves, select_subtree, subtree_mask,
)
from hf_swiftspec.steps.verify import Sampler, Verified, apply_processors, verify_tree
from sync_counter import SyncCounter

V = 50


def random_tree(rng: random.Random, capacity: int = 40, coarse: bool = False):
    """A tree grown as the draft grows one (best leaves first, k children each), with random log-probs;
    `coarse` rounds them to halves so scores tie; some trees are re-rooted below their root."""
    tree = new_tree(rng.randrange(V), capacity, "cpu")
    for _ in range(rng.randint(1, 5)):
        width, k = rng.randint(1, 3), rng.randint(1, 3)
        if tree.size + width * k > capacity:
            break
        leaves = select_leaves(tree, width)
        if leaves.numel() == 0:
            break
        w = leaves.shape[0]
        logprobs = -torch.rand(w, k, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 3
        if coarse:
            logprobs = (logprobs * 2).round() / 2
        tokens = torch.tensor([[rng.randrange(V) for _ in range(k)] for _ in range(w)])
        tokens[:, -1] = tokens[:, 0] if k > 1 and rng.random() < 0.3 else tokens[:, -1]  # duplicate siblings
        add_children(tree, leaves, logprobs.sort(dim=1, descending=True).values, tokens)
    if tree.size > 3 and rng.random() < 0.3:
        reroot(tree, rng.randrange(1, 3))
        tree.root_token = int(tree.tokens[0])  # as the round's re-root sets it (select_subtree reads it)
    return tree


def host_subtrees(trees, budget):
    return [select_subtree(tree, budget)[0] for tree in trees]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 5, 8, 13])
def test_selection_equals_the_host_subtree(seed, budget):
    """Node ids, parents re-indexed, tokens and scores equal best_node_ids / select_subtree row by row (ties
    included: coarse scores), and the mask and depths equal subtree_mask's; padding past a small tree is
    invalid, sees itself alone and has no parent."""
    rng = random.Random(seed)
    trees = [random_tree(rng, coarse=seed % 2 == 0) for _ in range(5)]
    sub = select_device(stack_trees(trees), budget)
    for b, tree in enumerate(trees):
        node_ids, parents = best_node_ids(tree, budget)
        host, scores = select_subtree(tree, budget)
        n = len(host)
        assert sub.valid[b].tolist() == [True] * n + [False] * (budget - n)
        assert sub.node_ids[b, :n].tolist() == node_ids.tolist() == host.node_ids
        assert sub.parents[b, :n].tolist() == parents.tolist() == host.parents
        assert sub.tokens[b, :n].tolist() == host.tokens
        torch.testing.assert_close(sub.scores[b, :n].double(), torch.tensor(scores, dtype=torch.float64))
        mask, depths = subtree_mask(host.parents, "cpu")
        assert torch.equal(sub.mask[b, :n, :n], mask)
        assert torch.equal(sub.depths[b, :n], depths)
        assert torch.equal(sub.mask[b, n:, n:], torch.eye(budget - n, dtype=torch.bool))
        assert not sub.mask[b, :n, n:].any() and not sub.mask[b, n:, :n].any()
        assert (sub.parents[b, n:] == -1).all()


def leaning_choices(rng: random.Random, sub, budget: int) -> torch.Tensor:
    """Target choices (B, T) that mostly pick a child's token (so walks go deep), else a random token."""
    B = sub.tokens.shape[0]
    choices = torch.zeros(B, budget, dtype=torch.long)
    for b in range(B):
        for i in range(budget):
            children = [j for j in range(budget) if sub.parents[b, j] == i and sub.valid[b, j]]
            choices[b, i] = sub.tokens[b, rng.choice(children)] if children and rng.random() < 0.8 else rng.randrange(V)
    return choices


def host_walk(choices_row: list[int], subtree, max_tokens: int, eos: set[int]) -> Verified:
    """The walk as its definition says, on host lists: from the root, emit the target's choice after the node and move
    to the first child carrying it, while there is one and tokens are left; stop after an EOS token."""
    out, node = Verified(), 0
    while node is not None and len(out.tokens) < max_tokens:
        out.path.append(node)
        out.tokens.append(choices_row[node])
        if choices_row[node] in eos:
            out.finished = True
            break
        node = next((i for i, (p, t) in enumerate(zip(subtree.parents, subtree.tokens))
                     if p == node and t == choices_row[node]), None)
    out.finished = out.finished or len(out.tokens) >= max_tokens
    return out


def test_the_plain_subtree_is_the_selection_of_the_roots_alone():
    """A plain round's subtree, made without a selection, is what select_device picks from a root-only tree with a
    budget of 1: every field, dead rows (root 0) too."""
    from dataclasses import fields

    from hf_swiftspec.drafters.device_suffix import root_tree

    roots = torch.tensor([5, 0, 17, 3])
    made, picked = plain_subtree(roots), select_device(root_tree(roots), 1)
    for f in fields(made):
        got, want = getattr(made, f.name), getattr(picked, f.name)
        assert got.dtype == want.dtype and torch.equal(got, want), f.name


@pytest.mark.parametrize("seed", range(8))
def test_greedy_walk_equals_the_host_walk(seed):
    """The accepted path, tokens, count and finished flag equal the plain walk's, with max_tokens limits (0 included)
    and EOS stops (an EOS id drawn from the walk's own tokens, so it fires)."""
    rng = random.Random(100 + seed)
    budget = rng.choice([4, 8, 12])
    trees = [random_tree(rng) for _ in range(6)]
    sub = select_device(stack_trees(trees), budget)
    choices = leaning_choices(rng, sub, budget)
    hosts = host_subtrees(trees, budget)
    unlimited = [budget + 5] * len(trees)
    max_tokens = [rng.choice([0, 1, 2, 3, budget + 5]) for _ in trees]
    free = [host_walk(choices[b].tolist(), hosts[b], budget + 5, set()) for b in range(len(trees))]
    pool = [t for out in free for t in out.tokens[1:]] or [0]
    eos = {rng.choice(pool), V + 7}
    for stop, limits in ((set(), unlimited), (set(), max_tokens), (eos, max_tokens), (eos, unlimited)):
        walk = walk_subtree(choices, sub, torch.tensor(limits), torch.tensor(sorted(stop)) if stop else None)
        for b in range(len(trees)):
            out = host_walk(choices[b].tolist(), hosts[b], limits[b], stop)
            n = len(out.tokens)
            assert walk.count[b] == n
            assert walk.path[b, :n].tolist() == out.path and walk.tokens[b, :n].tolist() == out.tokens
            assert (walk.path[b, n:] == -1).all() and (walk.tokens[b, n:] == -1).all()
            assert bool(walk.finished[b]) == out.finished, (b, stop, out)
    deepest = max(len(out.tokens) for out in free)
    assert deepest >= 2  # a walk went past the root


@pytest.mark.parametrize("seed", range(4))
def test_sampled_walk_equals_verify_under_a_seed(seed):
    """Sampling by the round's exact rule: per row, Sampler's processors, then Gumbel-max with the noise of
    the row's own (seed, row, position) streams; the device walk over sampled_choices emits verify_tree's
    tokens for every row (its sampled walk, walk_rows), and they differ from the greedy walk somewhere."""
    rng = random.Random(200 + seed)
    budget, B = 8, 4
    trees = [random_tree(rng) for _ in range(B)]
    sub = select_device(stack_trees(trees), budget)
    hosts = host_subtrees(trees, budget)
    logits = torch.randn(B, budget, V, generator=torch.Generator().manual_seed(seed)) * 2
    for b in range(B):  # lean the target towards the tree so sampled walks go deep
        for j in range(budget):
            if sub.valid[b, j] and sub.parents[b, j] >= 0:
                logits[b, sub.parents[b, j], sub.tokens[b, j]] += 4
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.3), TopKLogitsWarper(12)])
    samplers = Sampler(processors, True, torch.Generator().manual_seed(seed)).for_rows(B)
    contexts = [torch.randint(0, V, (1, rng.randint(3, 9))) for _ in range(B)]
    max_tokens = torch.tensor([budget + 1, 2, budget + 1, budget + 1])
    scores = torch.stack([apply_processors(s.logits_processor, c, logits[b].clone())
                          for b, (s, c) in enumerate(zip(samplers, contexts))])
    noise = torch.stack([s.gumbel([c.shape[1] + d for d in range(budget)], V, torch.device("cpu"))
                         for s, c in zip(samplers, contexts)])
    walk = walk_subtree(sampled_choices(scores, noise, sub.depths), sub, max_tokens)
    greedy = walk_subtree(greedy_choices(scores), sub, max_tokens)
    for b in range(B):
        n = len(hosts[b])
        out = verify_tree(logits[b, :n], hosts[b], contexts[b], samplers[b], StoppingCriteriaList(), int(max_tokens[b]))
        assert walk.tokens[b, : walk.count[b]].tolist() == out.tokens
        assert walk.path[b, : walk.count[b]].tolist() == out.path
    assert not torch.equal(walk.tokens, greedy.tokens)


def filled_cache(rng: random.Random, B: int, layers: int = 2, capacity: int = 32):
    """A TreeCache with random KV in every slot and per-row prefix / tree-region lengths."""
    cache = TreeCache(layers, capacity, batch_size=B)
    H, D = 2, 3
    for layer in cache.layers:
        layer.update(torch.randn(B, H, capacity - 1, D), torch.randn(B, H, capacity - 1, D))
    cache.advance(capacity - 1)
    regions = [rng.randint(1, 10) for _ in range(B)]
    cache.prefix_lens = [rng.randint(1, capacity - 12) for _ in range(B)]
    cache.lengths = [p + r for p, r in zip(cache.prefix_lens, regions)]
    return cache, regions


@pytest.mark.parametrize("seed", range(6))
def test_commit_equals_commit_rows(seed):
    """commit_plan's moves are every move TreeCache.commit_rows makes (paths then kept slots, per row, rows
    of different prefixes; padding ignored) and leaves the same prefix lengths and lengths."""
    rng = random.Random(300 + seed)
    B, M, K = 4, 6, 5
    cache, regions = filled_cache(rng, B)
    data = cache.buffers[0].data.clone()
    paths, keeps = [], []
    for r in regions:
        slots = rng.sample(range(r), r)
        m = rng.randint(1, min(r, M))
        path = sorted(slots[:m]) if rng.random() < 0.5 else slots[:m]
        rest = slots[m:][: rng.randint(0, min(K, r - m))]
        paths.append(path)
        keeps.append(sorted(rest))
    pad = lambda rows, width: torch.tensor([row + [rng.randrange(30)] * (width - len(row)) for row in rows])
    src, dst, prefixes, lengths = commit_plan(
        torch.tensor(cache.prefix_lens), pad(paths, M), torch.tensor([len(p) for p in paths]), pad(keeps, K),
        torch.tensor([len(k) for k in keeps]), cache.scratch,
    )
    move_positions(data, cache.buffers[0].dim, src, dst)
    cache.commit_rows([torch.tensor(p) for p in paths], [torch.tensor(k, dtype=torch.long) for k in keeps])
    assert prefixes.tolist() == cache.prefix_lens and lengths.tolist() == cache.lengths
    scratch = cache.scratch
    assert torch.equal(data.narrow(3, 0, scratch), cache.buffers[0].data.narrow(3, 0, scratch))


def test_a_composed_round_reads_the_device_once():
    """Selection -> the target's choices from given logits -> walk -> commit for 4 rows reads nothing from
    the device; the host's one read is round_result (counts, finished flags and tokens), and it equals the
    host round's walk, with the target cache's committed slots as commit_rows leaves them."""
    rng = random.Random(7)
    B, budget = 4, 8
    trees = [random_tree(rng) for _ in range(B)]
    cache, _ = filled_cache(rng, B, capacity=40)
    cache.lengths = [p + budget for p in cache.prefix_lens]  # the verification wrote T slots a row
    hosts = host_subtrees(trees, budget)
    device_tree = stack_trees(trees)
    sub0 = select_device(device_tree, budget)
    logits = torch.randn(B, budget, V) + 6 * torch.nn.functional.one_hot(
        leaning_choices(rng, sub0, budget), V)  # the target agrees often
    data = cache.buffers[0].data.clone()
    prefix_lens, max_tokens = torch.tensor(cache.prefix_lens), torch.tensor([budget + 1] * B)
    with SyncCounter() as inside:
        sub = select_device(device_tree, budget)
        walk = walk_subtree(greedy_choices(logits), sub, max_tokens, torch.tensor([2]))
        src, dst, _, _ = commit_plan(prefix_lens, walk.path.clamp(min=0), walk.count, None, None, cache.scratch)
        move_positions(data, cache.buffers[0].dim, src, dst)
        result = round_result(walk)
    assert sum(inside.calls.values()) == 0, inside.calls
    with SyncCounter() as read:
        rows = result.tolist()
    assert sum(read.calls.values()) == 1
    paths = []
    for b in range(B):
        out = host_walk(logits[b].argmax(-1).tolist(), hosts[b], budget + 1, {2})
        count, finished, tokens = rows[b][0], rows[b][1], rows[b][2:]
        assert (count, bool(finished), tokens[:count]) == (len(out.tokens), out.finished, out.tokens)
        paths.append(torch.tensor(out.path))
    assert max(row[0] for row in rows) >= 2
    cache.commit_rows(paths)
    assert torch.equal(data.narrow(3, 0, cache.scratch), cache.buffers[0].data.narrow(3, 0, cache.scratch))
