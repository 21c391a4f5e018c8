"""Serial tree speculation on one device: draft, then verify, then re-root, as the policy says.

One round serves every row of the batch: one draft forward per expansion for all rows, one target
forward verifying each row's subtree (one tree size for the batch, so the forward is a rectangle
of rows x nodes), a walk per row with the target's own choices, one commit per cache. Rows that
finish leave both caches at the end of the round (`keep_rows`: their slots are compacted away), so
they stop costing compute.
"""

from __future__ import annotations

import time

from ..cache import keep_order
from ..stats import SwiftSpecStats
from ..tree import Proposal
from .request import BatchRows, DecodeRequest, DecodeResult
from ..drafting import Drafters
from .workers import TargetWorker


def run_serial(target: TargetWorker, draft: Drafters, request: DecodeRequest) -> DecodeResult:
    """The whole decode loop. Lossless: every emitted token is the target's own choice."""
    policy = request.policy
    rows = BatchRows.start(request)
    samplers = list(request.samplers)
    start = time.perf_counter()
    target.prefill(request.prompt, request.contexts, request.attention_mask)
    draft.start(request.prompt_ids(), target.prompt_features)
    target.prompt_features = None  # the head keeps what it needs of them (fused: a third of their width)
    while rows.live:
        # 1. draft: expand while more expansions are expected to raise tokens per second
        round_start = time.perf_counter()
        plan = policy.plan_round(len(rows.live), rows.live)
        if plan.quiet or (target.root_logits is not None and policy.tree_budget is None):
            # plain rounds of late: verify the roots, build no proposal. And round 1, whose roots' logits came
            # with the prefill: plain, it emits their tokens with no forward at all, where a tree pays a whole
            # forward (1.6-2x a plain step on a CPU) and, if it misses, emits just as much. Its tree is worth
            # the next round's tree minus that round's root token: deferring it never loses a token.
            proposals, expansions, expanding_s, catch_up_s, caught_up = draft.plain(), 0, 0.0, 0.0, 0
        else:
            proposals, expansions, expanding_s, catch_up_s, caught_up = expand_and_choose(
                draft, policy, rows.live, plan.probing, round_start
            )
        draft.counters.rounds += 1
        draft.counters.busy_s += time.perf_counter() - round_start
        # 2. target: one forward over every row's subtree, walk each with its own choices, commit the paths
        subtrees = [p.subtree for p in proposals]
        verified = target.verify(
            subtrees, [samplers[i] for i in rows.live], rows.criteria(), rows.budgets()
        )
        outcomes = [(i, p, v) for i, p, v in zip(rows.live, proposals, verified)]
        keep = rows.record(verified, request.on_tokens)
        # 3. draft: keep each row's subtree under its last verified token, KV included
        staying = set(keep)
        draft.accept(subtrees, [v if b in staying else None for b, v in enumerate(verified)])
        round_s = time.perf_counter() - round_start
        first = not rows.result.rounds  # round 1's roots came with the prefill: it times no verification
        policy.observe_round(
            expansions, expanding_s, max(len(s) for s in subtrees), None if first else round_s - expanding_s - catch_up_s,
            tokens=sum(len(v.tokens) for v in verified), catch_up_s=catch_up_s, catch_up_tokens=caught_up,
        )
        policy.observe_outcomes(outcomes)
        rows.result.record_round(proposals, verified, expansions)
        if len(keep) < len(verified):  # rows that finished leave both caches: they stop costing compute
            order = keep_order(keep)
            rows.keep(order)
            if order:
                target.keep_rows(order)
                draft.keep_rows(order)
    result = rows.result
    result.stats = SwiftSpecStats.collect(
        "serial", result.new_tokens, time.perf_counter() - start, target.counters, draft.counters
    )
    result.stats.add_rounds(result.rounds)
    return result


def expand_and_choose(
    draft: Drafters, policy, rows: list[int], probing: bool, round_start: float
) -> tuple[list[Proposal], int, float, float, int]:
    """Step 1 of a round: every row's candidates (its draft tree's best nodes and its suffix proposal),
    draft expansions while more are expected to raise tokens per second, then each row's best nodes
    for the tree size the policy picks. Returns (proposals, expansions, expanding_s, catch_up_s,
    tokens caught up)."""
    suffixes = draft.suffix_trees(policy.max_budget, policy.wants_suffix(rows))
    candidates = draft.candidates(policy, suffixes)
    expansions, expanding_s, catch_up_s, caught_up = 0, 0.0, 0.0, 0
    while policy.keep_expanding(
        expansions, time.perf_counter() - round_start, ranked_probs(candidates), probing, draft.catch_up_tokens
    ):
        before = time.perf_counter()
        if draft.catch_up_tokens:  # tokens the draft has not run: no expansion's cost
            caught_up = draft.catch_up_tokens
            draft.catch_up()
            catch_up_s += time.perf_counter() - before
            before = time.perf_counter()
        if not draft.expand(within=policy.max_budget):
            break
        expanding_s += time.perf_counter() - before
        grown = draft.candidates(policy, suffixes)
        policy.observe_gain(expansions, ranked_probs(candidates), ranked_probs(grown), before - round_start)
        candidates, expansions = grown, expansions + 1
    if policy.fixed:  # both tree settings given: every subtree has tree_budget nodes
        expansions += draft.top_up(policy.max_budget)
        candidates = draft.candidates(policy, suffixes)
    proposals = draft.proposals(policy, candidates, time.perf_counter() - round_start)
    return proposals, expansions, expanding_s, catch_up_s, caught_up


def ranked_probs(candidates: list[Proposal]) -> list[list[float]]:
    """Each row's node probabilities, best first."""
    return [c.ranked_probs for c in candidates]
