"""Admission control: how many requests `swiftspec serve` holds, and what it answers past that.

A request is *waiting* from the moment the server admits it until its row starts decoding (the running batch takes
it in, or the sequential server's thread picks it), then *running* until its answer is done. Three limits, each
off unless given (`swiftspec serve --max-queue/--request-timeout/--cache-positions`):

- `max_queue`: the most requests waiting at once. One more is refused at once with a 429 in OpenAI's error shape
  (`code: "server_busy"`) and a Retry-After header (seconds: the median latency of the last answers, at least 1), so
  a client backs off instead of waiting however long.
- `request_timeout`: seconds a request may take from its arrival to its last token. Past it the request is
  cancelled wherever it is (waiting, or its row leaves the running batch after the round in flight) and answered
  with a 504 (`code: "request_timeout"`; a streamed answer ends with that error as its last event).
- `cache_positions`: the most cache positions the running batch holds (rows x each row's slots: its prompt, its
  max_tokens and the largest tree); a request that would pass it waits until rows leave (engine/continuous.py). So
  the caches' memory is bounded by what the server was given, and the queue is what bounds the rest.
- `prefix_cache_positions`: the most slots of shared prompt prefixes the running batch keeps for joining requests
  to reuse (engine/prefix_store.py; 0: none); by default the engine's own bound, or a quarter of cache_positions.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """What the server admits (None: no limit); see the module docstring."""

    max_queue: int | None = None
    request_timeout: float | None = None
    cache_positions: int | None = None
    # the slots of shared prompt prefixes the running batch keeps (engine/prefix_store.py; 0: none); None: the
    # engine's default, or a quarter of cache_positions where that is given
    prefix_cache_positions: int | None = None

    @property
    def prefix_positions(self) -> int | None:
        if self.prefix_cache_positions is not None or self.cache_positions is None:
            return self.prefix_cache_positions
        return self.cache_positions // 4

    def __post_init__(self):
        for name, low in (("max_queue", 0), ("request_timeout", 1e-9), ("cache_positions", 1),
                          ("prefix_cache_positions", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {value}: give {'a positive number' if low else 'a count of 0 or more'}, "
                                 "or leave it out for no limit.")


class Busy(Exception):
    """A request refused because the queue is full (the server's 429)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Admission:
    """The requests the server holds, waiting and running, by request id (thread-safe: the app's event loop
    admits and ends them, the batching managers' threads start them)."""

    limits: Limits = field(default_factory=Limits)
    waiting: set = field(default_factory=set)
    running: set = field(default_factory=set)
    latencies: deque = field(default_factory=lambda: deque(maxlen=64))  # the last answers' seconds
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, request_id: str) -> None:
        """Take the request in as waiting, or raise Busy past max_queue."""
        with self.lock:
            limit = self.limits.max_queue
            if limit is not None and len(self.waiting) >= limit:
                retry = self.retry_after()
                raise Busy(
                    f"The server is busy: {len(self.waiting)} requests are waiting (--max-queue {limit}) beside "
                    f"{len(self.running)} decoding. Retry after {retry} s.", retry,
                )
            self.waiting.add(request_id)

    def started(self, request_id: str) -> None:
        """The request's row began decoding."""
        with self.lock:
            if request_id in self.waiting:
                self.waiting.discard(request_id)
                self.running.add(request_id)

    def ended(self, request_id: str, latency_s: float | None = None) -> None:
        with self.lock:
            self.waiting.discard(request_id)
            self.running.discard(request_id)
            if latency_s is not None:
                self.latencies.append(latency_s)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one answer's time (the median of the last ones)."""
        return max(1, math.ceil(statistics.median(self.latencies))) if self.latencies else 1

    def counts(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self.lock:
            return len(self.waiting), len(self.running)
