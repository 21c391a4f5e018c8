"""The device round's asynchronous engine (engine/device_async.py) across two torchrun ranks: the draft's loop on the
draft rank, the target's on the target rank, the same two loops the threads transport runs, over one message type
each way (gloo on CPU processes, NCCL on GPUs).

    subtree message   [status, T, steps, node_ids, tokens, parents, scores (float32 bits), valid, depths (budget
                       each, the first T real), mask (T x T)]                     draft rank -> target rank
    verdict message   [status, count, n, token, verify_us, wait_us, path (T), tokens (n: up to T, or a run of plain
                       steps' up to MAX_PLAIN_STEPS), padding]
                                                                                  target rank -> draft rank
    status: 0 go on, 1 finished, -1 the sender failed (a UTF-8 error text of ERROR_BYTES follows)

Both messages are int32 tensors of one fixed size (a failure notice fits whatever a rank waits for), made on the
device from the round's own tensors: the subtree crosses without a host read on the draft rank, whose one read a
round is the verdict's. Every wait has SwiftSpecConfig.worker_timeout_s as its deadline (engine/distributed.py's
post / wait / Arrival): a failed rank tells its peer, a dead one is noticed when the deadline passes, and generate()
raises SwiftSpecWorkerError on both ranks instead of hanging. One rank a group (a tensor-parallel group runs the host
round's engine, engine/distributed.py); every rank returns the target's tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..policy.choice import MAX_PLAIN_STEPS
from ..steps.device_round import DeviceSubtree
from .device_async import Sent, Verdict, call_sides, call_stats, drafting_choice, run_draft, run_target
from .distributed import FINISHED, GO, Arrival, DistLink, Groups, check_usable, failures_told, post
from .request import BatchRows, DecodeRequest, DecodeResult

DISTRIBUTED_ENGINE = "async-distributed-device"
SUBTREE_HEAD = 3  # status, T, steps (engine/device_async.Sent)
VERDICT_HEAD = 6  # status, count, n (tokens emitted), token (the next root), verify_us, wait_us


@dataclass
class DeviceDistLink(DistLink):
    """ThreadLink's four calls (send_subtree / receive_subtree / send_verdict / verdict_ready + receive_verdict) for
    the device engine's DeviceSubtree and Verdict, between the two ranks' leaders (DistLink's failure notices,
    counters and deadlines). budget: T, the subtree's nodes (AsyncShape.budget, the same on both ranks). device: the
    rank's model's device, where a received message's tensors go (None: the link's)."""

    device: torch.device | None = None

    @property
    def size(self) -> int:
        T = self.budget  # (a verdict after a run of plain steps carries up to MAX_PLAIN_STEPS tokens)
        return max(SUBTREE_HEAD + 6 * T + T * T, VERDICT_HEAD + T + MAX_PLAIN_STEPS)

    # ---- draft side -------------------------------------------------------------------------
    def send_subtree(self, sent: Sent) -> None:
        self._send_to_peer(self.encode_subtree(sent.subtree, sent.steps), "subtree")
        self._verdict_buf = self._tensor(self.size)
        what = "verdict from the target rank"
        work = post(lambda: dist.irecv(self._verdict_buf, self.groups.peer_leader), self.timeout_s, what)
        self._verdict_work = Arrival(work, self.timeout_s, what)

    def encode_subtree(self, sub: DeviceSubtree, steps: int = 1) -> torch.Tensor:
        """(size,) int32 on the link's device, from the subtree's (1, T) tensors (T <= budget: each field padded to the
        budget; a plain round's T is 1), without a host read."""
        B, T = self.budget, sub.tokens.shape[1]
        if sub.tokens.shape[0] != 1 or T > B:
            raise ValueError(f"a subtree of shape {tuple(sub.tokens.shape)} on a link of budget {B}")
        msg = torch.zeros(self.size, dtype=torch.int32, device=sub.tokens.device)
        msg[0], msg[1], msg[2] = GO, T, steps
        fields = (sub.node_ids, sub.tokens, sub.parents, sub.scores.float().view(torch.int32), sub.valid, sub.depths)
        at = SUBTREE_HEAD
        for i, values in enumerate(fields):
            msg[at + i * B : at + i * B + T] = values[0].to(torch.int32)
        msg[at + 6 * B : at + 6 * B + T * T] = sub.mask[0].flatten().to(torch.int32)
        return msg.to(self.groups.device)

    def verdict_ready(self) -> bool:
        return self._verdict_work.done.is_set()

    def receive_verdict(self) -> Verdict:
        """The verdict, read to the host (the draft rank's one read a round); its path back on the draft's device."""
        self._verdict_work.result()
        msg = self._verdict_buf
        self._raise_if_failed(msg, self.groups.peer_leader, "target")
        T = self.budget
        values = msg.tolist()
        status, count, n, token, verify_us, wait_us = values[:VERDICT_HEAD]
        path = values[VERDICT_HEAD : VERDICT_HEAD + T]
        tokens = values[VERDICT_HEAD + T : VERDICT_HEAD + T + n]
        self.tokens += tokens
        device = self.groups.device if self.device is None else self.device
        return Verdict(torch.tensor([path], dtype=torch.long, device=device), count,
                       torch.tensor([token], dtype=torch.long, device=device), status == FINISHED,
                       verify_s=verify_us / 1e6, wait_s=wait_us / 1e6, tokens=tuple(tokens))

    # ---- target side ------------------------------------------------------------------------
    def receive_subtree(self) -> Sent:
        """The subtree's tensors on the target's device (its header read: a failure notice raises here)."""
        msg = self._recv(self.size, self.groups.peer_leader, "subtree from the draft rank")
        self._raise_if_failed(msg, self.groups.peer_leader, "draft")
        B, (T, steps), at = self.budget, msg[1:3].tolist(), SUBTREE_HEAD
        msg = msg.to(self.device or msg.device)
        node_ids, tokens, parents, scores, valid, depths = (msg[at + i * B : at + i * B + T][None] for i in range(6))
        mask = msg[at + 6 * B : at + 6 * B + T * T].view(1, T, T)
        return Sent(DeviceSubtree(node_ids.long(), tokens.long(), parents.long(), scores.contiguous().view(torch.float32),
                                  valid.bool(), depths.long(), mask.bool()), steps)

    def send_verdict(self, verdict: Verdict) -> None:
        T = self.budget
        status = FINISHED if verdict.finished else GO
        head = [status, verdict.count, len(verdict.tokens), 0, round(verdict.verify_s * 1e6), round(verdict.wait_s * 1e6)]
        msg = self._tensor(self.size)
        msg[:VERDICT_HEAD] = torch.tensor(head, dtype=torch.int32)
        msg[3:4] = verdict.token.to(msg.device, torch.int32)
        msg[VERDICT_HEAD : VERDICT_HEAD + verdict.path.shape[1]] = verdict.path[0].to(msg.device, torch.int32)
        msg[VERDICT_HEAD + T : VERDICT_HEAD + T + len(verdict.tokens)] = torch.tensor(verdict.tokens, dtype=torch.int32)
        self.tokens += list(verdict.tokens)
        self._send_to_peer(msg, "verdict")

    # ---- at the end: the draft's expansions a round, for the target rank's stats --------------
    def send_rounds_ran(self, ran: list[int], suffix: list[int]) -> None:
        """Each verification's expansions in flight and its tokens from suffix nodes alone (as many of each)."""
        self._send_to_peer(torch.tensor([len(ran)], dtype=torch.int32, device=self.groups.device), "round count")
        if ran:
            self._send_to_peer(torch.tensor(ran + suffix, dtype=torch.int32, device=self.groups.device),
                               "expansions and suffix tokens a round")

    def receive_rounds_ran(self) -> tuple[list[int], list[int]]:
        n = int(self._recv(1, self.groups.peer_leader, "round count from the draft rank")[0])
        if not n:
            return [], []
        values = self._recv(2 * n, self.groups.peer_leader, "expansions and suffix tokens a round from the draft rank")
        return values[:n].tolist(), values[n:].tolist()


def distributed_gaps(groups: Groups) -> list[str]:
    """Why this torchrun job cannot run the device round's asynchronous engine (empty: it can)."""
    if len(groups.target_ranks) != 1 or len(groups.draft_ranks) != 1:
        return [f"it runs one target rank and one draft rank (this placement has {len(groups.target_ranks)} and "
                f"{len(groups.draft_ranks)}; tensor-parallel groups run the host round's engine, round='host')"]
    return []


def run_device_async_distributed(groups: Groups, target, draft, request: DecodeRequest, config,
                                 architectures=(None, None)) -> DecodeResult:
    """This rank's side of one sequence: the target rank verifies, the draft rank grows and re-roots; both return the
    target's tokens. The target rank's stats hold both sides' counters (the draft's come over at the end)."""
    check_usable(groups)
    shape, draft_side, target_side = call_sides(target, draft, request, config, architectures, groups.role)
    rows = BatchRows.start(request)
    model = target if groups.role == "target" else draft
    link = DeviceDistLink(groups, shape.budget, config.worker_timeout_s, device=model.device)
    choice = drafting_choice(request, config)
    start = time.perf_counter()
    with failures_told(groups, link), torch.no_grad():
        if groups.role == "target":
            side = target_side()
            if request.max_new_tokens:
                run_target(side, link, rows, request.on_tokens)
            draft_counters, (ran, suffix) = link.receive_counters(), link.receive_rounds_ran()
        else:
            side = draft_side()
            if request.max_new_tokens:
                run_draft(side, link, choice)
            link.send_counters(side.counters)
            link.send_rounds_ran(side.in_flight_by_round, side.suffix_by_round)
            rows.result.rows[0].tokens = list(link.tokens)
            rows.result.end = len(link.tokens)
            draft_counters, ran, suffix = side.counters, [], []
    result = rows.result
    result.stats = call_stats(DISTRIBUTED_ENGINE, result, time.perf_counter() - start,
                              side if groups.role == "target" else None, draft_counters, ran, 2 * link.size * 4,
                              choice if groups.role == "draft" else None, suffix)  # (the draft rank decides)
    if choice is not None and groups.role == "target":
        result.stats.engine_choice = f"{DISTRIBUTED_ENGINE}: the draft rank chooses whether each round drafts"
    return result
