"""The adaptive sides of the round (engine/rounds.py): the target's worker over its tree cache, the
drafters and the goodput policy, on one device, serially: draft, then verify, then re-root.

One round serves every row of the batch: one draft forward per expansion for all rows, one target
forward verifying each row's subtree (one tree size for the batch, so the forward is a rectangle
of rows x nodes), a walk per row with the target's own choices, one commit per cache. Rows that
finish leave both caches at the end of the round (`keep_rows`: their slots are compacted away), so
they stop costing compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..drafters.drafting import Drafters
from ..policy.goodput import GoodputPolicy
from ..stats import PhaseClock, SwiftSpecStats
from ..steps import step
from ..steps.capture import MAX_QUERIES, step_menu
from ..steps.tree import Proposal
from ..steps.verify import Verified
from .request import BatchRows, DecodeRequest, DecodeResult
from .rounds import Proposed, run_rounds
from .workers import TargetWorker


def run_serial(target: TargetWorker, draft: Drafters, request: DecodeRequest) -> DecodeResult:
    """The round (engine/rounds.py) on the adaptive sides."""
    return run_rounds(AdaptiveSides(target, draft, request.policy, prepare=True), request)


@dataclass
class AdaptiveProposed(Proposed):
    """Phase 1's hand-off on the adaptive sides: with the draft's time on expansions and on catching up
    (tokens it had not run), what the policy prices the next rounds by."""

    expanding_s: float = 0.0
    catch_up_s: float = 0.0
    caught_up: int = 0  # tokens the catch-up ran
    setup_before: float = 0.0  # the sides' capture time (setup_s) when the round began

    @property
    def subtrees(self):
        return [p.subtree for p in self.proposals]


class AdaptiveSides:
    """The round's phases over a TargetWorker, the Drafters and the request's GoodputPolicy."""

    name = "serial"

    def __init__(self, target: TargetWorker, draft: Drafters, policy: GoodputPolicy, latency_guard: bool = False,
                 prepare: bool = False):
        self.target, self.draft, self.policy = target, draft, policy
        self.latency_guard = latency_guard  # the policy's latency guard sizes the trees (a running batch's rounds)
        # replayed steps captured (or compiled) before the rounds for every shape they may take, at the start and when
        # rows leave (prepare_steps): a lone call's. A running batch's rows join and leave every few rounds, each time
        # over another cache layout: it captures the steps it runs, in rounds the policy then leaves unpriced
        self.prepare = prepare
        self.samplers: list = []
        self.clock = PhaseClock.on(target.device, policy.engines.clock)  # the round's phases (the stats' breakdown)
        target.clock = self.clock  # the worker times its verification's phases on it

    def start(self, request: DecodeRequest) -> None:
        self.samplers = list(request.samplers)
        self.target.prefill(request.prompt, request.contexts, request.attention_mask)
        self.draft.start(request.prompt_ids(), self.target.prompt_features)
        self.target.prompt_features = None  # the head keeps what it needs of them (fused: a third of their width)
        if self.prepare:
            prepare_steps(self.target, self.draft, self.policy.max_budget)

    def start_in_pieces(self, request: DecodeRequest, piece: int):
        """start() for one row, its prompt prefilled `piece` tokens per forward: a generator that yields
        between the forwards (engine/continuous.py decodes a round of the running batch meanwhile)."""
        self.samplers = list(request.samplers)
        yield from self.target.prefill_pieces(request.prompt, piece, request.contexts)
        self.draft.start(request.prompt_ids(), self.target.prompt_features)
        self.target.prompt_features = None

    def propose(self, rows: BatchRows) -> AdaptiveProposed:
        """1. draft: expand while more expansions are expected to raise tokens per second."""
        proposed = AdaptiveProposed([], rows=list(rows.live), setup_before=self.setup_s())
        with self.clock.phase("policy"):
            plan = self.policy.plan_round(len(rows.live), rows.live, guard=self.latency_guard)
        if plan.quiet or (self.target.roots_known and self.policy.tree_budget is None):
            # plain rounds of late: verify the roots, build no proposal. And round 1, whose roots' logits came
            # with the prefill: plain, it emits their tokens with no forward at all, where a tree pays a whole
            # forward (1.6-2x a plain step on a CPU) and, if it misses, emits just as much. Its tree is worth
            # the next round's tree minus that round's root token: deferring it never loses a token.
            with self.clock.phase("select"):
                proposed.proposals = self.draft.plain()
        else:
            expand_and_choose(self.draft, self.policy, rows.live, plan.probing, proposed, self.clock)
        self.draft.counters.rounds += 1
        self.draft.counters.busy_s += time.perf_counter() - proposed.started
        return proposed

    def verify(self, proposed: AdaptiveProposed, rows: BatchRows) -> list[Verified]:
        """2. target: one forward over every row's subtree, walk each with its own choices, commit the paths."""
        return self.target.verify(proposed.subtrees, [self.samplers[i] for i in rows.live], rows.criteria(),
                                  rows.budgets())

    def accept(self, proposed: AdaptiveProposed, verified: list[Verified], keep: list[int]) -> None:
        """3. draft: keep each row's subtree under its last verified token, KV included."""
        staying = set(keep)
        with self.clock.phase("commit"):  # the draft's side of the commit: its re-root keeps the accepted KV
            self.draft.accept(proposed.subtrees, [v if b in staying else None for b, v in enumerate(verified)])

    def observe(self, proposed: AdaptiveProposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """4. the policy: the round's costs (round 1's roots came with the prefill: it times no verification;
        a round that captured or compiled a step's bucket times that too, not a step) and what each row's
        proposal yielded."""
        untimed = first or self.setup_s() > proposed.setup_before
        verify_s = None if untimed else round_s - proposed.expanding_s - proposed.catch_up_s
        with self.clock.phase("policy"):
            self.policy.observe_round(
                proposed.expansions, proposed.expanding_s, max(len(s) for s in proposed.subtrees), verify_s,
                tokens=sum(len(v.tokens) for v in verified), catch_up_s=proposed.catch_up_s,
                catch_up_tokens=proposed.caught_up,
            )
            self.policy.observe_outcomes(list(zip(proposed.rows, proposed.proposals, verified)))

    @property
    def roots_known(self) -> bool:
        """Whether the rows' roots came with the prefill (joined rows' too): the next round is their first."""
        return self.target.roots_known

    def setup_s(self) -> float:
        return setup_s(self.target, self.draft)

    def keep_rows(self, order: list[int]) -> None:
        self.target.keep_rows(order)
        self.draft.keep_rows(order)
        if self.prepare:  # fewer rows: the caches' buffers narrowed, a layout of their own
            prepare_steps(self.target, self.draft, self.policy.max_budget)

    def absorb(self, other: "AdaptiveSides") -> None:
        """Take `other`'s rows (sides of the same pair, started on their prompts) in after this one's: rows
        joining a running batch (engine/continuous.py)."""
        self.target.absorb(other.target)
        self.draft.absorb(other.draft)

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats:
        return SwiftSpecStats.collect(self.name, new_tokens, wall_s, self.target.counters, self.draft.counters,
                                      clock=self.clock)


def setup_s(target: TargetWorker | None, draft: Drafters | None) -> float:
    """Seconds the workers' replayed steps spent capturing (or first compiling) buckets so far (capture.py); a
    worker this rank does not hold is None."""
    runners = (getattr(w, "runner", None) for w in (target, draft and draft.model) if w is not None)
    return sum(g.setup_s for g in runners if g is not None)


def prepare_steps(target: TargetWorker, draft: Drafters, max_budget: int) -> None:
    """Capture (or compile) every step each model may replay over its cache now, before a round runs one (capture.py,
    step.prepare_steps): the target's verifications of up to the largest tree the policy may pick; a draft model's
    expansions of up to `width` leaves (a fresh tree's: its root and the one token pending after a catch-up) and its
    catch-ups of up to MAX_QUERIES tokens; a draft head's steps of up to MAX_QUERIES queries (its pending tokens run
    along with the root). A draft whose cache has not run a forward gets its buffers first, unless an earlier call
    prepared a fresh cache of its rows and capacity: its first forward then packs into those same buffers."""
    if target.runner is not None:
        step.prepare_steps(target.model, target.cache, target.runner, target.attention, target.architecture,
                           step_menu(max_budget, (0,)), tap=target.tap)
    drafter = draft.model
    runner = getattr(drafter, "runner", None)
    if runner is None:
        return
    head = drafter.reads_features
    size = (drafter.cache.batch_size, drafter.cache.capacity)
    if not drafter.cache.buffers:
        if size in runner.prepared_sizes:
            return
        step.pack_buffers(drafter.model, drafter.cache, drafter.architecture, head)
        runner.prepared_sizes.add(size)
    step.prepare_steps(drafter.model, drafter.cache, runner, drafter.attention, drafter.architecture,
                       draft_menu(drafter), head=head)


def draft_menu(drafter) -> tuple[tuple[int, int], ...]:
    """The steps a drafter's serial rounds may replay (prepare_steps): a draft head's keep every query's logits; a
    draft model's expansions keep them, its catch-ups (which run whatever is pending first) keep none."""
    if drafter.reads_features:
        return step_menu(MAX_QUERIES, (0,))
    catch_up = step.step_keep(False, drafter.architecture)
    return step_menu(max(drafter.width, 2), (0,)) + step_menu(MAX_QUERIES, (catch_up,))


def expand_and_choose(draft: Drafters, policy, rows: list[int], probing: bool, proposed: AdaptiveProposed,
                      clock: PhaseClock) -> None:
    """Phase 1 of a round that may speculate: every row's candidates (its draft tree's best nodes and its
    suffix proposal), draft expansions while more are expected to raise tokens per second, then each
    row's best nodes for the tree size the policy picks; into `proposed` (with the draft's timings), each
    part timed on `clock` as its phase."""
    round_start = proposed.started
    keep_expanding, observe_gain = clock.timed("policy", policy.keep_expanding), clock.timed("policy", policy.observe_gain)
    candidates_of = clock.timed("select", draft.candidates)
    with clock.phase("select"):
        offers = draft.offers(policy, policy.wants_suffix(rows))
        candidates = draft.candidates(policy, offers)
    while keep_expanding(
        proposed.expansions, time.perf_counter() - round_start, ranked_probs(candidates), probing,
        draft.catch_up_tokens,
    ):
        if draft.model is None:  # draft-free: the root alone, nothing to catch up on or grow (RootOnly)
            break
        before = time.perf_counter()
        if draft.catch_up_tokens:  # tokens the draft has not run: no expansion's cost
            proposed.caught_up = draft.catch_up_tokens
            with clock.phase("catch_up"):
                draft.catch_up()
            proposed.catch_up_s += time.perf_counter() - before
            before = time.perf_counter()
        with clock.phase("expand"):
            grew = draft.expand(within=policy.max_budget)
        if not grew:
            break
        proposed.expanding_s += time.perf_counter() - before
        grown = candidates_of(policy, offers)
        observe_gain(proposed.expansions, ranked_probs(candidates), ranked_probs(grown), before - round_start)
        candidates, proposed.expansions = grown, proposed.expansions + 1
    if policy.fixed:  # both tree settings given: every subtree has tree_budget nodes
        with clock.phase("expand"):
            proposed.expansions += draft.top_up(policy.max_budget)
        candidates = candidates_of(policy, offers)
    with clock.phase("select"):
        proposed.proposals = draft.proposals(policy, candidates, time.perf_counter() - round_start)


def ranked_probs(candidates: list[Proposal]) -> list[list[float]]:
    """Each row's node probabilities, best first."""
    return [c.ranked_probs for c in candidates]
