"""Suffix proposals: the index against a brute-force count, the bounded history of earlier outputs,
and lossless decoding (greedy and sampled) with suffix trees merged into the draft's."""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.drafters.suffix import MAX_MATCH, OutputHistory, SuffixIndex, continuation
from hf_swiftspec.tools.models import tiny_model, truncated_draft

from test_sampling import exact_joint, pooled_chisquare, warpers


def brute_force(tokens, docs, max_n, k, scan, depth):
    """{path: count} over the continuations of the occurrences of the longest suffix of `tokens` up to
    max_n (of its `scan` most recent: the sequence itself first, newest first, then each document,
    newest first) whose match reaches furthest back (up to MAX_MATCH), the k most recent of those."""
    for n in range(min(max_n, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - n :]
        ends = [(tokens, e) for e in range(len(tokens) - 1, n - 1, -1) if tokens[e - n : e] == suffix]
        for doc in docs:
            ends += [(doc, e) for e in range(len(doc) - 1, n - 1, -1) if doc[e - n : e] == suffix]
        if ends:
            ends = ends[:scan]
            lengths = []
            for doc, end in ends:
                m = n
                while m < MAX_MATCH and m < end and doc[end - m - 1] == tokens[len(tokens) - m - 1]:
                    m += 1
                lengths.append(m)
            ends = [e for e, m in zip(ends, lengths) if m == max(lengths)][:k]
            counts = {}
            for doc, end in ends:
                copy = continuation(tokens, end, depth) if doc is tokens else doc[end : end + depth]
                for j in range(1, len(copy) + 1):
                    counts[tuple(copy[:j])] = counts.get(tuple(copy[:j]), 0) + 1
            return max(lengths), len(ends), counts
    return 0, 0, {}


def paths(tree):
    out = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        out[i] = (out[parent] if parent >= 0 else ()) + (token,)
    return {out[i]: tree.counts[i] for i in range(len(tree))}


@pytest.mark.parametrize("seed", range(12))
def test_suffix_index_counts_continuations_like_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, max_n, k, depth = int(torch.randint(2, 6, (1,), generator=g)), 1 + seed % 4, 1 + seed % 5, 6
    docs = [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(3)]
    history = OutputHistory(max_tokens=10_000, max_n=max_n)
    for doc in docs:
        history.add(doc)
    scan = 3 + seed % 7
    index = SuffixIndex(max_n=max_n, history=history, max_occurrences=k, scan_occurrences=scan)
    stream = torch.randint(0, vocab, (80,), generator=g).tolist()
    stream[50:70] = stream[10:30]  # a long repeat: matches reach far back
    index.extend(stream[:1])
    for t in range(1, len(stream)):
        if t % 7 == 0 or t == len(stream) - 1:
            tree = index.propose(10_000, max_depth=depth)
            kept = [d for d in reversed(docs) if len(d) >= 2]  # newest output first
            match, occurrences, counts = brute_force(index.tokens, kept, max_n, k, scan, depth)
            assert (tree.match, tree.occurrences, paths(tree)) == (match, occurrences, counts), t
            small = index.propose(5, max_depth=depth)  # the 5 most frequent nodes form a connected tree
            assert len(small) == min(5, len(tree)) and all(p < i for i, p in enumerate(small.parents))
        index.extend([stream[t]])


def test_output_history_is_bounded_in_tokens_and_forgets_the_oldest():
    g = torch.Generator().manual_seed(0)
    history = OutputHistory(max_tokens=200, max_n=3)
    added = []
    for _ in range(60):
        doc = torch.randint(0, 7, (int(torch.randint(2, 90, (1,), generator=g)),), generator=g).tolist()
        history.add(doc)
        added.append(doc)
        held = list(history.docs.values())
        assert history.tokens == sum(map(len, held)) <= 200
        assert held == added[len(added) - len(held) :]  # first in, first out
        # every index entry points into a document still held, and each held n-gram is indexed once
        assert history.table.entries == sum(min(3, e) for d in held for e in range(1, len(d)))
        assert all(doc in history.docs for entries in history.table.where.values() for doc, _ in entries)
    history.add(list(range(500)))  # longer than the limit: its last 200 tokens
    assert list(history.docs.values()) == [list(range(300, 500))]
    history.clear()
    assert history.tokens == 0 and not history.docs and not history.table.where


def test_later_requests_copy_earlier_outputs():
    """A second call on the same prompt copies the first call's output from the history: far fewer
    verifications, the same tokens; clearing the history gives the first call's count back."""
    target = tiny_model("llama", seed=5)
    target.generation_config.eos_token_id = None
    # a fixed tree size: the verification counts below then follow the proposals, not this machine's step timings
    model = SwiftSpecForCausalLM.from_models(target, tree_budget=16)
    prompt = torch.randint(3, 98, (1, 12), generator=torch.Generator().manual_seed(2))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=40).tolist()
    steps, copyable = [], []
    for clear in (False, False, True):
        if clear:
            model.output_history.clear()
        assert model.generate(prompt, do_sample=False, max_new_tokens=40).tolist() == expected
        steps.append(model.swiftspec_stats.verify_steps)
        copyable.append(model.swiftspec_stats.history_tokens)
        said = "tokens of earlier calls' outputs (model.output_history.clear() to time a call alone)"
        assert (said in model.swiftspec_stats.summary()) == bool(copyable[-1])  # a timed repeat says what it reused
    assert steps[1] < steps[0] / 2 and steps[2] > steps[1], steps
    assert copyable == [0, model.output_history.tokens, 0] and copyable[1] > 40, copyable
    assert model.output_history.tokens <= model.config.suffix_cache_tokens
    off = SwiftSpecForCausalLM.from_models(target, suffix_cache_tokens=0)
    for _ in range(2):
        assert off.generate(prompt, do_sample=False, max_new_tokens=40).tolist() == expected
    assert len(off.output_history) == 0


def branching_prompt(vocab, seed=0, length=40):
    """Several copies of one phrase with a token changed in each: the suffix trees branch."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, vocab, (8,), generator=g)
    copies = []
    for i in range(length // 8):
        copy = phrase.clone()
        copy[3 + i % 4] = int(torch.randint(3, vocab, (1,), generator=g))
        copies.append(copy)
    return torch.cat(copies)[None]


@pytest.mark.parametrize("with_draft", [False, True], ids=["draft-free", "draft"])
def test_greedy_with_suffix_branches_equals_target(with_draft):
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2) if with_draft else None)
    index = SuffixIndex(max_n=3)
    index.extend(branching_prompt(98, 1)[0].tolist()[:-5])
    tree = index.propose(32)
    assert any(tree.counts[i] < tree.parent_count(i) for i in range(len(tree)))  # the prompts really branch
    accepted = 0
    for seed in range(4):
        prompt = branching_prompt(98, seed)
        for kwargs in (dict(), dict(repetition_penalty=1.2)):
            expected = target.generate(prompt, do_sample=False, max_new_tokens=40, **kwargs)
            assert model.generate(prompt, do_sample=False, max_new_tokens=40, **kwargs).tolist() == expected.tolist()
            accepted += sum(r.ngram_accepted for r in model.swiftspec_stats.rounds)
    assert accepted > 10


def test_draft_free_sampling_with_suffix_branches_follows_the_target():
    """Chi-square of the first two sampled tokens, draft-free, from a prompt whose repeats branch
    (3 7 -> 5 and 3 7 -> 6), against the target's exact joint distribution."""
    vocab, draws = 12, 1000
    target = tiny_model("llama", seed=3, vocab_size=vocab)
    target.generation_config.eos_token_id = None
    # a fixed tree size: every draw verifies the suffix branches, whatever the policy learnt of them
    model = SwiftSpecForCausalLM.from_models(target, tree_budget=6, suffix_cache_tokens=0)
    prompt = torch.tensor([[3, 7, 5, 9, 3, 7, 6, 9, 3, 7, 5, 9, 3, 7]])
    expected = exact_joint(target, prompt, warpers(1.0))
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    from_suffix = 0
    for seed in range(draws):
        out = model.generate(prompt, do_sample=True, max_new_tokens=2, generator=torch.Generator().manual_seed(seed))
        t1, t2 = out[0, -2:].tolist()
        counts[t1 * vocab + t2] += 1
        from_suffix += sum(r.ngram_accepted for r in model.swiftspec_stats.rounds)
    assert from_suffix > draws // 50
    pvalue = pooled_chisquare(counts, expected.flatten() * draws)
    assert pvalue > 1e-3, f"p={pvalue:.2e}: samples do not follow the target's distribution"


def paths(tree):
    """{path of tokens from the root: count} of a SuffixTree."""
    out, prefix = {}, {}
    for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)):
        prefix[i] = (prefix[p] if p >= 0 else ()) + (t,)
        out[prefix[i]] = tree.counts[i]
    return out


def test_a_proposal_followed_by_the_text_is_kept_and_equals_a_fresh_one(monkeypatch):
    """After the target emits tokens along the last proposal, the proposal is that proposal's subtree
    (no look-up); where the occurrences agree it is exactly what a fresh look-up proposes; when the
    text leaves the proposal, it is looked up anew."""
    text = [5, 6, 7, 8, 9, 10, 11, 12] * 6 + [5, 6, 7]
    index = SuffixIndex(max_n=3)
    index.extend(text)
    first = index.propose(8)
    assert first.tokens[:3] == [8, 9, 10] and first.match >= 3
    index.extend([8])  # the text follows the proposal
    looked_up = SuffixIndex(max_n=3)
    looked_up.extend(index.tokens)
    fresh = looked_up.look_up(8, 8)
    monkeypatch.setattr(index, "look_up", lambda *a: pytest.fail("looked up a proposal the text followed"))
    kept = index.propose(8)
    monkeypatch.undo()
    assert index._last_size == len(index.tokens) and kept.tokens[0] == 9
    assert paths(kept).items() <= paths(fresh).items() and len(kept) >= 4  # the kept nodes, as a fresh look-up counts them
    assert kept.match == min(first.match + 1, MAX_MATCH)
    index.extend([99])  # the text leaves it: looked up anew (99 never occurred: nothing to propose)
    assert index.propose(8).tokens == []


def test_a_deep_room_copies_no_more_than_a_proposal_can_keep(monkeypatch):
    """max_depth is the room left in the context (thousands of tokens on a real model): a proposal of
    max_nodes nodes is no deeper than max_nodes, so no occurrence is copied further, the proposal is the
    one max_depth = max_nodes gives, and a proposal the text follows is kept as the room shrinks."""
    import hf_swiftspec.drafters.suffix as suffix

    text = [5, 6, 7, 8, 9, 10, 11, 12] * 6 + [5, 6, 7]
    copied = []
    build = suffix.build_trie
    monkeypatch.setattr(suffix, "build_trie", lambda copies, *a: copied.extend(map(len, copies)) or build(copies, *a))
    index, reference = SuffixIndex(max_n=3), SuffixIndex(max_n=3)
    index.extend(text)
    reference.extend(text)
    deep = index.propose(8, max_depth=5000)
    assert copied and max(copied) <= 8
    assert deep == reference.propose(8, max_depth=8)
    index.extend([8])
    copied.clear()
    assert index.propose(8, max_depth=4999).tokens[0] == 9 and not copied  # followed, not looked up again
