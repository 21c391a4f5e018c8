"""Serial tree speculation on one device: draft d expansions, then verify, then re-root."""

from __future__ import annotations

import time

from ..stats import SwiftSpecStats
from .request import DecodeRequest, DecodeResult
from .workers import DraftWorker, TargetWorker


def run_serial(target: TargetWorker, draft: DraftWorker, request: DecodeRequest) -> DecodeResult:
    """The whole decode loop. Lossless: every emitted token is the target's own choice."""
    result = DecodeResult()
    start = time.perf_counter()
    target.prefill(request.prompt)
    draft.start(request.prompt)
    while len(result.tokens) < request.max_new_tokens:
        # 1. draft: grow the part of the tree the target may verify, then top it up to the budget
        round_start = time.perf_counter()
        expansions = draft.grow(request.depth.depth(), within=request.tree_budget)
        expansions += draft.top_up(request.tree_budget)
        subtree = draft.propose(request.tree_budget)  # syncs the draft device
        verify_start = time.perf_counter()
        draft.counters.busy_s += verify_start - round_start
        # 2. target: one forward over the subtree, walk it with its own choices, commit the path
        verified = target.verify(
            subtree, request.sampler, request.stopping_criteria, request.max_new_tokens - len(result.tokens)
        )
        verify_end = time.perf_counter()
        request.depth.observe(verify_start - round_start, expansions, verify_end - verify_start)
        request.depth.observe_round(len(verified.tokens), verify_end - round_start)
        result.emit(verified, request)
        if verified.finished:
            break
        # 3. draft: keep the subtree under the last verified token, KV included
        draft.reroot(subtree, verified)
    result.stats = SwiftSpecStats.collect(
        "serial", len(result.tokens), time.perf_counter() - start, target.counters, draft.counters
    )
    return result
