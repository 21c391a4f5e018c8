"""`swiftspec serve --continuous-batching`: every request speculates inside one running batch.

transformers' server talks to one batching manager (start, stop, add_request, register_result_handler,
cancel_request, background_thread_status); `SpeculatingBatcher` is that manager for a pair. Each request
is a `pair.generate()` call of its own thread, with the request's max_new_tokens and stop tokens and
the server's shared sampling settings (what transformers' continuous batching takes per request), and
decodes in the pair's continuous engine (engine/continuous.py): it joins the running batch between
rounds, speculates there with trees the goodput policy sizes for the batch it has, and leaves when
done or cancelled. Its tokens reach the server's handler as they are verified (streaming) or at the
end; the engine keeps by request id what speculation did for it, which the response's usage reads
(`SpeculationUsage`).

A pair whose models cannot share a batch (a recurrent or chain-shaped model) keeps routing.py's rule.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch

from ..models import compat
from ..engine.continuous import RequestCancelled, RowUsage

@dataclass
class SpeculationUsage:
    """Where the server's responses and its /v1/swiftspec/usage endpoint read what speculation did: the
    running engine (set when the first request starts it), per request id and in total."""

    engine: object = None

    def of(self, request_id: str) -> RowUsage | None:
        return None if self.engine is None else self.engine.usage_of(request_id)

    def totals(self) -> dict:
        engine = self.engine
        if engine is None:
            return {"requests": 0, "usage": RowUsage().as_dict(), "rounds_by_batch_size": {}}
        return {
            "requests": engine.served, "usage": engine.usage.as_dict(),
            "rounds_by_batch_size": {str(k): v for k, v in sorted(engine.rounds_by_batch.items())},
        }


@dataclass
class ThreadStatus:
    """What the server reads of a batching manager's health (transformers' BackgroundThreadStatus)."""

    fatal_error: BaseException | None = None


class ServerStreamer:
    """One request's streamer: each round's tokens to the request's handler (streaming requests), and the
    tokens kept for the final output."""

    def __init__(self, manager, request: "ServedRequest"):
        self.manager, self.request, self.first = manager, request, True  # manager: whose deliver() hands tokens over

    def put(self, value: torch.Tensor) -> None:
        if self.first:  # generate() puts the prompt first
            self.first = False
            return
        self.request.tokens += value.reshape(-1).tolist()
        if self.request.streaming:
            self.manager.deliver(self.request, compat.cb_request_status().DECODING)

    def end(self) -> None:
        pass


@dataclass
class ServedRequest:
    """One request: its prompt, its limits and who hears of its tokens.

    handler: (callback, event loop) the server registered; outputs are delivered on that loop
    """

    request_id: str
    input_ids: list[int] = field(default_factory=list)
    max_new_tokens: int | None = None
    eos_token_id: int | list[int] | None = None
    streaming: bool = False
    handler: tuple | None = None
    tokens: list[int] = field(default_factory=list)
    registered: threading.Event = field(default_factory=threading.Event)
    added: bool = False


class SpeculatingBatcher:
    """The batching manager `transformers serve --continuous-batching` drives (see the module docstring)."""

    def __init__(self, pair, generation_config, usage: SpeculationUsage | None = None):
        self.pair = pair
        self.generation_config = generation_config
        self.usage = usage if usage is not None else SpeculationUsage()
        self.engine = pair.continuous_engine()
        self.usage.engine = self.engine
        self.requests: dict[str, ServedRequest] = {}
        self.lock = threading.Lock()
        self.background_thread_status = ThreadStatus()
        self.batch_processor = None  # transformers' scheduler (monitoring): the engine has none
        self.count = 0

    def start(self) -> None:
        pass  # the engine's thread starts with its first request

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self.engine.close()

    def add_request(
        self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
        streaming: bool = False, eos_token_id=None, **kwargs,
    ) -> str:
        if kwargs:
            raise ValueError(
                f"swiftspec serve's batch takes a request's max_new_tokens and eos_token_id, not {sorted(kwargs)}; "
                "set sampling for the whole server (its generation config)."
            )
        try:
            self.pair.check_request(len(input_ids), max_new_tokens)  # a ValueError here is the server's 400
        except ValueError:
            self.forget(request_id)
            raise
        with self.lock:
            self.count += 1
            request_id = request_id or f"swiftspec_{self.count}"
            request = self.requests.get(request_id) or ServedRequest(request_id)
            request.input_ids, request.max_new_tokens, request.eos_token_id = list(input_ids), max_new_tokens, eos_token_id
            request.streaming, request.added = streaming, True
            self.requests[request_id] = request
        threading.Thread(target=self.decode, args=(request,), name=f"swiftspec-{request_id}", daemon=True).start()
        return request_id

    def register_result_handler(self, request_id: str, callback) -> None:
        """Called on the server's event loop, before add_request (non-streaming) or after it (streaming)."""
        import asyncio

        loop = asyncio.get_running_loop()
        with self.lock:
            request = self.requests.setdefault(request_id, ServedRequest(request_id))
            request.handler = (callback, loop)
        request.registered.set()

    def cancel_request(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def decode(self, request: ServedRequest) -> None:
        """A request's thread: its generate() in the running batch, then its final output to its handler."""
        status = compat.cb_request_status()
        request.registered.wait(timeout=30)  # a streaming request's handler comes just after add_request
        try:
            self.pair.generate(
                torch.tensor([request.input_ids], device=self.pair.device),
                attention_mask=torch.ones(1, len(request.input_ids), dtype=torch.long, device=self.pair.device),
                generation_config=self.request_config(request),
                streamer=ServerStreamer(self, request),
                swiftspec=True,
                swiftspec_engine=(self.engine, request.request_id),
            )
            self.deliver(request, status.FINISHED)
        except RequestCancelled:
            self.forget(request.request_id)
        except Exception as error:  # the request fails, with the reason; the server goes on
            self.deliver(request, status.FAILED, error=f"{type(error).__name__}: {error}")

    def request_config(self, request: ServedRequest):
        return request_config(self.generation_config, request)

    def deliver(self, request: ServedRequest, status, error: str | None = None) -> None:
        """Hand the request's tokens so far to its handler (forgetting it once finished)."""
        if hand_over(request, status, error).is_finished():
            self.forget(request.request_id)

    def forget(self, request_id: str | None) -> None:
        with self.lock:
            self.requests.pop(request_id, None)


def request_config(shared, request):
    """The server's shared generation config with a request's length and stop tokens (what transformers'
    continuous batching takes per request), using the cache (the server turns it off for its paged one)."""
    config = copy.deepcopy(shared)
    config.use_cache = True
    if request.max_new_tokens is not None:
        config.max_new_tokens = request.max_new_tokens
    if request.eos_token_id is not None:
        config.eos_token_id = request.eos_token_id
    return config


def hand_over(request, status, error: str | None = None):
    """Hand a request's tokens so far (request_id, input_ids, tokens, handler: a ServedRequest or the router's
    RoutedRequest) to its handler, on the handler's event loop; returns the output handed over."""
    output = compat.cb_generation_output()(
        request_id=request.request_id, prompt_ids=request.input_ids, generated_tokens=list(request.tokens),
        error=error, status=status,
    )
    if request.handler is not None:
        callback, loop = request.handler
        loop.call_soon_threadsafe(callback, output)
    return output
