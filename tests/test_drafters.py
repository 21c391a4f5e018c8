"""The drafters behind one proposing method: Drafters merges every drafter's proposal into one tree per row,
as merging the draft model's best nodes with the suffix proposal directly (tree.merge_suffix) does."""

import torch

from hf_swiftspec.drafters.draft_model import DraftModelDrafter
from hf_swiftspec.drafters.drafting import Drafters
from hf_swiftspec.drafters.suffix import SuffixDrafter, SuffixIndex
from hf_swiftspec.policy.goodput import GoodputPolicy
from hf_swiftspec.steps.tree import Subtree, merge_suffix, select_subtree

# Repeats itself, so the suffix index proposes a branching tree: "1 2 3" went on as "4 5" and as "7 8".
PROMPTS = [[9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 6, 1, 2, 3], [11, 12, 13, 11, 12, 13, 14, 11, 12]]


def reference_suffix(prompt, policy, max_depth=None):
    """The suffix proposal of a fresh index over `prompt` (tokens, parents, calibrated probs, buckets, match)."""
    index = SuffixIndex(max_n=3)
    index.extend(prompt)
    tree = index.propose(policy.max_budget, max_depth)
    probs, buckets = policy.suffix_probs(tree)
    return tree.tokens, tree.parents, probs, buckets, tree.match


def as_tuple(proposal):
    s = proposal.subtree
    return (s.node_ids, s.tokens, s.parents, proposal.probs, proposal.scores, proposal.suffix, proposal.match,
            proposal.offered)


def test_draft_free_proposal_is_the_root_with_the_suffix_proposal():
    policy = GoodputPolicy()
    drafters = Drafters(None, SuffixDrafter(max_n=3, batch_size=2), batch_size=2)
    drafters.start(PROMPTS)
    offers = drafters.offers(policy)
    got = drafters.candidates(policy, offers)
    for prompt, proposal in zip(PROMPTS, got):
        want = merge_suffix(Subtree([0], [prompt[-1]], [-1]), [0.0], [1.0], *reference_suffix(prompt, policy))
        assert len(want.subtree) > 2  # the prompts do repeat: the check is not about empty proposals
        assert as_tuple(proposal) == as_tuple(want)
    # a row the policy does not want a suffix proposal for this round proposes its root alone
    (_, second) = drafters.candidates(policy, drafters.offers(policy, wanted=[True, False]))
    assert as_tuple(second) == as_tuple(merge_suffix(Subtree([0], [PROMPTS[1][-1]], [-1]), [0.0], [1.0], [], [], [], []))


@torch.no_grad()
def test_draft_model_proposal_merges_the_suffix_proposal_into_its_best_nodes(llama_pair):
    _, draft_model, _ = llama_pair
    policy = GoodputPolicy()
    model = DraftModelDrafter(draft_model, capacity=256, tree_capacity=200, width=3, vocab_limit=98, batch_size=2)
    drafters = Drafters(model, SuffixDrafter(max_n=3, batch_size=2), batch_size=2)
    drafters.start(PROMPTS)
    offers = drafters.offers(policy)
    for _ in range(3):
        assert drafters.expand() > 0
        got = drafters.candidates(policy, offers)  # the suffix proposal of the round, the tree as it grew
        for b, (prompt, proposal) in enumerate(zip(PROMPTS, got)):
            subtree, scores = select_subtree(model.trees[b], policy.max_budget)
            want = merge_suffix(subtree, scores, policy.draft_probs(scores), *reference_suffix(prompt, policy))
            assert len(want.subtree) > len(subtree)  # some suffix nodes are the tree's own, not all
            assert as_tuple(proposal) == as_tuple(want)

