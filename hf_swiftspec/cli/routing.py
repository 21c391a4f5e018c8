"""`swiftspec serve --continuous-batching` for a pair whose models cannot share a speculating batch (a
recurrent or chain-shaped model; every other pair runs batching.py): each request speculates when the
server is idle and joins transformers' continuous batch of the target alone when others are decoding.

SmartSpec's goodput rule at the scale of requests: a lone request is latency-bound, and a token tree
verified in one forward multiplies its tokens per second; a busy batch is compute-bound, where
verifying trees costs more than it returns, so the right speculation length there is zero. transformers'
server talks to one batching manager (start, stop, add_request, register_result_handler,
cancel_request, background_thread_status); `SpeculationRouter` is that manager for a pair. It owns
transformers' own manager for the target (`target.init_continuous_batching`) and one thread that runs
`pair.generate()` for the request it routes to speculation. Both decoders produce the target's own
tokens (greedy) or draws from its distribution, so the route changes speed, not output.

Route: a request speculates if no other request is in flight when it arrives, else it joins the batch.
A speculating request that gets company joins the batch too, after the round it is in: its prompt and
the tokens it has so far are prefilled there, and its handler keeps receiving the whole answer. So
speculation and batching never run at once (they would fight over the cores and the interpreter: the
batch alone at 16 clients ran 441 tokens/s, beside a speculating request 202). A batched request
stays batched.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
from dataclasses import dataclass, field

import torch

from ..models import compat
from .batching import ServedRequest, ServerStreamer, hand_over, request_config


@dataclass
class RoutedRequest(ServedRequest):
    """One request the router took (batching.ServedRequest's fields): where it runs, and what it brought along."""

    speculate: bool = False
    handed_over: list[int] = field(default_factory=list)  # of its tokens, those it brought when it joined the batch
    cancelled: threading.Event = field(default_factory=threading.Event)
    company: threading.Event = field(default_factory=threading.Event)  # others arrived: join the batch


def shared_weights_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A second module tree over the same parameter and buffer tensors, with its own config. The two routes
    run concurrently, and each sets the attention implementation on its model's config (the batcher switches
    to a paged one; a speculative generate() routes attention for its call): one object would let each change
    the other's attention mid-forward. The copy costs the modules, not the weights."""
    memo = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


class RequestCancelled(Exception):
    """Raised inside the speculative generate() when its request was cancelled (its client left)."""


class RequestJoinsBatch(Exception):
    """Raised inside the speculative generate() after a round, when other requests arrived."""


class RouterStreamer(ServerStreamer):
    """The streamer of one speculative generate() (batching.ServerStreamer) that also stops it when its request
    was cancelled, or after a round once others arrived (it then joins the batch)."""

    def put(self, value: torch.Tensor) -> None:
        if self.request.cancelled.is_set():
            raise RequestCancelled(self.request.request_id)
        prompt = self.first  # generate() puts the prompt first
        super().put(value)
        if not prompt and self.request.company.is_set():
            raise RequestJoinsBatch(self.request.request_id)


class SpeculationRouter:
    """The batching manager `transformers serve --continuous-batching` drives, for a pair (see the module
    docstring). `batcher` is transformers' manager for the target alone."""

    def __init__(self, pair, generation_config, continuous_batching_config=None):
        self.pair = pair
        self.generation_config = generation_config
        self.batched_target = shared_weights_copy(pair.target)
        self.batcher = self.batched_target.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=continuous_batching_config
        )
        self.requests: dict[str, RoutedRequest] = {}
        self.lock = threading.Lock()
        self.queue: queue.Queue[RoutedRequest | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.speculating: RoutedRequest | None = None
        self.routed = {"speculate": 0, "batch": 0, "joined": 0}  # requests each way since start (tests, logs)

    # ------------------------------------------------ what the server calls

    @property
    def background_thread_status(self):
        return self.batcher.background_thread_status

    @property
    def batch_processor(self):
        return self.batcher.batch_processor

    def start(self) -> None:
        self.batcher.start()
        self.thread = threading.Thread(target=self.run_speculative, name="swiftspec-speculate", daemon=True)
        self.thread.start()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self.queue.put(None)
        self.batcher.stop(block=block, timeout=timeout)
        if block and self.thread is not None:
            self.thread.join(timeout)

    def add_request(
        self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
        streaming: bool = False, eos_token_id=None, **kwargs,
    ) -> str | None:
        try:
            self.pair.check_request(len(input_ids), max_new_tokens)  # a ValueError here is the server's 400
        except ValueError:
            self.forget(request_id)
            raise
        with self.lock:
            request_id = request_id or f"swiftspec_{sum(self.routed.values())}"
            speculate = not kwargs and not any(r.added for r in self.requests.values() if r.request_id != request_id)
            request = self.requests.get(request_id) or RoutedRequest(request_id)
            request.input_ids, request.max_new_tokens, request.eos_token_id = list(input_ids), max_new_tokens, eos_token_id
            request.streaming, request.speculate, request.added = streaming, speculate, True
            self.requests[request_id] = request
            self.routed["speculate" if speculate else "batch"] += 1
            if not speculate and self.speculating is not None:
                self.speculating.company.set()
        if speculate:
            self.queue.put(request)
            return request_id
        if request.handler is not None:  # registered before it was added (the server's non-streaming order)
            self.batcher.register_result_handler(request_id, self.batched_handler(request))
        return self.batcher.add_request(
            input_ids, request_id=request_id, max_new_tokens=max_new_tokens, streaming=streaming,
            eos_token_id=eos_token_id, **kwargs,
        )

    def register_result_handler(self, request_id: str, callback) -> None:
        """Called on the server's event loop, before add_request (non-streaming) or after it (streaming)."""
        import asyncio

        loop = asyncio.get_running_loop()
        with self.lock:
            request = self.requests.get(request_id)
            if request is None:  # not added yet: the route is decided when it is
                request = RoutedRequest(request_id)
                self.requests[request_id] = request
            request.handler = (callback, loop)
            request.registered.set()
            if not request.added:
                return
        if not request.speculate:
            self.batcher.register_result_handler(request_id, self.batched_handler(request))

    def cancel_request(self, request_id: str) -> None:
        with self.lock:
            request = self.requests.get(request_id)
        if request is None:
            return
        if request.speculate:
            request.cancelled.set()
        else:
            self.batcher.cancel_request(request_id)
            self.forget(request_id)

    # ------------------------------------------------ the two routes

    def batched_handler(self, request: RoutedRequest):
        """The server's callback, for the batch's outputs: after the tokens the request brought, if any."""
        callback, _loop = request.handler

        def handle(output) -> None:
            if request.handed_over:
                output = dataclasses.replace(
                    output, prompt_ids=request.input_ids, generated_tokens=request.handed_over + list(output.generated_tokens)
                )
            if output.is_finished():
                self.forget(request.request_id)
            callback(output)

        return handle

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.requests.pop(request_id, None)

    def run_speculative(self) -> None:
        """The speculative route's thread: one pair.generate() at a time."""
        status = compat.cb_request_status()
        while (request := self.queue.get()) is not None:
            request.registered.wait(timeout=30)  # a streaming request's handler comes just after add_request
            with self.lock:
                self.speculating = request
                if any(r.added and r is not request for r in self.requests.values()):
                    request.company.set()  # others came while it waited for its handler
            try:
                self.pair.generate(
                    torch.tensor([request.input_ids], device=self.pair.device),
                    attention_mask=torch.ones(1, len(request.input_ids), dtype=torch.long, device=self.pair.device),
                    generation_config=self.request_config(request),
                    streamer=RouterStreamer(self, request),
                )
                self.deliver(request, status.FINISHED)
            except RequestCancelled:
                self.forget(request.request_id)
            except RequestJoinsBatch:
                self.join_batch(request)
            except Exception as error:  # the request fails, with the reason; the server goes on
                self.deliver(request, status.FAILED, error=f"{type(error).__name__}: {error}")
            finally:
                with self.lock:
                    self.speculating = None

    def join_batch(self, request: RoutedRequest) -> None:
        """Move a speculating request to the batch: its prompt and its tokens so far are the batch's prompt,
        for the tokens it has left (done already if its last token ended it)."""
        left = None if request.max_new_tokens is None else request.max_new_tokens - len(request.tokens)
        eos = request.eos_token_id if request.eos_token_id is not None else self.generation_config.eos_token_id
        eos = set(eos) if isinstance(eos, (list, tuple, set)) else {eos}
        if (left is not None and left <= 0) or (request.tokens and request.tokens[-1] in eos):
            self.deliver(request, compat.cb_request_status().FINISHED)
            return
        request.speculate, request.handed_over = False, list(request.tokens)
        with self.lock:
            self.routed["joined"] += 1
        _callback, loop = request.handler

        def join() -> None:  # on the server's loop: the batcher registers handlers there
            self.batcher.register_result_handler(request.request_id, self.batched_handler(request))
            self.batcher.add_request(
                request.input_ids + request.handed_over, request_id=request.request_id, max_new_tokens=left,
                streaming=request.streaming, eos_token_id=request.eos_token_id,
            )

        loop.call_soon_threadsafe(join)

    def request_config(self, request: RoutedRequest):
        return request_config(self.generation_config, request)

    def deliver(self, request: RoutedRequest, status, error: str | None = None) -> None:
        """Hand the request's tokens so far to its handler (forgetting it once finished)."""
        if hand_over(request, status, error).is_finished():
            self.forget(request.request_id)
