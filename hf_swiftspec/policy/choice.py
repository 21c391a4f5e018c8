"""Which engine a two-device placement's calls run: the asynchronous one (draft and target each on their
own device and thread, or in their own torchrun processes) or the serial round (on the same workers in one
process; under torchrun on the target's rank, the draft model beside it), whichever decoded faster on this pair.

Overlap hides the draft's time, so it pays only where the draft is a sizeable share of a serial round.
Measured on the project's 2-core CPU machine (examples/bench_async.py, demo pair): the serial round spent
3% of its time in the draft (0.4 ms a round against 9.6 ms verifying), and the asynchronous engine ran
0.86-1.01x the serial round; on a pair whose draft agrees and costs more it ran 1.49x. So where the
placement asks for it (`SwiftSpecConfig.serial_fallback`), the first MEASURED_CALLS calls of each engine
alternate (asynchronous first), and later calls run the engine that measured more tokens per second, the
other one call in RETRY_EVERY so a change (longer prompts, another kind of text) is noticed. A call's
tokens per second depends on how predictable its text is, so one call of each decides badly: on the demo
pair a single slow serial call kept the asynchronous engine (0.80x the serial round there) for five calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

ASYNC, SERIAL = "async", "serial"  # the two engines a call may run (their stats name the asynchronous one more precisely)
RETRY_EVERY = 8  # calls: the engine not chosen runs one call in this many
MEASURED_CALLS = 2  # calls of each engine, alternating, before the rates choose
SMOOTHING = 0.5  # weight of a call's tokens per second in its engine's running average


@dataclass
class EngineChoice:
    """Tokens per second each engine measured on this pair, averaged over calls, and the choice they make.

    rates: engine -> running average of new tokens per second of its calls; calls: engine -> calls run.
    clock: what a call is timed with (seconds), and the serial round's phases (stats.PhaseClock); a test gives one
        that advances by fixed costs per engine, or by a tick a reading (tests/test_breakdown.py).
    """

    rates: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    picks: int = 0
    clock: Callable[[], float] = time.perf_counter

    def pick(self) -> str:
        """The engine of the next call: the two alternately (asynchronous first) until each ran MEASURED_CALLS calls,
        then the faster, the other every RETRY_EVERY calls."""
        self.picks += 1
        runs = {engine: self.calls.get(engine, 0) for engine in (ASYNC, SERIAL)}
        if min(runs.values()) < MEASURED_CALLS:
            return ASYNC if runs[ASYNC] <= runs[SERIAL] else SERIAL
        best, other = self.ranked()
        return other if self.picks % RETRY_EVERY == 0 else best

    def ranked(self) -> tuple[str, str]:
        """(faster, slower) by the rates measured; ties go to the asynchronous engine the placement asked for."""
        return (ASYNC, SERIAL) if self.rates[ASYNC] >= self.rates[SERIAL] else (SERIAL, ASYNC)

    def observe(self, engine: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.rates.get(engine)
        self.rates[engine] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        self.calls[engine] = self.calls.get(engine, 0) + 1

    def describe(self, engine: str, name: str | None = None) -> str:
        """Why this call ran `engine` (SwiftSpecStats.engine_choice), which its stats call `name`."""
        name = name or engine
        if min(self.calls.get(e, 0) for e in (ASYNC, SERIAL)) < MEASURED_CALLS:
            return f"{name}: measuring both engines, {MEASURED_CALLS} calls each, alternately"
        best, _ = self.ranked()
        ratio = self.rates[ASYNC] / self.rates[SERIAL]
        measured = (f"the asynchronous engine measured {ratio:.2f}x the serial round's tokens per second on this pair "
                    f"(over {self.calls[ASYNC]} and {self.calls[SERIAL]} calls)")
        if engine == best:
            return f"{name}: {measured}"
        return f"{name}: retried one call in {RETRY_EVERY}; {measured}"
