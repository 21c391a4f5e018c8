"""SwiftSpec's growth on the device (drafters/device_expansion.py): a draft tree expanded best leaves first, re-rooted
on a verdict and expanded on, against the same growth from fresh causal forwards of the draft along every branch (a
tree of Python lists); the expanded nodes' KV against those forwards' KV; no host read."""

import pytest
import torch

from hf_swiftspec.drafters.device_expansion import DraftTree, best_leaves, expand, reroot, unexpanded, unrun
from hf_swiftspec.steps.device_round import path_hashes, select_device
from hf_swiftspec.steps.slot_cache import SlotCache, catch_up
from hf_swiftspec.steps.tree import subtree_mask
from hf_swiftspec.tools.models import tiny_model
from sync_counter import SyncCounter

CAPACITY = 96


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama", seed=3)


class ReferenceTree:
    """One row's tree as lists, grown as SwiftSpec does from fresh causal forwards of `model` over the committed
    tokens and each branch."""

    def __init__(self, model, committed: list[int], root: int, capacity: int):
        self.model, self.committed, self.capacity = model, list(committed), capacity
        self.tokens, self.parents, self.scores, self.expanded = [root], [-1], [0.0], [False]

    def branch(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return out[::-1]

    def logprobs(self, i: int) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([self.committed + self.branch(i)])).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    def expand(self, width: int, children: int, nodes: list[int] | None = None) -> None:
        """The best `width` childless nodes (or `nodes`: those of them not run yet, in order), each given its best
        `children` children, leaf by leaf, while there is room."""
        if nodes is None:
            leaves = sorted((i for i in range(len(self.tokens)) if i not in self.parents),
                            key=lambda i: (-self.scores[i], i))[:width]
        else:
            leaves = [i for i in nodes if not self.expanded[i]]
        for i in leaves:
            best, token = self.logprobs(i).topk(children)
            self.expanded[i] = True
            for score, t in zip(best.tolist(), token.tolist()):
                if len(self.tokens) < self.capacity:
                    self.tokens.append(t)
                    self.parents.append(i)
                    self.scores.append(self.scores[i] + score)
                    self.expanded.append(False)

    def reroot(self, path: list[int], token: int) -> None:
        """The verified path (node ids, the root first) committed; the child of its last node holding `token` the
        new root, its subtree kept in order; else a tree of `token` alone."""
        self.committed += [self.tokens[i] for i in path]
        last = path[-1]
        root = next((i for i in range(len(self.tokens)) if self.parents[i] == last and self.tokens[i] == token), None)

        def below(i: int) -> bool:
            while i >= 0:
                if i == root:
                    return True
                i = self.parents[i]
            return False

        kept = [i for i in range(len(self.tokens)) if root is not None and below(i)]
        if not kept:
            self.tokens, self.parents, self.scores, self.expanded = [token], [-1], [0.0], [False]
            return
        new = {old: j for j, old in enumerate(kept)}
        self.tokens = [self.tokens[i] for i in kept]
        self.parents = [new.get(self.parents[i], -1) if i != root else -1 for i in kept]
        self.scores = [self.scores[i] - self.scores[root] for i in kept]
        self.expanded = [self.expanded[i] for i in kept]


def check(draft_model, cache: SlotCache, grown: DraftTree, refs: list[ReferenceTree]) -> None:
    tree = grown.tree
    for b, ref in enumerate(refs):
        size = len(ref.tokens)
        assert int(tree.size[b]) == size, b
        assert tree.tokens[b, :size].tolist() == ref.tokens, b
        assert tree.parents[b, :size].tolist() == ref.parents, b
        assert grown.expanded[b, :size].tolist() == ref.expanded, b
        assert not grown.expanded[b, size:].any() and (tree.scores[b, size:] == float("-inf")).all()
        torch.testing.assert_close(tree.scores[b, :size], torch.tensor(ref.scores), atol=1e-4, rtol=1e-4)
        mask, depths = subtree_mask(ref.parents, "cpu")
        assert torch.equal(tree.ancestors[b, :size, :size], mask) and torch.equal(tree.depths[b, :size], depths)
        assert torch.equal(tree.hashes[b, :size], path_hashes(tree)[b, :size])
        assert int(grown.prefix_lens[b]) == len(ref.committed)
        for i in range(size):  # every node the draft ran holds the KV of a fresh forward along its branch
            if not ref.expanded[i]:
                continue
            sequence = ref.committed + ref.branch(i)
            with torch.no_grad():
                out = draft_model(input_ids=torch.tensor([sequence]), use_cache=True)
            slot = len(ref.committed) + i
            for layer, mine in zip(out.past_key_values.layers, cache.layers):
                torch.testing.assert_close(mine.keys[b, :, slot], layer.keys[0, :, -1], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(mine.values[b, :, slot], layer.values[0, :, -1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("width,children,capacity", [(2, 2, 24), (3, 2, 14), (1, 3, 9)])
def test_expansions_then_a_reroot_then_more_equal_fresh_causal_forwards(draft, width, children, capacity):
    """Rows of different prompts expand 3 times, then run the unexpanded nodes of a subtree the draft selected (the
    graft), re-root on a verdict (row 0: the root and a child accepted, the target's next token a drafted grandchild;
    row 1: the root alone, then a token the draft never proposed), expand 2 more times: every field, every ran node's
    KV and the committed prefix equal the reference's, with no host read."""
    prompts, roots = [[5, 17, 33, 9, 60], [70, 12, 8]], [11, 40]
    prefix = torch.tensor([len(p) for p in prompts])
    cache = SlotCache(draft.config.num_hidden_layers, CAPACITY)
    with torch.no_grad():
        catch_up(draft, cache, torch.tensor([p + [0] * (5 - len(p)) for p in prompts]), prefix)
    grown = DraftTree.rooted(torch.tensor(roots), prefix, capacity)
    refs = [ReferenceTree(draft, p, r, capacity) for p, r in zip(prompts, roots)]
    with torch.no_grad(), SyncCounter() as reads:
        for _ in range(3):
            grown = expand(draft, cache, grown, width, children)
        sub = select_device(grown.tree, 5)
        grown = expand(draft, cache, grown, width, children, leaves=unexpanded(grown, sub.node_ids, sub.valid))
    assert sum(reads.calls.values()) == 0, reads.calls
    for b, ref in enumerate(refs):
        for _ in range(3):
            ref.expand(width, children)
        ref.expand(width, children, nodes=[n for n, v in zip(sub.node_ids[b].tolist(), sub.valid[b].tolist()) if v])
    check(draft, cache, grown, refs)
    # row 0 keeps the subtree below a grandchild of an expanded child; row 1 takes a new tree
    parents = refs[0].parents
    child = next(i for i in range(1, len(parents)) if parents[i] == 0 and i in parents)
    grandchild = parents.index(child)
    path, count = torch.tensor([[0, child], [0, 0]]), torch.tensor([2, 1])
    token = torch.tensor([refs[0].tokens[grandchild], 97])
    assert not unrun(grown, path, count).any()
    with torch.no_grad(), SyncCounter() as reads:
        grown, found = reroot(cache, grown, path, count, token)
        for _ in range(2):
            grown = expand(draft, cache, grown, width, children)
    assert sum(reads.calls.values()) == 0, reads.calls
    assert found.tolist() == [True, False]
    refs[0].reroot([0, child], int(token[0]))
    refs[1].reroot([0], 97)
    for ref in refs:
        for _ in range(2):
            ref.expand(width, children)
    assert len(refs[1].tokens) > 1 and refs[1].tokens[0] == 97
    check(draft, cache, grown, refs)


def test_a_path_ending_at_a_leaf_the_draft_never_ran_is_named(draft):
    cache = SlotCache(draft.config.num_hidden_layers, CAPACITY)
    prefix = torch.tensor([3])
    with torch.no_grad():
        catch_up(draft, cache, torch.tensor([[4, 5, 6]]), prefix)
        grown = expand(draft, cache, DraftTree.rooted(torch.tensor([9]), prefix, 8), 1, 2)
    # node 1 is a leaf (never expanded); node 0 was
    assert unrun(grown, torch.tensor([[0, 1]]), torch.tensor([2])).tolist() == [True]
    assert unrun(grown, torch.tensor([[0, 1]]), torch.tensor([1])).tolist() == [False]


def test_no_leaf_grows_children_past_its_room(draft):
    """room (B,): a row's leaves at that depth or deeper are not expanded (their children would sit past the models'
    context), the graft's nodes alike; a row with more room grows deeper."""
    cache = SlotCache(draft.config.num_hidden_layers, CAPACITY)
    prefix = torch.tensor([3, 3])
    room = torch.tensor([1, 8])
    with torch.no_grad():
        catch_up(draft, cache, torch.tensor([[4, 5, 6], [7, 8, 9]]), prefix)
        grown = DraftTree.rooted(torch.tensor([9, 10]), prefix, 40)
        for _ in range(5):
            grown = expand(draft, cache, grown, 2, 2, leaves=best_leaves(grown, 2, room))
        sub = select_device(grown.tree, 8)
        again = expand(draft, cache, grown, 2, 2, leaves=unexpanded(grown, sub.node_ids, sub.valid, room))
    depths = [grown.tree.depths[b, : int(grown.tree.size[b])] for b in range(2)]
    assert int(depths[0].max()) == 1 and int(depths[1].max()) > 2
    assert int(again.tree.size[0]) == int(grown.tree.size[0])  # row 0's graft ran nothing: every node at its room
