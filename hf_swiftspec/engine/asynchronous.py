"""Asynchronous tree speculation (SwiftSpec Algorithm 1): the draft grows the tree while the
target verifies the subtree it was sent. Same workers as engine/adaptive.py; only the schedule
differs:

    draft:  propose S_n -> settle the last re-root -> graft S_n (its nodes join the tree and run) ->
            expand up to d times while S_n is verified -> receive verdict -> follow it (the re-root
            itself waits) -> propose S_n+1 below the new root (a fresh tree expands first)
    target: receive S_n -> forward + walk -> send verdict -> commit -> emit tokens

`run_draft` and `run_target` are transport-free; `run_threads` runs them in one process. They
decode one sequence (a batch of prompts takes the serial engine, which batches every forward).
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..config import FIRST_TREE
from ..stats import SwiftSpecStats
from .links import ThreadLink, run_two_threads
from .request import BatchRows, DecodeRequest, DecodeResult, round_record
from ..drafters.drafting import Drafters, offered_nothing
from .workers import TargetWorker



def run_draft(draft: Drafters, request: DecodeRequest, link, records: list | None = None) -> None:
    """The draft worker's loop; returns when the target says generation is finished (one sequence).
    Each phase's time goes to its DraftCounters field (stats.OverlapBreakdown); each round's RoundRecord to
    `records` (its expansions: those run while its subtree was verified)."""
    policy, counters = request.policy, draft.counters
    draft.start(request.prompt_ids(), link.receive_prompt_states() if draft.reads_features else None)
    start = time.perf_counter()
    draft.top_up(min(policy.max_budget, FIRST_TREE))
    counters.start_s += time.perf_counter() - start
    tokens = round_trips_s = 0.0  # this call's verified tokens and round trips, for draft_pays
    while True:
        selecting = time.perf_counter()
        # Drafting is off the critical path here: the tree size is chosen by verification time alone.
        policy.plan_round(1, [0], probes=False)
        offers = draft.offers(policy)
        drafting = draft_pays(policy, link, tokens, round_trips_s, counters.rounds)
        if draft.fresh and offered_nothing(offers[0]) and drafting:
            # a fresh tree and nothing to copy: one expansion first (else the root alone, a plain step)
            catching_up = time.perf_counter()
            draft.top_up(2)
            counters.catch_up_s += time.perf_counter() - catching_up
            selecting += time.perf_counter() - catching_up
        candidates = draft.candidates(policy, offers)
        (proposal,) = draft.proposals(policy, candidates, spent_s=0.0, agree=link.agree)
        counters.select_s += time.perf_counter() - selecting
        link.send_subtree(proposal.subtree)
        sent = time.perf_counter()
        counters.rounds += 1
        counters.busy_s += sent - start
        (in_flight,) = draft.settle([proposal.subtree])  # the last verdict's re-root, now off the critical path
        # While the target verifies, keep growing the whole tree: after the re-root, whatever
        # grew under the verified path is already there.
        growing = drafting or counters.rounds % PROBE_GROWTH_EVERY == 0  # now and then: has the text become predictable?

        def stop() -> bool:  # the verdict is in, or (a lone draft rank) one more expansion would end after it
            return link.verdict_ready() or (
                link.stops_alone and not policy.expansion_fits(len(proposal.subtree), time.perf_counter() - sent))

        # First the subtree in flight: its nodes join the tree and run, so any verdict re-roots on a run node.
        expansions = draft.grow(1, stop=stop) if growing and draft.fresh else 0  # the root runs first
        expansions += draft.graft([in_flight]) if growing and not stop() else 0
        expansions += draft.grow(link.agree(policy.overlap_depth()) - expansions if growing else 0, stop=stop)
        drafted = time.perf_counter()
        verified = link.receive_verdict()
        start = time.perf_counter()
        arrived = min(link.verdict_arrived_at(), start)
        counters.grow_s += max(min(drafted, arrived) - sent, 0.0)
        counters.overrun_s += max(drafted - arrived, 0.0)
        counters.wait_s += start - drafted
        counters.busy_s += drafted - sent
        counters.in_flight_expansions += expansions
        counters.grown_rounds += expansions > 0
        policy.observe_round(expansions, drafted - sent, len(proposal.subtree), start - sent)
        policy.observe_outcome(proposal, verified)
        if records is not None:
            records.append(round_record([proposal], [verified], expansions))
        tokens, round_trips_s = tokens + len(verified.tokens), round_trips_s + (start - sent)
        if verified.finished:
            return
        draft.accept([proposal.subtree], [verified], defer=True)  # the target waits from here to the next send
        counters.reroot_s += time.perf_counter() - start


PROBE_GROWTH_EVERY = 8  # rounds: where the draft does not pay, it still grows during one verification in this many


def draft_pays(policy, link, tokens: float, round_trips_s: float, rounds: int) -> bool:
    """policy.draft_pays on this call's rounds so far (tokens and round trips over `rounds`), the same on every
    draft rank (the leader's choice)."""
    if rounds == 0:
        return True
    return bool(link.agree(int(policy.draft_pays(tokens / rounds, round_trips_s / rounds))))


def run_target(target: TargetWorker, request: DecodeRequest, link, rows: BatchRows) -> None:
    """The target worker's loop: verify each subtree, answer as soon as the walk is done (before the commit:
    the draft re-roots meanwhile), then emit the tokens. One sequence: the walk's `finished` is the row's end."""

    def answer(verdicts: list) -> None:
        sending = time.perf_counter()
        link.send_verdict(verdicts[0])
        target.counters.verdict_s += time.perf_counter() - sending

    target.prefill(request.prompt, request.contexts, request.attention_mask)
    if target.tap is not None:  # an EAGLE-3 head starts from the prompt's hidden states
        link.send_prompt_states(target.prompt_features)
        target.prompt_features = None
    while rows.live:
        waiting = time.perf_counter()
        subtree = link.receive_subtree()
        target.counters.idle_s += time.perf_counter() - waiting
        if not target.counters.verify_steps:
            target.counters.first_wait_s = time.perf_counter() - waiting
        (verified,) = target.verify(
            [subtree], request.samplers, rows.criteria(), rows.budgets(), walk=link.walk, walked=answer
        )
        rows.keep(rows.record([verified], request.on_tokens))


def run_threads(target: TargetWorker, draft: Drafters, request: DecodeRequest, timeout_s: float) -> DecodeResult:
    """Target in the calling thread, draft in a worker thread (on its own CUDA stream)."""
    rows = BatchRows.start(request)
    link = ThreadLink(timeout_s)
    records = []  # the draft's RoundRecords, read once its thread has stopped
    start = time.perf_counter()
    run_two_threads(link, lambda: run_draft(draft, request, link, records),
                    lambda: run_target(target, request, link, rows), timeout_s, lambda: stream_for(draft.device))
    result = rows.result
    result.stats = SwiftSpecStats.collect(
        "async-threads", result.new_tokens, time.perf_counter() - start, target.counters, draft.counters,
        message_bytes=0,  # the messages are Python objects handed between threads
    )
    result.stats.add_rounds(records)
    return result


def stream_for(device: torch.device):
    """A side CUDA stream for the draft thread, so its kernels overlap the target's."""
    if device.type == "cuda":
        return torch.cuda.stream(torch.cuda.Stream(device))
    return contextlib.nullcontext()
