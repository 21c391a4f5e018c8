"""Serial tree speculation on one device: draft d expansions, then verify, then re-root."""

from __future__ import annotations

import time

import torch

from .request import DecodeRequest, DecodeResult
from .workers import DraftWorker, TargetWorker


def device_sync(device: torch.device) -> None:
    """Wait for queued kernels so phase timings are real (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_serial(target: TargetWorker, draft: DraftWorker, request: DecodeRequest) -> DecodeResult:
    """The whole decode loop. Lossless: every emitted token is the target's own choice."""
    result = DecodeResult()
    stats = result.stats
    start = time.perf_counter()
    sequence = request.prompt.to(target.device)  # (1, L): committed tokens + the current root
    target.prefill(sequence[:, :-1])
    draft.start(request.prompt)
    expansions_total = 0
    while len(result.tokens) < request.max_new_tokens:
        round_start = time.perf_counter()
        expansions = draft.grow(request.depth.depth(), request.tree_budget)
        subtree = draft.propose(request.tree_budget)  # syncs the draft device
        verify_start = time.perf_counter()
        verified = target.verify(
            subtree,
            sequence,
            request.sampler,
            request.stopping_criteria,
            request.max_new_tokens - len(result.tokens),
        )
        device_sync(target.device)
        verify_end = time.perf_counter()

        request.depth.observe(verify_start - round_start, expansions, verify_end - verify_start)
        request.depth.observe_round(len(verified.tokens), verify_end - round_start)
        stats.draft_time_s += verify_start - round_start
        stats.target_time_s += verify_end - verify_start
        stats.verify_steps += 1
        expansions_total += expansions
        sequence = torch.cat([sequence, torch.tensor([verified.tokens], device=sequence.device)], dim=1)
        result.emit(verified, request)
        if verified.finished:
            break
        draft.reroot(subtree, verified)

    stats.new_tokens = len(result.tokens)
    stats.target_forwards = target.forwards
    stats.draft_forwards = draft.forwards
    stats.reroot_hits, stats.reroot_misses = draft.reroot_hits, draft.reroot_misses
    stats.draft_depth = expansions_total / max(stats.verify_steps, 1)
    stats.wall_time_s = time.perf_counter() - start
    return result
