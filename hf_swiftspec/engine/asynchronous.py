"""Asynchronous tree speculation (SwiftSpec Algorithm 1): the draft grows the tree while the
target verifies the subtree it was sent. Same workers as engine/serial.py; only the schedule
differs:

    draft:  propose S_n -> expand up to d times while S_n is verified -> receive verdict ->
            re-root (the tree keeps what it grew meanwhile) -> top up -> propose S_n+1
    target: receive S_n -> forward + walk + commit -> send verdict -> emit tokens

`run_draft` and `run_target` are transport-free; `run_threads` runs them in one process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from ..policy import DepthPolicy
from .links import LinkClosed, SwiftSpecWorkerError, ThreadLink, Verdict
from .request import DecodeRequest, DecodeResult
from .workers import DraftWorker, TargetWorker


@dataclass
class DraftReport:
    """What the draft worker did in one generation."""

    forwards: int = 0
    rounds: int = 0
    in_flight_expansions: int = 0  # expansions run while a verification was in flight
    reroot_hits: int = 0
    reroot_misses: int = 0
    busy_s: float = 0.0


def run_draft(draft: DraftWorker, prompt: torch.Tensor, budget: int, depth: DepthPolicy, link) -> DraftReport:
    """The draft worker's loop; returns when the target says generation is finished."""
    report = DraftReport()
    draft.start(prompt)
    start = time.perf_counter()
    draft.grow(0, budget)
    last_sent, last_tokens = None, 0
    while True:
        subtree = draft.propose(budget)
        link.send_subtree(subtree)
        sent = time.perf_counter()
        report.busy_s += sent - start
        if last_sent is not None:  # one full period of the previous round, for its depth
            depth.observe_round(last_tokens, sent - last_sent)
        expansions, planned = 0, link.agree_depth(depth.depth())
        while expansions < planned and not link.verdict_ready():
            if not draft.expand():
                break
            expansions += 1
        drafted = time.perf_counter()
        verdict = link.receive_verdict()
        start = time.perf_counter()
        report.busy_s += drafted - sent
        depth.observe(drafted - sent, expansions, start - sent)
        last_sent, last_tokens = sent, len(verdict.tokens)
        report.rounds += 1
        report.in_flight_expansions += expansions
        if verdict.finished:
            break
        draft.reroot(subtree, verdict)
        draft.grow(0, budget)
    report.forwards = draft.forwards
    report.reroot_hits, report.reroot_misses = draft.reroot_hits, draft.reroot_misses
    return report


def run_target(target: TargetWorker, request: DecodeRequest, link, result: DecodeResult) -> None:
    """The target worker's loop: verify each subtree, answer at once, then emit the tokens."""
    stats = result.stats
    sequence = request.prompt.to(target.device)
    target.prefill(sequence[:, :-1])
    while True:
        waiting = time.perf_counter()
        subtree = link.receive_subtree()
        verifying = time.perf_counter()
        remaining = request.max_new_tokens - len(result.tokens)
        verified = target.verify(
            subtree, sequence, request.sampler, request.stopping_criteria, remaining, walk=link.walk
        )
        link.send_verdict(Verdict(verified.tokens, verified.path, verified.finished))
        stats.target_idle_s += verifying - waiting
        stats.target_time_s += time.perf_counter() - verifying
        stats.verify_steps += 1
        sequence = torch.cat([sequence, torch.tensor([verified.tokens], device=sequence.device)], dim=1)
        result.emit(verified, request)
        if verified.finished:
            return


def run_threads(target: TargetWorker, draft: DraftWorker, request: DecodeRequest, timeout_s: float) -> DecodeResult:
    """Target in the calling thread, draft in a worker thread (on its own CUDA stream)."""
    result = DecodeResult()
    result.stats.engine = "async-threads"
    link = ThreadLink(timeout_s)
    reports: list[DraftReport] = []

    def draft_main() -> None:
        try:
            with stream_for(draft.device):
                reports.append(run_draft(draft, request.prompt, request.tree_budget, request.depth, link))
        except LinkClosed:
            pass
        except BaseException as error:  # surfaces in generate() through the link
            link.report_failure("draft", error)

    thread = threading.Thread(target=draft_main, name="swiftspec-draft", daemon=True)
    start = time.perf_counter()
    thread.start()
    try:
        run_target(target, request, link, result)
    except SwiftSpecWorkerError:
        raise
    except Exception as error:
        raise SwiftSpecWorkerError(f"the target worker failed: {error!r}") from error
    finally:
        link.close()
        thread.join(timeout=timeout_s)
    if thread.is_alive():
        raise SwiftSpecWorkerError(f"the draft worker did not stop within {timeout_s:.0f}s after generation ended")
    result.stats.wall_time_s = time.perf_counter() - start
    fill_stats(result, target, reports[0] if reports else DraftReport())
    return result


def fill_stats(result: DecodeResult, target: TargetWorker, report: DraftReport) -> None:
    stats = result.stats
    stats.new_tokens = len(result.tokens)
    stats.target_forwards = target.forwards if target is not None else 0
    stats.draft_forwards = report.forwards
    stats.draft_time_s = report.busy_s
    stats.draft_depth = report.in_flight_expansions / max(report.rounds, 1)
    stats.in_flight_expansions = report.in_flight_expansions
    stats.reroot_hits, stats.reroot_misses = report.reroot_hits, report.reroot_misses


def stream_for(device: torch.device):
    """A side CUDA stream for the draft thread, so its kernels overlap the target's."""
    if device.type == "cuda":
        return torch.cuda.stream(torch.cuda.Stream(device))
    return contextlib.nullcontext()
