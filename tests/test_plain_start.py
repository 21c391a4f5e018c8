"""A request that finds the device round's running batch idle gets its first token with its prefill
(engine/continuous_device.py's PrefillGroup with roots, DeviceSides.starts_plain): the target's last prefill piece
runs each prompt's root too and keeps its logits, and the batch's first round is plain, with no forward, as a lone
call's round 1 is. Before, the first token waited for the draft's growth and a verification forward after the prefill.

Checked against independent references: every answer is target.generate's (greedy, float32) or what its seed draws
(gumbel_reference); the kept logits are the target's own last logits over the whole prompt; the first token is
streamed after the prefill's forwards alone (a forward hook counts the target's); a request joining rows that decode
still has its root verified in a round (nothing runs twice, and nothing is skipped)."""

from __future__ import annotations

import pytest
import torch

from hf_swiftspec.engine import continuous
from hf_swiftspec.engine.continuous_device import DeviceContinuousEngine, PrefillCosts, PREFILL_TOKENS, PrefillGroup
from hf_swiftspec.tools.models import random_prompts
from gumbel_reference import seeded_draws
from test_continuous import pair_of, relay_calls
from test_continuous_device import assert_answers_are_target_generates
from test_shared_prefill import decode_together

SIZED = dict(round="device")  # the policy sizes every round (no tree_budget): batches start plain


class ForwardsAtTokens:
    """A streamer noting how many target forwards had run when each of its puts came (the first put is the prompt's)."""

    def __init__(self, forwards: list):
        self.forwards, self.at = forwards, []

    def put(self, value) -> None:
        self.at.append(len(self.forwards))

    def end(self) -> None:
        pass


def counting_forwards(model) -> tuple[list, object]:
    forwards = []
    return forwards, model.register_forward_pre_hook(lambda module, args: forwards.append(1))


def kept_root_logits(monkeypatch) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt, its root's kept logits (V,)) for each row of each finished group that ran the roots."""
    kept, keep = [], PrefillGroup.keep_root_logits

    def watched(self, logits, windows, ends):
        before = [p.root_logits for p in self.prefills]
        keep(self, logits, windows, ends)
        kept.extend((list(p.sequence), p.root_logits[0, 0].clone())
                    for p, b in zip(self.prefills, before) if p.root_logits is not None and b is None)

    monkeypatch.setattr(PrefillGroup, "keep_root_logits", watched)
    return kept


@pytest.mark.parametrize("family", ["llama", "draft-free"])
@pytest.mark.parametrize("piece", [continuous.PREFILL_PIECE, 8])  # the whole prompt; 8 tokens a forward
def test_a_request_finding_the_batch_idle_streams_its_first_token_after_its_prefill_alone(family, piece, monkeypatch):
    monkeypatch.setattr(continuous, "PREFILL_PIECE", piece)
    kept = kept_root_logits(monkeypatch)
    pair = pair_of(family, **SIZED)
    target = pair.target
    target.generation_config.eos_token_id = None
    engine = pair.continuous_engine()
    assert isinstance(engine, DeviceContinuousEngine)
    forwards, hook = counting_forwards(target)
    try:
        for prompt, new in zip(random_prompts((20, 1, 33), 7, 98), (12, 6, 9)):
            call = dict(input_ids=torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
            forwards.clear()
            streamer = ForwardsAtTokens(forwards)
            out = pair.generate(swiftspec_engine=(engine, f"alone-{len(prompt)}"), streamer=streamer, **call)
            assert out.tolist() == target.generate(**call).tolist()
            # its prompt, root included, in pieces of `piece` tokens: those forwards, then the first token, no other
            assert streamer.at[1] == -(-len(prompt) // piece), streamer.at
    finally:
        hook.remove()
        engine.close()
    assert [len(p) for p, _ in kept] == [20, 1, 33]
    for prompt, logits in kept:
        torch.testing.assert_close(logits, target(torch.tensor([prompt])).logits[0, -1].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("piece", [continuous.PREFILL_PIECE, 8])
def test_requests_joining_an_idle_batch_together_start_it_with_a_plain_round(piece, monkeypatch):
    """Five prompts (one of one token) prefilled in one group, their roots ending in different pieces: the batch's
    first round runs no target forward, and every answer is target.generate's."""
    monkeypatch.setattr(continuous, "PREFILL_PIECE", piece)
    monkeypatch.setattr(PrefillCosts, "fixed_tokens", lambda self: float(PREFILL_TOKENS))  # one group
    kept = kept_root_logits(monkeypatch)
    pair = pair_of("llama", **SIZED)
    target = pair.target
    target.generation_config.eos_token_id = None
    calls = {f"r{i}": dict(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False)
             for i, (p, n) in enumerate(zip(random_prompts((3, 23, 1, 30, 12), 4, 98), (12, 5, 9, 14, 7)))}
    engine = pair.continuous_engine()
    forwards, hook = counting_forwards(target)
    first_rounds, one_round = [], DeviceContinuousEngine.one_round

    def counted(self):
        before = len(forwards)
        one_round(self)
        first_rounds.append(len(forwards) - before)

    monkeypatch.setattr(DeviceContinuousEngine, "one_round", counted)
    try:
        out = decode_together(pair, engine, calls)
    finally:
        hook.remove()
        engine.close()
    assert_answers_are_target_generates(target, list(calls.values()), [out[key] for key in calls])
    assert first_rounds[0] == 0 and first_rounds[1] == 1, first_rounds  # plain, then a verification forward
    assert sorted(len(p) for p, _ in kept) == [1, 3, 12, 23, 30]


def test_a_sampled_request_finding_the_batch_idle_draws_its_first_token_from_the_prefills_logits():
    pair = pair_of("llama", **SIZED)
    target = pair.target
    target.generation_config.eos_token_id = None
    prompt = torch.tensor([random_prompts((17,), 9, 98)[0]])
    engine = pair.continuous_engine()
    try:
        out = pair.generate(swiftspec_engine=(engine, "sampled"), input_ids=prompt, max_new_tokens=16, do_sample=True,
                            temperature=0.9, top_k=20, generator=torch.Generator().manual_seed(5))
    finally:
        engine.close()
    drawn = seeded_draws(target, prompt, torch.Generator().manual_seed(5), temperature=0.9, top_k=20,
                         max_new_tokens=16)
    assert out.tolist() == drawn.tolist()


def test_a_request_joining_rows_that_decode_has_its_root_verified_in_a_round(monkeypatch):
    """The second request joins while the first decodes: its group runs no root (its first round is the batch's
    next, a tree round), and both answers are target.generate's."""
    kept = kept_root_logits(monkeypatch)
    roots_run, init = [], PrefillGroup.__init__

    def noted(self, sides, prefills, roots=False):
        roots_run.append(roots)
        init(self, sides, prefills, roots)

    monkeypatch.setattr(PrefillGroup, "__init__", noted)
    pair = pair_of("llama", **SIZED)
    target = pair.target
    target.generation_config.eos_token_id = None
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False)
             for p, n in zip(random_prompts((9, 14), 11, 98), (30, 10))]
    engine = pair.continuous_engine()
    try:
        out = relay_calls(pair, engine, calls, at=(3, 1), wait_s=300)
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls, out)
    assert roots_run == [True, False]
    assert [len(p) for p, _ in kept] == [9]
