"""The asynchronous engine across torch.distributed process groups (torchrun; gloo or NCCL).

The world splits into a target group and a draft group, each tensor-parallel over its ranks.
Only the two leaders (first rank of each group) talk across groups, point to point, in small
int32 messages; each leader then broadcasts within its group. Every wait polls with a deadline
(SwiftSpecConfig.worker_timeout_s): a failed worker sends a failure message, a dead one is
noticed when its deadline passes, and either way every rank raises instead of hanging.

    subtree message   [status, T, tokens (B), parents (B)]    draft leader -> target leader
    verdict message   [status, m, tokens (B), path (B)]       target leader -> draft leader
    counters message  DraftCounters' fields, in field order   draft leader -> target leader, at the end
    rounds message    [n], then n RoundRecords' fields (n, 5)  draft leader -> target leader, last
    status: 0 go on, 1 finished, -1 the sender failed (a UTF-8 error text of ERROR_BYTES follows)

With serial_fallback (choice.py) each call starts with the target leader's engine, [GO, engine, ...], to the
draft leader. A serial call runs the serial round on the target's rank, the draft model beside it; the draft
ranks only follow its tokens, so that every rank returns the same:
    tokens message    [GO, n, tokens (n <= B), ...]          target leader -> draft leader, each round
    end message       [FINISHED, 1, end, ...]                target leader -> draft leader, last

With an EAGLE-3 head as the draft, the target's hidden states cross too, as float32 (what the head reads):
once the prompt's, a verdict-sized [GO, L, D, ...] then (L, D), before the first subtree; and after each
verdict that is not a failure, the accepted path's (m, D).

Subtree and verdict messages have the same size, so a failure notice matches whatever
broadcast a rank happens to be waiting in.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import astuple, dataclass, field, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ..policy.choice import ASYNC, SERIAL
from ..stats import DraftCounters, RoundRecord, SwiftSpecStats, TargetCounters
from ..steps.tree import Subtree
from ..steps.verify import Verified, verify_tree
from .asynchronous import run_draft, run_target
from .links import PeerFailed, SwiftSpecWorkerError
from .request import BatchRows, DecodeRequest, DecodeResult
from .adaptive import run_serial

GO, FINISHED, FAILED = 0, 1, -1
ENGINE_CODES = (ASYNC, SERIAL)  # an engine choice's message carries the engine's index here
ERROR_BYTES = 512
MESSAGE_DTYPE = torch.int32  # token ids, tree indices and statuses all fit


@dataclass
class Groups:
    """This rank's view of the split world; built once per model (creating groups is collective)."""

    rank: int
    target_ranks: list[int]
    draft_ranks: list[int]
    device: torch.device  # where this rank's model runs and its messages live (cuda for NCCL, cpu for gloo)
    target_group: object = None  # ProcessGroup of the target ranks (None for a single rank)
    draft_group: object = None
    broken: str | None = None  # set after a failure: the process group may hold stale messages

    @property
    def role(self) -> str:
        return "target" if self.rank in self.target_ranks else "draft"

    @property
    def my_ranks(self) -> list[int]:
        return self.target_ranks if self.role == "target" else self.draft_ranks

    @property
    def my_group(self):
        return self.target_group if self.role == "target" else self.draft_group

    @property
    def leader(self) -> int:
        return self.my_ranks[0]

    @property
    def peer_role(self) -> str:
        return "draft" if self.role == "target" else "target"

    @property
    def peer_leader(self) -> int:
        return (self.draft_ranks if self.role == "target" else self.target_ranks)[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def stuck_or_dead(what: str, timeout_s: float, error: BaseException) -> SwiftSpecWorkerError:
    return SwiftSpecWorkerError(
        f"no {what} within {timeout_s:.0f}s (SwiftSpecConfig.worker_timeout_s): that worker is stuck or its "
        f"process died ({error})."
    )


def post(start, timeout_s: float, what: str):
    """Start an async send/recv/broadcast: `start()` returns its Work. Gloo raises right here,
    not in wait(), when the peer's socket is already closed."""
    try:
        return start()
    except Exception as error:
        raise stuck_or_dead(what, timeout_s, error) from error


def wait(work, timeout_s: float, what: str) -> None:
    """Wait for an async send/recv/broadcast, raising SwiftSpecWorkerError past the deadline."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as error:  # a timeout, or gloo noticing the peer's socket closed
        raise stuck_or_dead(what, timeout_s, error) from error


def complete(start, timeout_s: float, what: str) -> None:
    """post() then wait()."""
    wait(post(start, timeout_s, what), timeout_s, what)


class Arrival:
    """A posted receive whose completion can be polled (gloo's Work cannot be polled itself)."""

    def __init__(self, work, timeout_s: float, what: str):
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.arrived_at = float("inf")  # perf_counter when the message was in (inf: not yet)
        self.thread = threading.Thread(target=self._wait, args=(work, timeout_s, what), daemon=True)
        self.thread.start()

    def _wait(self, work, timeout_s, what) -> None:
        try:
            wait(work, timeout_s, what)
        except BaseException as error:
            self.error = error
        self.arrived_at = time.perf_counter()
        self.done.set()

    def result(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


@dataclass
class DistLink:
    """The ThreadLink protocol over process groups, for one rank and one generation."""

    groups: Groups
    budget: int
    timeout_s: float
    tokens: list[int] = field(default_factory=list)  # every verified token, seen on every rank
    _verdict_buf: torch.Tensor | None = None
    _verdict_work: object = None
    _depth: int = 0
    state_width: int | None = None  # D of the target's hidden states a draft head reads (None: none cross)
    state_bytes: int = 0  # hidden states sent or received, in bytes
    _posted: list = field(default_factory=list)  # (Work, message, what) of sends not waited for yet (a serial call's)

    @property
    def size(self) -> int:
        return 2 + 2 * self.budget

    @property
    def round_bytes(self) -> int:
        """What one round sends across groups: a subtree one way, a verdict back."""
        return 2 * self.size * MESSAGE_DTYPE.itemsize

    def _tensor(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=MESSAGE_DTYPE, device=self.groups.device)

    def _recv(self, n: int, src: int, what: str) -> torch.Tensor:
        buf = self._tensor(n)
        complete(lambda: dist.irecv(buf, src), self.timeout_s, what)
        return buf

    def _send_to_peer(self, msg: torch.Tensor, what: str) -> None:
        g = self.groups
        what = f"delivery of the {what} to the {g.peer_role} leader"
        complete(lambda: dist.isend(msg, g.peer_leader), self.timeout_s, what)

    def _share(self, msg: torch.Tensor, what: str) -> torch.Tensor:
        """Broadcast `msg` from this group's leader to the rest of the group (in place)."""
        g = self.groups
        if len(g.my_ranks) > 1:
            complete(lambda: dist.broadcast(msg, g.leader, group=g.my_group, async_op=True), self.timeout_s, what)
        return msg

    def _raise_if_failed(self, msg: torch.Tensor, src: int, worker: str) -> None:
        if int(msg[0]) != FAILED:
            return
        if self.groups.is_leader and src != self.groups.leader:
            text = self._recv(ERROR_BYTES, src, f"error text from the {worker} leader")
        else:
            text = self._tensor(ERROR_BYTES)
        text = self._share(text, "error text")
        reason = bytes(text.cpu().to(torch.uint8).tolist()).rstrip(b"\0").decode(errors="replace")
        raise PeerFailed(f"the {worker} worker failed: {reason}")

    # ---- draft side -------------------------------------------------------------------------
    def send_subtree(self, subtree: Subtree) -> None:
        if self.groups.is_leader:
            msg = self._encode(GO, subtree.tokens, subtree.parents)
            self._send_to_peer(msg, "subtree")
            self._verdict_buf = self._tensor(self.size)
            what = "verdict from the target leader"
            work = post(lambda: dist.irecv(self._verdict_buf, self.groups.peer_leader), self.timeout_s, what)
            self._verdict_work = Arrival(work, self.timeout_s, what)

    def agree(self, value: int) -> int:
        """A choice every draft rank must share (expansions, tree size), so their trees stay
        identical under tensor parallelism: the leader's, measured on its own clock."""
        if len(self.groups.draft_ranks) == 1:
            return value
        return int(self._share(torch.full((1,), value, dtype=torch.long, device=self.groups.device), "choice"))

    @property
    def stops_alone(self) -> bool:
        """Whether the draft may stop growing on its own clock: a lone draft rank (TP ranks expand alike)."""
        return len(self.groups.draft_ranks) == 1

    def verdict_ready(self) -> bool:
        # Only a lone draft rank may stop early: TP ranks must all expand the same number of times.
        return len(self.groups.draft_ranks) == 1 and self._verdict_work.done.is_set()

    def verdict_arrived_at(self) -> float:
        """When the verdict reached the draft leader (perf_counter; other ranks: when they receive it)."""
        return self._verdict_work.arrived_at if self.groups.is_leader else time.perf_counter()

    def receive_verdict(self) -> Verified:
        if self.groups.is_leader:
            self._verdict_work.result()
            msg = self._verdict_buf
        else:
            msg = self._tensor(self.size)
        msg = self._share(msg, "verdict")
        self._raise_if_failed(msg, self.groups.peer_leader, "target")
        verified = self._decode_verdict(msg)
        if self.state_width is not None:
            verified.features = self._receive_states(len(verified.path), "the accepted path's hidden states")
        return verified

    def receive_prompt_states(self) -> list[torch.Tensor]:
        """The target's hidden states at the prompt's positions (one sequence: a list of one (L, D))."""
        what = "the prompt's hidden states"
        header = self._recv(self.size, self.groups.peer_leader, what) if self.groups.is_leader else self._tensor(self.size)
        header = self._share(header, what)  # [GO, L, D, ...]: a verdict's size, so a failure notice fits it
        self._raise_if_failed(header, self.groups.peer_leader, "target")
        length, self.state_width = header[1:3].tolist()
        return [self._receive_states(length, what)]

    def _receive_states(self, rows: int, what: str) -> torch.Tensor:
        """(rows, state_width) float32 from the target leader, shared within the draft group."""
        states = torch.zeros(rows, self.state_width, dtype=torch.float32, device=self.groups.device)
        if self.groups.is_leader:
            complete(lambda: dist.irecv(states, self.groups.peer_leader), self.timeout_s, f"{what} from the target leader")
        self.state_bytes += states.numel() * states.element_size()
        return self._share(states, what)

    def _encode(self, status: int, first: list[int], second: list[int]) -> torch.Tensor:
        B, n = self.budget, len(first)
        msg = self._tensor(self.size)
        msg[0], msg[1] = status, n
        msg[2 : 2 + n] = torch.tensor(first, dtype=torch.long)
        msg[2 + B : 2 + B + len(second)] = torch.tensor(second, dtype=torch.long)
        return msg

    def _decode(self, msg: torch.Tensor) -> tuple[int, list[int], list[int]]:
        B = self.budget
        values = msg.tolist()
        n = values[1]
        return values[0], values[2 : 2 + n], values[2 + B : 2 + B + n]

    def _decode_verdict(self, msg: torch.Tensor) -> Verified:
        status, tokens, path = self._decode(msg)
        self.tokens += tokens
        return Verified(tokens=tokens, path=path, finished=status == FINISHED)

    def send_counters(self, counters: DraftCounters) -> None:
        if self.groups.is_leader:
            msg = torch.tensor(astuple(counters), dtype=torch.float64, device=self.groups.device)
            self._send_to_peer(msg, "draft counters")

    def send_rounds(self, records: list[RoundRecord]) -> None:
        """The draft's RoundRecords (what the target's rank reports in its stats), after the counters."""
        if self.groups.is_leader:
            self._send_to_peer(torch.tensor([len(records)], dtype=MESSAGE_DTYPE, device=self.groups.device), "round count")
            if records:
                rows = torch.tensor([astuple(r) for r in records], dtype=MESSAGE_DTYPE, device=self.groups.device)
                self._send_to_peer(rows, "round records")

    # ---- target side ------------------------------------------------------------------------
    def receive_subtree(self) -> Subtree:
        if self.groups.is_leader:
            msg = self._recv(self.size, self.groups.peer_leader, "subtree from the draft leader")
        else:
            msg = self._tensor(self.size)
        msg = self._share(msg, "subtree")
        self._raise_if_failed(msg, self.groups.peer_leader, "draft")
        _, tokens, parents = self._decode(msg)
        return Subtree(node_ids=list(range(len(tokens))), tokens=tokens, parents=parents)

    def walk(self, logits, subtree, context, sampler, stopping_criteria, max_tokens) -> Verified:
        """The leader walks the tree; the other target ranks take its verdict."""
        if self.groups.is_leader:
            return verify_tree(logits, subtree, context, sampler, stopping_criteria, max_tokens)
        msg = self._share(self._tensor(self.size), "verdict")
        self._raise_if_failed(msg, self.groups.leader, "target")
        return self._decode_verdict(msg)

    def send_verdict(self, verified: Verified) -> None:
        if not self.groups.is_leader:
            return
        msg = self._encode(FINISHED if verified.finished else GO, verified.tokens, verified.path)
        self._share(msg, "verdict")
        self.tokens += verified.tokens
        self._send_to_peer(msg, "verdict")
        if self.state_width is not None:
            self._send_states(verified.features, "the accepted path's hidden states")

    def send_prompt_states(self, states: list[torch.Tensor]) -> None:
        """The target's hidden states at the prompt's positions (L, D), for the draft head (one sequence)."""
        (prompt,) = states
        self.state_width = prompt.shape[-1]
        if self.groups.is_leader:
            header = self._tensor(self.size)
            header[0], header[1], header[2] = GO, *prompt.shape
            self._send_to_peer(header, "the prompt's hidden states")
            self._send_states(prompt, "the prompt's hidden states")

    def _send_states(self, states: torch.Tensor, what: str) -> None:
        states = states.to(device=self.groups.device, dtype=torch.float32).contiguous()
        self.state_bytes += states.numel() * states.element_size()
        self._send_to_peer(states, what)

    def receive_counters(self) -> DraftCounters:
        """The draft leader's counters (zeros on the other target ranks)."""
        if not self.groups.is_leader:
            return DraftCounters()
        buf = torch.zeros(len(astuple(DraftCounters())), dtype=torch.float64, device=self.groups.device)
        complete(lambda: dist.irecv(buf, self.groups.peer_leader), self.timeout_s, "counters from the draft leader")
        kinds = astuple(DraftCounters())
        return DraftCounters(*(type(kind)(value) for kind, value in zip(kinds, buf.tolist())))

    def receive_rounds(self) -> list[RoundRecord]:
        """The draft leader's RoundRecords (none on the other target ranks)."""
        if not self.groups.is_leader:
            return []
        n = int(self._recv(1, self.groups.peer_leader, "round count from the draft leader")[0])
        if n == 0:
            return []
        rows = torch.zeros(n, len(fields(RoundRecord)), dtype=MESSAGE_DTYPE, device=self.groups.device)
        complete(lambda: dist.irecv(rows, self.groups.peer_leader), self.timeout_s, "round records from the draft leader")
        return [RoundRecord(*row) for row in rows.tolist()]

    # ---- a call's engine, and a serial call (serial_fallback) ---------------------------------
    def agree_engine(self, engine: str | None) -> str:
        """The target leader's `engine` for this call (choice.ASYNC or SERIAL; ignored on the other ranks), on every rank."""
        g = self.groups
        msg = self._tensor(self.size)
        if g.role == "target":
            if g.is_leader:
                msg[0], msg[1] = GO, ENGINE_CODES.index(engine)
                self._send_to_peer(msg, "engine choice")
            return ENGINE_CODES[int(self._share(msg, "engine choice")[1])]
        if g.is_leader:
            msg = self._recv(self.size, g.peer_leader, "engine choice from the target leader")
        msg = self._share(msg, "engine choice")
        self._raise_if_failed(msg, g.peer_leader, "target")
        return ENGINE_CODES[int(msg[1])]

    def stream_tokens(self, tokens: list[int]) -> None:
        """Target leader, serial call: one round's new tokens to the draft leader (B at most a message), posted
        and not waited for (end_stream waits): the serial round does not stop for the message."""
        if self.groups.is_leader:
            for first in range(0, len(tokens), self.budget):
                self._post_to_peer(self._encode(GO, tokens[first : first + self.budget], []), "tokens")

    def end_stream(self, end: int) -> None:
        """Target leader, serial call: the row's end (new tokens it keeps), then every posted send waited for."""
        if self.groups.is_leader:
            self._post_to_peer(self._encode(FINISHED, [end], []), "end of the tokens")
        for work, _, what in self._posted:
            wait(work, self.timeout_s, what)
        self._posted.clear()

    def follow_tokens(self) -> list[int]:
        """Draft ranks, serial call: the target leader's tokens, up to the end it sends last."""
        tokens, g = [], self.groups
        while True:
            msg = self._recv(self.size, g.peer_leader, "tokens from the target leader") if g.is_leader else self._tensor(self.size)
            msg = self._share(msg, "tokens")
            self._raise_if_failed(msg, g.peer_leader, "target")
            status, chunk, _ = self._decode(msg)
            if status == FINISHED:
                return tokens[: chunk[0]]
            tokens += chunk

    def _post_to_peer(self, msg: torch.Tensor, what: str) -> None:
        what = f"delivery of the {what} to the {self.groups.peer_role} leader"
        self._posted.append((post(lambda: dist.isend(msg, self.groups.peer_leader), self.timeout_s, what), msg, what))

    # ---- failures ---------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Tell everyone who may be waiting on this rank that it failed (best effort, bounded)."""
        self.groups.broken = f"{type(error).__name__}: {error}"
        if not self.groups.is_leader:
            return
        text = self._tensor(ERROR_BYTES)
        raw = f"{type(error).__name__}: {error}".encode()[:ERROR_BYTES]
        text[: len(raw)] = torch.tensor(list(raw))
        msg = self._encode(FAILED, [], [])
        try:
            self._share(msg, "failure notice")
            self._share(text, "error text")
            self._send_to_peer(msg, "failure notice")
            self._send_to_peer(text, "error text")
        except Exception:
            pass  # the peer is gone too; our own exception is already on its way up


def check_usable(groups: Groups) -> None:
    if groups.broken:
        raise SwiftSpecWorkerError(
            f"an earlier generate() failed on this job ({groups.broken}); its process groups may hold stale "
            "messages. Restart the torchrun job (reload the model) to generate again."
        )


@contextlib.contextmanager
def failures_told(groups: Groups, link: DistLink):
    """A failure on this rank is told to every rank waiting on it (link.fail) and raised as SwiftSpecWorkerError;
    a peer's failure marks the groups broken."""
    try:
        yield
    except PeerFailed as error:
        groups.broken = str(error)
        raise
    except Exception as error:
        link.fail(error)
        if isinstance(error, SwiftSpecWorkerError):
            raise
        raise SwiftSpecWorkerError(f"the {groups.role} worker failed on rank {groups.rank}: {error!r}") from error


def agree_engine(groups: Groups, engine: str | None, request: DecodeRequest, timeout_s: float) -> str:
    """The engine of this call, the target leader's `engine` (choice.py), on every rank."""
    check_usable(groups)
    link = DistLink(groups, request.policy.max_budget, timeout_s)
    with failures_told(groups, link):
        return link.agree_engine(engine)


def run_distributed(groups: Groups, target, draft, request, timeout_s: float):
    """Run this rank's worker for one generation; every rank returns the same tokens.

    target / draft: this rank's TargetWorker or Drafters (the other is None).
    """
    check_usable(groups)
    link = DistLink(groups, request.policy.max_budget, timeout_s)
    rows = BatchRows.start(request)
    records = []  # the draft's RoundRecords
    start = time.perf_counter()
    with failures_told(groups, link):
        if groups.role == "target":
            run_target(target, request, link, rows)
            target_counters, draft_counters = target.counters, link.receive_counters()
            records = link.receive_rounds()
        else:
            run_draft(draft, request, link, records)
            link.send_counters(draft.counters)
            link.send_rounds(records)
            rows.result.rows[0].tokens = list(link.tokens)
            rows.result.end = len(link.tokens)
            target_counters, draft_counters = TargetCounters(), draft.counters
    result = rows.result
    rounds = max(target_counters.verify_steps or draft_counters.rounds, 1)
    result.stats = SwiftSpecStats.collect(
        "async-distributed", result.new_tokens, time.perf_counter() - start, target_counters, draft_counters,
        message_bytes=link.round_bytes + link.state_bytes // rounds,
    )
    result.stats.add_rounds(records)
    return result


def run_serial_distributed(groups: Groups, target, draft, request: DecodeRequest, timeout_s: float) -> DecodeResult:
    """A serial call under torchrun (serial_fallback): the target's rank runs the serial round with the draft model
    beside it (target, draft: that rank's TargetWorker and Drafters); the draft ranks (target, draft: None) follow its
    tokens, so every rank returns the same. The draft ranks' stats hold only the tokens and the wall time."""
    check_usable(groups)
    link = DistLink(groups, request.policy.max_budget, timeout_s)
    start = time.perf_counter()
    with failures_told(groups, link):
        if groups.role == "target":
            shown = request.on_tokens
            result = run_serial(target, draft, replace(request, on_tokens=lambda tokens: (
                link.stream_tokens(tokens), shown and shown(tokens))))
            link.end_stream(result.end)
            return result
        tokens = link.follow_tokens()
    result = BatchRows.start(request).result
    result.rows[0].tokens, result.end = tokens, len(tokens)
    result.stats = SwiftSpecStats(engine="serial", new_tokens=result.new_tokens, wall_time_s=time.perf_counter() - start)
    return result
