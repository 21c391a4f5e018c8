"""round="device" with suffix proposals (drafters/device_suffix.py): the host's suffix index proposes, one copy to the
device a round, merged into the draft model's tree (or alone: draft-free mode), ranked with it, verified, walked, and
the draft's cache caught up on the walked nodes it never ran. Greedy output is target.generate's token for token
(llama, qwen3; one row and a left-padded batch; EOS and max_new_tokens) with suffix nodes accepted and at most one
host read a round; the merge is the host's tree.merge_suffix; after a call both slot caches hold exactly a fresh
prefill of every row's committed tokens; replayed phases (capture=True) decode round for round as the eager ones;
sampling draws the host round's tokens under a seed."""

import math

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.config import SwiftSpecConfig
from hf_swiftspec.drafters.device_suffix import host_nodes, merge_suffix
from hf_swiftspec.engine import device_sides
from hf_swiftspec.policy.goodput import GoodputPolicy
from hf_swiftspec.steps.device_round import DeviceTree, select_device
from hf_swiftspec.steps.slot_cache import SlotCache, catch_up
from hf_swiftspec.steps.tree import Subtree
from hf_swiftspec.steps.tree import merge_suffix as host_merge_suffix
from hf_swiftspec.tools.models import left_padded, tiny_model, truncated_draft
from test_device_sides import reads_per_round

FIXED = dict(round="device", draft_depth=2, draft_width=2, tree_budget=8)  # one shape: no clock decides a round
FREE = dict(round="device", tree_budget=6)  # draft-free: the suffix tree alone
# prompts that repeat themselves, of different lengths (left padding), so the suffix index has something to copy
PROMPTS = [[5, 17, 33, 8, 61, 9, 40] * 3, [12, 7, 44, 7, 12, 7, 44], [3, 90, 21] * 4 + [3], [70, 18]]


@pytest.fixture(scope="module")
def targets():
    out = {}
    for arch in ("llama", "qwen3"):
        target = tiny_model(arch, seed=0)
        target.generation_config.eos_token_id = None  # each test names the EOS it stops at
        out[arch] = target
    return out


def pair_of(target, draft_free: bool, **settings):
    draft = None if draft_free else truncated_draft(target, 2)
    return SwiftSpecForCausalLM.from_models(target, draft, **(FREE if draft_free else FIXED), **settings)


def inputs(rows: int):
    return (torch.tensor([PROMPTS[0]]), None) if rows == 1 else left_padded(PROMPTS)


def suffix_walked(stats) -> int:
    """Tokens the walks took from nodes only the suffix proposed (RoundRecord.ngram_accepted)."""
    return sum(r.ngram_accepted for r in stats.rounds)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("draft_free", [False, True], ids=["draft", "draft-free"])
def test_greedy_equals_target_generate_with_suffix_nodes_accepted(targets, arch, rows, draft_free, monkeypatch):
    """Token for token target.generate's output (EOS mid-call for row 0, max_new_tokens, left padding), with suffix
    nodes on the walked paths, the draft (where there is one) growing every round, and at most one host read a
    round."""
    target = targets[arch]
    pair = pair_of(target, draft_free)
    ids, mask = inputs(rows)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    eos = int(free[0, ids.shape[1] + 30])  # row 0 stops late, at an EOS of its own
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=eos)
    expected = target.generate(ids, **kwargs)
    reads = reads_per_round(monkeypatch)
    assert pair.generate(ids, **kwargs).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and max(reads) <= 1 and len(reads) == len(stats.rounds)
    assert suffix_walked(stats) >= 3, [(r.accepted, r.ngram_accepted) for r in stats.rounds]
    if draft_free:
        assert stats.draft_forwards == 0 and "no draft model" in stats.attention
    else:  # the draft's 2 growth forwards every round, its prefill, and a catch-up before the growths that need one
        # (after a walk through nodes it never ran: the last depth's, the suffix's)
        assert 2 * len(stats.rounds) + 1 < stats.draft_forwards <= 3 * len(stats.rounds) + 1


def assert_caches_hold_prefills(sides, target, b: int, committed: list[int]) -> None:
    """Row b's committed slots in the target's cache, and the draft's up to what it has run (its draft_lens, the
    host's mirror of it: a draft model catches up on the rest before its next growth), are a fresh prefill of its
    tokens."""
    assert_holds_prefill(target, sides.slots.caches[0], b, committed)
    if sides.drafter.model is not None:
        ran = int(sides.slots.rows.drafter["draft_lens"][b])
        assert ran == sides.host[b].drafted and ran <= len(committed)
        assert_holds_prefill(sides.drafter.model, sides.slots.caches[1], b, committed[:ran])


def caught_up_before_growing(monkeypatch) -> list[int]:
    """After each growth phase: every live row's draft has run all its committed tokens (the catch-up ran first)."""
    grown, propose = [], device_sides.DeviceSides.propose

    def checking(sides, rows):
        proposed = propose(sides, rows)
        if proposed.shape.depth:
            state = sides.slots.rows
            live = slice(0, sides.live)
            assert state.drafter["draft_lens"][live].tolist() == state.prefix_lens[live].tolist()
            grown.append(sides.live)
        return proposed

    monkeypatch.setattr(device_sides.DeviceSides, "propose", checking)
    return grown


def assert_holds_prefill(model, cache: SlotCache, b: int, committed: list[int]) -> None:
    """Row b's first len(committed) slots of `cache` are a fresh prefill of `committed` (keys and values, every layer)."""
    fresh = SlotCache(len(cache.layers), len(committed) + 2)
    catch_up(model, fresh, torch.tensor([committed]), torch.tensor([len(committed)]))
    for mine, theirs in zip(cache.layers, fresh.layers):
        for a, c in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            torch.testing.assert_close(a[b, :, : len(committed)], c[0, :, : len(committed)], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("capture", [False, True])
def test_both_caches_hold_a_fresh_prefill_of_the_committed_tokens(targets, capture, monkeypatch):
    """After every round of a call whose walks took suffix nodes (and draft nodes at the last depth, which the draft
    never ran), every row's committed slots in both models' caches equal a fresh prefill of its tokens: the target's
    commit, and the draft's commit of the nodes it ran; before each growth the draft has caught up on the rest.
    (The output alone cannot tell: a draft with wrong KV only proposes worse.)"""
    target = targets["llama"]
    pair = pair_of(target, False, capture=capture)
    ids, mask = inputs(4)
    checked, accept = [], device_sides.DeviceSides.accept

    def accept_and_check(sides, proposed, verified, keep):
        accept(sides, proposed, verified, keep)
        prefix_lens = sides.slots.rows.prefix_lens.tolist()
        for b, row in enumerate(proposed.rows):
            committed = sides.host[b].sequence[ids.shape[1] - len(PROMPTS[row]) : -1]  # the root: no model holds it
            assert prefix_lens[b] == len(committed)
            assert_caches_hold_prefills(sides, target, b, committed)
            checked.append(len(committed))

    monkeypatch.setattr(device_sides.DeviceSides, "accept", accept_and_check)
    grown = caught_up_before_growing(monkeypatch)
    out = pair.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    assert out.tolist() == target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40).tolist()
    assert suffix_walked(pair.swiftspec_stats) >= 3 and len(checked) == sum(r.rows for r in pair.swiftspec_stats.rounds)
    assert len(grown) == len(pair.swiftspec_stats.rounds)


@pytest.mark.parametrize("draft_free", [False, True], ids=["draft", "draft-free"])
def test_replayed_phases_decode_round_for_round_as_the_eager_ones(targets, draft_free):
    """capture=True on a CPU replays both phases from the emulating stand-in, whose replay calls the phase the first
    round captured again: each round's suffix proposal must reach it as an input, or every round verifies the first
    round's suffix nodes. The tokens are target.generate's either way (the walk rejects what the target does not
    choose), so the rounds are compared: what each accepted, and how much of it came from the suffix."""
    target = targets["qwen3"]
    ids, mask = inputs(4)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=32)
    eager, replayed = pair_of(target, draft_free), pair_of(target, draft_free, capture=True)
    expected = target.generate(ids, **kwargs).tolist()
    assert eager.generate(ids, **kwargs).tolist() == expected == replayed.generate(ids, **kwargs).tolist()
    stats = replayed.swiftspec_stats
    assert "replayed phases, emulate" in stats.attention and "eager:" not in stats.attention
    assert [(r.accepted, r.ngram_accepted) for r in stats.rounds] == [
        (r.accepted, r.ngram_accepted) for r in eager.swiftspec_stats.rounds]
    assert suffix_walked(stats) >= 3


@pytest.mark.parametrize("draft_free", [False, True], ids=["draft", "draft-free"])
def test_sampling_draws_what_the_host_round_draws(targets, draft_free):
    """Under one seed each row's sampled tokens are the host round's with the same drafters (the same Gumbel-max rule,
    noise keyed by seed, row and position: the target's distribution, test_sampling.py's chi-square), replayed or
    not, and not greedy's."""
    target = targets["llama"]
    draft = None if draft_free else truncated_draft(target, 2)
    host = SwiftSpecForCausalLM.from_models(target, draft)
    ids, mask = inputs(4)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=True, temperature=0.9, top_k=20)
    drawn = host.generate(ids, generator=torch.Generator().manual_seed(7), **kwargs).tolist()
    for capture in (False, True):
        pair = pair_of(target, draft_free, capture=capture)
        assert pair.generate(ids, generator=torch.Generator().manual_seed(7), **kwargs).tolist() == drawn
        assert pair.swiftspec_stats.engine == "device"
    assert drawn != pair.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False).tolist()


def random_tree(g: torch.Generator, nodes: int, vocab: int) -> tuple[list[int], list[int], list[float]]:
    """A random draft tree (tokens, parents, scores: cumulative log-probs, never rising along a path), node 0 the
    root, no two children of a node with one token."""
    tokens, parents, scores = [0], [-1], [0.0]
    while len(tokens) < nodes:
        p = int(torch.randint(0, len(tokens), (1,), generator=g))
        t = int(torch.randint(1, vocab, (1,), generator=g))
        if any(pp == p and tt == t for pp, tt in zip(parents, tokens)):
            continue
        tokens.append(t), parents.append(p), scores.append(scores[p] + math.log(float(torch.rand(1, generator=g))))
    return tokens, parents, scores


def random_suffix(g: torch.Generator, draft: tuple, nodes: int, vocab: int):
    """A random suffix trie (tokens, parents: -1 the root's children, scores) half of whose nodes follow the draft's
    paths (so some are draft nodes), the rest new tokens."""
    d_tokens, d_parents, _ = draft
    tokens, parents, scores, where = [], [], [], []  # where: each suffix node's draft twin, or -1
    while len(tokens) < nodes:
        p = int(torch.randint(-1, len(tokens), (1,), generator=g))
        twin = 0 if p < 0 else where[p]
        kids = [i for i, pp in enumerate(d_parents) if pp == twin and twin >= 0]
        if kids and float(torch.rand(1, generator=g)) < 0.6:
            pick = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
            t = d_tokens[pick]
        else:
            t, pick = int(torch.randint(1, vocab, (1,), generator=g)), None
        if any(pp == p and tt == t for pp, tt in zip(parents, tokens)):
            continue
        if pick is None:
            pick = next((i for i in kids if d_tokens[i] == t), -1)
        tokens.append(t), parents.append(p), where.append(pick)
        scores.append((scores[p] if p >= 0 else 0.0) + math.log(float(torch.rand(1, generator=g))))
    return tokens, parents, scores


def paths(tokens, parents) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for t, p in zip(tokens, parents):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


def device_tree(rows: list[tuple]) -> DeviceTree:
    tokens = torch.tensor([r[0] for r in rows])
    parents = torch.tensor([r[1] for r in rows])
    B, N = tokens.shape
    ancestors = torch.zeros(B, N, N, dtype=torch.bool)
    depths = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(N):
            p = int(parents[b, i])
            ancestors[b, i] = ancestors[b, p] if p >= 0 else ancestors[b, i]
            ancestors[b, i, i] = True
            depths[b, i] = depths[b, p] + 1 if p >= 0 else 0
    return DeviceTree(tokens, parents, depths, torch.tensor([r[2] for r in rows]), ancestors, torch.full((B,), N))


def test_the_merge_is_the_host_rounds_merge():
    """On random draft trees and suffix tries (some suffix nodes on the draft's paths, padding in some rows),
    merge_suffix makes the host's tree.merge_suffix tree: the same token paths, each with the host's probability
    (the higher of the two where both proposed it); live nodes first, parents before children, ancestors as the
    parents say; and select_device's best T of it is a connected subtree."""
    g = torch.Generator().manual_seed(0)
    N, S, vocab, B = 9, 7, 6, 6
    drafts = [random_tree(g, N, vocab) for _ in range(B)]
    suffixes = [random_suffix(g, d, int(torch.randint(0, S + 1, (1,), generator=g)), vocab) for d in drafts]
    tree = device_tree(drafts)
    packed = torch.tensor([host_nodes(t, p, s, S) for t, p, s in suffixes], dtype=torch.float64)  # as a round copies it
    merged = merge_suffix(tree, packed)
    merged_away = [N + len(s[0]) - int(size) for s, size in zip(suffixes, merged.size)]
    assert sum(merged_away) >= 3 and packed[:, 3].isinf().any()  # suffix nodes that are draft nodes; padding
    for b, ((d_tokens, d_parents, d_scores), (s_tokens, s_parents, s_scores)) in enumerate(zip(drafts, suffixes)):
        host = host_merge_suffix(Subtree(list(range(N)), d_tokens, d_parents), d_scores, [math.exp(s) for s in d_scores],
                                 s_tokens, s_parents, [math.exp(s) for s in s_scores], [0] * len(s_tokens))
        want = dict(zip(paths(host.subtree.tokens[1:], [p - 1 for p in host.subtree.parents[1:]]), host.probs[1:]))
        size = int(merged.size[b])
        tokens, parents = merged.tokens[b, 1:size].tolist(), (merged.parents[b, 1:size] - 1).tolist()
        got = dict(zip(paths(tokens, parents), merged.scores[b, 1:size].exp().tolist()))
        assert got.keys() == want.keys() and len(got) == size - 1
        assert all(math.isclose(got[k], want[k], rel_tol=1e-5) for k in want), (got, want)
        assert (merged.scores[b, size:] == -math.inf).all() and all(p < i for i, p in enumerate(parents))
        for i in range(size):
            chain, node = set(), i
            while node >= 0:
                chain.add(node)
                node = int(merged.parents[b, node])
            assert set(merged.ancestors[b, i].nonzero().flatten().tolist()) == chain
        assert merged.depths[b, :size].tolist() == [0] + [len(k) for k in paths(tokens, parents)]
    sub = select_device(merged, 8)
    assert ((sub.parents >= 0) | ~sub.valid | (torch.arange(8) == 0)).all()


def test_a_subtree_chosen_on_the_host_is_the_device_selection():
    """A round that grows nothing takes its subtree from the host (device_suffix.chosen_nodes, from the proposal alone)
    instead of merging and selecting on the device: on random suffix tries (some rows empty, ties in probability, T
    past a row's nodes) it is select_device's pick from merge_suffix of the roots and the same proposal, field by
    field (its node ids aside: only which nodes the draft grew is read from them, and neither grew any)."""
    from hf_swiftspec.drafters.device_suffix import chosen_nodes, chosen_subtree, root_tree

    g = torch.Generator().manual_seed(3)
    roots = torch.tensor([11, 12, 13, 14, 15, 16])
    for S, T in ((7, 4), (7, 9), (5, 1), (12, 6)):
        offers = [random_suffix(g, ([0], [-1], [0.0]), int(torch.randint(0, S + 1, (1,), generator=g)), 6)
                  for _ in roots]
        offers[0] = ([3, 4], [-1, -1], [-0.5, -0.5])  # a tie: the lower index first
        packed = torch.tensor([host_nodes(t, p, sc, S) for t, p, sc in offers], dtype=torch.float64)
        expected = select_device(merge_suffix(root_tree(roots), packed), T)
        chosen = torch.tensor([chosen_nodes(t, p, [math.exp(x) for x in sc], T) for t, p, sc in offers],
                              dtype=torch.float64)
        got = chosen_subtree(chosen, roots)
        width = expected.tokens.shape[1]  # select_device keeps at most the tree's N + S nodes
        for name in ("tokens", "parents", "valid", "depths", "mask"):
            want, have = getattr(expected, name), getattr(got, name)
            have = have[:, :width, :width] if name == "mask" else have[:, :width]
            assert torch.equal(have, want), (name, S, T, have, want)
        assert bool((got.valid[:, width:] == 0).all())
        torch.testing.assert_close(got.scores[:, :width][expected.valid], expected.scores[expected.valid])


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("draft_free", [False, True], ids=["draft", "draft-free"])
def test_plain_rounds_among_grown_ones_decode_exactly_and_keep_the_draft_cache_whole(targets, capture, draft_free,
                                                                                       monkeypatch):
    """Plain rounds (the roots alone: no growth, T = 1; here the policy's quiet rounds, forced in a fixed cycle, no
    clock) among grown rounds of a fixed shape: greedy output is target.generate's; after every round the target's
    cache holds a fresh prefill of each row's committed tokens and the draft's of those it has run (a plain round runs
    no draft forward: the tokens it commits wait), and before every growth the draft has caught up on them all; at
    most one host read a round."""
    target = targets["llama"]
    cycle = [True, False, True, True]  # quiet, grown, quiet, quiet
    plan_round = GoodputPolicy.plan_round

    def cycled(policy, *args, **kwargs):
        plan = plan_round(policy, *args, **kwargs)
        plan.quiet = cycle[policy.at(plan.batch).rounds % len(cycle)]
        return plan

    monkeypatch.setattr(GoodputPolicy, "plan_round", cycled)
    pair = pair_of(target, draft_free, capture=capture)
    ids, mask = inputs(4)
    checked, accept = [], device_sides.DeviceSides.accept

    def accept_and_check(sides, proposed, verified, keep):
        accept(sides, proposed, verified, keep)
        for b, row in enumerate(proposed.rows):
            committed = sides.host[b].sequence[ids.shape[1] - len(PROMPTS[row]) : -1]
            assert_caches_hold_prefills(sides, target, b, committed)
            checked.append(len(committed))

    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=30)
    expected = target.generate(ids, **kwargs)
    with monkeypatch.context() as checking:
        checking.setattr(device_sides.DeviceSides, "accept", accept_and_check)
        grown = caught_up_before_growing(checking)
        assert pair.generate(ids, **kwargs).tolist() == expected.tolist()
    assert checked and (draft_free or grown)
    reads = reads_per_round(monkeypatch)  # a second call, its reads counted (the checks above read the caches)
    assert pair.generate(ids, **kwargs).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert max(reads) <= 1
    plain = [r for r in stats.rounds if r.budget == 1]
    assert len(plain) >= len(stats.rounds) // 2 and all(r.accepted == 0 for r in plain)
    assert any(r.budget > 1 for r in stats.rounds)


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("rows", [1, 4])
def test_the_proposal_in_hand_sizes_each_draft_free_round(targets, rows, capture, monkeypatch):
    """Draft-free mode with the policy sizing every round from the suffix proposals in hand, its costs given by the
    test (no clock: 10 ms plus 0.1 ms a verified node): greedy output is target.generate's token for token; a round
    whose proposals hold nothing verifies the roots alone, a round that verifies more has nodes that promised tokens,
    rounds of both kinds ran and suffix nodes were walked; at most one host read a round."""
    from fixed_costs import given_costs

    target = targets["llama"]
    pair = SwiftSpecForCausalLM.from_models(target, None, round="device", capture=capture)
    given_costs(pair, 0.01, {t: 0.010 + 0.0001 * t for t in (1, 2, 4, 8, 16, 32)}, batches=(1, 2, 3, 4))
    ids, mask = inputs(rows)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40)
    expected = target.generate(ids, **kwargs)
    seen, grow = [], device_sides.DeviceSides.grow

    def recorded(sides, proposed, shape, inputs):
        out = grow(sides, proposed, shape, inputs)
        if proposed.sizing is not None:
            seen.append((proposed.sizing.candidates(), out.shape.budget))
        return out

    monkeypatch.setattr(device_sides.DeviceSides, "grow", recorded)
    reads = reads_per_round(monkeypatch)
    assert pair.generate(ids, **kwargs).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and max(reads) <= 1 and stats.draft_forwards == 0
    assert all(1 <= len(rows_seen) <= rows for rows_seen, _ in seen)  # rows leave as they end
    assert all(budget == 1 for rows_seen, budget in seen if all(len(r) == 1 for r in rows_seen))
    assert all(any(len(r) > 1 for r in rows_seen) for rows_seen, budget in seen if budget > 1)
    assert {budget > 1 for _, budget in seen} == {False, True}
    assert suffix_walked(stats) >= 3
