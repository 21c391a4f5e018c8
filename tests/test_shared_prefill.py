"""Requests for one prompt taken into the running batch together (a request's n answers) share its prefill: the
target runs the prompt once, each copy's row gets its KV by a copy (its own sampler, seed and stop rule set over it),
and every answer is still the target's own (greedy: target.generate; sampled with a seed: the pair's lone call with
that seed), on the host round's running batch and the device round's."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_swiftspec.engine.workers import TargetWorker
from test_continuous import PROMPTS, pair_of


def decode_together(pair, engine, calls: dict[str, dict]) -> dict[str, torch.Tensor]:
    """generate() for each named call, on threads of their own, taken in by the engine together."""
    out, errors = {}, {}

    def run(key: str) -> None:
        try:
            out[key] = pair.generate(swiftspec_engine=(engine, key), **calls[key])
        except Exception as error:  # noqa: BLE001 (reported below)
            errors[key] = error

    threads = [threading.Thread(target=run, args=(key,)) for key in calls]
    with engine.together(list(calls), lambda: any(t.is_alive() for t in threads)):
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return out


def counting_prefills(monkeypatch) -> list[int]:
    """Each target prefill's prompt length, as TargetWorker.prefill_pieces (the host round's running batch) or a
    Prefill (the device round's) runs it."""
    from hf_swiftspec.engine.continuous_device import Prefill

    prefills = []
    real, device = TargetWorker.prefill_pieces, Prefill.__init__

    def counted(self, prompt, *args, **kwargs):
        prefills.append(prompt.shape[1])
        return (yield from real(self, prompt, *args, **kwargs))

    def counted_device(self, sides, request, *args):
        prefills.append(request.prompt.shape[1])
        device(self, sides, request, *args)

    monkeypatch.setattr(TargetWorker, "prefill_pieces", counted)
    monkeypatch.setattr(Prefill, "__init__", counted_device)
    return prefills


@pytest.mark.parametrize("round_", ["host", "device"])
def test_copies_of_a_prompt_share_its_prefill_and_answer_as_the_target(monkeypatch, round_):
    prefills = counting_prefills(monkeypatch)
    from hf_swiftspec.engine.continuous_device import DeviceContinuousEngine

    pair = pair_of("llama", round=round_)
    engine = pair.continuous_engine()
    assert isinstance(engine, DeviceContinuousEngine) == (round_ == "device")
    prompt, other = torch.tensor([PROMPTS[1]]), torch.tensor([PROMPTS[5]])
    calls = {f"greedy-{i}": dict(input_ids=prompt, max_new_tokens=15, do_sample=False) for i in range(3)}
    calls |= {f"seeded-{i}": dict(input_ids=prompt, max_new_tokens=15, do_sample=True, temperature=1.0,
                                  generator=torch.Generator().manual_seed(i)) for i in range(2)}
    calls["other"] = dict(input_ids=other, max_new_tokens=15, do_sample=False)
    try:
        out = decode_together(pair, engine, calls)
    finally:
        engine.close()
    assert sorted(prefills) == sorted([prompt.shape[1], other.shape[1]])  # the shared prompt ran once
    assert max(engine.rounds_by_batch) == 6  # every copy decoded in its own row
    expected = pair.target.generate(prompt, max_new_tokens=15, do_sample=False)
    for i in range(3):
        assert out[f"greedy-{i}"].tolist() == expected.tolist()
    assert out["other"].tolist() == pair.target.generate(other, max_new_tokens=15, do_sample=False).tolist()
    for i in range(2):
        lone = pair.generate(prompt, max_new_tokens=15, do_sample=True, temperature=1.0,
                             generator=torch.Generator().manual_seed(i))
        assert out[f"seeded-{i}"].tolist() == lone.tolist()
    assert out["seeded-0"].tolist() != out["seeded-1"].tolist()


def test_a_prompt_asked_for_another_length_prefills_on_its_own(monkeypatch):
    """A copy needs the same cache capacity as the row it copies: another max_new_tokens prefills alone."""
    prefills = counting_prefills(monkeypatch)
    pair = pair_of("llama")
    engine = pair.continuous_engine()
    prompt = torch.tensor([PROMPTS[2]])
    try:
        out = decode_together(pair, engine, {"a": dict(input_ids=prompt, max_new_tokens=9, do_sample=False),
                                             "b": dict(input_ids=prompt, max_new_tokens=14, do_sample=False)})
    finally:
        engine.close()
    assert len(prefills) == 2
    for key, new in (("a", 9), ("b", 14)):
        assert out[key].tolist() == pair.target.generate(prompt, max_new_tokens=new, do_sample=False).tolist()
