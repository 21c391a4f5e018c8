"""round='auto' runs transformers' own loop where the round decoded plainly and the loop measured faster
(policy/choice.LoopChoice): every call's tokens are target.generate's either way, the stats say which ran and why,
and the choice never touches a call that speculated, sampled, named its round (or target_loop=False), or has
another batch size.

The choice's clock is given (CostClock): each call of an engine costs what the test charges it, so which engine is
faster is the test's, not this machine's load."""

import pytest
import torch

import hf_swiftspec.generation as generation
from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.policy.choice import (
    PLAIN_CALL_ROUNDS, RETRY_EVERY, ROUND, TARGET_LOOP, EngineChoice, LoopChoice,
)
from hf_swiftspec.tools.models import tiny_model

from fixed_costs import CostClock

NEW = 24  # new tokens a call: at least PLAIN_CALL_ROUNDS plain rounds


def prompts(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 98, (1, 4 + 3 * i), generator=g) for i in range(n)]


def charged_clock(monkeypatch, round_s: float, loop_s: float) -> CostClock:
    """A CostClock charged round_s by each round's call and loop_s by each call of transformers' own loop."""
    clock = CostClock()
    monkeypatch.setattr(generation, "decode_adaptive", clock.charging(generation.decode_adaptive, round_s))
    monkeypatch.setattr(generation, "target_loop", clock.charging(generation.target_loop, loop_s))
    return clock


def plain_pair(**settings) -> SwiftSpecForCausalLM:
    """A draft-free pair with suffix proposals off: nothing to propose, so every round is plain."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    return SwiftSpecForCausalLM.from_models(target, None, ngram_size=0, **settings)


def on_clock(model, clock, batch: int = 1) -> LoopChoice:
    choice = model.policy().loops[batch] = LoopChoice(engines=EngineChoice(clock=clock, engines=(ROUND, TARGET_LOOP)))
    return choice


def test_the_loop_is_a_candidate_only_after_a_plain_call_and_is_forgotten_after_one_that_speculated():
    choice = LoopChoice()
    assert choice.pick() == ROUND
    choice.observe(ROUND, 64, 1.0, rounds=PLAIN_CALL_ROUNDS - 1, plain_rounds=PLAIN_CALL_ROUNDS - 1)
    assert not choice.candidate and choice.pick() == ROUND  # too short a call to judge the text by
    choice.observe(ROUND, 64, 1.0, rounds=40, plain_rounds=35)  # 88% plain: it speculated
    assert not choice.candidate
    choice.observe(ROUND, 64, 1.0, rounds=40, plain_rounds=36)  # 90% plain
    assert choice.candidate
    measuring = []
    for _ in range(2):  # the round ran two calls: the loop runs two before the rates choose
        measuring.append(choice.pick())
        choice.observe(TARGET_LOOP, 64, 0.5)
    assert measuring == [TARGET_LOOP, TARGET_LOOP]
    picks = [choice.pick() for _ in range(2 * RETRY_EVERY)]
    assert picks.count(ROUND) == 2 and picks.count(TARGET_LOOP) == 2 * RETRY_EVERY - 2, picks
    assert choice.describe(TARGET_LOOP, "target loop") == (
        "target loop: the round measured 0.50x transformers' own loop's tokens per second on this pair "
        "(over 2 and 2 calls)")
    choice.observe(ROUND, 64, 0.1, rounds=64, plain_rounds=10)  # the round's retry speculated: the round alone
    assert not choice.candidate and choice.engines.rates == {ROUND: 640.0}
    assert [choice.pick() for _ in range(RETRY_EVERY)] == [ROUND] * RETRY_EVERY


@pytest.mark.parametrize("round_s, loop_s", [(1.0, 0.5), (0.5, 1.0)], ids=["loop-faster", "round-faster"])
def test_a_plain_pair_runs_the_faster_of_the_round_and_the_loop_exactly(monkeypatch, round_s, loop_s):
    """Call 1 runs the round (all its rounds plain), then the loop and the round alternate, two calls each, then the
    faster runs, the other one call in 8; every output is target.generate's and the stats say which ran and why."""
    model = plain_pair()
    on_clock(model, charged_clock(monkeypatch, round_s, loop_s))
    engines = []
    for prompt in prompts(10):
        expected = model.target.generate(prompt, do_sample=False, max_new_tokens=NEW)
        assert model.generate(prompt, do_sample=False, max_new_tokens=NEW).tolist() == expected.tolist()
        stats = model.swiftspec_stats
        engines.append("loop" if stats.engine == "target loop" else stats.engine)
        assert stats.new_tokens == NEW and stats.engine_choice.startswith(stats.engine)
        if stats.engine == "target loop":
            assert "transformers' own loop" in stats.round_choice and "engine choice" in stats.summary()
            assert stats.target_forwards == stats.verify_steps == NEW and stats.tau == 1.0
        else:
            assert stats.plain_rounds == len(stats.rounds) == NEW
    faster, slower = ("loop", "device") if loop_s < round_s else ("device", "loop")
    assert engines[:4] == ["device", "loop"] * 2, engines
    assert engines[4:] == [faster] * 4 + [slower] + [faster], engines
    assert "measured" in model.swiftspec_stats.engine_choice


def test_the_loop_never_takes_a_call_that_samples_names_its_round_or_has_another_batch_size(monkeypatch):
    """A loop measured faster than the round (and chosen for single prompts) leaves sampled calls, a pair whose
    round is named or set target_loop=False, and a batch of two prompts to the round."""
    clock = charged_clock(monkeypatch, 1.0, 0.1)
    model = plain_pair()
    on_clock(model, clock)
    for prompt in prompts(4):
        model.generate(prompt, do_sample=False, max_new_tokens=NEW)
    assert model.swiftspec_stats.engine == "target loop"
    for seed, prompt in enumerate(prompts(3, seed=5)):  # sampling: the round's draws by seed and position
        generator = torch.Generator().manual_seed(seed)
        model.generate(prompt, do_sample=True, max_new_tokens=NEW, generator=generator)
        assert model.swiftspec_stats.engine == "device"
    batch = torch.randint(3, 98, (2, 6), generator=torch.Generator().manual_seed(9))
    for _ in range(2):  # a batch size has its own choice: its first call runs the round, whose plain
        # rounds make the loop a candidate for its second
        out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=NEW)
        assert out.tolist() == model.target.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                                     max_new_tokens=NEW).tolist()
    assert model.swiftspec_stats.engine == "target loop" and set(model.policy().loops) == {1, 2}
    for settings in (dict(round="device"), dict(target_loop=False)):
        named = plain_pair(**settings)
        on_clock(named, clock)
        for prompt in prompts(4):
            named.generate(prompt, do_sample=False, max_new_tokens=NEW)
            assert named.swiftspec_stats.engine == "device" and named.swiftspec_stats.engine_choice is None, settings


def test_the_loops_outputs_join_the_history_later_suffix_proposals_copy_from():
    """A call on transformers' own loop keeps its output (after its prompt's last ngram_size tokens) in the pair's
    output history, as a round's call does, so a later call's suffix proposals can copy it."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    model = SwiftSpecForCausalLM.from_models(target, None, ngram_size=3)
    measured = EngineChoice(rates={ROUND: 1.0, TARGET_LOOP: 2.0}, calls={ROUND: 2, TARGET_LOOP: 2},
                            engines=(ROUND, TARGET_LOOP))
    model.policy().loops[1] = LoopChoice(candidate=True, engines=measured)
    prompt = prompts(1)[0]
    out = model.generate(prompt, do_sample=False, max_new_tokens=NEW)
    assert model.swiftspec_stats.engine == "target loop"
    assert list(model.output_history.docs.values()) == [prompt[0, -3:].tolist() + out[0, prompt.shape[1]:].tolist()]
