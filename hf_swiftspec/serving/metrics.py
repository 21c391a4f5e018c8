"""`GET /metrics`: the server's figures in Prometheus' text format (prometheus_client), for a scraper.

Each server has a registry of its own (several servers in one process, as the tests run them, never mix). What
the app sees of each request (its outcome, latency, first token, tokens) is counted as it ends; what the batching
manager and the running batch keep (requests held, rounds, speculation totals) is read at scrape time.

| metric | type | what |
|---|---|---|
| swiftspec_requests_total{outcome} | counter | requests ended: finished, busy (429), timed_out (504), refused (400), failed (500), cancelled (client left) |
| swiftspec_requests_waiting, swiftspec_requests_running | gauge | requests admitted and not decoding yet / decoding |
| swiftspec_prompt_tokens_total, swiftspec_generation_tokens_total | counter | tokens read and emitted by finished requests |
| swiftspec_generation_tokens_per_second | gauge | emitted tokens per second over the last `WINDOW_S` seconds |
| swiftspec_request_latency_seconds | histogram | arrival to last token, finished requests |
| swiftspec_time_to_first_token_seconds | histogram | streamed requests: arrival to the first event with answer text |
| swiftspec_inter_token_latency_seconds | histogram | streamed requests: from one event with answer text to the next (a round's tokens go out in one event) |
| swiftspec_time_per_output_token_seconds | histogram | finished streamed requests: first text event to last, over the tokens after the first |
| swiftspec_verifications_total, swiftspec_proposed_tokens_total, swiftspec_accepted_tokens_total | counter | usage.speculation, summed over finished requests |
| swiftspec_acceptance_length | histogram | per finished request, tokens per verification (usage.speculation's tokens_per_verification) |
| swiftspec_rounds_total, swiftspec_plain_rounds_total | counter | rounds run, and those that verified each row's root alone |
| swiftspec_plain_round_share | gauge | plain rounds over rounds |
| swiftspec_prefix_cache_hits_total, swiftspec_prefix_cache_reused_tokens_total | counter | with --continuous-batching on the device round: joining prompts that copied a stored prefix's KV, and the prompt tokens they did not prefill |
"""

from __future__ import annotations

import threading
import time
from collections import deque

WINDOW_S = 60.0  # the tokens-per-second gauge's window
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, float("inf"))
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, float("inf"))
ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, float("inf"))
OUTCOMES = ("finished", "busy", "timed_out", "refused", "failed", "cancelled")


class ServerMetrics:
    """The server's Prometheus metrics (see the module docstring); `served` is the app's and the batching
    manager's shared state (batching.Served), read at scrape time."""

    def __init__(self, served):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.served = served
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("swiftspec_requests", "Requests ended, by outcome", ["outcome"], registry=registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome shows, at 0 until it happens
        Gauge("swiftspec_requests_waiting", "Requests admitted, not decoding yet", registry=registry).set_function(
            lambda: served.admission.counts()[0])
        Gauge("swiftspec_requests_running", "Requests decoding", registry=registry).set_function(
            lambda: served.admission.counts()[1])
        self.prompt_tokens = Counter("swiftspec_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("swiftspec_generation_tokens", "Tokens emitted for finished requests",
                                         registry=registry)
        Gauge("swiftspec_generation_tokens_per_second", f"Tokens emitted per second over the last {WINDOW_S:g} s",
              registry=registry).set_function(self.tokens_per_second)
        self.latency = Histogram("swiftspec_request_latency_seconds", "Arrival to last token of finished requests",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.first_token = Histogram("swiftspec_time_to_first_token_seconds", "Arrival to the first streamed text of the answer",
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("swiftspec_inter_token_latency_seconds",
                                     "From one streamed event with answer text to the next", buckets=TOKEN_BUCKETS,
                                     registry=registry)
        self.per_token = Histogram("swiftspec_time_per_output_token_seconds",
                                   "Per finished streamed request: first text to last, over the tokens after the first",
                                   buckets=TOKEN_BUCKETS, registry=registry)
        self.verifications = Counter("swiftspec_verifications", "Target verifications of finished requests",
                                     registry=registry)
        self.proposed = Counter("swiftspec_proposed_tokens", "Proposed tokens verified for finished requests",
                                registry=registry)
        self.accepted = Counter("swiftspec_accepted_tokens", "Proposed tokens the target accepted", registry=registry)
        self.acceptance = Histogram("swiftspec_acceptance_length", "Tokens per verification, per finished request",
                                    buckets=ACCEPTANCE_BUCKETS, registry=registry)
        registry.register(RoundsCollector(served))
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last WINDOW_S seconds' answers
        self.lock = threading.Lock()

    def ended(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def finished(self, usage: dict | None, latency_s: float, streamed: dict | None = None) -> None:
        """A request answered (200): its usage (OpenAI's, with usage.speculation) and latency; a streamed one's
        first and last text events (`streamed`: perf_counter times first_at, last_at)."""
        self.ended("finished")
        self.latency.observe(latency_s)
        usage = usage or {}
        tokens = usage.get("completion_tokens") or usage.get("output_tokens") or 0
        if streamed and "first_at" in streamed and tokens > 1:
            self.per_token.observe((streamed["last_at"] - streamed["first_at"]) / (tokens - 1))
        self.prompt_tokens.inc(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
        self.generation_tokens.inc(tokens)
        with self.lock:
            self.recent.append((time.monotonic(), tokens))
        figures = usage.get("speculation")
        if figures:
            self.verifications.inc(figures["verifications"])
            self.proposed.inc(figures["proposed_tokens"])
            self.accepted.inc(figures["accepted_tokens"])
            if figures["verifications"]:
                self.acceptance.observe(figures["tokens_per_verification"])

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            while self.recent and self.recent[0][0] < now - WINDOW_S:
                self.recent.popleft()
            return sum(tokens for _, tokens in self.recent) / WINDOW_S

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RoundsCollector:
    """Rounds and plain rounds, read from the running batch (or the lone calls) at scrape time."""

    def __init__(self, served):
        self.served = served

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rounds, plain = self.served.usage.round_counts()
        yield CounterMetricFamily("swiftspec_rounds", "Rounds run (one verification of every row decoding)", rounds)
        yield CounterMetricFamily("swiftspec_plain_rounds", "Rounds that verified every row's root alone", plain)
        yield GaugeMetricFamily("swiftspec_plain_round_share", "Plain rounds over rounds", plain / rounds if rounds else 0.0)
        prefixes = getattr(self.served.usage.engine, "prefixes", None)
        yield CounterMetricFamily("swiftspec_prefix_cache_hits", "Joining prompts that reused a stored prefix's KV",
                                  prefixes.hits if prefixes is not None else 0)
        yield CounterMetricFamily("swiftspec_prefix_cache_reused_tokens", "Prompt tokens not prefilled: a stored prefix's",
                                  prefixes.reused_tokens if prefixes is not None else 0)
