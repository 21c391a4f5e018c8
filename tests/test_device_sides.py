"""round="device" (engine/device_sides.py): the draft model's growth, the selection, the target's verification,
the walk and both caches' commits on the device, read once a round, decode exactly as target.generate does
(greedy, float32) on two full-attention architectures, one sequence and a left-padded batch, with EOS,
max_new_tokens and stop strings (rows that decode on after theirs); sampling draws what the seed draws
(tests/gumbel_reference.py) (its rule: the target's distribution, test_sampling.py); and a call it cannot decode exactly is a
ValueError naming why, never a silent fallback."""

import dataclasses
import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_swiftspec import SwiftSpecConfig, SwiftSpecForCausalLM
from hf_swiftspec.engine import rounds
from hf_swiftspec.engine.device_phases import PLAIN
from fixed_costs import given_costs
from hf_swiftspec.tools.models import char_tokenizer, left_padded, random_prompts, tiny_model, truncated_draft
from sync_counter import SyncCounter

DEVICE = dict(round="device", ngram_size=0)
FIXED = dict(draft_depth=3, draft_width=2, tree_budget=6)  # one shape: what a round accepts follows no clock


@pytest.fixture(scope="module")
def pairs():
    """Per architecture: the target, and its pair on the device round (the draft cut from the target's first two
    layers, so it agrees often)."""
    out = {}
    for arch in ("llama", "qwen3"):
        target = tiny_model(arch, seed=0)
        target.generation_config.eos_token_id = None  # each test names the EOS it stops at
        out[arch] = target, SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE, **FIXED)
    return out


def batch(lengths=(3, 17, 9, 1), seed=0):
    return left_padded(random_prompts(lengths, seed, 98))


def reads_per_round(monkeypatch) -> list[int]:
    """Host reads of each round (rounds.one_round, the round's whole body), as SyncCounter counts them."""
    counts, body = [], rounds.one_round

    def counted(sides, rows):
        with SyncCounter() as counter:
            keep = body(sides, rows)
        counts.append(sum(counter.calls.values()))
        return keep

    monkeypatch.setattr(rounds, "one_round", counted)
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [1, 4])
def test_greedy_equals_target_generate_reading_once_a_round(pairs, arch, rows, monkeypatch):
    """Token for token target.generate's output (EOS and max_new_tokens as generate applies them, left padding),
    with the draft model running every round (draft forwards > rounds), proposals accepted (more tokens than
    verifications), and at most one host read per round."""
    target, pair = pairs[arch]
    ids, mask = batch() if rows > 1 else (torch.tensor([[5, 17, 33, 8, 61, 9, 40]]), None)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    eos = int(free[0, ids.shape[1] + 11])  # row 0 stops mid-call at an EOS of its own
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos)
    expected = target.generate(ids, **kwargs)
    reads = reads_per_round(monkeypatch)
    actual = pair.generate(ids, **kwargs)
    assert actual.tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and max(reads) <= 1 and len(reads) == len(stats.rounds)
    assert stats.draft_forwards > len(stats.rounds) and stats.draft_depth > 0
    assert stats.new_tokens > sum(r.rows for r in stats.rounds)  # the draft's nodes were accepted
    phases = stats.phases  # the round's breakdown: growth, verification graph, the read and the host's part
    assert phases.rounds == len(stats.rounds) and min(phases.expand, phases.verify, phases.walk) > 0, phases


def test_stop_strings_and_rows_that_decode_on():
    """Stop strings (applied on the host to the round's one read): with no EOS id generate decodes a row on past its
    stop string until every row's has appeared; the device round cuts its walk there and goes on from the cut.
    (The criteria run on host copies of the tokens, so SyncCounter, which cannot tell host tensors from device
    ones, sees their calls: the reads are bounded by the greedy test, which has no stop strings.)"""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE)
    tok = char_tokenizer()
    ids, mask = batch(seed=5)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)[:, ids.shape[1]:]
    stops = [tok.decode(free[b, at: at + 2]) for b, at in enumerate((4, 20, 9, 13))]
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, stop_strings=stops, tokenizer=tok)
    expected = target.generate(ids, **kwargs)
    actual = pair.generate(ids, **kwargs)
    assert actual.tolist() == expected.tolist()
    out = actual[:, ids.shape[1]:]
    stopped_at = [next(t + 1 for t in range(out.shape[1]) if tok.decode(row[: t + 1]).endswith(tuple(stops)))
                  for row in out]
    assert max(stopped_at) == out.shape[1] < 40 and min(stopped_at) < out.shape[1] - 5  # rows decoded on


def test_sampling_draws_what_the_seed_draws():
    """Under one seed, each row's sampled tokens are the seed's draws (tests/gumbel_reference.py: the target's own loop
    with the Gumbel-max rule, noise keyed by seed, row and position: the target's distribution, which
    test_sampling.py checks by chi-square), and not greedy's."""
    from gumbel_reference import seeded_draws

    target = tiny_model("llama", seed=0)
    draft = truncated_draft(target, 2)
    device = SwiftSpecForCausalLM.from_models(target, draft, **DEVICE)
    ids, mask = batch(seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20)
    drawn = device.generate(ids, do_sample=True, generator=torch.Generator().manual_seed(11), temperature=0.9,
                            top_k=20, **kwargs)
    expected = seeded_draws(target, ids, torch.Generator().manual_seed(11), temperature=0.9, top_k=20, **kwargs)
    assert drawn.tolist() == expected.tolist()
    assert device.swiftspec_stats.engine == "device"
    assert drawn.tolist() != device.generate(ids, do_sample=False, **kwargs).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_replayed_phases_decode_as_the_eager_ones(arch):
    """capture=True on a CPU replays both phases from the emulating stand-in (steps/phase_graphs.py), whose replay
    calls the phase captured in the first round again: every prefix length, root, budget, EOS id and noise must reach
    it as an input, or a later round reuses the first's and decodes other tokens. Greedy equals target.generate
    (rows leaving: a new batch shape, captured anew), and a seed draws the host round's tokens."""
    target = tiny_model(arch, seed=0)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 2)
    pair = SwiftSpecForCausalLM.from_models(target, draft, capture=True, **DEVICE, **FIXED)
    ids, mask = batch(seed=1)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=int(free[1, ids.shape[1] + 9]))
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    assert "replayed phases, emulate" in pair.swiftspec_stats.attention and "eager:" not in pair.swiftspec_stats.attention
    assert len(pair.swiftspec_stats.rounds) > 4  # graphs replayed (2 phases x a few row counts were captured)
    host = SwiftSpecForCausalLM.from_models(target, draft, ngram_size=0)
    sampled = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20)
    assert pair.generate(ids, generator=torch.Generator().manual_seed(2), **sampled).tolist() == host.generate(
        ids, generator=torch.Generator().manual_seed(2), **sampled).tolist()


def test_output_scores_are_generates():
    """return_dict_in_generate's scores and logits: each step's equals target.generate's."""
    target = tiny_model("llama", seed=0)
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE)
    ids = torch.tensor([[5, 17, 33, 8, 61]])
    kwargs = dict(do_sample=False, max_new_tokens=10, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=None)
    expected, actual = target.generate(ids, **kwargs), pair.generate(ids, **kwargs)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    for name in ("scores", "logits"):
        for got, want in zip(getattr(actual, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def refused(pair, ids, **kwargs) -> str:
    with pytest.raises(ValueError, match="round='device'") as raised:
        pair.generate(ids, max_new_tokens=4, do_sample=False, **kwargs)
    return str(raised.value)


def test_calls_it_cannot_decode_exactly_are_refused_with_the_reason():
    """A rule by cache slot past which only one-token steps are exact (doge's key budget; sliding windows are a term of
    its masks, test_device_windows.py; rules past which chains are exact run chains, test_device_chains.py): a
    ValueError naming the cause and the fix, never the host round or the target's loop instead. Processors that read
    the path are no longer refused: the walk over the read logits decodes them (a repetition penalty here;
    test_device_processors.py for the rest)."""
    target = tiny_model("llama", seed=0)
    ids = torch.tensor([[5, 17, 33, 8]])
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE)
    penalty = dict(logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]), max_new_tokens=8,
                   do_sample=False)
    assert pair.generate(ids, **penalty).tolist() == target.generate(ids, **penalty).tolist()
    assert pair.swiftspec_stats.engine == "device"
    from hf_swiftspec.tools import sweep

    budgeted = sweep.tiny_of_type("doge", seed=0, vocab_size=98, keep_window_size=4)
    message = refused(SwiftSpecForCausalLM.from_models(budgeted, None, round="device", ngram_size=3), ids)
    assert "slot-limited" in message and "keeps only its 4 best-scored keys" in message and "round='host'" in message
    with pytest.raises(ValueError, match="round='gpu'"):
        SwiftSpecConfig(round="gpu")


def test_calls_past_the_context_and_with_nothing_to_propose_decode_as_target_generate():
    """A call whose prompt and max_new_tokens reach past the models' context decodes as target.generate does (no node
    placed past it: its last rounds plain; a rotary target decodes on past its max_position_embeddings, as its own
    generate does), and draft-free mode with ngram_size=0 (nothing to propose) decodes plainly, one forward a token."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE)
    limit = target.config.max_position_embeddings
    long = torch.randint(1, 90, (1, limit - 10), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=30, do_sample=False)
    assert pair.generate(long, **kwargs).tolist() == target.generate(long, **kwargs).tolist()
    assert pair.swiftspec_stats.engine == "device"
    plain = SwiftSpecForCausalLM.from_models(target, None, **DEVICE)
    ids = torch.tensor([[5, 17, 33, 8]])
    assert plain.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    stats = plain.swiftspec_stats
    assert stats.engine == "device" and all(r.budget == 1 for r in stats.rounds) and stats.target_forwards == 30


def test_every_documented_refusal_names_its_reason():
    """settings.md's list of what the device round refuses, each by its message (beside the test above's): a placement
    other than serial, but two threads on one device, which run its asynchronous engine (test_device_async.py refuses
    what that cannot decode by name), (a slot rule past which only one-token steps are exact: the test above).
    (compile=True and
    attention="kernel" it honours: test_device_attention.py; an attention that takes no 4D mask is refused by the pair
    itself, whatever the round: architectures.UnsupportedArchitecture. Recurrent models and those placing tokens by
    slot run chains: test_device_chains.py.) Logits processors that read the path left the list: no gap names them."""
    target = tiny_model("llama", seed=0)
    ids = torch.tensor([[5, 17, 33, 8]])
    threads = dict(placement={"target": ["cpu"], "draft": ["cpu"]})
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE, **threads)
    assert pair.generate(ids, max_new_tokens=8, do_sample=False).tolist() == target.generate(
        ids, max_new_tokens=8, do_sample=False).tolist()
    assert pair.swiftspec_stats.engine == "async-threads-device"
    from hf_swiftspec.engine.device_sides import choose_round
    from hf_swiftspec.engine.placement import resolve_placement
    from hf_swiftspec.steps.probes import describe

    other = resolve_placement({"target": ["cpu"], "draft": ["cpu"]}, target.config, target.config)
    other = dataclasses.replace(other, mode="distributed")  # (torchrun ranks: no second process here)
    with pytest.raises(ValueError, match="placement='serial'"):
        choose_round(SwiftSpecConfig(**DEVICE), target, truncated_draft(target, 2), (describe(target, "target"), None),
                     [], other, None, False, [])
    from hf_swiftspec.engine.device_sides import device_round_gaps
    from transformers import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor

    path_readers = [RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(2),
                    NoBadWordsLogitsProcessor([[5]], eos_token_id=2)]
    assert device_round_gaps(SwiftSpecConfig(**DEVICE), target, truncated_draft(target, 2),
                             (describe(target, "target"), None), path_readers, None, None, False, []) == []


@pytest.mark.parametrize("capture", [False, True])
def test_eos_lists_of_other_widths_across_calls_replay_exactly(capture):
    """A first call with one EOS id captures its phases; later calls of the same rows with three and then five EOS ids
    (Llama-3 Instruct targets have three), one of them reached mid-call, equal target.generate's (the EOS width is in
    the graphs' key: a wider list captures its own graphs rather than failing to copy into the narrower ones)."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), capture=capture, **DEVICE, **FIXED)
    ids, mask = batch(seed=4)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    new = free[:, ids.shape[1]:]
    unused = [t for t in range(98) if t not in set(new.flatten().tolist())]
    for eos in ([unused[0]], [unused[1], int(new[2, 8]), unused[2]], unused[3:6] + [int(new[0, 12]), int(new[1, 5])]):
        kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos)
        assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist(), eos
        assert pair.swiftspec_stats.engine == "device"


@pytest.mark.parametrize("ngram_size", [0, 3])
def test_sampled_draws_follow_the_targets_distribution(ngram_size):
    """The device round's own draws (noise drawn on the device: verify.gumbel_noise) against the target's exact joint
    distribution of the first two new tokens, by chi-square: 1,500 rows of one batched call, each row its own draw."""
    from test_sampling import ALPHA, VOCAB, exact_joint, pooled_chisquare, warpers

    target = tiny_model("llama", seed=3, vocab_size=VOCAB)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), round="device", ngram_size=ngram_size,
                                            draft_depth=2, draft_width=3, tree_budget=6)
    prompt = [3, 7, 5, 9, 3, 7, 5] if ngram_size else [3, 7, 5, 9]
    draws = 1500
    out = pair.generate(torch.tensor([prompt] * draws), do_sample=True, temperature=0.9, max_new_tokens=2,
                        generator=torch.Generator().manual_seed(0))
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and stats.verify_steps < 2 * draws  # trees were accepted: some rows took both at once
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    for t1, t2 in out[:, -2:].tolist():
        counts[t1 * VOCAB + t2] += 1
    expected = exact_joint(target, torch.tensor([prompt]), warpers(0.9))
    pvalue = pooled_chisquare(counts, expected.flatten() * draws)
    assert pvalue > ALPHA, f"p={pvalue:.2e}: the device round's draws do not follow the target's distribution"


def sized_rounds(monkeypatch) -> list[tuple]:
    """Each sized round's (levels grown, T verified, the candidates' P(accepted) the policy saw), as RoundSizing
    decided them (policy/sizing.py)."""
    from hf_swiftspec.engine import device_sides

    seen, grow = [], device_sides.DeviceSides.grow

    def recorded(sides, proposed, shape, inputs):
        out = grow(sides, proposed, shape, inputs)
        if proposed.sizing is not None:
            seen.append((out.shape.depth, out.shape.budget, proposed.sizing.candidates()))
        return out

    monkeypatch.setattr(device_sides.DeviceSides, "grow", recorded)
    return seen


def confident(model):
    """`model` with its head's logits scaled up: a random tiny model whose next-token distributions are peaked, so its
    draft scores say its nodes are likely (as a trained draft's do)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


@pytest.mark.parametrize("expand_s,grows", [(0.001, True), (0.5, False)], ids=["cheap-draft", "dear-draft"])
def test_the_goodput_policy_sizes_each_round_between_levels(expand_s, grows, monkeypatch):
    """The device round's trees are the goodput policy's (the host round's rule): between levels (eager phases, a
    read free) the drafter grows while one more level is expected to raise tokens per second, then the T of the best
    goodput is verified. With the target as its own draft and costs given (no clock): an expansion that costs little
    against a verification is grown, every round, and its nodes verified (T > 1, tokens accepted); one that costs 50
    verifications is grown by the policy's probes alone (the plain round wins). Greedy tokens are
    target.generate's either way."""
    target, draft = (confident(tiny_model("llama", seed=0)) for _ in range(2))
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, draft, draft_width=2, **DEVICE)
    given_costs(pair, expand_s, {1: 0.010, 2: 0.0102, 4: 0.0104, 8: 0.011, 16: 0.012, 32: 0.014})
    ids = torch.tensor([[5, 17, 33, 8, 61, 9, 40]])
    seen = sized_rounds(monkeypatch)
    out = pair.generate(ids, max_new_tokens=40, do_sample=False)
    assert out.tolist() == target.generate(ids, max_new_tokens=40, do_sample=False).tolist()
    rounds = pair.swiftspec_stats.rounds
    assert seen and len(seen) == len(rounds) - 1  # round 1 is plain: its roots came with the prefill
    if grows:
        assert all(levels >= 2 and budget > 2 for levels, budget, _ in seen[1:]), seen
        assert pair.swiftspec_stats.tau > 3
    else:
        grown = [levels for levels, _, _ in seen[1:] if levels]
        assert len(grown) <= len(seen) // 16 + 1, seen  # the policy's probes alone (one in 16 rounds at most)
        assert all(budget == 1 for levels, budget, _ in seen[1:] if not levels), seen


def test_a_suffix_proposal_in_hand_sizes_the_tree():
    """With the round's suffix proposals in hand and no growth, T is the best goodput of their calibrated nodes at the
    measured costs: nothing proposed verifies the roots alone; three sure nodes a tree of 4; a batch whose second row
    proposes nothing verifies a tree under the plain goodput rule, and the latency guard (a running batch) keeps it
    plain for that row's sake; fifteen likely nodes the most nodes that pay."""
    from hf_swiftspec.policy.costs import CostModel
    from hf_swiftspec.policy.goodput import BatchSize, GoodputPolicy
    from hf_swiftspec.policy.sizing import Offer, RoundSizing
    from hf_swiftspec.steps.tree import SuffixTree

    def chain(n: int, p: float) -> Offer:
        tree = SuffixTree(list(range(3, 3 + n)), list(range(-1, n - 1)), [4] * n, 4, 8)
        probs = [p ** (k + 1) for k in range(n)]
        return Offer(tree, probs, [0] * n, list(range(100, 100 + n)))

    def budget(offers, guard=False):
        policy = GoodputPolicy()
        verify = {1: 0.010, 4: 0.011, 8: 0.012, 16: 0.016, 32: 0.030}
        for batch in (1, 2):
            policy.batches[batch] = BatchSize(CostModel(batch=batch, expand_s=0.01, verify_s=dict(verify), given=True))
        policy.plan_round(len(offers), guard=guard)
        return RoundSizing(policy, offers, width=0).budget()

    assert budget([None]) == budget([chain(0, 1.0)]) == 1
    assert budget([chain(3, 0.999)]) == 4
    assert 8 < budget([chain(15, 0.99)]) <= 16
    assert budget([chain(3, 0.999), None]) > 1 and budget([chain(3, 0.999), None], guard=True) == 1


@pytest.mark.parametrize("width,capture", [(1, False), (2, False), (2, True)])
def test_a_draft_equal_to_the_target_has_its_whole_chain_accepted(width, capture):
    """With the target as its own draft, the tree of depth 3 (all of it verified) holds the target's own greedy
    continuation, so every round but the call's last accepts 3 nodes in every row (at width 2 the greedy path can
    fall out of the tree, a second child's path outscoring it, so: most rounds, and 26 tokens in 8 rounds at most):
    the draft's cache holds exactly the committed sequence after each round (its commit of the nodes it ran, moved
    from their tree slots at width 2, its catch-up on the last one, the rows' prefixes). Replayed (capture=True), a draft input baked into the growth's
    graph would grow the first round's tree again: the tokens stay the target's, but acceptance drops."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, tiny_model("llama", seed=0), draft_width=width, draft_depth=3,
                                            tree_budget=1 + 3 * width, capture=capture, **DEVICE)
    ids, mask = batch(seed=3)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=26)
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    records = pair.swiftspec_stats.rounds
    full = [r.accepted == 3 * r.rows for r in records]  # 26 tokens: 6 rounds of 4, and the last's 2
    assert all(r.budget == 1 + 3 * width for r in records)
    assert (sum(full), len(records)) == (6, 7) if width == 1 else (sum(full) >= 4 and len(records) <= 8)


class OnCuda(torch.nn.Module):
    """A model as choose_round sees one on CUDA (its device and config; nothing runs)."""

    def __init__(self, model):
        super().__init__()
        self.config, self.wrapped = model.config, [model]

    @property
    def device(self):
        return torch.device("cuda")


def test_auto_takes_the_device_round_wherever_it_applies_and_says_why():
    """round="auto" (the default): the device round on a CPU and on CUDA, unless it cannot decode the call exactly
    (then the host round, naming the reason: here a placement that runs the draft beside the target, which the
    asynchronous engine serves); each call's stats say which ran and why."""
    from hf_swiftspec.engine.device_sides import choose_round
    from hf_swiftspec.engine.placement import resolve_placement
    from hf_swiftspec.steps.probes import describe
    from hf_swiftspec.steps.probes import describe

    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2))
    assert pair.config.round == "auto"
    ids = torch.tensor([[5, 17, 33, 8, 61]])
    assert pair.generate(ids, max_new_tokens=8, do_sample=False).tolist() == target.generate(
        ids, max_new_tokens=8, do_sample=False).tolist()
    assert pair.swiftspec_stats.engine == "device" and pair.swiftspec_stats.round_choice == "round='auto': the device round"
    config, cuda = SwiftSpecConfig(ngram_size=3), OnCuda(target)
    architectures = describe(target, "target"), None
    assert choose_round(config, cuda, None, architectures, [], None, None, False, []) == (
        "device", "round='auto': the device round")
    threads = resolve_placement({"target": ["cpu"], "draft": ["cpu"]})
    round_, why = choose_round(config, cuda, None, architectures, [], threads, None, False, [])
    assert round_ == "host" and "placement='serial'" in why
    assert choose_round(SwiftSpecConfig(round="host"), cuda, None, architectures, [], None, None, False, [])[0] == "host"


def test_what_the_policy_measured_carries_over_to_the_next_call():
    """The device round sizes its trees with the pair's policy (kept on the model object): what one call measured (the
    step costs at its batch size: a growth level, a plain verification) is where the next starts; a call's own tokens are
    target.generate's all the same."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, tiny_model("llama", seed=1, layers=1), round="device",
                                            ngram_size=0)
    policy = pair.policy()
    for seed in range(2):
        ids = torch.tensor(random_prompts([6], seed, 98))
        out = pair.generate(ids, max_new_tokens=24, do_sample=False)
        assert out.tolist() == target.generate(ids, max_new_tokens=24, do_sample=False).tolist()
        assert pair.policy() is policy and policy.at(1).costs.measured
    assert policy.at(1).costs.expand_s is not None and 1 in policy.at(1).costs.verify_s  # a level and a plain step


@pytest.mark.parametrize("rows,capture", [(1, False), (4, False), (4, True)])
def test_a_plain_first_round_takes_the_roots_from_the_prefill(rows, capture, monkeypatch):
    """Where the policy sizes trees (tree_budget not fixed), round 1 is plain and the target's prefill runs each whole prompt (right-aligned, the
    root last) and keeps the roots' logits, as generate's prefill does, so round 1 runs no target forward: one forward
    a token, not one more a call. Greedy tokens, scores and logits equal target.generate's (prompts of 3, 17, 9 and 1
    tokens: the alignment's padding), and a seed draws the host round's tokens; replayed too (round 1 runs eagerly)."""
    from hf_swiftspec.engine import device_sides

    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 2)
    pair = SwiftSpecForCausalLM.from_models(target, draft, capture=capture, **DEVICE)
    ids, mask = batch(seed=4) if rows > 1 else (torch.tensor([[5, 17, 33, 8, 61, 9, 40]]), None)
    firsts = []
    pick = device_sides.DeviceSides.start

    def start(sides, request):
        pick(sides, request)
        firsts.append((sides.first_plain, sides.root_logits is not None))

    monkeypatch.setattr(device_sides.DeviceSides, "start", start)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    expected, actual = target.generate(ids, **kwargs), pair.generate(ids, **kwargs)
    assert firsts == [(True, True)]
    assert actual.sequences.tolist() == expected.sequences.tolist()
    for name in ("scores", "logits"):
        for got, want in zip(getattr(actual, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and stats.rounds[0].budget == 1
    assert stats.target_forwards == len(stats.rounds)  # the prefill, and a forward in every round but the first
    host = SwiftSpecForCausalLM.from_models(target, draft, ngram_size=0)
    sampled = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20)
    drawn = pair.generate(ids, generator=torch.Generator().manual_seed(3), **sampled)
    assert firsts[-1] == (True, True)
    assert drawn.tolist() == host.generate(ids, generator=torch.Generator().manual_seed(3), **sampled).tolist()
