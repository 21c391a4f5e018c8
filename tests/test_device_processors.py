"""round="device" with logits processors that read the path (engine/device_walk.py, the walk over the read logits:
the verification's forward, one read of its logits, every row walked node by node on the host with its processors fed
the path to each node, the walks copied back for the device's commits): greedy output is target.generate's token for
token (float32) with repetition_penalty, no_repeat_ngram_size, min_new_tokens, bad_words_ids and a processor of the
user's, one row and a left-padded batch, with a draft model, draft-free (suffix proposals on prompts that repeat) and
an EAGLE-3 head; stop strings and output scores / logits too; a seed draws what the host round draws, and the draws
follow the target's distribution (chi-square); one host read a round; and the strategy commits exactly as the walk on
the device does (a processor that reads the path and changes nothing gives the same trees, round for round, eager
and replayed)."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import device_sides, device_walk, rounds
from hf_swiftspec.tools.models import char_tokenizer, left_padded, random_prompts, tiny_model, truncated_draft
from sync_counter import SyncCounter
from test_eagle3 import random_head

FIXED = dict(draft_depth=3, draft_width=2, tree_budget=6)  # one shape: what a round accepts follows no clock
NEW = 24
# prompts that repeat themselves: the suffix index proposes from them (and from what the target repeats)
REPEATING = [[5, 17, 33, 8, 61, 5, 17, 33, 8, 61, 5, 17], [40, 9, 12, 40, 9, 12, 40], [7, 30, 2, 7, 30, 2, 7, 30, 2, 7],
             [11, 4, 11, 4, 11]]


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=0)
    model.generation_config.eos_token_id = None  # each test names the EOS it stops at
    return model


def pair_for(target, drafter: str, **settings) -> SwiftSpecForCausalLM:
    """The device round's pair: a draft model (the target's first two layers: it agrees often), draft-free (suffix
    proposals alone) or a random EAGLE-3 head; fixed shapes."""
    if drafter == "suffix":
        return SwiftSpecForCausalLM.from_models(target, None, round="device", ngram_size=3, tree_budget=6, **settings)
    draft = truncated_draft(target, 2) if drafter == "draft" else random_head(target)
    return SwiftSpecForCausalLM.from_models(target, draft, round="device", ngram_size=0, **FIXED, **settings)


def prompts(rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One prompt, or a left-padded batch of `rows` (prompts that repeat: the suffix index proposes from them)."""
    if rows == 1:
        return torch.tensor(REPEATING[:1]), None
    return left_padded(REPEATING[:rows])


def counted_rounds(monkeypatch) -> list[tuple[int, int]]:
    """Per round (rounds.one_round, its whole body): (host reads, tensors made of host data), as SyncCounter counts
    them. The host's walk runs on the read's host copies and host lists (nothing it calls reads the device; on a CPU
    the counter cannot tell a host tensor from a device one), so it runs uncounted."""
    seen, body, walk = [], rounds.one_round, device_walk.walk_rows

    def counted(sides, rows):
        with SyncCounter() as counter:
            keep = body(sides, rows)
        seen.append((counter.total, counter.host_tensors))
        return keep

    def uncounted(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return walk(*args, **kwargs)

    monkeypatch.setattr(rounds, "one_round", counted)
    monkeypatch.setattr(device_walk, "walk_rows", uncounted)
    return seen


def settings_that_bite(target, ids, mask) -> dict[str, dict]:
    """Per processor, generate() arguments that change this prompt's plain greedy output (asserted by the test)."""
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)[:, ids.shape[1]:]
    row = plain[0].tolist()
    return {
        "repetition_penalty": dict(repetition_penalty=1.2),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=3),  # (2 bans every repeat a suffix proposes)
        "min_new_tokens": dict(min_new_tokens=14, eos_token_id=row[4]),  # plain: row 0 would stop at its 5th token
        "bad_words_ids": dict(bad_words_ids=[[row[2]], [row[6], row[7]]]),
    }


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "bad_words_ids"])
@pytest.mark.parametrize("drafter", ["draft", "suffix"])
def test_greedy_equals_target_generate_reading_once_a_round(target, drafter, name, rows, monkeypatch):
    """Token for token target.generate's output, the processor changing it (against the plain output), proposals
    accepted (more tokens than verifications), one host read a round, and per round one tensor of host data (the walks'
    copy) and one more with suffix proposals (theirs)."""
    ids, mask = prompts(rows)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW, **settings_that_bite(target, ids, mask)[name])
    expected = target.generate(ids, **kwargs)
    assert expected.tolist() != target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW).tolist()
    pair = pair_for(target, drafter)
    seen = counted_rounds(monkeypatch)
    assert pair.generate(ids, **kwargs).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and len(seen) == len(stats.rounds)
    assert stats.new_tokens > sum(r.rows for r in stats.rounds)  # proposals were accepted
    assert {reads for reads, _ in seen} == {1}, seen
    assert max(host for _, host in seen) == (2 if drafter == "suffix" else 1), seen


class NotTwiceIn(LogitsProcessor):
    """A processor of the user's that reads the path: tokens among the last `window` of the sequence are pushed down
    (and the contexts it was called with are kept)."""

    def __init__(self, window: int):
        self.window = window
        self.seen: list[list[int]] = []

    def __call__(self, input_ids, scores):
        self.seen.append(input_ids[0].tolist())
        scores = scores.clone()
        scores[:, input_ids[0, -self.window:]] -= 4.0
        return scores


@pytest.mark.parametrize("drafter", ["draft", "suffix", "head"])
def test_a_processor_of_the_users_is_fed_the_path_to_each_node(target, drafter):
    """A LogitsProcessor subclass the user wrote (so the device round cannot know it ignores the path): output equal to
    target.generate's, which it changes, and every context it saw on the walk is the call's output up to some token
    (the path the walk took, never a branch it did not)."""
    ids = torch.tensor(REPEATING[:1])
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW,
                               logits_processor=LogitsProcessorList([NotTwiceIn(3)]))
    assert expected.tolist() != target.generate(ids, do_sample=False, max_new_tokens=NEW).tolist()
    processor = NotTwiceIn(3)
    out = pair_for(target, drafter).generate(ids, do_sample=False, max_new_tokens=NEW,
                                             logits_processor=LogitsProcessorList([processor]))
    assert out.tolist() == expected.tolist()
    final = out[0].tolist()
    assert len(processor.seen) >= NEW and all(seen == final[: len(seen)] for seen in processor.seen)


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("drafter", ["draft", "suffix", "head"])
def test_the_walk_over_the_read_logits_commits_as_the_walk_on_the_device(target, drafter, capture, monkeypatch):
    """A repetition penalty of 1.0 reads the path (the walk over the read logits runs) and changes nothing: every
    round's selected tree and what it accepted equal the walk on the device's round for round (no processor), on a
    left-padded batch of four, so the target cache's commit, the drafter's (a draft model's, a head's catch-up on
    the target's states handed from the forward's phase) and the rows' advance are the fused verification's. Replayed
    (capture=True), a value either phase baked in would grow other trees."""
    ids, mask = prompts(4)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    trees, grow = [], device_sides.DeviceSides.grow

    def recorded(sides, proposed, shape, inputs):
        out = grow(sides, proposed, shape, inputs)
        trees[-1].append((out.subtree.tokens.clone(), out.subtree.parents.clone()))
        return out

    monkeypatch.setattr(device_sides.DeviceSides, "grow", recorded)
    records = []
    for processors in (None, LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.0)])):
        trees.append([])
        pair = pair_for(target, drafter, capture=capture)
        assert pair.generate(ids, logits_processor=processors, **kwargs).tolist() == target.generate(
            ids, **kwargs).tolist()
        stats = pair.swiftspec_stats
        records.append([(r.budget, r.accepted, r.rows) for r in stats.rounds])
        assert stats.engine == "device" and "eager:" not in stats.attention
    assert records[0] == records[1]
    assert len(trees[0]) == len(trees[1]) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*trees))


def test_replayed_phases_bake_in_no_processor(target):
    """With capture=True the strategy's two phases run on the models without the rows' rules: a later call with other
    processors (another penalty, no_repeat_ngram_size) replays the graphs the first captured and still decodes
    target.generate's tokens (a penalty baked into a replayed phase would give the first call's)."""
    pair = pair_for(target, "draft", capture=True)
    ids, mask = prompts(4)
    captured = []
    for settings in (dict(repetition_penalty=1.5), dict(repetition_penalty=3.0), dict(no_repeat_ngram_size=2)):
        kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW, **settings)
        assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist(), settings
        attention = pair.swiftspec_stats.attention
        assert "replayed phases, emulate" in attention and "eager:" not in attention
        captured.append(int(attention.split(" captured by this call")[0].rsplit(" ", 1)[1]))
    assert captured[0] >= 3 and max(captured[1:]) < captured[0], captured  # the forward's and the commit's replayed


def test_sampling_draws_what_the_host_round_draws(target):
    """Under one seed, each row's sampled tokens with a repetition penalty and no_repeat_ngram_size are the host
    round's (the same walk, noise keyed by seed, row and position), and not greedy's."""
    draft = truncated_draft(target, 2)
    device = SwiftSpecForCausalLM.from_models(target, draft, round="device", ngram_size=0, **FIXED)
    host = SwiftSpecForCausalLM.from_models(target, draft, round="host", ngram_size=0, **FIXED)
    ids, mask = left_padded(random_prompts((3, 17, 9, 1), 2, 98))
    kwargs = dict(attention_mask=mask, max_new_tokens=20, temperature=0.9, top_k=20, repetition_penalty=1.4,
                  no_repeat_ngram_size=3)
    drawn = device.generate(ids, do_sample=True, generator=torch.Generator().manual_seed(11), **kwargs)
    assert drawn.tolist() == host.generate(ids, do_sample=True, generator=torch.Generator().manual_seed(11),
                                           **kwargs).tolist()
    assert device.swiftspec_stats.engine == "device" and host.swiftspec_stats.engine == "serial"
    assert drawn.tolist() != device.generate(ids, do_sample=False, **kwargs).tolist()


@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram_size"])
def test_sampled_draws_follow_the_targets_distribution(name):
    """The device round's draws with a processor that reads the path, against the target's exact joint distribution
    of the first two new tokens (test_sampling.py's), by chi-square: 1,500 rows of one batched call, each its own draw,
    many second tokens from an accepted tree node (whose scores the host's walk processed along its path)."""
    from test_sampling import ALPHA, PROCESSORS, VOCAB, exact_joint, pooled_chisquare

    kwargs, processors = PROCESSORS[name]
    model = tiny_model("llama", seed=3, vocab_size=VOCAB)
    model.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(model, truncated_draft(model, 2), round="device", ngram_size=0,
                                            draft_depth=1, draft_width=3, tree_budget=6)
    prompt = torch.tensor([[3, 7, 5, 9]])
    draws = 1500
    ids = prompt.repeat(draws, 1)
    out = pair.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=2,
                        generator=torch.Generator().manual_seed(0), **kwargs)
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and sum(r.accepted for r in stats.rounds) > draws // 4
    counts = torch.bincount(out[:, -2] * VOCAB + out[:, -1], minlength=VOCAB * VOCAB).double()
    expected = exact_joint(model, prompt, LogitsProcessorList(processors))
    pvalue = pooled_chisquare(counts, expected.flatten() * draws)
    assert pvalue > ALPHA, f"p={pvalue:.2e}: the device round's draws with {name} do not follow the target's"


def test_stop_strings_and_rows_that_decode_on(target):
    """Stop strings, which the host's walk applies after each token: with no EOS id generate decodes a row on past its
    stop string until every row's has appeared (the row then walks with no stop rule); equal to target.generate's
    with a repetition penalty."""
    tok = char_tokenizer()
    ids, mask = left_padded(random_prompts((3, 17, 9, 1), 5, 98))
    penalty = dict(attention_mask=mask, do_sample=False, repetition_penalty=1.3)
    free = target.generate(ids, max_new_tokens=40, **penalty)[:, ids.shape[1]:]
    stops = [tok.decode(free[b, at: at + 2]) for b, at in enumerate((4, 20, 9, 13))]
    kwargs = dict(max_new_tokens=40, stop_strings=stops, tokenizer=tok, **penalty)
    expected = target.generate(ids, **kwargs)
    actual = pair_for(target, "draft").generate(ids, **kwargs)
    assert actual.tolist() == expected.tolist()
    out = actual[:, ids.shape[1]:]
    stopped_at = [next(t + 1 for t in range(out.shape[1]) if tok.decode(row[: t + 1]).endswith(tuple(stops)))
                  for row in out]
    assert max(stopped_at) == out.shape[1] < 40 and min(stopped_at) < out.shape[1] - 5  # rows decoded on


@pytest.mark.parametrize("sized", ["fixed", "by-the-policy"])
@pytest.mark.parametrize("rows", [1, 4])
def test_output_scores_and_logits_are_generates(target, rows, sized):
    """return_dict_in_generate's scores (the processed ones, which the host's walk made) and logits: each step's equals
    target.generate's, with a repetition penalty. Where the policy sizes the trees, round 1 is plain and its roots'
    logits are the prefill's (the strategy's forward phase runs no forward then)."""
    ids, mask = prompts(rows)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, repetition_penalty=1.5,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    pair = pair_for(target, "draft") if sized == "fixed" else SwiftSpecForCausalLM.from_models(
        target, truncated_draft(target, 2), round="device", ngram_size=0)
    expected, actual = target.generate(ids, **kwargs), pair.generate(ids, **kwargs)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    for name in ("scores", "logits"):
        for got, want in zip(getattr(actual, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    stats = pair.swiftspec_stats
    assert stats.engine == "device"
    if sized != "fixed":  # round 1 from the prefill: one target forward a round but the first
        assert stats.rounds[0].budget == 1 and stats.target_forwards == len(stats.rounds)
