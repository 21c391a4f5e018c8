"""Replayed and compiled steps prepared before the rounds (capture.py's step_menu, step.prepare_steps,
adaptive.prepare_steps): every step shape a model may replay over its cache is captured (or compiled) before a round
runs one, at a call's start and when rows leave, so no round captures or compiles, the goodput policy prices every
round but the first by replayed steps, and a call after the first captures nothing, whatever tree sizes it picks.

Counted, never timed: captures by StepRunner.capture ("emulate") and compiles by torch.compile's backend ("compiled":
the backend swapped for one that counts the graphs dynamo hands it and runs them as traced), each marked as made
inside a round (engine/rounds.one_round) or outside one. Mutations checked: no preparation at the start (or none when
rows leave) makes the captures inside rounds nonzero; a padding forward that took a position breaks pack_buffers'
equality.
"""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import rounds
from hf_swiftspec.policy.goodput import GoodputPolicy
from hf_swiftspec.steps import capture
from hf_swiftspec.steps.capture import MAX_QUERIES, StepRunner, step_menu
from hf_swiftspec.steps.probes import describe
from hf_swiftspec.steps.recurrent import new_cache
from hf_swiftspec.steps.step import RowQueries, pack_buffers, run_step
from hf_swiftspec.tools.models import left_padded, random_prompts, tiny_model, truncated_draft

VOCAB = 98


@pytest.fixture
def counted(monkeypatch):
    """{"inside": [...], "outside": [...]}: what captured or compiled, inside a round or outside one (filled by the
    patches the tests add with `note`), and each round's verification time as the policy saw it ("priced")."""
    counts = {"round": False, "inside": [], "outside": [], "priced": []}
    one_round, observe_round = rounds.one_round, GoodputPolicy.observe_round

    def counted_round(*args, **kwargs):
        counts["round"] = True
        try:
            return one_round(*args, **kwargs)
        finally:
            counts["round"] = False

    def recording_observe(self, expansions, draft_s, budget, verify_s, *args, **kwargs):
        counts["priced"].append(verify_s)
        return observe_round(self, expansions, draft_s, budget, verify_s, *args, **kwargs)

    monkeypatch.setattr(rounds, "one_round", counted_round)
    monkeypatch.setattr(GoodputPolicy, "observe_round", recording_observe)
    counts["note"] = lambda what: counts["inside" if counts["round"] else "outside"].append(what)
    return counts


def test_step_menu_holds_every_bucket_up_to_the_largest_step():
    assert step_menu(8, (0,)) == ((0, 1), (0, 2), (0, 4), (0, 8))
    assert step_menu(5, (0, 1)) == ((0, 1), (0, 2), (0, 4), (0, 8), (1, 1), (1, 2), (1, 4), (1, 8))
    assert step_menu(1, (0,)) == ((0, 1),) and step_menu(10_000, (0,))[-1] == (0, MAX_QUERIES)


def test_no_round_captures_a_step(counted, monkeypatch):
    """The policy picks each round's tree size (up to 32 nodes) and the draft's depth; lone calls and a batch whose
    rows finish at different rounds: greedy tokens equal target.generate's, every capture happens outside the rounds
    (at a call's start, and between rounds when rows leave), every round but each call's first is priced, and a lone
    call after the first captures nothing."""
    capture_step = StepRunner.capture

    def noted_capture(self, key, *args, **kwargs):
        counted["note"](key[0])
        return capture_step(self, key, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "capture", noted_capture)
    target = tiny_model("llama", seed=0)
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), capture=True, round="host")
    capture_s = []
    for seed, lengths in enumerate([(7,), (30,), (3, 23, 9), (12,), (20, 4, 11)]):
        ids, mask = left_padded(random_prompts(lengths, seed, VOCAB))
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        actual = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        assert actual.tolist() == expected.tolist(), lengths
        capture_s.append(model.swiftspec_stats.capture_s)
    runners = model.captures.runners
    assert counted["inside"] == [] and len(counted["outside"]) > 0
    assert all(len(runner.prepared) >= 3 for runner in runners.values())  # 1 row, 3 rows, and fewer as rows left
    assert capture_s[0] > 0 and capture_s[2] > 0 and capture_s[1] == capture_s[3] == 0.0, capture_s
    assert min(sum(b.replays for b in r.buckets.values()) for r in runners.values()) > 0
    unpriced = [v for v in counted["priced"] if v is None]
    assert len(unpriced) == 5 and len(counted["priced"]) > 20, counted["priced"]  # each call's first round alone


def test_a_round_that_captures_is_not_priced(counted, monkeypatch):
    """Where a step's shape was not prepared (here: preparation turned off, as in a running batch) its round
    captures it, and the policy learns no verification time from that round; the rounds that only replayed are
    priced (checked round by round, not by how long a capture took)."""
    from hf_swiftspec.engine import adaptive

    capture_step = StepRunner.capture
    captured_in_round = []

    def noted_capture(self, *args, **kwargs):
        captured_in_round.append(len(counted["priced"]))  # the round under way: the next one the policy observes
        return capture_step(self, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "capture", noted_capture)
    monkeypatch.setattr(adaptive, "prepare_steps", lambda *args: None)
    target = tiny_model("llama", seed=0)
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), capture=True, tree_budget=8, round="host")
    prompt = torch.tensor([random_prompts((9,), 5, VOCAB)[0]])
    out = model.generate(prompt, max_new_tokens=40, do_sample=False)
    assert out.tolist() == target.generate(prompt, max_new_tokens=40, do_sample=False).tolist()
    capturing = set(captured_in_round)
    assert len(capturing) > 1 and all(counted["priced"][r] is None for r in capturing), counted["priced"]
    assert any(v is not None for r, v in enumerate(counted["priced"]) if r not in capturing)
    assert model.swiftspec_stats.capture_s == pytest.approx(sum(g.setup_s for g in model.captures.runners.values()))


def test_compiled_steps_compile_before_the_rounds(counted, monkeypatch):
    """compile=True on a CPU (no graphs: each fixed step with its decoder layers compiled): dynamo compiles every step
    shape before the first round, none inside a round, and nothing in later calls of other lengths, whatever tree
    sizes their rounds pick (the issue saw 4 shapes compile inside a timed call's rounds, 0.24x the default round)."""
    real_compile = torch.compile

    def counting_backend(graph_module, example_inputs):
        counted["note"](graph_module)
        return graph_module.forward  # the traced graph, run as traced: dynamo's choices, not inductor's code

    counting = lambda fn, **kwargs: real_compile(fn, backend=counting_backend, **kwargs)  # noqa: E731
    monkeypatch.setattr(capture.torch, "compile", counting)
    target = tiny_model("llama", seed=0, layers=1)
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), compile=True, round="host")
    for seed, length in enumerate((7, 30, 12, 50)):
        prompt = torch.tensor([random_prompts((length,), seed, VOCAB)[0]])
        expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
        assert model.generate(prompt, max_new_tokens=40, do_sample=False).tolist() == expected.tolist()
        if seed == 0:
            compiled_first = len(counted["outside"])
        else:
            assert model.swiftspec_stats.capture_s == 0.0
    assert counted["inside"] == [] and compiled_first > 0 and len(counted["outside"]) == compiled_first
    assert "fixed steps, compiled layers" in model.swiftspec_stats.attention


def test_a_cache_packed_by_a_padding_forward_runs_its_first_forward_as_a_fresh_one():
    """pack_buffers gives a cache that has run nothing its buffers and no position: its first forward (a prompt's
    catch-up) gives the logits it gives on a fresh cache, and the rows hold what that forward wrote."""
    model = tiny_model("llama", seed=0, layers=2)
    arch = describe(model, "draft")
    chains = [[5, 9, 13, 40, 41], [7, 8, 60]]
    outs = []
    for packed in (False, True):
        cache = new_cache(arch, 64, batch_size=2, pool=StepRunner("emulate").pool)
        with torch.no_grad():
            if packed:
                pack_buffers(model, cache, arch)
                assert cache.buffers and cache.lengths == [0, 0] and cache.prefix_lens == [0, 0]
            rows = [RowQueries.chain(chain, 0, "cpu") for chain in chains]
            outs.append(run_step(model, cache, rows, "sdpa", arch))
            assert cache.lengths == [5, 3]
    for fresh, packed in zip(*outs, strict=True):
        torch.testing.assert_close(packed, fresh)


def test_preparing_a_tapped_target_hands_its_head_nothing(monkeypatch):
    """A target tapped by an EAGLE-3 head prepares its steps too: the states those padding steps hand the tap are
    dropped (the next take() must return a forward of the call's, not theirs), and the call decodes as
    target.generate does."""
    from test_eagle3 import random_head

    from hf_swiftspec.engine import adaptive

    prepare, left = adaptive.prepare_steps, []

    def checked(target, draft, max_budget):
        prepare(target, draft, max_budget)
        left.append(dict(target.tap.captured))

    monkeypatch.setattr(adaptive, "prepare_steps", checked)
    target = tiny_model("llama", seed=1, layers=3)
    model = SwiftSpecForCausalLM.from_models(target, random_head(target), capture=True, tree_budget=6, draft_depth=3,
                                             round="host")
    prompt = torch.tensor([[5, 17, 33, 8, 5, 17, 40]])
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False),
                       target.generate(prompt, max_new_tokens=30, do_sample=False))
    assert left and all(captured == {} for captured in left)
    assert len(model.captures.runners["target"].prepared) == 1
