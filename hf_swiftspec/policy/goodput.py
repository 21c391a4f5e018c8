"""How much to speculate each round: the tree that maximises expected tokens per second.

SmartSpec's goodput idea on a token tree. Each round the policy estimates, for every tree size
T it could verify, the expected number of tokens the verification yields,

    E(T) = sum over the T likeliest nodes of P(node is accepted)   (the root counts 1),

from the draft's scores and the suffix proposals' match lengths, frequencies and depths,
calibrated online against what the target actually accepted, and divides it by the round's time from a cost model measured online
on this device (draft expansions + a T-node verification, serially). It grows the draft's tree
while one more expansion is expected to raise that ratio, then verifies the best T. T = 1 is
plain decoding by the target: when speculation does not pay, that is what the policy picks,
re-probing now and then (an expansion and a larger tree) in case it pays again: every
`probe_every` rounds while probes pay, twice as far apart after each one that does not (up to
`max_probe_every`), so a useless draft costs a probe per few hundred rounds, not one per 16.

For a batch of B sequences the round is the batch's: one draft forward per expansion for all
rows, one verification of B rows x T nodes (a row with fewer candidates verifies fewer), so the
policy picks the T that maximises the batch's goodput, B x the harmonic mean over rows of E_row(T)
over the time of that verification (see expected_batch for why not the sum). Verification costs are measured per batch size (a row more costs more than a
node more: each row reads its own KV), so at some batch size on a given machine a plain step
wins, and the policy finds it there and only there; as rows finish and the batch shrinks it
prices the smaller batch by what it measured at that size.

A running batch (engine/continuous.py) plans its rounds with guard=True: the latency guard
(policy/guard.py) caps the goodput's tree size at the largest one at which every row's expected tokens
per verification, from its calibrated acceptance and its own scale (row_scale), over the
verification's measured cost at that size, are at least a plain step's 1 token per c(1) (less the
tokens the row is ahead of plain steps so far: CallState.row_credit); so no row, the ones the draft
predicts worst included, decodes slower than the batch would plainly. The round's plan says which
rows bound it (RoundPlan.guarded), and the engine counts them.

One policy serves every generate() call of a model object (SwiftSpecForCausalLM keeps it), so
what it measured carries over: only the first call pays for learning that a draft, the suffix
proposals or a tree size do not pay on this machine.

The calls an engine makes, in order (the serial and the overlapped engines alike):

    start_generation(new_tokens)         once per generate() call: forget the last call's rows
    plan = plan_round(batch, rows)       each round's start: probe, time a plain step, stay quiet?
    keep_expanding(...) / best_budget()  the round's choices (the serial engine's; the overlapped
                                         one grows for overlap_depth() expansions instead)
    observe_round(...)                   each round's end: its costs
    observe_outcomes(...)                and what each row's proposal yielded
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ..config import MAX_BUDGET
from .costs import CostModel
from .choice import DraftingChoice, EngineChoice, LoopChoice
from .calibration import (BUCKET, BUCKETS, Calibration, SuffixWatch, score_bucket, suffix_bucket,
                          suffix_priors)
from .guard import LatencyGuarding, latency_cap
from ..steps.tree import Proposal, SuffixTree
from ..steps.verify import Verified

# An expansion not priced by measured costs (the first, a probe) runs only if the draft has at most this many
# tokens to catch up (its prompt) per new token the call may emit: a long prompt with a short answer decodes
# without the draft (a 2-of-30-layer draft's prefill of 4k-8k tokens cost a 135M target's 16-token answer 7-12%).
FIRST_CATCH_UP_PER_TOKEN = 32
PROBE_SHARE = 0.05  # a probe may cost this share of its call decoded plainly (probe_affordable)
# A row whose suffix proposals keep missing at their first token builds one only every 2, 4, ... up to
# this many rounds (building one costs about as much as a plain step's processing on a small model).
MAX_SUFFIX_EVERY = 8
# After this many plain rounds in a row at a batch size above 1 (the goodput's or the latency guard's
# choice), the rounds go quiet: plain, without building the proposals that were not verified anyway,
# except one round in LOOK_EVERY that builds them and decides as usual (and the probes). On a small
# model, building them for 16 rows costs a fifth of a plain step; a text that starts to repeat is still
# noticed within LOOK_EVERY tokens. A single sequence proposes every round: there it costs little (demo
# pair, HumanEval, against the previous release: 2.10x vs 2.21x target.generate with quiet rounds at
# batch 1, 2.22x vs 2.24x without).
QUIET_AFTER = 4
LOOK_EVERY = 4
# Per row, how much of what the calibrations expected its verified trees to yield they did yield:
# running sums decayed by ROW_DECAY per verified tree, with ROW_PRIOR tokens of each as a prior. A row
# of hard text is not priced by the easy rows the calibrations learnt from (SmartSpec's per-request
# acceptance estimate).
ROW_DECAY = 0.8
ROW_PRIOR = 2.0
ROW_SCALE = (0.05, 1.5)  # the scale stays in this range
# Per batch size, the same check on the batch's worth of a tree round (what expected_batch predicts,
# beyond a plain step's) against what the round yielded: its running ratio discounts the predicted
# gain there. It catches what per-row scales cannot see: a batch's worth moves with its slowest rows.
GAIN_PRIOR = 4.0  # tokens of each, realized and predicted, before anything is seen


@dataclass
class BatchSize:
    """What the policy measured at one batch size: its step costs and its own probe schedule."""

    costs: CostModel
    rounds: int = 0
    next_probe: int = 17  # the round that probes next (round 1 measures the draft already)
    probe_interval: int = 16
    round_rate: float | None = None  # running average of tokens per second of rounds that did not probe
    plain_streak: int = 0  # plain rounds in a row that were not quiet (quiet ones keep it)
    gain_seen: tuple[float, float] = (0.0, 0.0)  # trees' (realized, predicted) worth beyond a plain step, decayed


@dataclass
class CallState:
    """What the policy keeps for one generate() call (start_generation starts a new one): a new request's
    text is another, so none of it carries over.

    watching:     per row, suffix proposals of earlier rounds still followed down the emitted tokens
    suffix_every: per row, rounds between its suffix proposals; suffix_wait: rounds until its next one
    row_yield:    per row, (accepted, expected) tokens beyond the root of its verified trees, decayed
    row_credit:   per row, tokens it got beyond what plain steps would have given it in the time (guard.py)
    new_tokens:   the most tokens a row may emit in this call (None: not said), what speculation can win back within
    """

    watching: dict[int, list[SuffixWatch]] = field(default_factory=dict)
    suffix_every: dict[int, int] = field(default_factory=dict)
    suffix_wait: dict[int, int] = field(default_factory=dict)
    row_yield: dict[int, tuple[float, float]] = field(default_factory=dict)
    row_credit: dict[int, float] = field(default_factory=dict)
    new_tokens: int | None = None

    def forget_rows(self, rows: list[int]) -> None:
        """Drop what was kept for `rows` (requests that left a running batch: their ids do not come back)."""
        for kept in (self.watching, self.suffix_every, self.suffix_wait, self.row_yield, self.row_credit):
            for row in rows:
                kept.pop(row, None)


@dataclass
class RoundPlan:
    """What the policy decided for one round (plan_round returns it; every choice of the round reads it).

    batch:        rows decoding together this round
    row_scales:   the rows' scales (how their trees have yielded), in the order plan_round got them
    probing:      this round probes: forced expansions, the probe's tree size
    timing_plain: this round verifies T = 1 to time a plain step at this batch size
    quiet:        this round is plain and builds no proposal (see QUIET_AFTER)
    guard:        the latency guard caps the tree size (policy/guard.py; a running batch's rounds)
    guarded:      the rows (positions in the batch) that would not have broken even at the goodput's tree
                  size, so the guard lowered it, at the round's last sizing (empty: it did not)
    row_ids:      the rows' ids, in plan_round's order
    draft_s:      the round's draft time (observe_round), which the guard's credit charges every row
    """

    batch: int = 1
    row_scales: list[float] = field(default_factory=list)
    probing: bool = False
    timing_plain: bool = False
    quiet: bool = False
    guard: bool = False
    guarded: tuple[int, ...] = ()
    row_ids: list[int] = field(default_factory=list)
    draft_s: float = 0.0


@dataclass
class GoodputPolicy(LatencyGuarding):
    """Chooses draft expansions and the verified tree size each round; see the module docstring.

    Its state has three lifetimes: what it learns across generate() calls (its own fields: step costs
    per batch size and their probe schedules, the drafters' calibrations, expansion gains), what one call
    keeps (`call`, a CallState) and what one round decided (`plan`, a RoundPlan). Every engine makes the
    same calls: start_generation() once per call; plan_round() at the start of each round; after it,
    observe_round() with its costs and observe_outcomes() with each row's proposal and walk.

    tree_budget / draft_depth: fixed values the user set (None: chosen here).
    """

    tree_budget: int | None = None
    draft_depth: int | None = None
    max_budget: int = MAX_BUDGET
    max_depth: int = 16
    probe_every: int = 16  # rounds between probes (forced expansions, a larger tree) while they pay
    max_probe_every: int = 256  # rounds between probes after many that did not pay
    probe_depth: int = 1  # one expansion: with a real vocabulary head it can cost as much as a target step
    probe_budget: int = 8  # a probe verifies this many nodes, to measure a larger tree's cost
    # ---- learnt across calls
    batches: dict[int, BatchSize] = field(default_factory=dict)  # per batch size (rows decoding together)
    draft: Calibration = field(init=False)  # P(node on the accepted path) by draft score bucket
    suffix: Calibration = field(init=False)  # P(suffix node accepted | its parent was) by suffix_bucket
    gains: list[float] = field(init=False)  # expected tokens per row the k-th expansion of a round adds
    gains_seen: list[int] = field(init=False)
    last_budget: int = 1
    catch_up_token_s: float | None = None  # seconds per token the draft runs to catch up (the prompt, plain rounds)
    engines: EngineChoice = field(default_factory=EngineChoice)  # a two-device placement's engine per call (choice.py)
    drafting: DraftingChoice = field(default_factory=DraftingChoice)  # the device asynchronous engine's mode (choice.py)
    loops: dict[int, LoopChoice] = field(default_factory=dict)  # batch size -> round or transformers' loop (choice.py)
    # ---- one call, one round
    call: CallState = field(default_factory=CallState)
    plan: RoundPlan = field(default_factory=RoundPlan)

    def __post_init__(self):
        if self.tree_budget is not None:
            self.max_budget = self.tree_budget
        mids = [math.exp(-BUCKET * (b + 0.5)) for b in range(BUCKETS)]
        self.draft = Calibration(prior=mids)  # a perfectly calibrated draft, until observed
        self.suffix = Calibration(prior=suffix_priors())
        self.gains = [1.0] * (self.max_depth + 1)  # optimistic: try the draft before judging it
        self.gains_seen = [0] * (self.max_depth + 1)
        self.refresh()

    @property
    def fixed(self) -> bool:
        """Both the tree size and the expansions per round were set by the user."""
        return self.tree_budget is not None and self.draft_depth is not None

    def at(self, batch: int) -> BatchSize:
        """What was measured at `batch` rows; a batch size met for the first time borrows how cost grows
        with T from the nearest one measured, until its own rounds say."""
        if batch not in self.batches:
            nearest = min(self.batches, key=lambda b: (abs(b - batch), b), default=None)
            shape = self.batches[nearest].costs if nearest is not None else None
            self.batches[batch] = BatchSize(CostModel(batch=batch, shape=shape), probe_interval=self.probe_every)
        return self.batches[batch]

    @property
    def costs(self) -> CostModel:
        """The cost model of the current batch size."""
        return self.at(self.plan.batch).costs

    def refresh(self) -> None:
        """Recompute the lookup tables from the calibrations (once per round)."""
        # Non-increasing along buckets / positions: a less likely node never gets a higher estimate
        # than a likelier one, so the T best nodes always form a connected tree.
        self.draft_table = list(itertools.accumulate(self.draft.rates, min))
        self.suffix_rates = self.suffix.rates

    # ---- per round ----------------------------------------------------------------------------
    def plan_round(
        self, batch: int = 1, rows: list[int] | None = None, probes: bool = True, guard: bool = False
    ) -> RoundPlan:
        """Plan a round of `batch` rows (`rows`: their ids, default 0..batch-1): whether it probes (forced
        expansions, the largest tree), times a plain step or stays quiet. Kept as `plan` for the round's
        choices, and returned.

        A batch size whose plain step (T = 1) was never timed verifies plainly in its second round (the
        first one's roots come with the prefill), so that plain decoding is priced by what it costs here.
        probes=False (an engine that overlaps drafting with verification, where the size is chosen by
        verification time alone): a round that neither probes nor times a plain step.
        guard: cap the round's tree size by the latency guard (policy/guard.py).
        """
        rows = list(rows if rows is not None else range(batch))
        scales = [self.row_scale(r) for r in rows]
        state = self.at(batch)
        state.rounds += 1
        probing = probes and state.rounds == state.next_probe
        timing_plain = probes and state.rounds == 2 and 1 not in state.costs.verify_s and self.tree_budget is None
        quiet = (
            batch > 1 and state.plain_streak >= QUIET_AFTER and not probing and self.tree_budget is None
            and self.draft_depth is None and state.rounds % LOOK_EVERY != 0
        )
        self.plan = RoundPlan(batch, scales, probing, timing_plain, quiet, guard, row_ids=rows)
        return self.plan

    def wants_suffix(self, rows: list[int]) -> list[bool]:
        """Per row (original row ids), whether to build a suffix proposal this round: every round while
        the row's proposals get their first token right, every 2, 4, ... MAX_SUFFIX_EVERY rounds while
        they miss (a proposal is optional: skipping one changes speed, never tokens)."""
        wanted = []
        for row in rows:
            wait = self.call.suffix_wait.get(row, 0)
            wanted.append(wait == 0)
            self.call.suffix_wait[row] = max(wait - 1, 0)
        return wanted

    def draft_probs(self, scores: list[float]) -> list[float]:
        """Calibrated P(accepted) of draft nodes from their scores; the root (score 0) gets 1."""
        table = self.draft_table
        return [1.0 if score >= 0 else table[score_bucket(score)] for score in scores]

    def suffix_probs(self, tree: SuffixTree) -> tuple[list[float], list[int]]:
        """Calibrated P(accepted) of each suffix node (the product of its path's conditional rates, so
        never above its parent's), and its calibration bucket."""
        probs: list[float] = []
        buckets: list[int] = []
        depths: list[int] = []
        rates = self.suffix_rates
        for i, p in enumerate(tree.parents):
            depths.append(depths[p] + 1 if p >= 0 else 1)
            bucket = suffix_bucket(tree.match, tree.counts[i], tree.parent_count(i), depths[i])
            buckets.append(bucket)
            probs.append((probs[p] if p >= 0 else 1.0) * rates[bucket])
        return probs, buckets

    def expected_tokens(self, probs: list[float], scale: float = 1.0) -> list[float]:
        """E(T) for T = 1..len(probs) from node probabilities sorted best first (root first, counted 1),
        the others scaled by the row's `scale`."""
        out, total = [], 0.0
        for i, p in enumerate(probs[: self.max_budget]):
            total += p if i == 0 else min(p * scale, 1.0)
            out.append(total)
        return out

    def row_scale(self, row: int) -> float:
        """How far row `row`'s trees have yielded what the calibrations expected (1: as expected)."""
        accepted, expected = self.call.row_yield.get(row, (0.0, 0.0))
        return min(max((accepted + ROW_PRIOR) / (expected + ROW_PRIOR), ROW_SCALE[0]), ROW_SCALE[1])

    def expected_batch(self, rows: list[list[float]]) -> list[float]:
        """The batch's worth of a round for T = 1..the most candidates of a row (every row verifies its
        min(T, n) best nodes; rows' node probabilities sorted best first, in plan_round's order):
        B times the harmonic mean of the rows' E(T).

        Not their sum: every row needs its own tokens, and each row costs its share of every forward
        until it has them, so a batch's time goes as the sum over rows of (its tokens / its E(T)); a
        round that races ahead rows that will finish early anyway buys little. Measured on the demo
        pair at 16 rows, the sum made the policy verify trees in most rounds and run at 0.71x
        target.generate, the harmonic mean at 0.89x (4 rows: 1.15x and 1.29x)."""
        scales = self.plan.row_scales if len(self.plan.row_scales) == len(rows) else [1.0] * len(rows)
        if len(rows) == 1:
            return self.expected_tokens(rows[0], scales[0])
        per_row = [self.expected_tokens(probs, scale) for probs, scale in zip(rows, scales)]
        longest = max(len(e) for e in per_row)
        padded = [e + [e[-1]] * (longest - len(e)) for e in per_row]  # a row verifies at most its own nodes
        B = len(rows)
        worth = [B * B / sum(1.0 / e for e in column) for column in zip(*padded)]
        trust = self.gain_trust()
        return [worth[0]] + [worth[0] + trust * (w - worth[0]) for w in worth[1:]]

    def gain_trust(self) -> float:
        """How much of the worth beyond a plain step that tree rounds were predicted to have they yielded,
        at the current batch size (1 at batch 1: rows' own scales cover a lone row)."""
        if self.plan.batch == 1:
            return 1.0
        realized, predicted = self.at(self.plan.batch).gain_seen
        return min((realized + GAIN_PRIOR) / (predicted + GAIN_PRIOR), 1.0)

    def best_budget(self, rows: list[list[float]], spent_s: float, probing: bool | None = None) -> tuple[int, float]:
        """(T, expected tokens per second) maximising the batch's goodput, for each row's sorted node
        probabilities.

        probing: whether to take the probe's tree size instead (default: whether this round probes).
        """
        expected = self.expected_batch(rows)
        times = self.costs.verify_times(len(expected))
        if self.plan.timing_plain and probing is None:
            return 1, expected[0] / (spent_s + times[0])
        if self.tree_budget is not None or (self.plan.probing if probing is None else probing):
            T = len(expected) if self.tree_budget is not None else min(len(expected), self.probe_size())
            return T, expected[T - 1] / (spent_s + times[T - 1])
        rates = [e / (spent_s + t) for e, t in zip(expected, times)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if self.plan.guard:
            _, per_row, credit = self.guard_inputs(rows)
            guarded = latency_cap(per_row, self.guard_times(len(times)), best + 1, credit)
            best, self.plan.guarded = guarded.budget - 1, guarded.rows
        return best + 1, rates[best]

    def probe_size(self) -> int:
        """Nodes per row a probe verifies: probe_budget query rows in all, split over the batch (at least 2 per
        row), so a probe at 4 rows runs 8 query rows through the vocabulary head, not 32."""
        return max(2, self.probe_budget // max(self.plan.batch, 1))

    def keep_expanding(
        self, done: int, spent_s: float, rows: list[list[float]], probing: bool, catch_up: int = 0
    ) -> bool:
        """Whether to run expansion number done + 1 of this round, given every row's current candidates.

        catch_up: tokens the draft must run before it can expand (its prompt, plain rounds' tokens): the
            first expansion costs that catch-up too (on a batch of long prompts, more than a round).
        """
        if self.draft_depth is not None:
            return done < self.draft_depth
        if done >= self.max_depth or self.plan.timing_plain:
            return False
        if probing:  # a forced expansion, if the call can repay the draft's catch-up (see repays_catch_up)
            return done < self.probe_depth and self.repays_catch_up(catch_up) and self.probe_affordable(catch_up)
        costs = self.costs
        if not costs.measured:  # the first round: measure one expansion, if the call can repay the catch-up
            return done < 1 and self.repays_catch_up(catch_up)
        # Look several expansions ahead: where a 2-node tree costs much more than a plain step (CPUs)
        # one expansion alone never pays, while three that grow a 4-node path do.
        T, now = self.best_budget(rows, spent_s)
        expected, times = self.expected_batch(rows)[T - 1], costs.verify_times(self.max_budget)
        spent_s += catch_up * (self.catch_up_token_s or 0.0)
        for k in range(1, self.max_depth - done + 1):
            expected += len(rows) * self.gains[done + k - 1]
            budget = min(T + k, self.max_budget)
            if expected / (spent_s + k * costs.expand_cost + times[budget - 1]) > now and self.guard_allows(
                    rows, done, k, spent_s + k * costs.expand_cost, budget):
                return True
        return False

    def repays_catch_up(self, tokens: int) -> bool:
        """Whether an expansion that is not priced by measured costs (the first, a probe) may first run `tokens`
        the draft has not seen (its prompt, plain rounds' tokens): at most FIRST_CATCH_UP_PER_TOKEN per new
        token the call may emit, so a long prompt with a short answer never pays for a draft prefill."""
        new_tokens = self.call.new_tokens
        return new_tokens is None or tokens <= FIRST_CATCH_UP_PER_TOKEN * new_tokens

    def probe_affordable(self, catch_up: int) -> bool:
        """Whether a probe, priced by what was measured (the draft's catch-up, an expansion, the probe's larger
        verification over a plain one), costs at most PROBE_SHARE of the call decoded plainly (its
        max_new_tokens plain steps). Unpriced (nothing measured yet, or no length said): allowed. On the
        gemma-3-270m shape at 4 rows a probe cost ~320 ms, a 16-token call 3.5 s: every other call paid 9%.
        Under the latency guard (a running batch, whose rows' lengths are not said) every row waits for it: at
        most one plain step more (guard.py), so a batch's catch-up piled up over plain rounds never stalls it."""
        costs, new_tokens = self.costs, self.call.new_tokens
        if self.catch_up_token_s is None or costs.expand_cost is None or not costs.verify_s:
            return True
        times = costs.verify_times(self.probe_size())
        price = catch_up * self.catch_up_token_s + costs.expand_cost + times[-1] - times[0]
        if self.plan.guard:
            return price <= times[0]
        return new_tokens is None or price <= PROBE_SHARE * new_tokens * times[0]

    def overlap_depth(self) -> int:
        """Expansions that fit wholly in one verification (asynchronous engines, where drafting is
        hidden): one that would overrun it delays the next subtree, and the target waits for it."""
        if self.draft_depth is not None:
            return self.draft_depth
        costs = self.costs
        if not costs.measured:
            return 4
        verify = costs.verify_times(self.last_budget)[-1]
        return max(1, min(self.max_depth, int(verify / costs.expand_cost)))

    def expansion_fits(self, budget: int, elapsed_s: float) -> bool:
        """Whether one more expansion, started `elapsed_s` after a subtree of `budget` nodes was sent, is expected
        to end before its verdict comes back (asynchronous engines: one that ends later makes the target wait for
        the next subtree). True until both an expansion and a verification were measured."""
        costs = self.costs
        if self.draft_depth is not None or not costs.measured:
            return True
        return elapsed_s + costs.expand_cost <= costs.verify_times(budget)[-1]

    def draft_pays(self, tau: float | None, round_s: float | None) -> bool:
        """Asynchronous engines: whether the draft model's forwards pay in this call, by its rounds so far (tau
        tokens a round, round_s seconds a round trip): while rounds yield more than one token by more than an
        expansion's share of a round, tau > 1 + expansion / round. Unmeasured: they do. Where they do not, the draft
        neither makes the target wait for a fresh tree's catch-up expansion (it sends the root alone, a plain step)
        nor grows the tree during verifications, where its forwards only slow the target's (two processes on one
        CPU share its memory bandwidth). On a shape:smollm2-135m pair (a draft that never agrees, a 49k-row head)
        the catch-up was 21 ms of a 93 ms round, and the growth 8 ms more of each verification."""
        expand = self.costs.expand_cost
        if self.draft_depth is not None or tau is None or not round_s or expand is None:
            return True
        return tau > 1.0 + expand / round_s

    # ---- after the round ----------------------------------------------------------------------
    def observe_gain(self, done: int, before: list[list[float]], after: list[list[float]], spent_s: float) -> None:
        """Fold in how much expansion number done + 1 raised, per row, the expected tokens of the best
        tree one node larger than the best one before it (what keep_expanding's look-ahead assumes)."""
        t_before, _ = self.best_budget(before, spent_s, probing=False)  # at the best T, not the probe's
        grown = self.expected_batch(after)
        total = grown[min(t_before, len(grown) - 1)] - self.expected_batch(before)[t_before - 1]
        gain = max(total / len(before), 0.0)
        seen = self.gains_seen[done]
        self.gains[done] = gain if seen == 0 else 0.7 * self.gains[done] + 0.3 * gain
        self.gains_seen[done] = seen + 1
        for k in range(done + 1, len(self.gains)):  # deeper expansions, never seen: no better than this
            if self.gains_seen[k] == 0:
                self.gains[k] = min(self.gains[k], self.gains[done])

    def observe_rate(self, rate: float) -> None:
        """Fold in one round's tokens per second at the current batch size. After a probe: probe again
        in `probe_every` rounds if it beat the rounds around it, else twice as late as last time."""
        state = self.at(self.plan.batch)
        if not self.plan.probing:
            state.round_rate = rate if state.round_rate is None else 0.8 * state.round_rate + 0.2 * rate
            return
        paid = state.round_rate is None or rate > state.round_rate
        state.probe_interval = self.probe_every if paid else min(2 * state.probe_interval, self.max_probe_every)
        state.next_probe = state.rounds + state.probe_interval

    def observe_round(
        self, expansions: int, draft_s: float, budget: int, verify_s: float | None, tokens: int | None = None,
        catch_up_s: float = 0.0, catch_up_tokens: int = 0,
    ) -> None:
        """Fold in one round's costs at the current batch size: `expansions` draft forwards in draft_s,
        a verification of `budget` nodes per row.

        verify_s: None when the round timed no verification (the first round of a generation gets
            its roots' logits from the prefill): nothing is learnt from it, and a probe moves on a round.
        tokens: what the round emitted over all rows, when draft_s + verify_s + catch_up_s is the whole
            round (the serial engine, the only one that probes): its rate tells whether a probe paid.
        catch_up_s: time the draft spent on committed tokens it had not run yet (the prompt, tokens
            of plain rounds): part of the round, but not what an expansion costs; catch_up_tokens: how
            many it ran (what a later catch-up is priced by).
        """
        self.last_budget = budget
        self.plan.draft_s = draft_s + catch_up_s
        if catch_up_tokens:
            per_token = catch_up_s / catch_up_tokens
            self.catch_up_token_s = per_token if self.catch_up_token_s is None else 0.8 * self.catch_up_token_s + 0.2 * per_token
        state = self.at(self.plan.batch)
        if not self.plan.quiet:  # (a round the latency guard made plain counts too: its proposals went unverified)
            plain = budget == 1 and not self.plan.probing
            state.plain_streak = state.plain_streak + 1 if plain else 0
        if verify_s is None:
            if self.plan.probing:
                state.next_probe = state.rounds + 1
            return
        state.costs.observe_expansions(draft_s, expansions)
        state.costs.observe_verify(budget, verify_s)
        if self.plan.quiet:
            state.costs.observe_quiet(verify_s)
        if tokens is not None:
            self.observe_rate(tokens / (draft_s + verify_s + catch_up_s))

    def observe_outcomes(self, outcomes: list[tuple[int, Proposal, Verified]]) -> None:
        """Fold in one round's (row, proposal, walk) of every row: draft nodes by score; suffix nodes by
        bucket, each one whose parent was accepted (the others were never tried)."""
        self.observe_batch_gain(outcomes)
        if self.plan.guard:
            self.observe_credit(outcomes)
        draft_seen: tuple[list[int], list[bool]] = ([], [])  # (bucket, accepted) of every node observed
        suffix_seen: tuple[list[int], list[bool]] = ([], [])
        for row, proposal, verified in outcomes:
            self.observe_row_yield(row, proposal, verified)
            on_path = set(verified.path)
            draft = [i for i, score in enumerate(proposal.scores) if i and score is not None]
            draft_seen[0].extend(score_bucket(proposal.scores[i]) for i in draft)
            draft_seen[1].extend(i in on_path for i in draft)
            watching = self.call.watching.get(row, [])
            if proposal.offered[0]:
                watching = watching[-self.max_budget + 1 :] + [SuffixWatch(*proposal.offered)]
            self.call.watching[row], hit = self.follow_suffixes(watching, verified.tokens, suffix_seen)
            if hit:  # a proposal (this round's or an earlier one) was right: propose every round
                self.call.suffix_every[row], self.call.suffix_wait[row] = 1, 0
            elif proposal.offered[0]:  # this round's missed at its first token: twice as rarely
                every = min(2 * self.call.suffix_every.get(row, 1), MAX_SUFFIX_EVERY)
                self.call.suffix_every[row], self.call.suffix_wait[row] = every, every - 1
        for calibration, (buckets, accepted) in ((self.draft, draft_seen), (self.suffix, suffix_seen)):
            if buckets:
                calibration.observe(buckets, accepted)
        if draft_seen[0] or suffix_seen[0]:  # (the tables change only with what was observed)
            self.refresh()

    def observe_batch_gain(self, outcomes: list[tuple[int, Proposal, Verified]]) -> None:
        """Fold in a tree round's worth beyond a plain step, predicted (B x the harmonic mean of each
        row's expected tokens, with the scale it was chosen with) and realized (of the tokens each row
        got); rounds of one row, plain rounds and rounds a row finished in say nothing."""
        if len(outcomes) < 2 or all(len(p.subtree) == 1 for _, p, _ in outcomes) or any(v.finished for *_, v in outcomes):
            return
        scales = self.plan.row_scales if len(self.plan.row_scales) == len(outcomes) else [1.0] * len(outcomes)
        expected = [1.0 + scale * (sum(p.probs) - 1.0) for (_, p, _), scale in zip(outcomes, scales)]
        got = [len(v.tokens) for *_, v in outcomes]
        B = len(outcomes)
        state = self.at(self.plan.batch)
        realized, predicted = state.gain_seen
        state.gain_seen = (
            ROW_DECAY * realized + B * B / sum(1.0 / g for g in got) - B,
            ROW_DECAY * predicted + B * B / sum(1.0 / e for e in expected) - B,
        )

    def observe_row_yield(self, row: int, proposal: Proposal, verified: Verified) -> None:
        """Fold in what a verified tree was expected to yield beyond its root and what it did (rounds cut
        short by a stopping criterion or max_new_tokens say nothing about the text)."""
        if len(proposal.subtree) == 1 or verified.finished:
            return
        accepted, expected = self.call.row_yield.get(row, (0.0, 0.0))
        self.call.row_yield[row] = (
            ROW_DECAY * accepted + len(verified.path) - 1,
            ROW_DECAY * expected + sum(proposal.probs) - 1.0,
        )

    def observe_outcome(self, proposal: Proposal, verified: Verified) -> None:
        """observe_outcomes for a single sequence."""
        self.observe_outcomes([(0, proposal, verified)])

    def follow_suffixes(
        self, watching: list[SuffixWatch], tokens: list[int], seen: tuple[list[int], list[bool]]
    ) -> tuple[list[SuffixWatch], bool]:
        """Check one row's suffix proposals of recent rounds against the tokens the target emitted since,
        adding each node tried to `seen` (its bucket, whether accepted); returns those still worth
        following, and whether any of them had a node accepted.

        A node is accepted exactly when its parent was and the target's own token at its position is
        its token (greedy, or sampled with noise fixed per position), so every proposal is calibrated
        whether it was verified or not: a plain round still learns that the text has started to
        repeat. Each node counts once its position's token is known: the children of the node a
        proposal has reached are tried against the next token.
        """
        buckets, accepted = seen
        still = []
        any_hit = False
        for watch in watching:
            for token in tokens:
                tried = watch.children(watch.node)
                hit = next((i for i in tried if watch.tokens[i] == token), None)
                buckets += [watch.buckets[i] for i in tried]
                accepted += [i == hit for i in tried]
                if hit is None:
                    break
                watch.node, any_hit = hit, True
            else:
                still.append(watch)
        return [w for w in still if w.children(w.node)], any_hit

    def start_generation(self, new_tokens: int | None = None) -> None:
        """Forget the proposals of an earlier generation and what was learnt per row (how often each row
        proposed, how its trees yielded: a new request's text is another); the calibrations stay.
        new_tokens: the call's max_new_tokens."""
        self.call = CallState(new_tokens=new_tokens)
