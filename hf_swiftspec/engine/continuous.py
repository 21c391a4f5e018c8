"""Requests joining and leaving one running round: the engine `swiftspec serve --continuous-batching` runs.

Each request is its own generate() call, on its own thread (the server's): generate() handles its
arguments as for any call (generation.py builds its DecodeRequest: sampler, stopping criteria,
max_new_tokens), then hands the request to `ContinuousEngine.decode` instead of running rounds of
its own, and waits for its row. The engine's one thread runs the round of engine/rounds.py over
every row it holds:

    while the engine runs:
        admit: each waiting request that fits (max_positions; the others wait, in arrival order) is
               prefilled alone on fresh sides (its target rows, its drafters), PREFILL_PIECE tokens per
               forward, one forward between two rounds (a long prompt does not hold the batch for its whole
               prefill); requests for the same prompt taken in together (together(): a request's n answers)
               share one prefill; once prefilled, the running sides absorb its rows (the rows already there
               are not copied: cache.absorb)
        one round over every row: propose, verify (each row with its own sampler, stops and budget),
               record, accept, observe; the policy sizes the round's trees for the batch it has, under
               its latency guard (policy/guard.py: no row's tree decodes it slower than a plain batch)
        rows that finished, failed or were cancelled leave both sides; their generate() calls return

So a request speculates whatever else is decoding: alone, its trees are the lone call's; among
others, the goodput policy prices trees by this batch size's measured verification (plain
rounds where a busy batch gains nothing from them). What each request's trees did is kept by its
name (`usage_of(key)`: a `RowUsage`), and the engine keeps the totals. A pair with round="device" runs
engine/continuous_device.py's subclass instead: the device round over cache rows padded to a power-of-two bucket.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from ..config import MAX_BUDGET
from ..steps.cache import keep_order
from ..stats import RoundRecord, SwiftSpecStats
from ..steps.acceptance import StopRule, split_criteria
from ..steps.verify import Verified
from . import rounds
from .request import DecodeRequest, DecodeResult, RowResult, round_record
from .adaptive import AdaptiveSides
from .workers import attend_the_tree


PREFILL_PIECE = 256  # prompt tokens a joining request prefills between two rounds of the running batch
USAGE_KEPT = 4096  # finished requests whose usage stays readable by key (oldest dropped first)


class BatchBroken(Exception):
    """A row could not join the running batch after the sides began taking it in: every row fails."""


class RequestCancelled(Exception):
    """Raised by ContinuousEngine.decode for a request cancelled while it decoded (its client left)."""


@dataclass
class RowUsage:
    """What speculation did for one request (or, summed, for every request an engine served).

    verifications: target verifications the row took part in
    proposed:      proposed tokens verified for it (tree nodes below its roots)
    accepted:      of them, those the target accepted (it adds one token of its own per verification)
    """

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def tokens_per_verification(self) -> float:
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0

    def add(self, other: "RowUsage") -> None:
        self.verifications += other.verifications
        self.proposed += other.proposed
        self.accepted += other.accepted

    def as_dict(self) -> dict:
        return {
            "verifications": self.verifications, "proposed_tokens": self.proposed, "accepted_tokens": self.accepted,
            "tokens_per_verification": round(self.tokens_per_verification, 3),
        }


@dataclass(eq=False)
class Member:
    """One request's row in the running batch (its generate() thread waits on `done`).

    row_id: the row's id for the sides' samplers and the policy (never reused)
    key:    the caller's name for the request (the server's request id), for cancel() and usage
    """

    request: DecodeRequest
    row_id: int
    key: str | None = None
    stops: StopRule | None = None
    result: RowResult = field(default_factory=RowResult)
    usage: RowUsage = field(default_factory=RowUsage)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    joined_at: float = field(default_factory=time.perf_counter)
    rounds: list[RoundRecord] = field(default_factory=list)  # the running batch's rounds it took part in

    @property
    def budget(self) -> int:
        return self.request.max_new_tokens - len(self.result.tokens)

    @property
    def positions(self) -> int:
        """Cache positions its row may reach: its prompt, its new tokens and the largest tree."""
        return self.request.prompt.shape[1] + self.request.max_new_tokens + MAX_BUDGET


@dataclass(eq=False)
class Joining:
    """A request on its way into the running batch: its own sides, prefilled a piece at a time (`pieces`).

    copies: requests for the same prompt and length that joined with it (a request's n answers): they share its
            prefill, each with drafters of its own (`share_prefill`)
    """

    member: Member
    sides: AdaptiveSides
    pieces: object  # AdaptiveSides.start_in_pieces's generator
    copies: list[tuple[Member, object]] = field(default_factory=list)  # (member, its Drafters, started)

    @property
    def members(self) -> list[Member]:
        return [self.member] + [m for m, _ in self.copies]


def same_prefill(a: DecodeRequest, b: DecodeRequest) -> bool:
    """Whether two one-row requests prefill the same KV into caches of the same capacity."""
    return (a.max_new_tokens == b.max_new_tokens and a.attention_mask is None and b.attention_mask is None
            and a.prompt.shape == b.prompt.shape and bool((a.prompt == b.prompt).all()))


def share_prefill(joining: Joining) -> None:
    """Give a prefilled request's copies their rows: its one-row target cache absorbs itself (the prompt's KV copied,
    never run again) until it holds a row per member, and each copy's own drafters join its drafters after its row."""
    target, members = joining.sides.target, len(joining.members)
    forwards = target.counters.forwards
    while target.cache.batch_size < members:
        target.absorb(target)
    target.keep_rows(list(range(members)))
    target.counters.forwards = forwards  # (absorb adds the forwards of what it takes in: here, its own)
    for _, drafters in joining.copies:
        joining.sides.draft.absorb(drafters)


@dataclass
class RunningRows:
    """The rows of the running batch, as a round runs over them (engine/rounds.py's RoundRows, as BatchRows):
    `live` is each cache row's row id, in cache order; each row's member adds what serving does (its usage,
    cancelling, its own streamer)."""

    members: dict[int, Member] = field(default_factory=dict)
    live: list[int] = field(default_factory=list)

    def criteria(self) -> list[StopRule]:
        return [self.members[i].stops for i in self.live]

    def budgets(self) -> list[int]:
        return [self.members[i].budget for i in self.live]

    def fold_round(self, proposed, verified: list[Verified]) -> list[int]:
        """Fold each row's walk into its member (its tokens streamed); the cache rows that keep decoding."""
        keep = []
        for b, outcome in enumerate(verified):
            member = self.members[self.live[b]]
            row, request = member.result, member.request
            row.add(outcome, request.keeps_scores, request.keeps_logits)
            member.usage.verifications += 1
            member.usage.proposed += len(proposed.proposals[b].subtree) - 1
            member.usage.accepted += len(outcome.path) - 1
            try:
                if request.on_tokens is not None:
                    request.on_tokens(outcome.tokens)
            except Exception as error:  # the request's own streamer failed: it alone ends
                member.error = error
            if outcome.finished or member.budget <= 0:
                row.done_at = len(row.tokens)
            if row.done_at is None and member.error is None and not member.cancelled.is_set():
                keep.append(b)
        return keep

    def record_round(self, proposed, verified: list[Verified]) -> None:
        """The round's RoundRecord, kept by every member that took part (its call's stats)."""
        record = round_record(proposed.proposals, verified, proposed.expansions)
        for i in self.live:
            self.members[i].rounds.append(record)


class ContinuousEngine:
    """One running batch over a pair's target and draft (see the module docstring).

    target, draft: the pair's models (draft None: draft-free, suffix proposals only)
    policy:        the pair's GoodputPolicy (kept across requests)
    build:         builds (TargetWorker, Drafters) for one request's row (launch.build_workers)
    finish:        called on the engine's thread with (request, result) when a row is done (output history)
    latency_guard: whether the policy caps each round's tree size for its slowest row (policy/guard.py)

    Set by a server after building it (serving/admission.py):
    max_positions: the most cache positions the batch holds (rows x the largest row's `Member.positions`); a
                   request past it waits in arrival order (`held`) until rows leave (None: no limit)
    on_start:      called with a request's key on the engine's thread when its row starts (its prefill)

    Requests for the same prompt and length taken in together (`together()`: a request's n answers) share one
    prefill (Joining.copies).
    """

    on_device = False  # its rounds are the host round's (DeviceContinuousEngine: the device round's)

    def __init__(self, target, draft, policy, build, finish=None, latency_guard: bool = True):
        self.target, self.draft, self.policy = target, draft, policy
        self.build, self.finish, self.latency_guard = build, finish, latency_guard
        self.waiting: queue.Queue[Member | None] = queue.Queue()
        self.rows = RunningRows()
        self.sides: AdaptiveSides | None = None
        self.joining: list[Joining] = []  # requests being prefilled, in arrival order
        self.routes: contextlib.ExitStack | None = None
        self.tap = None
        self.next_id = 0
        self.lock = threading.Lock()
        self.by_key: dict[str, Member] = {}
        self.usage = RowUsage()  # every finished request's, summed
        self.usage_by_key: OrderedDict[str, RowUsage] = OrderedDict()  # the latest USAGE_KEPT finished requests'
        self.served = 0
        self.rounds_by_batch: Counter[int] = Counter()  # rounds run, by how many rows they verified
        self.guarded_rounds = 0  # rounds whose tree size the latency guard lowered
        self.guarded_rows = 0  # over those rounds, the rows it was lowered for (each round's RoundPlan.guarded)
        self.thread: threading.Thread | None = None
        self.closed = False
        self.max_positions: int | None = None
        self.on_start = None
        self.held: deque[Member] = deque()  # requests taken from `waiting` that do not fit yet, in arrival order
        self.gate = threading.Lock()  # held by together(): the engine takes no request in meanwhile
        self.plain_rounds = 0  # rounds that verified every row's root alone (a plain step of the batch)

    # ------------------------------------------------------------------ callers' side
    def decode(self, request: DecodeRequest, key: str | None = None) -> DecodeResult:
        """Decode one request (batch 1) in the running batch; blocks until its row is done. Raises the row's
        error, or RequestCancelled if cancel(key) was called meanwhile."""
        if request.batch_size != 1:
            raise ValueError(
                f"the continuous engine takes one sequence per request, got {request.batch_size}; send each prompt "
                "as its own request."
            )
        if request.max_new_tokens == 0:
            return DecodeResult(rows=[RowResult()], end=0, stats=SwiftSpecStats(engine="continuous"))
        need = request.prompt.shape[1] + request.max_new_tokens + MAX_BUDGET
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(
                f"This request needs {need} cache positions (its prompt, max_tokens and a {MAX_BUDGET}-node tree); the "
                f"running batch holds at most {self.max_positions} (--cache-positions). Ask for fewer tokens."
            )
        with self.lock:
            if self.closed:
                raise RuntimeError("the continuous engine was closed; start a new one")
            member = Member(request, self.next_id, key, split_criteria(request.stopping_criteria))
            self.next_id += 1
            if key is not None:
                self.by_key[key] = member
            self.start_thread()
            self.waiting.put(member)  # under the lock: a request the engine knows by name is in its queue
        while not member.done.wait(timeout=1.0):
            if not self.thread.is_alive():  # run() fails what it holds before it ends: a bug if we get here
                member.error = member.error or RuntimeError("the continuous engine's thread ended without this request")
                break
        with self.lock:
            if key is not None:
                self.by_key.pop(key, None)
        if member.error is not None:
            raise member.error
        if member.cancelled.is_set() and member.result.done_at is None:
            raise RequestCancelled(key)
        return self.result_of(member)

    @contextlib.contextmanager
    def together(self, keys: list[str], submitting=lambda: True, timeout_s: float = 30.0):
        """Requests submitted inside this block (by other threads, as decode(..., key) for each of `keys`) are taken
        in together once all of them wait (or once `submitting()` says their threads stopped trying, or after
        `timeout_s`), so those for one prompt share its prefill. The engine takes no request in meanwhile (its rows
        keep decoding until a round would take one in)."""
        with self.gate:
            yield
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and submitting():
                with self.lock:
                    if all(key in self.by_key for key in keys):
                        return
                time.sleep(0.001)

    def cancel(self, key: str) -> bool:
        """Cancel the request named `key`; it leaves the batch after the round in flight. False if unknown."""
        with self.lock:
            member = self.by_key.get(key)
        if member is None:
            return False
        member.cancelled.set()
        return True

    def usage_of(self, key: str) -> RowUsage | None:
        """What speculation did for the finished request `key` (None: unknown, or long forgotten)."""
        with self.lock:
            return self.usage_by_key.get(key)

    def close(self) -> None:
        """Stop the engine's thread once the rows it holds are done."""
        with self.lock:
            self.closed = True
        self.waiting.put(None)
        if self.thread is not None:
            self.thread.join(timeout=60)

    def start_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self.run, name="swiftspec-continuous", daemon=True)
            self.thread.start()

    # ------------------------------------------------------------------ the engine's thread
    def run(self) -> None:
        import torch

        try:
            with torch.no_grad():
                while self.admit(block=not (self.rows.live or self.joining)):
                    self.prefill_pieces()
                    if self.rows.live:
                        self.guarded(self.one_round)
        except BaseException as error:  # nothing may wait for a thread that is gone
            joining, self.joining = [m for j in self.joining for m in j.members], []
            held, self.held = list(self.held), deque()
            self.fail(list(self.rows.members.values()) + joining + held + self.waiting_members(), error)
            raise
        finally:
            self.end_batch()

    def waiting_members(self) -> list[Member]:
        members = []
        while True:
            try:
                member = self.waiting.get_nowait()
            except queue.Empty:
                return members
            if member is not None:
                members.append(member)

    def admit(self, block: bool) -> bool:
        """Take in every request waiting that fits (waiting for one when `block` and none is held); False once
        the engine closes."""
        closing = False
        arrived = [self.waiting.get()] if block and not self.held else []  # outside the gate: together() may hold it
        with self.gate:
            while True:
                try:
                    arrived.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            for member in arrived:
                if member is None:
                    closing = True
                    break
                self.held.append(member)
            self.start_held()
        return self.drain() if closing else True

    def start_held(self) -> None:
        """Start the held requests, in arrival order, while the next one fits (a cancelled one leaves)."""
        for member in [m for m in self.held if m.cancelled.is_set()]:
            self.held.remove(member)
            member.done.set()  # its decode() raises RequestCancelled
        while self.held and self.fits(self.held[0]):
            member = self.held.popleft()
            if self.on_start is not None:
                self.on_start(member.key)
            self.guarded(lambda m=member: self.join(m), members=[member])

    def fits(self, member: Member) -> bool:
        """Whether the batch can take `member`'s row within max_positions (its caches are rows x the largest
        row's positions)."""
        if self.max_positions is None:
            return True
        rows = [self.rows.members[i] for i in self.rows.live] + [m for j in self.joining for m in j.members] + [member]
        return len(rows) * max(m.positions for m in rows) <= self.max_positions

    def drain(self) -> bool:
        """After close(): run the rows held (and joining, and waiting for room) to their end."""
        while self.rows.live or self.joining or self.held:
            self.start_held()
            self.prefill_pieces()
            if self.rows.live:
                self.guarded(self.one_round)
        return False

    def join(self, member: Member) -> None:
        """Start the request on fresh sides of its own, prefill_pieces() prefilling it; or, if a request joining
        meanwhile prefills the same prompt for as many tokens, as its copy (its drafters started, no prefill)."""
        target_worker, drafters = self.build(member.request)
        if self.routes is None:
            self.start_batch(target_worker, drafters)
        leader = next((j for j in self.joining if same_prefill(j.member.request, member.request)), None)
        if leader is not None and not drafters.reads_features:  # (a head drafts from the prompt's states: its own)
            drafters.start(member.request.prompt_ids(), None)
            leader.copies.append((member, drafters))
            return
        target_worker.tap = self.tap
        sides = AdaptiveSides(target_worker, drafters, self.policy, latency_guard=self.latency_guard)
        self.joining.append(Joining(member, sides, sides.start_in_pieces(member.request, PREFILL_PIECE)))

    def prefill_pieces(self) -> None:
        """One prefill forward for each request joining (all of them, when no row decodes meanwhile); the
        running sides take each prefilled one in."""
        while self.joining:
            for joining in list(self.joining):
                self.guarded(lambda j=joining: self.prefill_piece(j), members=joining.members)
                if joining.member.done.is_set():  # it failed
                    self.joining.remove(joining)
            if self.rows.live:
                return
        if not self.rows.live:
            self.end_batch()

    def prefill_piece(self, joining: Joining) -> None:
        try:
            next(joining.pieces)
            return
        except StopIteration:
            pass
        self.joining.remove(joining)
        self.take_in(joining)
        for member in joining.members:
            self.rows.members[member.row_id] = member
            self.rows.live.append(member.row_id)

    def take_in(self, joining: Joining) -> None:
        """The running sides take the prefilled request's rows in (its own sides, when none run yet): its copies'
        rows first join its own sides (share_prefill)."""
        if joining.copies:
            share_prefill(joining)
        if self.sides is None:
            self.sides = joining.sides
            self.sides.samplers = {}
        else:
            try:
                self.sides.absorb(joining.sides)
            except Exception as error:
                raise BatchBroken(error) from error
        for member in joining.members:
            self.sides.samplers[member.row_id] = member.request.samplers[0]

    def start_batch(self, target_worker, drafters) -> None:
        """A batch begins: each model attends the tree its way (and a head reads the target's states) until it
        ends; the policy starts a call."""
        self.routes = contextlib.ExitStack()
        self.tap = attend_the_tree(self.routes, self.target, self.draft, target_worker, drafters)
        self.policy.start_generation(None)

    def end_batch(self) -> None:
        """Every row left: drop the sides (caches); with none joining either, put the models' attention back."""
        self.sides, self.rows.live = None, []
        if self.routes is not None and not self.joining:
            self.routes.close()
            self.routes, self.tap = None, None

    def one_round(self) -> None:
        """The round of engine/rounds.py over every row held, then the rows that are done leave."""
        self.rounds_by_batch[len(self.rows.live)] += 1
        first = self.rows.members[self.rows.live[0]]
        keep = rounds.one_round(self.sides, self.rows)
        self.plain_rounds += bool(first.rounds) and first.rounds[-1].budget == 1
        guarded = len(self.policy.plan.guarded)
        self.guarded_rounds += guarded > 0
        self.guarded_rows += guarded
        if len(keep) < len(self.rows.live):
            self.leave(keep)

    def leave(self, keep: list[int]) -> None:
        """Rows not in `keep` leave both sides; their callers wake."""
        staying = set(keep)
        leaving = [row_id for b, row_id in enumerate(self.rows.live) if b not in staying]
        order = keep_order(keep)
        self.rows.live = [self.rows.live[b] for b in order]
        if order:
            self.sides.keep_rows(order)
        else:
            self.end_batch()
        self.policy.call.forget_rows(leaving)
        for row_id in leaving:
            self.done(self.rows.members.pop(row_id))

    def done(self, member: Member) -> None:
        if member.error is None and member.result.done_at is not None:
            with self.lock:
                self.usage.add(member.usage)
                self.served += 1
                if member.key is not None:
                    self.usage_by_key[member.key] = member.usage
                    while len(self.usage_by_key) > USAGE_KEPT:
                        self.usage_by_key.popitem(last=False)
            if self.finish is not None:
                self.finish(member.request, self.result_of(member))
        member.done.set()

    def guarded(self, step, members: list[Member] | None = None) -> None:
        """Run `step`; if it fails, its rows (`members`, default every row held) fail with the error and the
        batch starts afresh: the engine goes on serving."""
        try:
            step()
        except Exception as error:
            failed = list(members or [])
            if members is None or isinstance(error, BatchBroken):
                failed += [self.rows.members[i] for i in self.rows.live]
                self.end_batch()
                error = error.__cause__ if isinstance(error, BatchBroken) else error
            self.fail(failed, error)

    def fail(self, members: list[Member], error: BaseException) -> None:
        """The members fail with `error` (their generate() calls raise it) and leave."""
        for member in members:
            self.rows.members.pop(member.row_id, None)
            member.error = error
            member.done.set()

    @staticmethod
    def result_of(member: Member) -> DecodeResult:
        row = member.result
        stats = SwiftSpecStats(
            engine="continuous", new_tokens=len(row.tokens), verify_steps=row.verifications,
            wall_time_s=time.perf_counter() - member.joined_at,
        )
        stats.add_rounds(member.rounds)
        return DecodeResult(rows=[row], end=len(row.tokens), stats=stats, rounds=list(member.rounds))
