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

The same rule chooses between the round and transformers' own loop (`LoopChoice`): where the policy decoded a
call's rounds plainly (nothing it could propose paid), the round is the target's step plus its bookkeeping, and
target.generate's loop, which emits the same tokens, may be faster; measured on this pair, the faster of the two runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

ASYNC, SERIAL = "async", "serial"  # the two engines a call may run (their stats name the asynchronous one more precisely)
ROUND, TARGET_LOOP = "round", "target loop"  # a serial call's: the round, or transformers' own loop (LoopChoice)
RETRY_EVERY = 8  # calls: the engine not chosen runs one call in this many
MEASURED_CALLS = 2  # calls of each engine, alternating, before the rates choose
SMOOTHING = 0.5  # weight of a call's tokens per second in its engine's running average


@dataclass
class EngineChoice:
    """Tokens per second each engine measured on this pair, averaged over calls, and the choice they make.

    rates: engine -> running average of new tokens per second of its calls; calls: engine -> calls run.
    clock: what a call is timed with (seconds), and the serial round's phases (stats.PhaseClock); a test gives one
        that advances by fixed costs per engine, or by a tick a reading (tests/test_breakdown.py).
    engines: the two engines, the one asked for first (it runs first, and wins ties).
    """

    rates: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    picks: int = 0
    clock: Callable[[], float] = time.perf_counter
    engines: tuple[str, str] = (ASYNC, SERIAL)

    def pick(self) -> str:
        """The engine of the next call: the two alternately (the first engine first) until each ran MEASURED_CALLS
        calls, then the faster, the other every RETRY_EVERY calls."""
        self.picks += 1
        first, second = self.engines
        runs = {engine: self.calls.get(engine, 0) for engine in self.engines}
        if min(runs.values()) < MEASURED_CALLS:
            return first if runs[first] <= runs[second] else second
        best, other = self.ranked()
        return other if self.picks % RETRY_EVERY == 0 else best

    def ranked(self) -> tuple[str, str]:
        """(faster, slower) by the rates measured; ties go to the first engine (the one asked for)."""
        first, second = self.engines
        return (first, second) if self.rates[first] >= self.rates[second] else (second, first)

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
        first, second = self.engines
        if min(self.calls.get(e, 0) for e in self.engines) < MEASURED_CALLS:
            return f"{name}: measuring both engines, {MEASURED_CALLS} calls each, alternately"
        best, _ = self.ranked()
        ratio = self.rates[first] / self.rates[second]
        names = {ASYNC: "the asynchronous engine", SERIAL: "the serial round", ROUND: "the round",
                 TARGET_LOOP: "transformers' own loop"}
        measured = (f"{names[first]} measured {ratio:.2f}x {names[second]}'s tokens per second on this pair "
                    f"(over {self.calls[first]} and {self.calls[second]} calls)")
        if engine == best:
            return f"{name}: {measured}"
        return f"{name}: retried one call in {RETRY_EVERY}; {measured}"


PLAIN_SHARE = 0.9  # a round's call with at least this share of plain rounds makes transformers' own loop a candidate
PLAIN_CALL_ROUNDS = 8  # ... if it ran at least this many rounds (a shorter call says little of the text)


@dataclass
class LoopChoice:
    """Whether a serial greedy call runs the round or transformers' own loop (exactly target.generate's tokens), for
    one batch size of one pair. The round runs until one of its calls decodes nearly every round plainly (PLAIN_SHARE
    of at least PLAIN_CALL_ROUNDS rounds: the policy found nothing worth verifying, so the round is the target's step
    plus its bookkeeping); then both run, EngineChoice's rule picking the faster by tokens per second, the other one
    call in RETRY_EVERY. A round's call that speculated (fewer plain rounds) ends it: the round alone runs again, and
    what was measured is forgotten. On the demo pair with suffix proposals off (ngram_size=0: every round plain) the
    device round ran 0.93x target.generate on a 2-core CPU, its bookkeeping costing more than the target's loop
    (examples/results/cpu-rounds-side-by-side-demo-no-suffix-7436336).

    candidate: the loop may run (a round's call was nearly all plain); engines: their rates (EngineChoice), round first.
    """

    candidate: bool = False
    engines: EngineChoice = field(default_factory=lambda: EngineChoice(engines=(ROUND, TARGET_LOOP)))

    def pick(self) -> str:
        """The next call's: ROUND, or TARGET_LOOP where that is a candidate and measured faster (or being measured)."""
        return self.engines.pick() if self.candidate else ROUND

    def observe(self, engine: str, tokens: int, seconds: float, rounds: int = 0, plain_rounds: int = 0) -> None:
        """A call of `engine` made `tokens` in `seconds`; a round's also says how many of its `rounds` were plain."""
        if engine == ROUND and rounds >= PLAIN_CALL_ROUNDS:
            plain = plain_rounds >= PLAIN_SHARE * rounds
            if not plain:  # it speculated: the round alone, the loop's measurements forgotten
                self.engines = EngineChoice(clock=self.engines.clock, engines=self.engines.engines)
            self.candidate = plain
        self.engines.observe(engine, tokens, seconds)

    def describe(self, engine: str, name: str) -> str:
        """Why this call ran `engine` (SwiftSpecStats.engine_choice), which its stats call `name`."""
        return self.engines.describe(engine, name)


TREE, PLAIN = "tree", "plain"  # an asynchronous round's two modes: a drafted subtree, or the root alone (a plain step)
MODE_PROBE_EVERY = 16  # rounds of the chosen mode before the other runs again (a probe) while probes win
MODE_MAX_PROBE_EVERY = 256  # ... twice as many after each probe that did not win, up to this many
MODE_PROBE_ROUNDS = 3  # rounds a probe runs; its first, which pays for the switch (a catch-up), is not timed
MODE_DECAY = 0.8  # per timed round, the weight a mode's earlier tokens and seconds keep in its rate
MODE_MARGIN = 1.1  # the other mode takes over only where it measured this much faster (rounds' times are noisy)
MAX_PLAIN_STEPS = 64  # plain steps the target runs on its own from one message, at most (and within a quarter of the
# engine's worker_timeout_s at the plain rounds' measured rate, so a long run is never taken for a dead worker)


@dataclass
class DraftingChoice:
    """Whether the device round's asynchronous engine (engine/device_async.py) drafts its next round or sends the root
    alone, by each mode's measured tokens per second (a round as the target saw it: its wait for the subtree and its
    verification). The draft's growth runs beside the verification, so it pays only where its trees' tokens beat a
    plain step's, which on a shared CPU also runs faster without the draft beside it (a shape:smollm2-135m pair, whose
    draft never agrees, ran 0.41x target.generate with every round drafting). Trees first; a few plain rounds to time
    them; then the faster mode, the other for MODE_PROBE_ROUNDS rounds after every `probe_every` (twice as far apart
    after each probe that did not win, as the goodput policy's probes). Kept on the pair's policy, so later calls
    start from what earlier ones measured.

    rates: mode -> tokens per second (decayed sums of its timed rounds' tokens over their seconds: a ratio of sums, so
    a round of few tokens weighs by its time, not as much as a long one); timed: mode -> rounds timed; mode: the
    current one; streak: its rounds in a row; probing: the current mode is a probe.
    """

    rates: dict[str, float] = field(default_factory=dict)
    sums: dict[str, tuple[float, float]] = field(default_factory=dict)  # mode -> decayed (tokens, seconds)
    timed: dict[str, int] = field(default_factory=dict)
    mode: str = TREE
    streak: int = 0
    probing: bool = False
    probe_every: int = MODE_PROBE_EVERY

    def best(self) -> str:
        """The mode to run: the current one unless the other measured MODE_MARGIN times faster (before both were
        measured: trees)."""
        if TREE not in self.rates or PLAIN not in self.rates:
            return TREE
        other = PLAIN if self.mode == TREE else TREE
        if self.probing:  # (a probe's mode is the other one: the one it interrupted is the incumbent)
            other = self.mode
        incumbent = TREE if other == PLAIN else PLAIN
        return other if self.rates[other] > MODE_MARGIN * self.rates[incumbent] else incumbent

    def next_mode(self) -> str:
        """The mode of the next round (after observe() of the last one), kept as `mode`."""
        if self.probing and self.streak < MODE_PROBE_ROUNDS:
            return self.mode
        if self.probing:  # a probe just ended: its mode stays if it won (probe again soon), else back (twice as late)
            won = self.best() == self.mode
            self.probe_every = MODE_PROBE_EVERY if won else min(2 * self.probe_every, MODE_MAX_PROBE_EVERY)
            self.probing = False
            choice = self.mode if won else (PLAIN if self.mode == TREE else TREE)
            if choice != self.mode:
                self.mode, self.streak = choice, 0
            return choice
        if PLAIN not in self.rates:  # trees until they were timed, then plain rounds to time them
            choice = TREE if self.timed.get(TREE, 0) < MODE_PROBE_ROUNDS else PLAIN
            probing = choice == PLAIN
        else:
            best = self.best()
            probing = self.mode == best and self.streak >= self.probe_every
            choice = (PLAIN if best == TREE else TREE) if probing else best
        if choice != self.mode:
            self.streak = 0
        self.mode, self.probing = choice, probing
        return choice

    def plain_steps(self, timeout_s: float) -> int:
        """Plain steps the next message asks of the target, run on its own with no message between (the plain round
        of a probe: one; else up to the next probe)."""
        if self.probing or PLAIN not in self.rates:
            return 1
        steps = min(self.probe_every - self.streak, MAX_PLAIN_STEPS, int(0.25 * timeout_s * self.rates[PLAIN]))
        return max(1, steps)

    def observe(self, mode: str, tokens: int, seconds: float, switched: bool, rounds: int = 1) -> None:
        """One round of `mode` made `tokens` in `seconds` (`rounds` target steps: a run of plain ones counts as that
        many); switched: its mode differs from the round before's (it paid for the switch, or it was the call's first:
        not timed)."""
        self.streak += rounds
        if switched or tokens <= 0 or seconds <= 0:
            return
        made, took = self.sums.get(mode, (0.0, 0.0))
        decay = MODE_DECAY ** rounds
        made, took = decay * made + tokens, decay * took + seconds
        self.sums[mode], self.rates[mode] = (made, took), made / took
        self.timed[mode] = self.timed.get(mode, 0) + 1

    def describe(self) -> str:
        """The modes' measured rates (SwiftSpecStats.engine_choice of a device asynchronous call)."""
        parts = [f"{mode} rounds {self.rates[mode]:.1f} tokens/s" for mode in (TREE, PLAIN) if mode in self.rates]
        return "drafting by measurement: " + (", ".join(parts) or "nothing timed yet")
