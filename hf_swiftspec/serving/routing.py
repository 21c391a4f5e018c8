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
A request with settings of its own (sampling, penalties, a seed, stop strings: serving/request_settings.py)
always speculates, and stays there: transformers' batch shares one generation config.
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

from .batching import Served, ServedRequest, ServerStreamer, ServingManager


@dataclass
class RoutedRequest(ServedRequest):
    """One request the router took (batching.ServedRequest's fields): where it runs, and what it brought along."""

    speculate: bool = False
    handed_over: list[int] = field(default_factory=list)  # of its tokens, those it brought when it joined the batch
    company: threading.Event = field(default_factory=threading.Event)  # others arrived: join the batch
    own_settings: bool = False  # its sampling, processors, stops or seed differ from the batch's shared config


def shared_weights_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A second module tree over the same parameter and buffer tensors, with its own config. The two routes
    run concurrently, and each sets the attention implementation on its model's config (the batcher switches
    to a paged one; a speculative generate() routes attention for its call): one object would let each change
    the other's attention mid-forward. The copy costs the modules, not the weights."""
    memo = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "min_p")


def differs_from(generate_kwargs: dict, shared) -> bool:
    """Whether a request's generate() arguments ask for more than transformers' batch does with `shared`, its
    one generation config: processors, stops or a seed of its own, or other sampling settings."""
    config = generate_kwargs["generation_config"]
    sampling = [getattr(config, name) for name in SAMPLING_FIELDS] != [getattr(shared, name) for name in SAMPLING_FIELDS]
    return set(generate_kwargs) != {"generation_config"} or (sampling and (config.do_sample or shared.do_sample))


class RequestJoinsBatch(Exception):
    """Raised inside the speculative generate() after a round, when other requests arrived."""


class RouterStreamer(ServerStreamer):
    """The streamer of one speculative generate() (batching.ServerStreamer) that also stops it after a round
    once others arrived (it then joins the batch), unless it has settings of its own."""

    def put(self, value: torch.Tensor) -> None:
        prompt = self.first  # generate() puts the prompt first
        super().put(value)
        if not prompt and self.request.company.is_set() and not self.request.own_settings:
            raise RequestJoinsBatch(self.request.request_id)


class SpeculationRouter(ServingManager):
    """The batching manager `transformers serve --continuous-batching` drives, for a pair (see the module
    docstring). `batcher` is transformers' manager for the target alone."""

    request_class = RoutedRequest

    def __init__(self, pair, served: Served | None = None, continuous_batching_config=None):
        super().__init__(pair, served)
        self.batched_target = shared_weights_copy(pair.target)
        self.batcher = self.batched_target.init_continuous_batching(
            generation_config=self.generation_config, continuous_batching_config=continuous_batching_config
        )
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

    def submit(self, request: RoutedRequest) -> None:
        with self.lock:
            busy = any(r.added for r in self.requests.values() if r is not request)
            request.own_settings = differs_from(request.generate_kwargs, self.generation_config)
            request.own_settings = request.own_settings or bool(request.siblings) or request.settings.logprobs is not None
            request.speculate = request.own_settings or not busy
            self.routed["speculate" if request.speculate else "batch"] += 1
            if not request.speculate and self.speculating is not None:
                self.speculating.company.set()
            registered = request.handler is not None
        if request.speculate:
            self.queue.put(request)
            return
        self.served.admission.started(request.request_id)  # transformers' batch takes it in at once
        if registered:  # registered before it was added (the server's non-streaming order)
            self.batcher.register_result_handler(request.request_id, self.batched_handler(request))
        self.batcher.add_request(
            request.input_ids, request_id=request.request_id, max_new_tokens=request.max_new_tokens,
            streaming=request.streaming, eos_token_id=self.generation_config.eos_token_id,
        )

    def register_result_handler(self, request_id: str, callback) -> None:
        """Called on the server's event loop, before add_request (non-streaming) or after it (streaming)."""
        super().register_result_handler(request_id, callback)
        with self.lock:
            request = self.requests[request_id]
        if request.added and not request.speculate:
            self.batcher.register_result_handler(request_id, self.batched_handler(request))

    def cancelled(self, request: RoutedRequest) -> None:
        if not request.speculate:
            self.batcher.cancel_request(request.request_id)
            self.forget(request.request_id)

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
                self.served.book.finished(request.request_id, self.finish_reason(request, output.generated_tokens))
                self.forget(request.request_id)
            callback(output)

        return handle

    def run_speculative(self) -> None:
        """The speculative route's thread: one pair.generate() at a time."""
        while (request := self.queue.get()) is not None:
            request.registered.wait(timeout=30)  # a streaming request's handler comes just after add_request
            self.served.admission.started(request.request_id)
            with self.lock:
                self.speculating = request
                if any(r.added and r is not request for r in self.requests.values()):
                    request.company.set()  # others came while it waited for its handler
            try:
                self.run_request(request, streamer_class=RouterStreamer)
            except RequestJoinsBatch:
                self.join_batch(request)
            except Exception as error:  # the request fails, with the reason; the server goes on
                self.fail(request, error)
            finally:
                with self.lock:
                    self.speculating = None

    def join_batch(self, request: RoutedRequest) -> None:
        """Move a speculating request to the batch: its prompt and its tokens so far are the batch's prompt,
        for the tokens it has left (done already if its last token ended it)."""
        left = request.max_new_tokens - len(request.tokens)
        if left <= 0 or (request.tokens and request.tokens[-1] in self.eos_ids()):
            self.finished(request)
            return
        request.speculate, request.handed_over = False, list(request.tokens)
        with self.lock:
            self.routed["joined"] += 1
        _callback, loop = request.handler

        def join() -> None:  # on the server's loop: the batcher registers handlers there
            self.batcher.register_result_handler(request.request_id, self.batched_handler(request))
            self.batcher.add_request(
                request.input_ids + request.handed_over, request_id=request.request_id, max_new_tokens=left,
                streaming=request.streaming, eos_token_id=self.generation_config.eos_token_id,
            )

        loop.call_soon_threadsafe(join)
