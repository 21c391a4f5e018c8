"""The latency guard (policy/guard.py): a running batch's tree size is capped at the largest one at which every
row's expected tokens per verification, over the verification's cost, are at least a plain step's; it never
changes a token. Prices are given (CostModel.given), so no wall clock decides what the policy picks."""

from __future__ import annotations

import pytest

from fixed_costs import given_costs
from test_continuous import PROMPTS, assert_greedy_answers, pair_of, run_relay

from hf_swiftspec.policy.costs import CostModel
from hf_swiftspec.policy.goodput import LOOK_EVERY, QUIET_AFTER, BatchSize, GoodputPolicy
from hf_swiftspec.policy.guard import credit_after, latency_cap

# Two rows' candidates, best first (the root counts 1). The well-predicted row's draft is sure of its first
# nodes; the badly predicted one's is not, and its trees so far yielded a quarter of what was expected:
# its row_yield (accepted, expected) = (0, 6) gives it the scale (0 + 2) / (6 + 2) = 0.25 (ROW_PRIOR 2).
GOOD = [1.0, 1.0, 1.0, 0.9, 0.5, 0.2, 0.0, 0.0]
BAD = [1.0, 0.8, 0.4, 0.2, 0.1, 0.0, 0.0, 0.0]
VERIFY_S = {1: 1.0, 2: 1.15, 4: 1.55, 8: 2.15}  # seconds per verification of 2 rows x T nodes


def guarded_policy(guard: bool) -> GoodputPolicy:
    policy = GoodputPolicy()
    policy.batches[2] = BatchSize(CostModel(batch=2, expand_s=0.01, verify_s=dict(VERIFY_S), given=True))
    policy.call.row_yield[1] = (0.0, 6.0)
    policy.plan_round(2, [0, 1], guard=guard)
    return policy


def test_the_tree_size_is_capped_at_the_worst_rows_break_even():
    # By hand: c(T) = 1.0, 1.15, 1.35 (between 2 and 4), 1.55 for T = 1..4, so a row breaks even at T when it
    # expects c(T) / c(1) = 1.0, 1.15, 1.35, 1.55 tokens. The bad row expects 1 + 0.25 x (0.8, 1.2, 1.4) =
    # 1.2, 1.3, 1.35 at T = 2, 3, 4: it breaks even at T = 2 (1.2 >= 1.15), not at 3 (1.3 < 1.35).
    # The batch's goodput, 2 x the harmonic mean of (3, 1.3) over 1.35 s at T = 3 (2.69 tokens/s), beats
    # T = 2's (2, 1.2) over 1.15 s (2.61): unguarded the batch verifies 3 nodes a row.
    unguarded = guarded_policy(guard=False)
    assert unguarded.best_budget([GOOD, BAD], spent_s=0.0)[0] == 3
    assert unguarded.plan.guarded == ()
    policy = guarded_policy(guard=True)
    budget, rate = policy.best_budget([GOOD, BAD], spent_s=0.0)
    assert budget == 2
    assert policy.plan.guarded == (1,)  # the bad row bound it
    assert rate == pytest.approx(2 * 2 / (1 / 2 + 1 / 1.2) / 1.15)  # priced at the size it verifies


def test_a_row_ahead_of_plain_steps_pays_for_a_hard_round():
    # The bad row got 2 tokens from a 2-node round (c(2) / c(1) = 1.15): it is 0.85 tokens ahead of plain
    # steps, so at T = 3 it expects 0.85 + 1.3 >= 1.35 and the goodput's size stands.
    policy = guarded_policy(guard=True)
    policy.call.row_credit[1] = credit_after(0.0, 2, policy.costs.verify_times(2), 2)
    assert policy.call.row_credit[1] == pytest.approx(0.85)
    assert policy.best_budget([GOOD, BAD], spent_s=0.0)[0] == 3
    assert policy.plan.guarded == ()
    assert credit_after(0.1, 1, [1.0, 1.15], 2) == 0.0  # behind plain steps: no debt a plain round cannot repay


def test_rows_that_break_even_leave_the_goodputs_size_alone():
    sizes = []
    for guard in (False, True):
        policy = GoodputPolicy()
        policy.batches[2] = BatchSize(CostModel(batch=2, expand_s=0.01, verify_s=dict(VERIFY_S), given=True))
        policy.plan_round(2, [0, 1], guard=guard)  # both rows at scale 1: the bad row expects 2.4 at T = 4 (>= 1.55)
        sizes.append(policy.best_budget([GOOD, BAD], spent_s=0.0)[0])
        assert policy.plan.guarded == ()
    assert sizes == [4, 4]


def test_rounds_the_guard_made_plain_make_the_batch_go_quiet():
    # Plain rounds in a row make a batch quiet (QUIET_AFTER: no proposals built but one round in LOOK_EVERY). A
    # round the guard made plain counts: its proposals went unverified just the same, and at 16 clients on the demo
    # pair most plain rounds were the guard's, each building 16 rows' proposals for nothing (about a sixth of the
    # round). A look round that the guard makes plain again keeps the batch quiet.
    policy = GoodputPolicy()
    policy.batches[2] = BatchSize(CostModel(batch=2, expand_s=0.01, verify_s=dict(VERIFY_S), given=True),
                                  plain_streak=QUIET_AFTER - 1, rounds=1)
    assert not policy.plan_round(2, [0, 1], guard=True).quiet  # round 2: the streak is one short
    # the goodput wants T = 2 (2 x the harmonic mean of 2 and 1.1 over 1.15 s: 2.47 tokens/s, a plain step 2), where
    # the second row expects 1.1 < 1.15
    assert policy.best_budget([[1.0, 1.0], [1.0, 0.1]], spent_s=0.0)[0] == 1
    assert policy.plan.guarded == (1,)
    policy.observe_round(expansions=1, draft_s=0.01, budget=1, verify_s=1.0)
    assert policy.at(2).plain_streak == QUIET_AFTER
    assert policy.plan_round(2, [0, 1], guard=True).quiet  # round 3
    policy.observe_round(expansions=0, draft_s=0.0, budget=1, verify_s=1.0)
    assert policy.plan_round(2, [0, 1], guard=True).quiet == (4 % LOOK_EVERY != 0)  # round 4 looks (LOOK_EVERY 4)
    # a tree round (the guard lets one through) ends the streak
    policy.observe_round(expansions=1, draft_s=0.01, budget=2, verify_s=1.15)
    assert policy.at(2).plain_streak == 0
    assert not policy.plan_round(2, [0, 1], guard=True).quiet


def test_the_guard_prices_a_plain_step_at_a_quiet_rounds_cost():
    # The batch decoding plainly is a quiet round (no proposal built), cheaper than a round that built its rows'
    # proposals and verified the roots alone (verify_s[1]): once a quiet round ran at this batch size, a row breaks
    # even at T when it expects c(T) / quiet_s tokens. The bad row (scale 0.25) expects 1.2 at T = 2: against
    # c(1) = 1.0 it breaks even (1.2 >= 1.15), against a quiet round of 0.9 s it does not (1.2 < 1.15 / 0.9 = 1.28).
    sizes = []
    for quiet_s in (None, 0.9):
        policy = guarded_policy(guard=True)
        policy.costs.quiet_s = quiet_s
        times = policy.costs.verify_times(4)
        assert policy.guard_times(4) == (times if quiet_s is None else [0.9] + times[1:])
        sizes.append(policy.best_budget([GOOD, BAD], spent_s=0.0)[0])
        assert policy.plan.guarded == (1,)
    assert sizes == [2, 1]


def test_quiet_rounds_time_the_plain_step_the_guard_compares_with():
    policy = GoodputPolicy()
    policy.batches[2] = BatchSize(CostModel(batch=2, expand_s=0.01), plain_streak=QUIET_AFTER, rounds=1)
    assert policy.plan_round(2, [0, 1], guard=True).quiet  # round 2
    assert policy.guard_times(2) == policy.costs.verify_times(2)  # no quiet round timed yet: c(1) as measured
    policy.observe_round(expansions=0, draft_s=0.0, budget=1, verify_s=0.9)
    assert policy.costs.quiet_s == pytest.approx(0.9)
    assert policy.plan_round(2, [0, 1], guard=True).quiet  # round 3
    policy.observe_round(expansions=0, draft_s=0.0, budget=1, verify_s=1.4)
    assert policy.costs.quiet_s == pytest.approx(0.8 * 0.9 + 0.2 * 1.4)  # a running average (CostModel.smoothing)
    assert not policy.plan_round(2, [0, 1], guard=True).quiet  # round 4 looks (LOOK_EVERY)
    policy.observe_round(expansions=1, draft_s=0.01, budget=1, verify_s=2.0)  # built its proposals, verified roots
    assert policy.costs.quiet_s == pytest.approx(0.8 * 0.9 + 0.2 * 1.4)  # a round that was not quiet leaves it
    assert policy.guard_times(2)[0] == pytest.approx(0.8 * 0.9 + 0.2 * 1.4)
    assert policy.costs.verify_times(2)[0] > 1.0  # the rounds' c(1) mixes in the round that built its proposals


def test_a_row_that_never_breaks_even_makes_the_round_plain():
    # Its tree expects 1.05 tokens at T = 2 against the 1.15 a 2-node verification needs: it would decode
    # slower beside the other's tree than in a plain batch, and verifying its root alone would cost it the
    # same rectangle (one forward of rows x T queries) for 1 token, so the whole round is plain.
    guarded = latency_cap([[1.0, 2.0, 3.0], [1.0, 1.05, 1.08]], [1.0, 1.15, 1.35], budget=3)
    assert guarded.budget == 1 and guarded.rows == (1,)


def test_greedy_rows_under_the_guard_equal_target_generate():
    """Six requests joining a running batch, priced so that trees cost much more than a plain step (seconds:
    the wall clock's milliseconds of drafting do not move the choice): the guard lowers the tree size in some
    rounds, and every answer is still target.generate's."""
    pair = pair_of("llama")
    given_costs(pair, expand_s=0.05, verify_s={1: 10.0, 2: 11.5, 4: 13.0, 8: 14.5, 16: 20.0}, batches=range(1, 7))
    news = (20, 7, 33, 12, 1, 25)
    engine = pair.continuous_engine()
    try:
        out = run_relay(pair, engine, PROMPTS, news, do_sample=False)
    finally:
        engine.close()
    assert_greedy_answers(pair, out, PROMPTS, news)
    assert engine.guarded_rounds > 0 and engine.guarded_rows >= engine.guarded_rounds, (
        engine.guarded_rounds, engine.rounds_by_batch)


def expanding(guard: bool, credit: float = 0.0, expand_s: float = 0.2) -> bool:
    """keep_expanding's first decision for GOOD and BAD (the bad row at scale 0.25), each expansion expected to add
    0.5 tokens per row, an expansion priced at `expand_s` seconds (a fifth of a plain step by default)."""
    policy = GoodputPolicy()
    policy.batches[2] = BatchSize(CostModel(batch=2, expand_s=expand_s, verify_s=dict(VERIFY_S), given=True))
    policy.call.row_yield[1] = (0.0, 6.0)
    policy.call.row_credit[1] = credit
    policy.gains = [0.5] * len(policy.gains)
    policy.plan_round(2, [0, 1], guard=guard)
    return policy.keep_expanding(0, 0.0, [GOOD, BAD], probing=False)


def test_the_drafts_expansions_count_in_every_rows_break_even():
    # The batch's goodput pays for an expansion of 0.2 s. The bad row breaks even at T = 2 on the verification
    # alone (1.2 >= 1.15), but every expansion adds 0.2 to the tokens it needs ((D + c(T)) / c(1)) and only
    # 0.25 x 0.5 = 0.125 to those it expects: after k expansions it expects 1.2 + 0.125k at T = 2 against
    # 1.15 + 0.2k needed, 1.3 + 0.125k at T = 3 against 1.35 + 0.2k, never enough. So the guard stops the draft.
    assert expanding(guard=False) is True
    assert expanding(guard=True) is False
    # A row a token ahead of plain steps pays for that wait: the goodput's T = 3 stands, and after k expansions the
    # bad row expects 1 + 1.35 + 0.125k at T = 4 against 1.55 + 0.2k needed.
    assert expanding(guard=True, credit=1.0) is True
    assert expanding(guard=True, expand_s=0.0) is True  # free expansions: the verification's break-even alone


def test_a_rows_credit_is_charged_the_rounds_draft_time():
    # A round that drafted for 0.2 s and verified 2 nodes a row (c(2) = 1.15 s, c(1) = 1 s) cost each row 1.35
    # plain steps' time: 2 tokens put it 0.65 ahead, not 0.85.
    assert credit_after(0.0, 2, [1.0, 1.15], 2, draft_s=0.2) == pytest.approx(0.65)
    policy = guarded_policy(guard=True)
    policy.observe_round(expansions=1, draft_s=0.15, budget=2, verify_s=1.15, catch_up_s=0.05)
    from hf_swiftspec.steps.tree import Subtree

    class Outcome:  # what observe_credit reads of a walk: its tokens
        tokens = [5, 6]

    class Proposed:
        subtree = Subtree(node_ids=[0, 1], tokens=[1, 2], parents=[-1, 0])

    policy.observe_credit([(1, Proposed, Outcome)])
    assert policy.call.row_credit[1] == pytest.approx(2 - (0.15 + 0.05 + 1.15) / 1.0)


def probing(guard: bool, catch_up: int) -> bool:
    """Whether a probe round of 2 rows runs its forced expansion with `catch_up` tokens for the draft to run first,
    each 0.01 s (the demo's prices: a plain step 1 s, an expansion 0.2 s, the probe's 4-node verification 1.55 s)."""
    policy = GoodputPolicy()
    policy.batches[2] = BatchSize(CostModel(batch=2, expand_s=0.2, verify_s=dict(VERIFY_S), given=True))
    policy.catch_up_token_s = 0.01
    policy.plan_round(2, [0, 1], guard=guard)
    return policy.keep_expanding(0, 0.0, [GOOD, BAD], probing=True, catch_up=catch_up)


def test_a_probe_in_a_running_batch_delays_its_rows_by_at_most_a_plain_step():
    # The probe's price: catch-up x 0.01 s + 0.2 s + (1.55 - 1.0) s. Its rows' lengths are not said (a running batch),
    # so unguarded it always runs; under the guard it runs while that is at most a plain step (1 s): with 24 tokens
    # of catch-up (0.99 s), not 27 (1.02 s; a batch's catch-up piles up over plain rounds and would stall every row).
    assert probing(guard=False, catch_up=200) is True
    assert probing(guard=True, catch_up=24) is True
    assert probing(guard=True, catch_up=27) is False
