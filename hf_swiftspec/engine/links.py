"""How the two workers of the asynchronous engine talk: one protocol, two transports.

The draft side sends a `Subtree` (or a failure); the target side answers with the `Verified`
outcome of its walk (or a failure); the draft reads its tokens, path and `finished`. `ThreadLink` carries them between two threads
of one process; `engine/distributed.py` carries the same messages between process groups.
Every wait has a timeout, so a dead or stuck worker becomes an exception, never a hang.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass

import torch

from ..steps.tree import Subtree
from ..steps.verify import Verified, verify_tree


class SwiftSpecWorkerError(RuntimeError):
    """A worker of the asynchronous engine failed or went silent; the message names which."""


class PeerFailed(SwiftSpecWorkerError):
    """The other worker reported its own failure (so it needs no notice back)."""


@dataclass
class Failure:
    """Sent instead of a message when a worker raised, so its peer stops waiting at once."""

    worker: str
    error: BaseException


class LinkClosed(Exception):
    """The peer asked this worker to stop (generation is over or failed elsewhere)."""


class ThreadLink:
    """Two queues between the target (main thread) and the draft (a worker thread).

    timeout_s bounds every wait; poll_s is how often a wait looks at the stop flag.
    """

    walk = staticmethod(verify_tree)  # the target walks its own tree in-process
    stops_alone = True  # one draft worker: it may stop growing on its own clock (no peer must expand alike)

    def __init__(self, timeout_s: float, poll_s: float = 0.05):
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.proposals: queue.Queue = queue.Queue()
        self.verdicts: queue.Queue = queue.Queue()
        self.prompt_states: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self.verdict_sent_at = 0.0  # perf_counter when the last verdict was put (one clock: one process)

    # draft side
    def send_subtree(self, subtree: Subtree) -> None:
        self.proposals.put(subtree)

    def agree(self, value: int) -> int:
        """A choice every draft rank must share (one draft thread here: its own)."""
        return value

    def verdict_ready(self) -> bool:
        return not self.verdicts.empty()

    def receive_verdict(self) -> Verified:
        return self._get(self.verdicts, "target")

    def verdict_arrived_at(self) -> float:
        """When the verdict just received reached this worker (time.perf_counter)."""
        return self.verdict_sent_at

    def receive_prompt_states(self) -> list:
        """The target's hidden states at each prompt's positions, for a drafter that reads them (one per row)."""
        return self._get(self.prompt_states, "target")

    def report_failure(self, worker: str, error: BaseException) -> None:
        self.proposals.put(Failure(worker, error))

    # target side
    def receive_subtree(self) -> Subtree:
        return self._get(self.proposals, "draft")

    def send_verdict(self, verified: Verified) -> None:
        self.verdict_sent_at = time.perf_counter()
        self.verdicts.put(verified)

    def send_prompt_states(self, states: list) -> None:
        self.prompt_states.put(states)

    def close(self) -> None:
        """Tell the draft to stop at its next wait or step."""
        self.stopped.set()

    def _get(self, q: queue.Queue, peer: str):
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                item = q.get(timeout=self.poll_s)
            except queue.Empty:
                if self.stopped.is_set() and peer == "target":
                    raise LinkClosed() from None
                if time.monotonic() > deadline:
                    raise SwiftSpecWorkerError(
                        f"the {peer} worker sent nothing for {self.timeout_s:.0f}s (SwiftSpecConfig.worker_timeout_s); "
                        "it is stuck or died. Both workers were stopped."
                    ) from None
                continue
            if isinstance(item, Failure):
                raise PeerFailed(f"the {item.worker} worker failed: {item.error!r}") from item.error
            return item


def run_two_threads(link: ThreadLink, draft_work, target_work, timeout_s: float, draft_context=None) -> None:
    """The asynchronous engines' two threads: draft_work() in a worker thread (under no_grad, which is per thread, and
    draft_context(), e.g. its own CUDA stream), target_work() in the calling one. A draft failure reaches the target
    through the link; a target failure is raised as SwiftSpecWorkerError; either way the link closes and the draft
    thread must stop within timeout_s."""

    def draft_main() -> None:
        try:
            with torch.no_grad(), (draft_context() if draft_context is not None else contextlib.nullcontext()):
                draft_work()
        except LinkClosed:
            pass
        except BaseException as error:  # surfaces in generate() through the link
            link.report_failure("draft", error)

    thread = threading.Thread(target=draft_main, name="swiftspec-draft", daemon=True)
    thread.start()
    try:
        target_work()
    except SwiftSpecWorkerError:
        raise
    except Exception as error:
        raise SwiftSpecWorkerError(f"the target worker failed: {error!r}") from error
    finally:
        link.close()
        thread.join(timeout=timeout_s)
    if thread.is_alive():
        raise SwiftSpecWorkerError(f"the draft worker did not stop within {timeout_s:.0f}s after generation ended")
