"""The round, written once (engine/rounds.py): one generate() call's rows and the server's running batch run
the same loop body, and both keep a record of every round in the call's stats."""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import random_prompts, tiny_model, truncated_draft

PROMPTS = random_prompts((9, 14), 0, 98)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    return SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2))


def check_rounds(stats, new_tokens: int) -> None:
    """Every round is recorded: one per verification, and what they emitted adds up to the call's tokens
    (each row verifies its root's token, the target's own, and the proposed tokens it accepted)."""
    assert stats.rounds and len(stats.rounds) == stats.verify_steps, (len(stats.rounds), stats.verify_steps)
    assert sum(r.accepted + r.rows for r in stats.rounds) == new_tokens
    assert any(r.budget > 1 for r in stats.rounds)  # the draft agrees: some rounds speculated


@pytest.mark.parametrize("served", [False, True])
def test_every_round_is_recorded_in_the_stats(pair, served):
    prompt = torch.tensor([PROMPTS[0]])
    expected = pair.target.generate(prompt, max_new_tokens=24, do_sample=False)
    engine = pair.continuous_engine() if served else None
    try:
        extra = {"swiftspec_engine": (engine, "request-0")} if served else {}
        out = pair.generate(prompt, max_new_tokens=24, do_sample=False, **extra)
    finally:
        if engine is not None:
            engine.close()
    assert out.tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == ("continuous" if served else "device"), stats.engine
    check_rounds(stats, 24)
