"""What one `generate(swiftspec=True)` call did, kept on `model.swiftspec_stats` afterwards.

Each worker keeps its own counters (`TargetCounters`, `DraftCounters`) whatever the engine, and the serial
round its `PhaseClock`; `SwiftSpecStats.collect` is the one place they become the call's statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class TargetCounters:
    """What the target worker did in one generation."""

    forwards: int = 0  # every target forward, prefill included
    verify_steps: int = 0  # tree verifications
    busy_s: float = 0.0  # forward + walk + commit
    idle_s: float = 0.0  # waiting for a subtree (asynchronous engines)
    first_wait_s: float = 0.0  # of idle_s, waiting for the first (the draft's start: its prompt, its first tree)
    verdict_s: float = 0.0  # sending verdicts (asynchronous engines)
    replayed_tokens: int = 0  # accepted tokens run again to roll recurrent states back (recurrent.py)


@dataclass
class DraftCounters:
    """What the draft worker did in one generation (crosses process groups as one message)."""

    forwards: int = 0
    rounds: int = 0  # subtrees proposed
    expansions: int = 0  # tree expansions (draft forwards over tree leaves)
    in_flight_expansions: int = 0  # expansions run while a verification was in flight
    reroot_hits: int = 0  # the new root was already in the tree
    reroot_misses: int = 0  # a fresh tree was started
    busy_s: float = 0.0
    # The asynchronous draft's round, phase by phase (seconds; see OverlapBreakdown):
    grow_s: float = 0.0  # expanding while the verification was in flight (hidden)
    wait_s: float = 0.0  # nothing left to grow: waiting for the verdict
    overrun_s: float = 0.0  # finishing the expansion that was running when the verdict arrived
    reroot_s: float = 0.0  # following the verdict: commit the accepted KV, keep the subtree below the new root
    catch_up_s: float = 0.0  # expansions run before a subtree could be sent (a fresh tree, nothing to copy)
    start_s: float = 0.0  # the prompt and the first tree, before the first subtree (while the target prefills)
    select_s: float = 0.0  # choosing the next subtree (its sending is part of the link's time)
    grown_rounds: int = 0  # rounds that grew the tree while their verification was in flight
    # A draft with another tokenizer (drafters/translated.py): its branches translated into the target's tokens
    translated_nodes: int = 0  # draft nodes proposed for translation
    translated_kept: int = 0  # of those, nodes whose branch spelt target tokens (the rest: no whole text yet)
    mapped_nodes: int = 0  # of those, mapped token to token (a target twin), no tokenizer call
    translation_s: float = 0.0  # translating branches and following the verified text, in all
    taken_back: int = 0  # draft tokens dropped because the text's tail re-encoded otherwise
    slides: int = 0  # rows whose text filled the draft's context: it read their last part again


@dataclass(frozen=True)
class OverlapBreakdown:
    """Where an asynchronous round's time goes, per round, in milliseconds.

    The target's round is verify + idle. Its idle time is the draft's critical path (overrun +
    reroot + catch_up + select) plus the two messages' trips (link: what is left of idle); the call's
    start is apart (start: the draft's prompt and first tree, once a call, in ms; start_wait: how much of
    it the target, prefilling meanwhile, waited for). grow and
    wait happen while the target verifies: hidden, except that on devices that share memory
    bandwidth (two processes on one CPU) the draft's growth slows the verification itself, which
    shows as a larger `verify` than the serial round's at the same tree size. message_bytes: what
    one round sends, both ways.
    """

    rounds: int
    verify: float
    idle: float
    verdict: float  # the target sending its verdict
    grow: float
    wait: float
    overrun: float
    reroot: float
    catch_up: float
    select: float
    message_bytes: int
    grown_share: float  # of rounds that grew the tree in flight
    start: float = 0.0
    start_wait: float = 0.0

    @property
    def link(self) -> float:
        """The target's idle time the draft's work does not explain: the messages' trips, scheduling."""
        return max(self.idle - self.overrun - self.reroot - self.catch_up - self.select, 0.0)

    @classmethod
    def of(cls, target: TargetCounters, draft: DraftCounters, message_bytes: int) -> "OverlapBreakdown":
        n = max(target.verify_steps, 1)
        ms = lambda seconds: 1e3 * seconds / n  # noqa: E731
        return cls(
            rounds=target.verify_steps, verify=ms(target.busy_s), idle=ms(target.idle_s - target.first_wait_s),
            verdict=ms(target.verdict_s), start=1e3 * draft.start_s, start_wait=1e3 * target.first_wait_s,
            grow=ms(draft.grow_s), wait=ms(draft.wait_s), overrun=ms(draft.overrun_s), reroot=ms(draft.reroot_s),
            catch_up=ms(draft.catch_up_s), select=ms(draft.select_s), message_bytes=message_bytes,
            grown_share=draft.grown_rounds / max(draft.rounds, 1),
        )

    def line(self) -> str:
        return (
            f"per round (ms): verify {self.verify:.1f}, target idle {self.idle:.1f} = draft overrun {self.overrun:.1f} "
            f"+ re-root {self.reroot:.1f} + catch-up {self.catch_up:.1f} + select {self.select:.1f} + link "
            f"{self.link:.1f}; hidden: grow {self.grow:.1f}, wait {self.wait:.1f}; trees grown in flight in "
            f"{100 * self.grown_share:.0f}% of rounds; {self.message_bytes} bytes a round; per call: the draft's "
            f"start {self.start:.1f}, the target waited {self.start_wait:.1f} of it"
        )


# The serial round's phases, in the order a round runs them (RoundPhases says what each holds).
PHASES = ("expand", "catch_up", "select", "verify", "walk", "commit", "policy", "bookkeeping")
MAX_MARKS = 4096  # CUDA events kept before the completed rounds' are read (a running batch never collects its stats)


@dataclass(frozen=True)
class RoundPhases:
    """Where the serial round's time went, phase by phase, in seconds summed over the call's rounds.

    expand: the draft's expansions (its forwards over tree leaves, top-ups included); catch_up: the draft running
    the accepted tokens it had not run; select: the proposals (suffix lookups, reading each row's draft tree,
    merging them, choosing the subtree each row verifies); verify: the target's forward over the subtrees, its
    inputs included; walk: each row's walk against the target's choices; commit: the accepted path's KV kept in
    both caches (the target's commit and its wait for the device, the drafters following the verdict); policy:
    the goodput policy's choices and what it learns from the round; bookkeeping: the rows' records, streaming and
    stopping. other: what no phase claims, round_s less the phases (so the phases and other sum to round_s).
    clock: "host" (where the host spent the round: on a GPU its waits for the device land in the phase that
    read the device) or "cuda events" (the device's stream: when each phase's work ran there).
    """

    clock: str
    rounds: int
    round_s: float  # the rounds' time, each from its start to its end (the call's prefill is outside)
    expand: float
    catch_up: float
    select: float
    verify: float
    walk: float
    commit: float
    policy: float
    bookkeeping: float
    other: float

    @classmethod
    def of(cls, clock: str, rounds: int, round_s: float, seconds: dict[str, float]) -> "RoundPhases":
        """The breakdown from each phase's seconds; other is round_s less their sum."""
        named = {phase: seconds[phase] for phase in PHASES}
        return cls(clock=clock, rounds=rounds, round_s=round_s, other=round_s - sum(named.values()), **named)

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds, other last."""
        return {phase: getattr(self, phase) for phase in (*PHASES, "other")}

    def ms_per_round(self) -> dict:
        """What the bench's results keep: the clock, the rounds, and the round and each phase in ms per round."""
        n = max(self.rounds, 1)
        per = {"round": 1e3 * self.round_s / n, **{p: 1e3 * s / n for p, s in self.seconds().items()}}
        return {"clock": self.clock, "rounds": self.rounds, **{k: round(v, 6) for k, v in per.items()}}

    def line(self) -> str:
        ms = self.ms_per_round()
        parts = " + ".join(f"{p.replace('_', '-')} {ms[p]:.2f}" for p in (*PHASES, "other"))
        return f"per round ({self.clock}, ms, {self.rounds} rounds): {ms['round']:.2f} = {parts}"


class PhaseClock:
    """Times the serial round's PHASES (RoundPhases): engine/rounds.py opens and closes each round, and each
    phase's code runs inside `with clock.phase(name):` (or is a function wrapped by `timed(name, fn)`).

    Phases nest, and an inner phase's time is its own, not its outer one's: the phases never overlap, so they sum
    to at most the round, and what none claims is RoundPhases.other. Outside a round (the prefill, the
    asynchronous engine's workers) it times nothing. now: the host clock in seconds (EngineChoice.clock: a test
    gives one that ticks). events: makes a recorded CUDA event (on a CUDA device, `cuda_event`), one per phase
    change, read only when the stats are collected (`device_phases`): timing never syncs a round.
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter, events: Callable[[], object] | None = None):
        self.now, self.events = now, events
        self.stack: list[str] = []  # the open phases, innermost last, "other" at the bottom; empty outside a round
        self.since = 0.0  # when the innermost phase last became the one running
        self.started = 0.0  # the round's start
        self.host = dict.fromkeys((*PHASES, "other"), 0.0)
        self.rounds, self.round_s = 0, 0.0
        self.marks: list[tuple[str | None, object]] = []  # CUDA: (the phase from this event on, None: a round ended)
        self.device = dict.fromkeys((*PHASES, "other"), 0.0)
        self.device_rounds, self.device_round_s = 0, 0.0
        self.pool: list = []  # events already read, to record again
        self.pending = "other"

    @classmethod
    def on(cls, device: torch.device | str, now: Callable[[], float] = time.perf_counter) -> "PhaseClock":
        """A clock for rounds on `device`: with CUDA events on a CUDA device."""
        return cls(now, events=cuda_event if torch.device(device).type == "cuda" else None)

    # ---- a round --------------------------------------------------------------------------------------
    def begin_round(self) -> None:
        self.stack = ["other"]
        self.started = self.since = self.now()
        if self.events is not None:
            self.mark("other")

    def end_round(self) -> None:
        self.charge()
        self.round_s += self.since - self.started
        self.rounds += 1
        self.stack = []
        if self.events is not None:
            self.mark(None)
            if len(self.marks) > MAX_MARKS and self.marks[-1][1].query():  # complete: read without waiting
                self.read_marks()

    def phase(self, name: str) -> "PhaseClock":
        """`with clock.phase(name):` times its body as `name` (one of PHASES)."""
        self.pending = name
        return self

    def __enter__(self) -> None:
        if self.stack:  # in a round
            self.charge()
            self.stack.append(self.pending)
            if self.events is not None:
                self.mark(self.pending)

    def __exit__(self, *exc) -> None:
        if len(self.stack) > 1:  # in a round, in a phase
            self.charge()
            self.stack.pop()
            if self.events is not None:
                self.mark(self.stack[-1])

    def timed(self, name: str, fn: Callable) -> Callable:
        """`fn`, each call of it timed as `name`."""

        def run(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        return run

    def charge(self) -> None:
        """Charge the running phase its time since it last became the one running."""
        now = self.now()
        self.host[self.stack[-1]] += now - self.since
        self.since = now

    def mark(self, phase: str | None) -> None:
        """Record an event where `phase` starts running on the device (None: the round ended)."""
        event = self.pool.pop() if self.pool else self.events()
        event.record()
        self.marks.append((phase, event))

    # ---- the call's breakdown -------------------------------------------------------------------------
    def host_phases(self) -> RoundPhases | None:
        """The rounds' breakdown on the host clock (None before any round)."""
        return RoundPhases.of("host", self.rounds, self.round_s, self.host) if self.rounds else None

    def device_phases(self) -> RoundPhases | None:
        """The rounds' breakdown on the device's stream (None without events, or before any round). Waits for
        the last round's events: call it once, when the call's stats are collected."""
        if self.events is None or not (self.marks or self.device_rounds):
            return None
        if self.marks:
            self.marks[-1][1].synchronize()
            self.read_marks()
        return RoundPhases.of("cuda events", self.device_rounds, self.device_round_s, self.device)

    def read_marks(self) -> None:
        """Fold the recorded events (all complete) into the device's seconds; their events go back to the pool."""
        marks, self.marks = self.marks, []
        for (phase, start), (_, end) in zip(marks, marks[1:]):
            if phase is not None:
                seconds = start.elapsed_time(end) / 1e3  # ms between the two events on the stream
                self.device[phase] += seconds
                self.device_round_s += seconds
        self.device_rounds += sum(phase is None for phase, _ in marks)
        self.pool += [event for _, event in marks]


def cuda_event():
    return torch.cuda.Event(enable_timing=True)


@dataclass(frozen=True)
class Translation:
    """A draft with another tokenizer than the target's (drafters/translated.py): how many of the draft nodes it
    proposed became target tokens, and what translating cost.

    nodes:   draft nodes put to translation (each once, when it first entered a proposal)
    kept:    of those, nodes whose branch spelt target tokens (the survivors)
    mapped:  of the kept, nodes mapped token to token where the vocabularies overlap (no tokenizer call)
    seconds: time spent translating branches and following the verified text
    taken_back: draft tokens dropped and run again because the text's tail re-encoded otherwise
    """

    nodes: int
    kept: int
    mapped: int
    seconds: float
    taken_back: int

    @classmethod
    def of(cls, draft: "DraftCounters") -> "Translation | None":
        if not (draft.translated_nodes or draft.translation_s):
            return None
        return cls(draft.translated_nodes, draft.translated_kept, draft.mapped_nodes, draft.translation_s,
                   draft.taken_back)

    @property
    def survival(self) -> float:
        """Share of the proposed draft nodes whose branch became target tokens."""
        return self.kept / self.nodes if self.nodes else 0.0

    def line(self, rounds: int) -> str:
        per_round = 1e3 * self.seconds / rounds if rounds else 0.0
        return (f"translated {self.nodes} draft nodes: {100 * self.survival:.0f}% became target tokens "
                f"({self.mapped} mapped token to token), {per_round:.2f} ms a round translating")


@dataclass(frozen=True)
class RoundRecord:
    """One round: the tree the policy chose and what the target accepted of it."""

    budget: int  # T: nodes verified, root included (1: plain decoding)
    expansions: int  # draft forwards run for this round
    accepted: int  # proposed tokens accepted over all rows (the target adds one of its own per row)
    ngram_accepted: int  # of those, proposed by the n-gram chain
    rows: int = 1  # sequences verified in the round (batch rows still decoding)


@dataclass
class SwiftSpecStats:
    """Counters and timings of one speculative generation.

    target_forwards counts every target forward (prefill included); verify_steps counts the tree
    verifications alone, so tau = new_tokens / verify_steps is the mean number of tokens each
    verification produced (accepted draft tokens plus the target's own next token).
    """

    engine: str = "serial"
    attention: str = "sdpa"
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    verify_steps: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    draft_depth: float = 0.0  # mean draft expansions per round, whatever the schedule
    reroot_hits: int = 0
    reroot_misses: int = 0
    target_idle_s: float = 0.0  # target waiting for a subtree (async engines)
    in_flight_expansions: int = 0  # draft expansions run while a verification was in flight
    replayed_tokens: int = 0  # accepted tokens the target ran again to roll recurrent states back
    rounds: list[RoundRecord] = field(default_factory=list)  # the policy's choice per round
    row_tau: list[float] = field(default_factory=list)  # a batch's rows: each row's tokens per verification it took part in
    draft_model: bool = True  # False in draft-free mode: every proposal came from the suffix index
    overlap: OverlapBreakdown | None = None  # asynchronous engines: where a round's time went
    engine_choice: str | None = None  # with serial_fallback: which engine this call ran, and why (choice.py)
    round_choice: str | None = None  # which round ran (host or device) and why (SwiftSpecConfig.round "auto" decides)
    capture_s: float = 0.0  # of wall_time_s, capturing (or first compiling) steps' buckets: mostly a first call's cost
    # tokens of earlier calls' outputs (model.output_history) this call's suffix proposals could copy from: a repeated
    # prompt then decodes faster than a first one (1.45-1.78x became 1.00x once cleared), which timing should know
    history_tokens: int = 0
    phases: RoundPhases | None = None  # the serial round: where its time went, phase by phase (host clock)
    device_phases: RoundPhases | None = None  # the serial round on CUDA: the same phases on the device's stream
    translation: "Translation | None" = None  # a draft with another tokenizer: its translation's counts
    draft_slides: int = 0  # times a row's text filled the draft's context and it read the last part again

    @classmethod
    def collect(
        cls, engine: str, new_tokens: int, wall_time_s: float, target: TargetCounters, draft: DraftCounters,
        message_bytes: int | None = None, clock: PhaseClock | None = None,
    ) -> "SwiftSpecStats":
        """The statistics of one generation from its workers' counters (message_bytes: what one round of an
        asynchronous engine sends, both ways; None for the serial engine, which has no overlap to break down;
        clock: the serial round's PhaseClock, whose breakdowns it reads)."""
        return cls(
            engine=engine,
            new_tokens=new_tokens,
            wall_time_s=wall_time_s,
            target_forwards=target.forwards,
            verify_steps=target.verify_steps,
            target_time_s=target.busy_s,
            target_idle_s=target.idle_s,
            draft_forwards=draft.forwards,
            draft_time_s=draft.busy_s,
            draft_depth=draft.expansions / max(draft.rounds, 1),
            in_flight_expansions=draft.in_flight_expansions,
            reroot_hits=draft.reroot_hits,
            reroot_misses=draft.reroot_misses,
            replayed_tokens=target.replayed_tokens,
            overlap=None if message_bytes is None else OverlapBreakdown.of(target, draft, message_bytes),
            phases=None if clock is None else clock.host_phases(),
            device_phases=None if clock is None else clock.device_phases(),
            translation=Translation.of(draft),
            draft_slides=draft.slides,
        )

    def add_rounds(self, rounds: list[RoundRecord]) -> None:
        self.rounds = list(rounds)

    @property
    def plain_rounds(self) -> int:
        """Rounds the policy decoded plainly (T = 1: the target alone, nothing proposed)."""
        return sum(r.budget == 1 for r in self.rounds)

    @property
    def mean_tree_budget(self) -> float:
        return sum(r.budget for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def ngram_share(self) -> float:
        """Fraction of accepted proposed tokens that the n-gram chain proposed."""
        accepted = sum(r.accepted for r in self.rounds)
        return sum(r.ngram_accepted for r in self.rounds) / accepted if accepted else 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def target_idle_fraction(self) -> float:
        return self.target_idle_s / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    def summary(self) -> str:
        """One line for logs and the command line; the policy's trees only where rounds were recorded
        (every engine records them; under torchrun a sharded target group's ranks other than its leader have none).
        Below it, a line per breakdown the call has: the asynchronous round's overlap, the serial round's phases
        (and on CUDA the same phases on the device).

        "proposing" is the time spent building proposals (draft forwards, suffix lookups, the policy's
        choice), "verifying" the target's (its forwards, the walks, the commits).
        """
        rows = f" (per row: {', '.join(f'{t:.2f}' for t in self.row_tau)})" if len(self.row_tau) > 1 else ""
        drafter = f"draft forwards={self.draft_forwards}" if self.draft_model else "no draft model (suffix proposals only)"
        line = (
            f"{self.new_tokens} tokens in {self.wall_time_s:.2f}s ({self.tokens_per_second:.1f} tok/s), "
            f"tau={self.tau:.2f}{rows}, target forwards={self.target_forwards}, {drafter}, "
            f"proposing {self.draft_time_s:.2f}s / verifying {self.target_time_s:.2f}s, "
            f"target idle {100 * self.target_idle_fraction:.0f}%, engine={self.engine}, attention={self.attention}"
        )
        if self.capture_s:
            line = f"{line}, capturing {self.capture_s:.2f}s"
        if self.engine_choice:
            line = f"{line}, engine choice: {self.engine_choice}"
        if self.round_choice:
            line = f"{line}, round: {self.round_choice}"
        if self.history_tokens:
            line = (f"{line}, copying from {self.history_tokens} tokens of earlier calls' outputs "
                    "(model.output_history.clear() to time a call alone)")
        if self.rounds:
            line = (
                f"{line}, mean tree {self.mean_tree_budget:.1f} nodes, {self.plain_rounds} plain rounds, "
                f"n-gram share {100 * self.ngram_share:.0f}%"
            )
        if self.translation is not None:
            line = f"{line}, {self.translation.line(self.verify_steps)}"
        if self.draft_slides:
            line = f"{line}, the draft re-read a window of the text {self.draft_slides} times (its context is shorter)"
        breakdowns = [b.line() for b in (self.overlap, self.phases, self.device_phases) if b is not None]
        return "\n".join([line, *breakdowns])
