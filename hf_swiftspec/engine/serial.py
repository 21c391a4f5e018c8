"""Serial tree speculation on one device: draft, then verify, then re-root, as the policy says."""

from __future__ import annotations

import time

from ..stats import SwiftSpecStats
from .request import DecodeRequest, DecodeResult
from .workers import DraftWorker, TargetWorker


def run_serial(target: TargetWorker, draft: DraftWorker, request: DecodeRequest) -> DecodeResult:
    """The whole decode loop. Lossless: every emitted token is the target's own choice."""
    policy, result = request.policy, DecodeResult()
    start = time.perf_counter()
    target.prefill(request.prompt, request.padding)
    draft.start(request.prompt, request.corpus, request.history)
    while len(result.tokens) < request.max_new_tokens:
        # 1. draft: expand while more expansions are expected to raise tokens per second
        round_start = time.perf_counter()
        probing = policy.start_round()
        suffix = draft.suffix_tree(policy.max_budget)
        candidates = draft.candidates(policy, suffix)
        expansions, expanding_s, catch_up_s = 0, 0.0, 0.0
        while policy.keep_expanding(expansions, time.perf_counter() - round_start, candidates.ranked_probs, probing):
            before = time.perf_counter()
            if len(draft.pending) > 1:  # tokens the draft has not run (the prompt, plain rounds): no expansion's cost
                draft.catch_up()
                catch_up_s += time.perf_counter() - before
                before = time.perf_counter()
            if not draft.expand(within=policy.max_budget):
                break
            expanding_s += time.perf_counter() - before
            grown = draft.candidates(policy, suffix)
            policy.observe_gain(expansions, candidates.ranked_probs, grown.ranked_probs, before - round_start)
            candidates, expansions = grown, expansions + 1
        if policy.fixed:  # both tree settings given: the subtree always has tree_budget nodes
            expansions += draft.top_up(policy.max_budget)
            candidates = draft.candidates(policy, suffix)
        proposal = draft.proposal(policy, candidates, time.perf_counter() - round_start)
        draft.counters.rounds += 1
        draft.counters.busy_s += time.perf_counter() - round_start
        # 2. target: one forward over the subtree, walk it with its own choices, commit the path
        verified = target.verify(
            proposal.subtree, request.sampler, request.stopping_criteria, request.max_new_tokens - len(result.tokens)
        )
        result.emit(verified, request)
        if not verified.finished:  # 3. draft: keep the subtree under the last verified token, KV included
            draft.reroot(proposal.subtree, verified)
        round_s = time.perf_counter() - round_start
        verify_s = round_s - expanding_s - catch_up_s if result.rounds else None  # round 1's root came with the prefill
        policy.observe_round(
            expansions, expanding_s, len(proposal.subtree), verify_s,
            tokens=len(verified.tokens), catch_up_s=catch_up_s,
        )
        policy.observe_outcome(proposal, verified)
        result.record_round(proposal, verified, expansions)
        if verified.finished:
            break
    result.stats = SwiftSpecStats.collect(
        "serial", len(result.tokens), time.perf_counter() - start, target.counters, draft.counters
    )
    result.stats.add_rounds(result.rounds)
    return result
