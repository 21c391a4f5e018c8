"""round="device" with a draft that proposes from the host (drafters/device_host.py): a draft with another tokenizer
than the target's (its tree grows in its own tokens, its branches become target tokens through their text) and a draft
whose context is shorter than the call's (it reads the text in windows of its own positions). Their nodes join the
suffix proposal's in the round's one pinned copy; the device side of the round is draft-free.

Checked against target.generate token for token (greedy, float32: one row, a left-padded batch, EOS, max_new_tokens,
stop strings, the running batch), against the host round's draws under one seed (sampling: the same Gumbel-max rule,
the target's distribution, which test_other_tokenizer.py checks by chi-square), with the host proposals accepted
(tau > 1, with ngram_size=0 so that no suffix proposal does it), and the device round's own reads and copies counted.
The pairs are test_other_tokenizer.py's: tokenizers trained in the test (byte-level, SentencePiece-like, spaces that
end words), random models over two of them (nothing agrees but the text), two text models that continue one text in
their own tokens, and a gpt2 target of 256 positions with a 32-position draft (learned positions: a row past them would
fail in the embedding).
"""

import pytest
import torch

from hf_swiftspec import SwiftSpecConfig, SwiftSpecForCausalLM
from hf_swiftspec.drafters.device_host import HostProposals
from hf_swiftspec.engine import rounds
from hf_swiftspec.engine.device_sides import DeviceSides, choose_round
from hf_swiftspec.steps.probes import describe
from hf_swiftspec.tools.models import left_padded
from sync_counter import SyncCounter
from test_device_sides import OnCuda
from test_other_tokenizer import TEXTS, random_pair, short_context_pair, text_pair, tokenizers  # noqa: F401 (fixtures)

DEVICE = dict(round="device")
FIXED = dict(tree_budget=8, draft_depth=4)  # one shape: what a round accepts follows no clock


def greedy(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, **kwargs).tolist()


def pair_of(target, draft, tokenizers, style="pieces", **settings):
    return SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tokenizers["bytes"],
                                            draft_tokenizer=tokenizers[style], **DEVICE, **settings)


def assert_device_round(model, why: str) -> None:
    stats = model.swiftspec_stats
    assert stats.engine == "device" and f"on the host ({why}" in stats.attention, stats.attention


@pytest.mark.parametrize("settings", [FIXED, dict(FIXED, ngram_size=0), dict()], ids=["fixed", "no-ngram", "adaptive"])
def test_a_draft_of_another_tokenizer_decodes_as_target_generate(tokenizers, random_pair, text_pair, settings):
    """Random models (every translated node a guess) and text models (the draft continues the target's text in its own
    tokens, so its translated branches are accepted), two prompts each: target.generate's tokens."""
    tt = tokenizers["bytes"]
    for target, draft in (random_pair, text_pair):
        model = pair_of(target, draft, tokenizers, **settings)
        for text in TEXTS[:2]:
            ids = tt(text, return_tensors="pt").input_ids
            assert greedy(model, ids, max_new_tokens=24) == greedy(target, ids, max_new_tokens=24)
            first = first if text != TEXTS[0] else model.swiftspec_stats  # (later calls copy its output too)
        assert_device_round(model, "another tokenizer")
        assert first.translation is not None
        assert first.draft_forwards > 0 or "draft_depth" not in settings  # (the policy may skip it)
    if settings.get("ngram_size") == 0:  # nothing but the translated branches proposed: their tokens were accepted
        assert first.tau > 3.0, first.summary()


def test_a_draft_whose_spaces_end_words_takes_its_tail_back(tokenizers):
    """With the trailing-space tokenizer the draft's last word re-encodes once the target's next word arrives ("delt",
    "a" becomes "delta "): its tail is taken back and run again, every branch re-tokenised from its text, and the
    tokens stay the target's."""
    from hf_swiftspec.tools.models import text_model

    tt, dt = tokenizers["bytes"], tokenizers["trailing"]
    target = text_model(tt, seed=0)
    target.generation_config.eos_token_id = None
    model = pair_of(target, text_model(dt, seed=1, layers=1), tokenizers, "trailing", **FIXED, ngram_size=0)
    ids = tt("alpha bravo charlie delta", return_tensors="pt").input_ids
    assert greedy(model, ids, max_new_tokens=40) == greedy(target, ids, max_new_tokens=40)
    stats = model.swiftspec_stats
    assert stats.translation.taken_back > 0 and stats.translation.nodes > stats.translation.mapped, stats.summary()


@pytest.mark.parametrize("capture", [False, True])
def test_a_left_padded_batch_decodes_each_row_as_target_generate(tokenizers, random_pair, text_pair, capture):
    """Eager phases, and replayed ones (capture=True on a CPU: the emulating stand-in, whose replay reuses what the
    first round baked in, so host proposals that missed the graph's inputs would decode other tokens)."""
    tt = tokenizers["bytes"]
    ids, mask = left_padded([tt(text).input_ids for text in TEXTS], pad=tt.pad_token_id)
    kwargs = dict(attention_mask=mask, max_new_tokens=20)
    for target, draft in (random_pair, text_pair):
        model = pair_of(target, draft, tokenizers, capture=capture, **FIXED)
        assert greedy(model, ids, **kwargs) == greedy(target, ids, **kwargs)
        assert_device_round(model, "another tokenizer")
        assert ("replayed phases, emulate" in model.swiftspec_stats.attention) == capture
    assert model.swiftspec_stats.tau > 2.0  # the text pair's rows took translated branches


def test_eos_max_new_tokens_and_stop_strings_end_where_target_generate_ends(tokenizers, text_pair):
    """EOS reached mid-text, a stop string (cut on the host after the read: the draft follows the cut text), and a
    batch whose rows stop at other rounds and decode on; with the translated branches accepted on the way."""
    tt = tokenizers["bytes"]
    target, draft = text_pair
    model = pair_of(target, draft, tokenizers, **FIXED, ngram_size=0)
    ids = tt("alpha bravo", return_tensors="pt").input_ids
    eos = tt(" hotel", add_special_tokens=False).input_ids[0]  # a token the target reaches mid-text
    for kwargs in (dict(eos_token_id=eos), dict(stop_strings=["juli"], tokenizer=tt), dict(max_new_tokens=7)):
        kwargs = dict(dict(max_new_tokens=40), **kwargs)
        out = greedy(model, ids, **kwargs)
        assert out == greedy(target, ids, **kwargs)
        assert len(out[0]) < ids.shape[1] + 40  # it did stop early
        assert model.swiftspec_stats.tau > 1.5, model.swiftspec_stats.summary()
    rows, mask = left_padded([tt(text).input_ids for text in TEXTS], pad=tt.pad_token_id)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, stop_strings=["hotel", "mike"], tokenizer=tt)
    assert greedy(model, rows, **kwargs) == greedy(target, rows, **kwargs)


def test_sampling_draws_what_the_host_round_draws(tokenizers, text_pair):
    """Under one seed, each row's sampled tokens are the host round's (its rule: the target's distribution), and not
    greedy's."""
    tt = tokenizers["bytes"]
    target, draft = text_pair
    device = pair_of(target, draft, tokenizers, tree_budget=6, draft_depth=2)
    host = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=tokenizers["pieces"],
                                            round="host", tree_budget=6, draft_depth=2)
    ids, mask = left_padded([tt(text).input_ids for text in TEXTS], pad=tt.pad_token_id)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=1.5, top_k=0)
    drawn = device.generate(ids, generator=torch.Generator().manual_seed(3), **kwargs).tolist()
    assert drawn == host.generate(ids, generator=torch.Generator().manual_seed(3), **kwargs).tolist()
    assert device.swiftspec_stats.engine == "device" and host.swiftspec_stats.engine == "serial"
    assert sum(r.accepted for r in device.swiftspec_stats.rounds) > 0  # translated nodes were drawn
    assert drawn != greedy(device, ids, attention_mask=mask, max_new_tokens=16)


@pytest.mark.parametrize("settings", [dict(tree_budget=8, draft_depth=3), dict()], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("prompt_len", [10, 40])
def test_a_draft_with_a_shorter_context_drafts_past_it(short_context_pair, settings, prompt_len):
    """Its context (32) ends long before the call's (up to 140 positions): it reads the last part of a prompt that does
    not fit, and re-reads a window of the text each time its own fills, drafting to the end."""
    target, draft = short_context_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, **DEVICE, **settings)
    ids = torch.randint(3, 98, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    assert greedy(model, ids, max_new_tokens=100) == greedy(target, ids, max_new_tokens=100)
    assert_device_round(model, "its context of 32 positions")
    stats = model.swiftspec_stats
    assert stats.draft_slides >= 2 and stats.tau > 1.2, stats.summary()


def test_a_batch_with_a_shorter_draft_context(short_context_pair):
    target, draft = short_context_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, **DEVICE, tree_budget=6, draft_depth=2, ngram_size=0)
    ids, mask = left_padded([list(range(5, 25)), list(range(30, 70)), [7, 8, 9]])
    kwargs = dict(attention_mask=mask, max_new_tokens=60)
    assert greedy(model, ids, **kwargs) == greedy(target, ids, **kwargs)
    assert model.swiftspec_stats.draft_slides >= 2 and model.swiftspec_stats.tau > 1.2


class DeviceSideCounter(SyncCounter):
    """SyncCounter of the device round's own phases: what the host drafter does inside HostProposals.grow and .accept
    (its forwards, its trees' reads, the tensors it builds from its token lists: the host side of the round, whose
    forwards a GPU runs at their own pace) is left out; everything else of the round's body is counted (the suffix
    proposals, the pack, the growth and verification phases, the read, the stop criteria, the policy)."""

    active: "DeviceSideCounter | None" = None

    def __init__(self):
        super().__init__()
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def counted_rounds(monkeypatch) -> list[tuple[int, int]]:
    """Per round (rounds.one_round, the round's whole body): (host reads, tensors made of host data) of the device
    round's own phases (DeviceSideCounter)."""
    seen, body = [], rounds.one_round

    def counted(sides, rows):
        assert isinstance(sides, DeviceSides) and sides.proposer is not None
        with DeviceSideCounter() as counter:
            DeviceSideCounter.active = counter
            keep = body(sides, rows)
        DeviceSideCounter.active = None
        seen.append((counter.total, counter.host_tensors))
        return keep

    def host_side(method):
        def run(*args, **kwargs):
            counter = DeviceSideCounter.active
            counter.paused = True
            try:
                return method(*args, **kwargs)
            finally:
                counter.paused = False
        return run

    monkeypatch.setattr(rounds, "one_round", counted)
    for name in ("grow", "accept"):
        monkeypatch.setattr(HostProposals, name, host_side(getattr(HostProposals, name)))
    return seen


def test_a_round_reads_once_and_copies_once_on_the_device_side(tokenizers, text_pair, short_context_pair,
                                                                monkeypatch):
    """One row and a left-padded batch of each kind of host drafter: at most one host read and one tensor of host data
    (the host proposals' one pinned copy) a round in the device round's own phases, every round of the call counted."""
    tt = tokenizers["bytes"]
    seen = counted_rounds(monkeypatch)
    target, draft = text_pair
    model = pair_of(target, draft, tokenizers, **FIXED)
    ids, mask = left_padded([tt(text).input_ids for text in TEXTS], pad=tt.pad_token_id)
    short_target, short_draft = short_context_pair
    short = SwiftSpecForCausalLM.from_models(short_target, short_draft, **DEVICE, tree_budget=6, draft_depth=2)
    short_ids, short_mask = left_padded([list(range(5, 25)), [7, 8, 9]])
    for pair, reference, calls in ((model, target, [(ids[:1], None), (ids, mask)]),
                                   (short, short_target, [(short_ids[:1], None), (short_ids, short_mask)])):
        for prompt, attention in calls:
            kwargs = dict(attention_mask=attention, max_new_tokens=40)
            start = len(seen)
            assert greedy(pair, prompt, **kwargs) == greedy(reference, prompt, **kwargs)
            rounds_seen = seen[start:]
            assert len(rounds_seen) == len(pair.swiftspec_stats.rounds) > 2
            assert max(reads for reads, _ in rounds_seen) == 1, rounds_seen
            assert max(copies for _, copies in rounds_seen) == 1, rounds_seen
            assert pair.swiftspec_stats.tau > 1.5


def test_auto_takes_the_device_round_for_both_drafts(random_pair, short_context_pair, tokenizers):
    """round="auto", here on CUDA: neither draft sends the call to the host round any more."""
    from hf_swiftspec.drafters.vocabulary import Vocabularies

    config = SwiftSpecConfig(ngram_size=3)
    vocabularies = Vocabularies.between(tokenizers["bytes"], tokenizers["pieces"])
    for (target, draft), vocab in ((random_pair, vocabularies), (short_context_pair, None)):
        architectures = describe(target, "target"), describe(draft, "draft")
        assert choose_round(config, OnCuda(target), OnCuda(draft), architectures, [], None, None, False, [],
                            vocabularies=vocab) == ("device", "round='auto': the device round")


def test_copies_of_a_prompt_share_its_prefill_each_with_a_drafter_of_its_own(tokenizers, text_pair, monkeypatch):
    """A request's n answers in the device round's running batch (test_shared_prefill.py): the prompt's KV is copied,
    and each copy's row gets a host drafter of its own, started on the prompt; greedy copies answer as target.generate,
    seeded ones as the pair's lone call with that seed."""
    from test_shared_prefill import counting_prefills, decode_together

    prefills = counting_prefills(monkeypatch)
    tt = tokenizers["bytes"]
    target, draft = text_pair
    model = pair_of(target, draft, tokenizers, **FIXED)
    engine = model.continuous_engine(latency_guard=False)
    prompt = tt(TEXTS[0], return_tensors="pt").input_ids
    calls = {f"greedy-{i}": dict(input_ids=prompt, max_new_tokens=16, do_sample=False) for i in range(2)}
    calls |= {f"seeded-{i}": dict(input_ids=prompt, max_new_tokens=16, do_sample=True, temperature=1.5,
                                  generator=torch.Generator().manual_seed(i)) for i in range(2)}
    try:
        out = decode_together(model, engine, calls)
    finally:
        engine.close()
    assert prefills == [prompt.shape[1]] and max(engine.rounds_by_batch) == 4  # one prefill, a row per copy
    for i in range(2):
        assert out[f"greedy-{i}"].tolist() == greedy(target, prompt, max_new_tokens=16)
        lone = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=1.5,
                              generator=torch.Generator().manual_seed(i))
        assert out[f"seeded-{i}"].tolist() == lone.tolist()
    assert engine.usage.accepted > engine.usage.verifications  # each copy's translated branches were accepted
