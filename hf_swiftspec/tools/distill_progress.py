"""How a `swiftspec distill` run shows where it is: each phase (tokenising, self-distillation, the
evaluations, training, the speed measurement) as a progress line on stderr with the phase's ETA and the
whole run's, and the plan printed at the start with the whole run's estimate.

The clock is injected (`Progress(clock=...)`), so a test decides what time it is and the lines a run
prints depend on its work alone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable

Clock = Callable[[], float]

# The phases of a run, in order; the plan names those a run has (self-distillation and the speed measurement
# are optional).
PHASES = {
    "tokenise": "tokenise the data",
    "self-distill": "the target answers the records' prompts",
    "evaluate-start": "measure the starting draft",
    "train": "train",
    "evaluate-end": "measure the distilled draft",
    "speed": "time the pair against target.generate, prompt lookup and draft-free",
}


def minutes(seconds: float) -> str:
    """1m05s, 12s, 2h03m."""
    seconds = max(int(round(seconds)), 0)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


@dataclass
class Phase:
    name: str
    total: int
    unit: str
    started: float
    done: int = 0
    shown: int = -1  # `done` when the last line was printed
    shown_at: float = 0.0
    left: float | None = None  # the seconds left when the phase knows them (training under --minutes), not its rate


@dataclass
class Progress:
    """Progress lines on `stream` (stderr): rewritten in place on a terminal; elsewhere (a log file) a line at the
    start and end of each phase, at every tenth of it, and at least every `every_s` seconds of it.

    estimates: seconds each phase not yet finished is expected to take (the plan's, updated as the run measures
    them); the whole run's ETA is the current phase's plus theirs."""

    enabled: bool = True
    clock: Clock = time.monotonic
    stream: object = None
    every_s: float = 30.0
    estimates: dict[str, float] = field(default_factory=dict)
    phase: Phase | None = None
    started: float = 0.0
    took: dict[str, float] = field(default_factory=dict)  # each finished phase's seconds (a phase run twice: summed)

    def __post_init__(self) -> None:
        self.stream = self.stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = self.clock()

    # ---------------------------------------------------------------- printing

    def emit(self, line: str, final: bool = True) -> None:
        if not self.enabled:
            return
        if self.tty:
            print(f"\r\033[K{line}", end="\n" if final else "", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def note(self, message: str) -> None:
        self.emit(f"distill: {message}")

    def plan(self, estimates: dict[str, float], described: dict[str, str]) -> None:
        """The run's phases with their estimates, and the whole run's: printed once, at the start."""
        self.estimates = dict(estimates)
        parts = [f"{described.get(name, PHASES[name])} ~{minutes(seconds)}" for name, seconds in estimates.items()]
        total = self.clock() - self.started + sum(estimates.values())
        self.note(f"the run: {'; '.join(parts)}. About {minutes(total)} in all (ETA {minutes(sum(estimates.values()))}).")

    def expect(self, name: str, seconds: float) -> None:
        """A phase's new estimate, once the run has measured what it costs."""
        self.estimates[name] = seconds

    # ---------------------------------------------------------------- phases

    def start(self, name: str, total: int, unit: str, left: float | None = None) -> None:
        now = self.clock()
        self.phase = Phase(name, max(total, 0), unit, now, shown_at=now, left=left)
        self.show("")

    def retotal(self, total: int) -> None:
        """The phase's new size (training under --minutes: the steps the time left allows)."""
        if self.phase is not None:
            self.phase.total = max(total, self.phase.done)

    def advance(self, count: int = 1, status: str = "", left: float | None = None) -> None:
        phase = self.phase
        if phase is None:
            return
        phase.done += count
        phase.left = left
        tenth = max(phase.total // 10, 1)
        due = (self.tty or phase.done // tenth > phase.shown // tenth or phase.done >= phase.total
               or self.clock() - phase.shown_at >= self.every_s)
        if due:
            self.show(status)

    def finish(self, status: str = "") -> float:
        """End the phase; returns its seconds."""
        phase = self.phase
        if phase is None:
            return 0.0
        seconds = self.clock() - phase.started
        self.took[phase.name] = self.took.get(phase.name, 0.0) + seconds
        self.estimates.pop(phase.name, None)
        self.emit(f"distill: {PHASES[phase.name]}: done, {phase.done:,} {phase.unit} in {minutes(seconds)}"
                  + (f"  {status}" if status else "") + f"  (ETA {minutes(self.remaining())})")
        self.phase = None
        return seconds

    def phase_eta(self) -> float:
        phase = self.phase
        if phase is None:
            return 0.0
        if phase.left is not None:
            return phase.left
        if phase.done == 0:
            return self.estimates.get(phase.name, 0.0)
        rate = (self.clock() - phase.started) / phase.done
        return rate * (phase.total - phase.done)

    def remaining(self) -> float:
        """Seconds the whole run is expected to go on: the current phase's and those not started."""
        current = self.phase.name if self.phase is not None else None
        return self.phase_eta() + sum(s for name, s in self.estimates.items() if name != current)

    def show(self, status: str) -> None:
        phase = self.phase
        phase.shown, phase.shown_at = phase.done, self.clock()
        line = (f"distill: {PHASES[phase.name]}: {phase.done:,}/{phase.total:,} {phase.unit}"
                + (f"  {status}" if status else "")
                + f"  ETA {minutes(self.phase_eta())}, run {minutes(self.remaining())}")
        self.emit(line, final=not self.tty)
