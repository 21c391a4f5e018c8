"""Tree masks and the tree cache against independent references: plain causal forwards."""

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from hf_swiftspec.steps.probes import describe
from hf_swiftspec.steps.cache import TreeCache, keep_order
from hf_swiftspec.drafters.draft_model import DraftModelDrafter
from hf_swiftspec.engine.workers import TargetWorker
from hf_swiftspec.steps.step import RowQueries, model_step, run_step
from hf_swiftspec.steps.tree import Subtree, select_subtree, subtree_mask
from hf_swiftspec.tools.models import left_padded
from hf_swiftspec.steps.verify import Sampler, Verified

ATOL = 2e-5


def causal_logits(model, ids):
    """Logits (L, V) of a fresh forward over ids (list of ints), no cache."""
    return model(torch.tensor([ids])).logits[0].float()


def random_parents(n, gen, shape):
    if shape == "chain":
        return [-1] + list(range(n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def path_to(parents, tokens, i):
    path = []
    while i >= 0:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def tree_queries(cache, row, tokens, parents):
    """Row `row`'s queries for a subtree hanging after its committed tokens."""
    mask, depths = subtree_mask(parents, "cpu")
    positions = cache.prefix_lens[row] - cache.starts[row] + depths
    return RowQueries(torch.tensor(tokens), positions, mask, positions)


def tree_forward(model, cache, tokens, parents):
    """Logits (T, V) of a single sequence's subtree."""
    return run_step(model, cache, [tree_queries(cache, 0, tokens, parents)], "sdpa", describe(model))[0]


def path_nodes(parents, node):
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]


@pytest.mark.parametrize("shape", ["chain", "star", "random"])
@pytest.mark.parametrize("prefix_len", [0, 1, 9])
def test_tree_masked_logits_equal_per_branch_causal_logits(llama_pair, shape, prefix_len):
    target = llama_pair[0]
    gen = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(3, 98, (prefix_len,), generator=gen).tolist()
    tokens = torch.randint(3, 98, (13,), generator=gen).tolist()
    parents = random_parents(13, gen, shape)
    cache = TreeCache(target.config.num_hidden_layers, 64)
    if prefix:
        model_step(target, cache, torch.tensor([prefix]), torch.arange(prefix_len)[None], keep=1)
        cache.seal_prefix()
    logits = tree_forward(target, cache, tokens, parents)
    for i in range(13):
        expected = causal_logits(target, prefix + path_to(parents, tokens, i))[-1]
        torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)


def test_chain_tree_equals_causal_decoding(llama_pair):
    target = llama_pair[0]
    ids = torch.randint(3, 98, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = TreeCache(target.config.num_hidden_layers, 64)
    model_step(target, cache, torch.tensor([ids[:8]]), torch.arange(8)[None], keep=1)
    cache.seal_prefix()
    logits = tree_forward(target, cache, ids[8:], [-1] + list(range(11)))
    torch.testing.assert_close(logits, causal_logits(target, ids)[8:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_commit_then_next_step_equals_fresh_forward(llama_pair, seed):
    target = llama_pair[0]
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 98, (6,), generator=gen).tolist()
    cache = TreeCache(target.config.num_hidden_layers, 64)
    model_step(target, cache, torch.tensor([prefix]), torch.arange(6)[None], keep=1)
    cache.seal_prefix()
    committed = list(prefix)
    for _ in range(3):  # several rounds: commits stack up behind the prefix
        tokens = torch.randint(3, 98, (10,), generator=gen).tolist()
        parents = random_parents(10, gen, "random")
        tree_forward(target, cache, tokens, parents)
        node = int(torch.randint(0, 10, (1,), generator=gen))
        path_nodes = []
        while node >= 0:
            path_nodes.append(node)
            node = parents[node]
        path_nodes.reverse()
        cache.commit(torch.tensor(path_nodes))
        committed += [tokens[i] for i in path_nodes]
        assert cache.prefix_len == cache.length == len(committed)
    nxt = [5, 6, 7]
    logits = tree_forward(target, cache, nxt, [-1, 0, 1])
    torch.testing.assert_close(logits, causal_logits(target, committed + nxt)[-3:], atol=ATOL, rtol=0)


def test_draft_keeps_surviving_kv_across_reroots(llama_pair):
    """Every draft expansion, before and after re-roots, matches a fresh causal forward."""
    target, draft_model, _ = llama_pair
    prompt = torch.randint(3, 98, (1, 9), generator=torch.Generator().manual_seed(3))
    target_w = TargetWorker(target, capacity=128)
    draft = DraftModelDrafter(draft_model, capacity=512, tree_capacity=400, width=4, vocab_limit=98)
    target_w.prefill(prompt)
    draft.start(prompt.tolist())
    sampler = Sampler(LogitsProcessorList(), do_sample=False)
    hits = 0
    for _ in range(8):
        for _ in range(3):
            tree = draft.tree
            before = tree.size
            assert draft.expand() > 0
            new = torch.arange(before, tree.size)
            leaves = tree.parents[new].unique()
            committed = target_w.sequence[0, :-1].tolist()
            for leaf in leaves.tolist():
                path = []
                node = leaf
                while node >= 0:
                    path.append(int(tree.tokens[node]))
                    node = int(tree.parents[node])
                fresh = torch.log_softmax(causal_logits(draft_model, committed + path[::-1])[-1], -1)
                children = new[tree.parents[new] == leaf]
                got = tree.scores[children] - tree.scores[leaf]
                torch.testing.assert_close(got, fresh[tree.tokens[children]], atol=ATOL, rtol=0)
        subtree = select_subtree(draft.tree, 8)[0]
        verified = target_w.verify([subtree], [sampler], [StoppingCriteriaList()], [100])
        sequence = target_w.sequence
        hits += draft.accept([subtree], verified)
        assert draft.cache.prefix_len == target_w.cache.prefix_len == sequence.shape[1] - 1 - len(draft.pending[0])
    assert hits > 0  # the surviving-subtree path was exercised


def node_path(tree, node):
    """Tokens from the tree's root down to `node`."""
    path = []
    while node >= 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]


def test_grafted_nodes_run_as_per_branch_causal_forwards(llama_pair):
    """graft (asynchronous engines): a sent subtree's nodes that only another drafter proposed (node id -1) join
    the draft tree and run with its unrun nodes in one forward. Against fresh causal forwards: each run node's
    children are the draft's best tokens but the grafted one, with its log-probs; a grafted node under a run
    node scores its log-prob; no token sits twice under one parent; a verdict down the grafted chain re-roots
    on it (a hit) and the next expansion still matches."""
    _, draft_model, _ = llama_pair
    draft = DraftModelDrafter(draft_model, capacity=512, tree_capacity=400, width=2, vocab_limit=98)
    draft.start([[5, 6, 7, 8, 9]])
    draft.expand()
    draft.expand()
    tree = draft.tree
    sub, _ = select_subtree(tree, 4)
    expanded_before = tree.expanded[: tree.size].clone()
    taken = set(tree.tokens[: tree.size].tolist())
    chain = [next(t for t in range(3, 98) if t not in taken)]  # a suffix chain under the root, not a draft child,
    for _ in range(2):  # then the draft's own best tokens: the forward's children must leave them out
        chain.append(int(causal_logits(draft_model, draft.committed[0] + chain)[-1][:98].argmax()))
    n, before = len(sub), tree.size
    subtree = Subtree(sub.node_ids + [-1] * 3, sub.tokens + chain, sub.parents + [0, n, n + 1])
    assert draft.graft(0, subtree) == 1
    ids = draft.grafted[0]
    assert ids == sub.node_ids + [before, before + 1, before + 2] and bool(tree.expanded[torch.tensor(ids)].all())
    ran = [node for node in ids if node >= before or not expanded_before[node]]
    prefix = draft.committed[0][:-1]
    for node in ran:
        fresh = torch.log_softmax(causal_logits(draft_model, prefix + node_path(tree, node))[-1][:98], -1)
        children = (tree.parents[: tree.size] == node).nonzero().flatten()
        tokens = tree.tokens[children].tolist()
        assert len(tokens) == len(set(tokens))
        grafted = [c for c in children.tolist() if before <= c < before + 3]
        own = [c for c in children.tolist() if c not in grafted]
        skip = fresh.clone()
        skip[tree.tokens[grafted]] = float("-inf")
        assert sorted(tree.tokens[own].tolist()) == sorted(skip.topk(2).indices.tolist())
        for child in children:
            got = tree.scores[child] - tree.scores[node]
            torch.testing.assert_close(got, fresh[tree.tokens[child]], atol=ATOL, rtol=0)
    last = before + 2
    bonus = int(tree.tokens[(tree.parents[: tree.size] == last).nonzero()[0, 0]])
    hits = draft.accept([subtree], [Verified(tokens=chain + [bonus], path=[0, n, n + 1, n + 2])])
    assert hits == 1 and draft.committed[0][-5:] == [9] + chain + [bonus]
    assert draft.cache.prefix_len == len(draft.committed[0]) - 1 and draft.grafted[0] is None
    before = tree.size
    assert draft.expand() > 0
    for leaf in tree.parents[before : tree.size].unique().tolist():
        fresh = torch.log_softmax(causal_logits(draft_model, draft.committed[0][:-1] + node_path(tree, leaf))[-1], -1)
        children = torch.arange(before, tree.size)[tree.parents[before : tree.size] == leaf]
        torch.testing.assert_close(tree.scores[children] - tree.scores[leaf], fresh[tree.tokens[children]], atol=ATOL, rtol=0)


def test_a_deferred_reroot_chooses_and_keeps_what_a_reroot_does(llama_pair):
    """accept(defer=True) (asynchronous engines): the next subtree is chosen below the new root where it stands
    and sent before the re-root; it equals the subtree an immediate re-root gives, and after settle() the trees,
    the cache's committed KV and the next expansion (against a fresh causal forward) are the same too."""
    target, draft_model, _ = llama_pair
    prompt = torch.randint(3, 98, (1, 9), generator=torch.Generator().manual_seed(2))
    target_w = TargetWorker(target, capacity=256)
    now, later = (DraftModelDrafter(draft_model, capacity=512, tree_capacity=400, width=3, vocab_limit=98) for _ in "ab")
    target_w.prefill(prompt)
    for draft in (now, later):
        draft.start(prompt.tolist())
        for _ in range(3):
            draft.expand()
    sampler, deferred = Sampler(LogitsProcessorList(), do_sample=False), 0
    subtree = select_subtree(now.tree, 8)[0]
    for _ in range(10):
        verified = target_w.verify([subtree], [sampler], [StoppingCriteriaList()], [100])
        hits = now.accept([subtree], verified)
        assert later.accept([subtree], verified, defer=True) == hits
        deferred += later.unsettled is not None
        chosen = select_subtree(now.tree, 8)
        early, scores = select_subtree(later.tree, 8, later.new_roots[0])  # node ids of the tree before its re-root
        assert (early.tokens, early.parents) == (chosen[0].tokens, chosen[0].parents)
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(chosen[1]), atol=1e-6, rtol=0)
        (sent,) = later.settle([early])
        assert sent.tokens == chosen[0].tokens and sent.parents == chosen[0].parents
        assert sent.node_ids == chosen[0].node_ids  # renumbered for the re-rooted tree
        size = now.tree.size
        assert later.tree.size == size and later.tree.tokens[:size].tolist() == now.tree.tokens[:size].tolist()
        assert later.cache.prefix_len == now.cache.prefix_len and later.pending == now.pending
        length = now.cache.length
        for got, want in zip(later.cache.buffers, now.cache.buffers):
            torch.testing.assert_close(got.data[..., :length, :], want.data[..., :length, :], atol=0, rtol=0)
        subtree = chosen[0]
        for draft in (now, later):
            for _ in range(4):
                draft.expand()
    assert deferred >= 3  # re-roots really waited
    leaf = int(later.tree.parents[later.tree.size - 1])
    fresh = torch.log_softmax(causal_logits(draft_model, later.committed[0][:-1] + node_path(later.tree, leaf))[-1], -1)
    children = (later.tree.parents[: later.tree.size] == leaf).nonzero().flatten()
    torch.testing.assert_close(later.tree.scores[children] - later.tree.scores[leaf], fresh[later.tree.tokens[children]],
                               atol=ATOL, rtol=0)


def node_ids_to(tree, node):
    """Node ids from the tree's root down to `node`."""
    path = [node]
    while path[0] > 0:
        path.insert(0, int(tree.parents[path[0]]))
    return path


def grown_drafter(llama_pair):
    """A drafter that expanded its tree three times (width 3) from a 4-token prompt."""
    _, draft_model, _ = llama_pair
    draft = DraftModelDrafter(draft_model, capacity=512, tree_capacity=400, width=3, vocab_limit=98)
    draft.start([[5, 6, 7, 8]])
    for _ in range(3):
        draft.expand()
    return draft


def test_a_hit_on_an_unrun_leaf_resets_the_tree_as_a_reroot_would(llama_pair):
    """A new root that is an unexpanded leaf keeps only itself: reroot_row resets the tree instead (cheaper, on
    the asynchronous draft's critical path), which leaves every live field as reroot() leaves it, and the
    re-root still counts as a hit; path_facts says whether the child it finds has run."""
    import dataclasses

    from hf_swiftspec.steps.tree import path_facts, reroot

    draft = grown_drafter(llama_pair)
    tree = draft.tree
    leaf = int((~tree.expanded[: tree.size]).nonzero()[-1, 0])
    parent, token = int(tree.parents[leaf]), int(tree.tokens[leaf])
    facts = path_facts(tree, node_ids_to(tree, parent), token)
    assert (facts.child, facts.child_ran) == (leaf, False)
    grown = int(tree.expanded[1 : tree.size].nonzero()[0, 0]) + 1
    facts = path_facts(tree, node_ids_to(tree, int(tree.parents[grown])), int(tree.tokens[grown]))
    assert (facts.child, facts.child_ran) == (grown, True)
    expected = dataclasses.replace(tree, **{f.name: getattr(tree, f.name).detach().clone()
                                            for f in dataclasses.fields(tree) if isinstance(getattr(tree, f.name), torch.Tensor)})
    reroot(expected, leaf)
    path = node_path(tree, leaf)[1:]  # the tokens below the root, the leaf's last
    local = {node: i for i, node in enumerate(n for n in range(tree.size) if tree.ancestors[leaf, n])}
    subtree = Subtree(sorted(local), [int(tree.tokens[n]) for n in sorted(local)],
                      [local.get(int(tree.parents[n]), -1) for n in sorted(local)])
    hits = draft.accept([subtree], [Verified(tokens=path, path=list(range(len(path))))])
    assert hits == 1 and tree.size == expected.size == 1 and tree.num_slots == expected.num_slots == 0
    for name in ("tokens", "parents", "depths", "scores", "expanded", "kv_slot"):
        assert getattr(tree, name)[:1].tolist() == getattr(expected, name)[:1].tolist(), name
    assert tree.root_token == token and draft.committed[0][-1] == token


def test_path_facts_read_the_tree_as_node_by_node_lookups_do(llama_pair):
    """path_facts (one host read, on the asynchronous draft's critical path) against per-node tensor lookups: how
    many of a path's first nodes ran and their KV slots, and the next token's child, for every node's path in a
    grown tree, with the child's token, another token, and paths that leave the tree (-1) or its run part."""
    from hf_swiftspec.steps.tree import path_facts

    draft = grown_drafter(llama_pair)
    tree = draft.tree
    children = {}
    for node in range(1, tree.size):
        children.setdefault(int(tree.parents[node]), []).append(node)
    checked = set()
    for node in range(tree.size):
        path = node_ids_to(tree, node)
        for tail in ([], [-1]):
            for token in [int(tree.tokens[c]) for c in children.get(node, [])[:2]] + [97]:
                full = path + tail
                ran = next((j for j, n in enumerate(full) if n < 0 or not bool(tree.expanded[n])), len(full))
                child = None if ran < len(full) else next(
                    (c for c in children.get(full[-1], []) if int(tree.tokens[c]) == token), None)
                expected = (ran, [int(tree.kv_slot[n]) for n in full[:ran]], child,
                            child is not None and bool(tree.expanded[child]))
                facts = path_facts(tree, full, token)
                assert (facts.ran, facts.slots, facts.child, facts.child_ran) == expected, (full, token)
                checked.add((ran == len(full), child is not None, expected[3]))
    assert checked >= {(True, True, True), (True, True, False), (True, False, False), (False, False, False)}, checked


def test_subtree_mask_is_ancestor_or_self():
    mask, depths = subtree_mask([-1, 0, 0, 1, 3, 2], "cpu")
    assert depths.tolist() == [0, 1, 1, 2, 3, 2]
    assert mask[4].tolist() == [True, True, False, True, True, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]


def test_subtree_from_select_is_connected(llama_pair):
    _, draft_model, _ = llama_pair
    draft = DraftModelDrafter(draft_model, capacity=256, tree_capacity=300, width=8, vocab_limit=98)
    draft.start([[5, 6, 7]])
    for _ in range(4):
        draft.expand()
    tree = draft.tree
    for budget in (2, 8, 16, 33):
        sub: Subtree = select_subtree(tree, budget)[0]
        assert len(sub) == budget and sub.parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(sub.parents) if i)
        chosen = tree.scores[torch.tensor(sub.node_ids)]
        rest = torch.ones(tree.size, dtype=torch.bool)
        rest[torch.tensor(sub.node_ids)] = False
        assert chosen.min() >= tree.scores[: tree.size][rest].max()  # the best nodes by score


@pytest.mark.parametrize("size", [1, 2, 33, 62, 63, 130])
def test_subtree_mask_matches_walking_up_the_parents(size):
    gen = torch.Generator().manual_seed(size)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    mask, depths = subtree_mask(parents, "cpu")
    for i in range(size):
        ancestors, node = set(), i
        while node >= 0:
            ancestors.add(node)
            node = parents[node]
        assert set(mask[i].nonzero().flatten().tolist()) == ancestors
        assert depths[i] == len(ancestors) - 1


@pytest.mark.parametrize("seed", range(3))
def test_ragged_rows_equal_per_branch_causal_forwards_round_after_round(llama_pair, seed):
    """Rows of different lengths in one cache: every round a tree of a different size per row (a row
    may sit a round out), commits of different paths, a row dropped midway; each row's logits equal
    fresh causal forwards of that row alone. Rows then write at different offsets (the scatter path)."""
    target = llama_pair[0]
    gen = torch.Generator().manual_seed(seed)
    committed = [torch.randint(3, 98, (n,), generator=gen).tolist() for n in (3, 11, 6)]
    ids, mask = left_padded(committed)
    cache = TreeCache(target.config.num_hidden_layers, 96, batch_size=3)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model_step(target, cache, ids, positions, attention_mask=mask, keep=1)
    cache.starts = (ids.shape[1] - mask.sum(-1)).tolist()
    cache.seal_prefix()
    for round_ in range(5):
        trees = []
        for b in range(len(committed)):
            n = int(torch.randint(0, 9, (1,), generator=gen))  # 0: the row sits the round out
            tokens = torch.randint(3, 98, (n,), generator=gen).tolist()
            trees.append((tokens, random_parents(n, gen, "random") if n else []))
        rows = [tree_queries(cache, b, t, p) if t else RowQueries.none("cpu") for b, (t, p) in enumerate(trees)]
        logits = run_step(target, cache, rows, "sdpa", describe(target))
        paths = []
        for b, (tokens, parents) in enumerate(trees):
            for i in range(len(tokens)):
                expected = causal_logits(target, committed[b] + [tokens[j] for j in path_nodes(parents, i)])[-1]
                torch.testing.assert_close(logits[b][i], expected, atol=ATOL, rtol=0)
            if not tokens:
                paths.append(None)
                continue
            accepted = path_nodes(parents, int(torch.randint(0, len(tokens), (1,), generator=gen)))
            committed[b] += [tokens[j] for j in accepted]
            paths.append(torch.tensor(accepted))
        cache.commit_rows(paths)
        assert [p - s for p, s in zip(cache.prefix_lens, cache.starts)] == [len(c) for c in committed]
        if round_ == 2:  # the first row finishes: the last one takes its place, the others go on
            order = keep_order([1, 2])
            assert order == [2, 1]
            cache.keep_rows(order)
            committed = [committed[b] for b in order]


def test_batched_target_verify_matches_one_row_at_a_time(llama_pair):
    """TargetWorker over a left-padded batch: the same walks and committed sequences as each prompt alone."""
    target = llama_pair[0]
    prompts = [[5, 9, 12], [7, 7, 3, 44, 60, 2, 19], [33]]
    ids, mask = left_padded(prompts)
    batch = TargetWorker(target, capacity=64, batch_size=3)
    batch.prefill(ids, attention_mask=mask)
    alone = [TargetWorker(target, capacity=64) for _ in prompts]
    for worker, prompt in zip(alone, prompts):
        worker.prefill(torch.tensor([prompt]))
    sampler, none = Sampler(LogitsProcessorList(), do_sample=False), StoppingCriteriaList()
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        subtrees = []
        for _ in prompts:
            n = int(torch.randint(1, 7, (1,), generator=gen))
            parents = random_parents(n, gen, "random")
            subtrees.append(Subtree(list(range(n)), torch.randint(3, 98, (n,), generator=gen).tolist(), parents))
        got = batch.verify(subtrees, [sampler] * 3, [none] * 3, [50] * 3)
        for b, worker in enumerate(alone):
            (expected,) = worker.verify([subtrees[b]], [sampler], [none], [50])
            assert (got[b].tokens, got[b].path) == (expected.tokens, expected.path)
    for b, worker in enumerate(alone):  # the batch's rows start with their padded prompt
        assert batch.sequences[b][0, ids.shape[1] :].tolist() == worker.sequence[0, len(prompts[b]) :].tolist()


def test_keep_order_fills_holes_from_the_end():
    assert keep_order([0, 1, 2, 3]) == [0, 1, 2, 3]
    assert keep_order([1, 2, 3]) == [3, 1, 2]  # row 0 left: row 3 moves into it, rows 1 and 2 stay
    assert keep_order([0, 2, 5, 6]) == [0, 6, 2, 5]
    assert keep_order([]) == []


def test_a_replayed_step_sets_the_cache_only_through_its_methods():
    """What capture.py's runner reads and sets of a TreeCache (its host bookkeeping, the slots a step writes)
    goes through TreeCache's methods: saved and put back whole, and slots that do not fit the planned step
    are refused, naming the fix."""
    cache = TreeCache(num_layers=1, capacity=32, batch_size=2)
    cache.lengths, cache.starts, cache.prefix_lens = [5, 3], [0, 2], [4, 2]
    cache.plan_step([2, 1], 2, "cpu")
    saved = cache.host_state()
    assert saved == ([0, 2], [4, 2], [5, 3], [2, 1])
    cache.advance()  # the step ran: lengths move, the plan is gone
    assert cache.host_state() == ([0, 2], [4, 2], [7, 4], None)
    cache.set_host_state(saved)
    assert cache.host_state() == saved and cache.step_end(2) == 7  # the planned step's furthest row: 5 + 2
    assert cache.step_slots() is None  # no buffers yet: the rows write without an index
    with pytest.raises(RuntimeError, match=r"plan_step\(fixed=True\) first"):
        cache.write_through(torch.zeros(2, 2, dtype=torch.long))
