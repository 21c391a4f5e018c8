"""Batches: every row decodes exactly as target.generate decodes it in the same left-padded batch.

Rows of different prompt lengths, rows that stop at different rounds (one in its first), max_length
reached mid-round, rows that decode on after a criterion fired (no EOS: generate's own rule), scores
and logits per row, pipeline(batch_size), num_return_sequences, and the exact fallback where a row
cannot be walked alone. Sampling: rows are independent draws from the target's distribution.
"""

import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, pipeline

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools import sweep
from hf_swiftspec.policy.goodput import GoodputPolicy
from hf_swiftspec.tools.models import (
    char_tokenizer, left_padded, random_prompts, sharpen, tiny_gpt2, tiny_model, truncated_draft,
)
from fixed_costs import given_costs
from test_sampling import VOCAB as SMALL_VOCAB
from test_sampling import exact_joint, pooled_chisquare, warpers

VOCAB = 98
LENGTHS = (3, 23, 9, 1)  # 23 reaches past gemma3's 16-token window


def gpt2_pair():
    """Learned absolute positions, no rotary: a family apart from llama."""
    target = tiny_gpt2(VOCAB, n_positions=256)
    return target, sweep.perturbed_copy(target)


def build(family: str):
    if family == "llama":
        target = tiny_model("llama", seed=0)
        return target, truncated_draft(target, 2)
    if family == "gemma3":  # sliding-window layers beside full ones
        target = sweep.tiny_of_type("gemma3_text", seed=0, vocab_size=VOCAB)
        sharpen(target, 4.0)
        return target, sweep.perturbed_copy(target)
    return gpt2_pair()


@pytest.fixture(scope="module")
def pairs():
    return {family: build(family) for family in ("llama", "gemma3", "gpt2")}


def padded_batch(lengths=LENGTHS, seed=0, vocab=VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts (B, L) of the given lengths and their attention_mask."""
    return left_padded(random_prompts(lengths, seed, vocab))


def same_as_target(model, ids, mask, **kwargs):
    expected = model.target.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    actual = model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    assert actual.tolist() == expected.tolist(), "\n".join(
        f"row {b}: plain {e}\n       swift {a}" for b, (e, a) in enumerate(zip(expected.tolist(), actual.tolist()))
        if e != a
    )
    return expected


@pytest.mark.parametrize("settings", [{}, dict(tree_budget=8, draft_depth=4)], ids=["default", "fixed"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_greedy_rows_equal_target_generate_on_the_padded_batch(pairs, family, settings):
    target, draft = pairs[family]
    model = SwiftSpecForCausalLM.from_models(target, draft, **settings)
    if not settings:  # the policy sizes the trees, from given step prices (a verification of up to 16 nodes costs
        # what a plain step does, an expansion a hundredth of it), not from this machine's timings under load
        given_costs(model, expand_s=0.01, verify_s={1: 1.0, 16: 1.0}, batches=range(1, len(LENGTHS) + 1))
    for seed in range(2):
        ids, mask = padded_batch(seed=seed)
        same_as_target(model, ids, mask, max_new_tokens=40)
    stats = model.swiftspec_stats
    assert stats.engine == "device", stats.summary()
    assert stats.tau > 1.2 and stats.mean_tree_budget > 1, stats.summary()  # it speculated, not decoded plainly
    # Each row's own tau; the batch's tau (all tokens over all row-verifications) is their weighted mean.
    assert len(stats.row_tau) == ids.shape[0] and min(stats.row_tau) >= 1.0, stats.row_tau
    assert min(stats.row_tau) - 1e-9 <= stats.tau <= max(stats.row_tau) + 1e-9 and "per row: " in stats.summary()


def first_stops(rows: list[list[int]], eos: list[int]) -> list[int | None]:
    """Where each row first emits one of `eos` (None: never)."""
    return [next((t for t, tok in enumerate(row) if tok in eos), None) for row in rows]


def staggered_eos(free: list[list[int]]) -> list[int]:
    """EOS ids (from the rows' free-running tokens) that stop one row at its first token and the rows
    at three or more different points."""
    for first in range(len(free)):
        for j in range(1, len(free[0])):
            for k in range(1, len(free[0])):
                eos = [free[first][0], free[(first + 1) % len(free)][j], free[(first + 2) % len(free)][k]]
                stops = first_stops(free, eos)
                if None not in stops and len(set(stops)) >= 3:
                    return eos
    raise AssertionError("no staggered EOS ids in these rows")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rows_stop_at_different_rounds_one_in_its_first(pairs, family):
    """EOS ids the rows emit at different points, one of them a row's first token: finished rows are
    padded (generate's rule with an EOS criterion) and leave the batch; the rest go on."""
    target, draft = pairs[family]
    model = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=8, draft_depth=4)
    ids, mask = padded_batch(seed=3)
    free = model.target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)[:, ids.shape[1] :]
    eos = staggered_eos(free.tolist())
    out = same_as_target(model, ids, mask, max_new_tokens=30, eos_token_id=eos)
    finished = first_stops(out[:, ids.shape[1] :].tolist(), eos)
    assert 0 in finished and len(set(finished)) >= 3, finished  # one in round one; several stops


def test_max_length_mid_round_and_max_new_tokens_one(pairs):
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=8, draft_depth=4)
    ids, mask = padded_batch(seed=4)
    for kwargs in (dict(max_length=ids.shape[1] + 7), dict(max_new_tokens=1), dict(max_new_tokens=2)):
        same_as_target(model, ids, mask, **kwargs)


def test_rows_without_an_eos_criterion_decode_on_until_every_row_stopped():
    """No EOS id: generate keeps decoding a row whose stop string appeared, with real tokens, until
    every row's has; swiftspec too (those rows speculate on until the batch's end)."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2))
    tok = char_tokenizer()
    ids, mask = padded_batch(seed=5)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)[:, ids.shape[1] :]
    stops = [tok.decode(free[b, at : at + 2]) for b, at in enumerate((4, 20, 9, 13))]  # a stop in every row
    kwargs = dict(max_new_tokens=40, stop_strings=stops, tokenizer=tok)
    out = same_as_target(model, ids, mask, **kwargs)[:, ids.shape[1] :]
    stopped_at = [  # the first token after which the row's text ends with a stop string
        next(t + 1 for t in range(out.shape[1]) if tok.decode(row[: t + 1]).endswith(tuple(stops))) for row in out
    ]
    assert max(stopped_at) == out.shape[1] < 40  # the batch ends where its last row stopped
    assert min(stopped_at) < out.shape[1] - 5  # and a row that stopped early decoded on, real tokens


def test_scores_and_logits_per_row(pairs):
    """Each row's scores and logits equal generate's at every step before the row finished; after,
    they say "pad, with certainty" (generate computes them on the padding, which a row that left
    the batch does not)."""
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft)
    ids, mask = padded_batch(seed=6)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)[:, ids.shape[1] :]
    kwargs = dict(
        do_sample=False, max_new_tokens=20, eos_token_id=int(free[1, 3]), repetition_penalty=1.3,
        return_dict_in_generate=True, output_scores=True, output_logits=True, attention_mask=mask,
    )
    expected, actual = target.generate(ids, **kwargs), model.generate(ids, **kwargs)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    assert len(actual.scores) == len(expected.scores) == len(actual.logits)
    new = expected.sequences[:, ids.shape[1] :]
    for b in range(ids.shape[0]):
        stop = next((t for t, tok in enumerate(new[b].tolist()) if tok == kwargs["eos_token_id"]), new.shape[1] - 1)
        for t in range(new.shape[1]):
            for name in ("scores", "logits"):
                got = getattr(actual, name)[t][b]
                if t <= stop:
                    torch.testing.assert_close(got, getattr(expected, name)[t][b], atol=1e-4, rtol=1e-4)
                else:
                    assert got[0] == 0 and torch.isinf(got[1:]).all()  # pad_token_id is 0


def test_pipeline_with_batch_size_matches_the_target_pipeline(pairs):
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft)
    tok = char_tokenizer()
    prompts = ["def f(x):", "Hello", "a", "import os, sys", "x = [1, 2", "while True:"]
    ours = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)
    theirs = pipeline("text-generation", model=target, tokenizer=tok, batch_size=4)
    kwargs = dict(max_new_tokens=20, do_sample=False)
    assert [o[0]["generated_text"] for o in ours(prompts, **kwargs)] == [
        o[0]["generated_text"] for o in theirs(prompts, **kwargs)
    ]
    assert model.swiftspec_stats.engine == "device"


def test_finished_rows_leave_the_forward(pairs):
    """Rows that stop early cost nothing afterwards: later target forwards carry fewer rows."""
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft)
    ids, mask = padded_batch(seed=3)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)[:, ids.shape[1] :]
    rows = []
    handle = target.register_forward_hook(lambda m, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]),
                                          with_kwargs=True)
    try:
        same_as_target(model, ids, mask, max_new_tokens=30, eos_token_id=[int(free[0, 2]), int(free[3, 8])])
    finally:
        handle.remove()
    swift = rows[len(rows) // 2 :]  # the plain side ran first, all four rows to the end
    assert max(swift) == 4 and min(swift) < 4, swift


def test_the_drafts_catch_up_runs_its_head_on_one_position_per_row(pairs):
    """The draft runs each prompt (its catch-up) without logits: its head sees one position per row there,
    not the whole padded prompt (with a 49k-row head, 16 prompts of 256 tokens were 0.8 GB of logits)."""
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=6, draft_depth=2)  # the draft runs
    ids, mask = padded_batch(seed=3)
    positions = []
    handle = draft.lm_head.register_forward_hook(lambda m, args, out: positions.append(args[0].shape[1]))
    try:
        same_as_target(model, ids, mask, max_new_tokens=8)
    finally:
        handle.remove()
    assert positions and max(positions) < ids.shape[1] - 1, (positions, ids.shape)


class RowIndexBias(LogitsProcessor):
    """A processor that reads the batch: it favours token (row index + 3) in each row."""

    def __call__(self, input_ids, scores):
        bias = torch.zeros_like(scores)
        bias[torch.arange(scores.shape[0]), torch.arange(scores.shape[0]) + 3] = 5.0
        return scores + bias


def test_a_processor_that_may_read_other_rows_gets_generates_own_loop(pairs):
    """A user processor's per-row calls could differ from its batched call: the batch decodes with
    transformers' own loop (exactly target.generate), and says so."""
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft)
    ids, mask = padded_batch(seed=7)
    processors = lambda: LogitsProcessorList([RowIndexBias()])  # noqa: E731
    with pytest.warns(UserWarning, match="RowIndexBias may read other rows"):
        same_as_target(model, ids, mask, max_new_tokens=12, logits_processor=processors())
    assert model.swiftspec_stats.engine.startswith("target (batch: RowIndexBias")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # batch 1 speculates with it, node by node
        model.generate(ids[:1, -3:], max_new_tokens=5, logits_processor=processors())
    assert model.swiftspec_stats.engine == "device"


def test_a_chain_family_batch_is_exact_through_generates_own_loop():
    """A model whose positions follow cache slots (no position_ids) cannot hold ragged rows."""
    target = sweep.tiny_of_type("trocr", seed=0)
    model = SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target))
    ids, mask = padded_batch(lengths=(4, 4, 4), seed=8, vocab=128)
    with pytest.warns(UserWarning, match="steps must be chains"):
        same_as_target(model, ids, None, max_new_tokens=10, pad_token_id=0)
    assert model.swiftspec_stats.engine.startswith("target")


def test_sampled_rows_are_independent_draws_from_the_target():
    """num_return_sequences copies of two prompts (one padded): each row's first two tokens follow the
    target's joint distribution (chi-square), and two copies of a prompt agree no more often than two
    independent draws would."""
    target = tiny_model("llama", seed=3, vocab_size=SMALL_VOCAB)
    target.generation_config.eos_token_id = None
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), tree_budget=6, draft_depth=1, draft_width=3)
    prompts = [[3, 7, 5, 9], [4, 8]]
    ids = torch.tensor([prompts[0], [0, 0] + prompts[1]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    copies, calls = 4, 400
    counts = torch.zeros(2, SMALL_VOCAB * SMALL_VOCAB, dtype=torch.float64)
    equal_pairs = torch.zeros(2)
    for seed in range(calls):
        out = model.generate(
            ids, attention_mask=mask, do_sample=True, max_new_tokens=2, num_return_sequences=copies,
            generator=torch.Generator().manual_seed(seed),
        )[:, -2:].reshape(2, copies, 2)
        for p in range(2):
            for t1, t2 in out[p].tolist():
                counts[p, t1 * SMALL_VOCAB + t2] += 1
            equal_pairs[p] += out[p, 0].tolist() == out[p, 1].tolist()
    for p, prompt in enumerate(prompts):
        joint = exact_joint(target, torch.tensor([prompt]), warpers(1.0)).flatten()
        pvalue = pooled_chisquare(counts[p], joint * calls * copies)
        assert pvalue > 1e-3, f"prompt {p}: p={pvalue:.2e}"
        collide = float((joint**2).sum())  # P(two independent draws are equal)
        spread = 5 * (collide * (1 - collide) / calls) ** 0.5
        assert abs(equal_pairs[p] / calls - collide) < spread + 1e-3, (equal_pairs[p] / calls, collide)


def test_the_policy_stops_speculating_where_the_batch_makes_trees_dear():
    """Per-row trees that pay at batch 1 (a 4-node tree costs 1.3x a plain step) stop paying at batch
    8 (where it costs 3x): the policy prices each batch size by its own measurements; a batch size
    never measured borrows the nearest one's curve, and past its own measured sizes grows by the
    nearest one's cost per node and row, times its own rows."""
    policy = GoodputPolicy()
    for batch, costs in ((1, {1: 0.010, 4: 0.013, 8: 0.016}), (8, {1: 0.020, 4: 0.060, 8: 0.100})):
        for budget, seconds in costs.items():
            for _ in range(3):
                policy.at(batch).costs.observe_verify(budget, seconds)
    row = [1.0, 0.6, 0.4, 0.3, 0.2, 0.1]
    policy.plan_round(1)
    assert policy.best_budget([row], 0.0)[0] >= 4
    policy.plan_round(8)
    assert policy.best_budget([row] * 8, 0.0)[0] == 1
    policy.plan_round(7)  # never measured: priced like batch 8 until its own rounds say otherwise
    assert policy.best_budget([row] * 7, 0.0)[0] == 1
    policy.at(7).costs.observe_verify(1, 0.018)  # its own plain step; a node more per row: batch 8's cost of
    per_node = (0.100 - 0.060) / (8 - 4) * 7 / 8  # one (between its two largest trees) for 7 rows instead of 8
    assert policy.costs.verify_times(4)[3] == pytest.approx(0.018 + 3 * per_node)


def test_a_batch_round_is_worth_the_harmonic_mean_of_its_rows():
    """A row far ahead does not make up for a row that gains nothing: the batch's worth of a T-node
    round is B x the harmonic mean of the rows' expected tokens (the sum would be 3.7 + 1.0)."""
    policy = GoodputPolicy()
    policy.plan_round(2, [0, 1])
    fast, stuck = [1.0, 0.9, 0.9, 0.9], [1.0, 0.0, 0.0, 0.0]
    worth = policy.expected_batch([fast, stuck])
    assert worth[3] == pytest.approx(2 * 2 / (1 / 3.7 + 1 / 1.0))
    assert worth[0] == pytest.approx(2.0)  # plain: one token per row
    assert policy.expected_batch([fast, fast])[3] == pytest.approx(2 * 3.7)  # equal rows: the sum


def test_tree_rounds_that_yield_less_than_predicted_lose_the_batch_its_trust():
    """At a batch size where tree rounds keep yielding one token per row (plain's worth) while the
    calibrations promised more, the predicted gain beyond a plain step is discounted until plain wins."""
    from hf_swiftspec.steps.tree import Proposal, Subtree
    from hf_swiftspec.steps.verify import Verified

    policy = GoodputPolicy()
    for budget, seconds in ((1, 0.010), (4, 0.014)):
        policy.at(2).costs.observe_verify(budget, seconds)
    row = [1.0, 0.9, 0.8, 0.7]
    policy.plan_round(2, [0, 1])
    assert policy.best_budget([row, row], 0.0)[0] == 4
    promised = Proposal(Subtree([0, 1, 2, 3], [5, 6, 7, 8], [-1, 0, 1, 2]), row, [0.0, -0.1, -0.2, -0.3], [-1] * 4)
    for _ in range(10):
        policy.plan_round(2, [0, 1])
        policy.observe_outcomes([(r, promised, Verified(tokens=[9], path=[0])) for r in (0, 1)])
    policy.plan_round(2, [0, 1])
    assert policy.gain_trust() < 0.6 and policy.plan.row_scales[0] < 0.3  # both the rows and the batch learnt it
    assert policy.best_budget([row, row], 0.0)[0] == 1


@pytest.mark.parametrize("asked", [{}, dict(output_scores=True), dict(output_logits=True)], ids=["none", "scores", "logits"])
def test_scores_and_logits_are_kept_only_when_asked_for(pairs, monkeypatch, asked):
    """Each emitted token's (1, V) scores and logits are held for the output only when generate() returns them:
    kept for every call, a 262k vocabulary held 230 MiB more at 4 rows x 32 tokens."""
    from hf_swiftspec.engine import request as engine_request

    started = []
    start = engine_request.BatchRows.start.__func__
    monkeypatch.setattr(engine_request.BatchRows, "start", classmethod(lambda cls, r: started.append(start(cls, r)) or started[-1]))
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft)
    ids, mask = padded_batch(seed=2)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, return_dict_in_generate=True, **asked)
    out = model.generate(ids, **kwargs)
    assert out.sequences.tolist() == target.generate(ids, **kwargs).sequences.tolist()
    (rows,) = started
    for name in ("scores", "logits"):
        wanted = bool(asked.get(f"output_{name}"))
        assert (getattr(out, name) is not None) == wanted
        assert all(bool(getattr(row, name)) == wanted for row in rows.result.rows)
