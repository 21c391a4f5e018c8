"""`swiftspec serve`'s batching managers: each request runs as its own `pair.generate()` call, with its own
settings (serving/request_settings.py), in one of three ways.

transformers' server talks to one batching manager (start, stop, add_request, register_result_handler,
cancel_request, background_thread_status); `ServingManager` is that interface for a pair, with what
every way shares: the request's checks (its length against the target's context, its settings), its
generate() arguments, handing its tokens to the server's handler, how it ended (finish_reason) and
forgetting it. transformers hands a manager only max_new_tokens and eos_token_id; the rest of a
request's settings come from the server's `RequestBook`, by request id. A request for n answers runs n
generate() calls (its siblings, answer i drawing with seed + i), whose tokens, logprobs and finish reasons go
to the book for the response (serving/responses.py); one past --request-timeout fails with RequestTimedOut.

- `SequentialServer` (the default): one request at a time, on one thread, each speculating alone.
- `SpeculatingBatcher` (--continuous-batching): every request decodes in the pair's continuous engine
  (engine/continuous.py): it joins the running batch between rounds, speculates there with trees the
  goodput policy sizes for the batch it has, with its own sampler, processors and stopping criteria
  in its row, and leaves when done or cancelled. The engine keeps by request id what speculation did
  for it, which the response's usage reads (`SpeculationUsage`).
- `SpeculationRouter` (serving/routing.py): for a pair whose models cannot share a batch.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from dataclasses import dataclass, field

import torch

from ..config import MAX_BUDGET
from ..models import compat
from ..engine.continuous import RequestCancelled, RowUsage
from ..engine.prefix_store import PrefixStore
from .admission import Admission
from .logprobs import token_logprobs
from .request_settings import Choice, RequestBook, RequestRefused, RequestSettings, cut_at_stop

USAGE_KEPT = 4096  # finished sequential requests whose usage stays readable by id (oldest dropped first)


@dataclass
class SpeculationUsage:
    """Where the server's responses and its /v1/swiftspec/usage endpoint read what speculation did: the
    running engine (set when the first batched request starts it) or, one request at a time, what each
    generate() call's statistics said (`record`), per request id and in total."""

    engine: object = None
    by_id: dict[str, RowUsage] = field(default_factory=dict)
    total: RowUsage = field(default_factory=RowUsage)
    served: int = 0
    rounds: int = 0  # rounds of the requests run alone, and of them those that verified the root alone
    plain_rounds: int = 0

    def record(self, request_id: str, usage: RowUsage, rounds: int = 0, plain_rounds: int = 0) -> None:
        self.by_id[request_id] = usage
        self.total.add(usage)
        self.served += 1
        self.rounds += rounds
        self.plain_rounds += plain_rounds
        while len(self.by_id) > USAGE_KEPT:
            self.by_id.pop(next(iter(self.by_id)))

    def of(self, request_id: str) -> RowUsage | None:
        if request_id in self.by_id:
            return self.by_id[request_id]
        return None if self.engine is None else self.engine.usage_of(request_id)

    def round_counts(self) -> tuple[int, int]:
        """(rounds, plain rounds) so far: the running batch's, or the lone requests'."""
        if self.engine is None:
            return self.rounds, self.plain_rounds
        return sum(self.engine.rounds_by_batch.values()), self.engine.plain_rounds

    def totals(self) -> dict:
        engine = self.engine
        if engine is None:
            return {"requests": self.served, "usage": self.total.as_dict(), "rounds_by_batch_size": {}}
        return {
            "requests": engine.served, "usage": engine.usage.as_dict(),
            "rounds_by_batch_size": {str(k): v for k, v in sorted(engine.rounds_by_batch.items())},
            "latency_guard": {"on": engine.latency_guard, "rounds_lowered": engine.guarded_rounds,
                              "rows_guarded": engine.guarded_rows},
        }


@dataclass
class Served:
    """What the app and the batching manager share: the requests' settings, what speculation did, the requests
    held (admission.py) and the batching manager (set when transformers' server builds it)."""

    book: RequestBook = field(default_factory=RequestBook)
    usage: SpeculationUsage = field(default_factory=SpeculationUsage)
    admission: Admission = field(default_factory=Admission)
    manager: object = None
    tokenizer: object = None  # the pair's (the responses decode further answers and logprobs' tokens with it)


@dataclass
class ThreadStatus:
    """What the server reads of a batching manager's health (transformers' BackgroundThreadStatus)."""

    fatal_error: BaseException | None = None


@dataclass
class ServedRequest:
    """One request: its prompt, its limits and settings, and who hears of its tokens.

    max_new_tokens: its limit on new tokens (its max_tokens, or what the context leaves it)
    handler: (callback, event loop) the server registered; outputs are delivered on that loop
    generate_kwargs: its generate() arguments from its settings (generation config, processors, stops, seed)
    logprobs: its tokens' TokenLogprob entries, once done (when its settings ask for logprobs)
    siblings: its other answers' requests (n > 1: answer i draws with seed + i), decoded beside it
    """

    request_id: str
    input_ids: list[int] = field(default_factory=list)
    max_new_tokens: int | None = None
    settings: RequestSettings = field(default_factory=RequestSettings)
    generate_kwargs: dict = field(default_factory=dict)
    streaming: bool = False
    handler: tuple | None = None
    tokens: list[int] = field(default_factory=list)
    registered: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    added: bool = False
    logprobs: list | None = None
    siblings: list["ServedRequest"] = field(default_factory=list)
    timed_out: bool = False  # cancelled for passing --request-timeout: it fails with RequestTimedOut


class RequestTimedOut(Exception):
    """A request cancelled for passing --request-timeout (the server answers 504)."""


class ServerStreamer:
    """One request's streamer: each round's tokens to the request's handler (streaming requests), and the
    tokens kept for the final output. A cancelled request's next put raises RequestCancelled, which ends
    its generate() (in the running batch: its row alone, engine/continuous.py's record)."""

    def __init__(self, manager, request: ServedRequest):
        self.manager, self.request, self.first = manager, request, True  # manager: whose deliver() hands tokens over

    def put(self, value: torch.Tensor) -> None:
        if self.request.cancelled.is_set():
            raise RequestCancelled(self.request.request_id)
        if self.first:  # generate() puts the prompt first
            self.first = False
            return
        self.request.tokens += value.reshape(-1).tolist()
        if self.request.streaming:
            self.manager.deliver(self.request, compat.cb_request_status().DECODING)

    def end(self) -> None:
        pass


class ServingManager:
    """What every batching manager of `swiftspec serve` shares (see the module docstring). Subclasses run
    the requests (`submit`) and may act on a cancellation at once (`cancelled`)."""

    request_class = ServedRequest

    def __init__(self, pair, served: Served | None = None):
        self.pair = pair
        self.served = served or Served()
        self.served.manager = self  # the app cancels a request past its timeout through it
        self.generation_config = pair.generation_config  # the pair's, never a request's: settings are per request
        self.requests: dict[str, ServedRequest] = {}
        self.lock = threading.Lock()
        self.status = ThreadStatus()
        self.counter = 0

    # ------------------------------------------------ what the server calls
    @property
    def background_thread_status(self) -> ThreadStatus:
        return self.status

    @property
    def batch_processor(self):
        return None

    def add_request(
        self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
        streaming: bool = False, eos_token_id=None, **kwargs,
    ) -> str:
        """Check the request and start it; a ValueError (a RequestRefused) is the server's 400. Its settings
        are the RequestBook's (max_new_tokens and eos_token_id come from the server's shared config)."""
        with self.lock:
            request_id = request_id or f"swiftspec_{self.counter}"
            self.counter += 1
            request = self.requests.get(request_id) or self.request_class(request_id)
            self.requests[request_id] = request
        try:
            if kwargs:
                raise ValueError(f"swiftspec serve does not take {sorted(kwargs)} per request.")
            request.settings = self.served.book.settings(request_id)
            request.input_ids, request.streaming = list(input_ids), streaming
            request.max_new_tokens = self.pair.request_length(len(input_ids), request.settings.max_tokens)
            request.generate_kwargs = self.generate_kwargs(request.settings, request)
            request.siblings = [self.sibling(request, i) for i in range(1, request.settings.n)]
            self.check_room(request)
        except ValueError:
            self.forget(request_id)
            raise
        request.added = True
        self.submit(request)
        return request_id

    def check_room(self, request: ServedRequest) -> None:
        """RequestRefused (a 400) for a request this manager could never run (the running batch's bound)."""

    def generate_kwargs(self, settings: RequestSettings, request: ServedRequest) -> dict:
        return settings.generation_kwargs(
            self.generation_config, len(request.input_ids), request.max_new_tokens, self.pair.tokenizer, self.pair.device
        )

    def sibling(self, request: ServedRequest, i: int) -> ServedRequest:
        """Answer i of a request for n answers: its prompt and settings, drawing with seed + i (reproducible)."""
        settings = request.settings
        settings = dataclasses.replace(settings, n=1, seed=None if settings.seed is None else settings.seed + i)
        sibling = ServedRequest(f"{request.request_id}/{i}", list(request.input_ids), request.max_new_tokens, settings,
                                added=True)
        sibling.generate_kwargs = self.generate_kwargs(settings, sibling)
        sibling.registered.set()  # its tokens go to the first answer's response, not to a handler of its own
        return sibling

    def register_result_handler(self, request_id: str, callback) -> None:
        """Called on the server's event loop, before add_request (non-streaming) or after it (streaming)."""
        import asyncio

        loop = asyncio.get_running_loop()
        with self.lock:
            request = self.requests.get(request_id)
            if request is None:  # not added yet
                request = self.request_class(request_id)
                self.requests[request_id] = request
            request.handler = (callback, loop)
            request.registered.set()

    def cancel_request(self, request_id: str) -> None:
        with self.lock:
            request = self.requests.get(request_id)
        if request is not None:
            for one in (request, *request.siblings):
                one.cancelled.set()
                self.cancelled(one)

    def time_out(self, request_id: str) -> None:
        """Cancel a request past --request-timeout: it fails with RequestTimedOut (the app answers 504)."""
        with self.lock:
            request = self.requests.get(request_id)
        if request is not None:
            request.timed_out = True
            self.cancel_request(request_id)

    def start(self) -> None:
        pass

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        pass

    # ------------------------------------------------ what subclasses provide
    def submit(self, request: ServedRequest) -> None:
        raise NotImplementedError

    def cancelled(self, request: ServedRequest) -> None:
        """A cancelled request's generate() ends at its streamer's next put; a manager may end it sooner."""

    # ------------------------------------------------ running one request
    def run_request(self, request: ServedRequest, streamer_class=ServerStreamer, **extra) -> None:
        """The request's generate() call with its own settings, its tokens to its handler (its other answers,
        n > 1, beside it: `run_answers`); a cancelled request is forgotten, one past its timeout fails with
        RequestTimedOut, a failing one fails alone (the server goes on)."""
        request.registered.wait(timeout=30)  # a streaming request's handler comes just after add_request
        try:
            self.run_answers(request, streamer_class, **extra)
            self.finished(request)
        except RequestCancelled:
            if not request.timed_out:
                self.forget(request.request_id)
                return
            timeout = self.served.admission.limits.request_timeout
            self.fail(request, RequestTimedOut(f"the request took longer than --request-timeout {timeout:g} s"))

    def run_answers(self, request: ServedRequest, streamer_class=ServerStreamer, **extra) -> None:
        """The request's answers: its other ones (n > 1) one after the other here (the running batch decodes them
        beside it), then its own."""
        for sibling in request.siblings:
            self.decode(sibling, ServerStreamer, **extra)
            self.record_usage(sibling)
        self.decode(request, streamer_class, **extra)

    def decode(self, request: ServedRequest, streamer_class=ServerStreamer, **extra) -> None:
        """One answer's generate() call; its logprobs kept when asked for (from the target's logits)."""
        output = self.pair.generate(
            torch.tensor([request.input_ids], device=self.pair.device),
            attention_mask=torch.ones(1, len(request.input_ids), dtype=torch.long, device=self.pair.device),
            streamer=streamer_class(self, request),
            **request.generate_kwargs,
            **extra,
        )
        if request.settings.logprobs is not None:
            request.logprobs = token_logprobs(output.logits, request.tokens, request.settings.logprobs)

    def finished(self, request: ServedRequest, status=None) -> None:
        """Say how the request ended (the response's finish_reason), its logprobs and other answers, and what
        speculation did for it, and hand over its last tokens."""
        self.record_usage(request)
        choices = [Choice(s.tokens, self.finish_reason(s, s.tokens), s.logprobs, self.served.usage.of(s.request_id))
                   for s in request.siblings]
        self.served.book.finished(request.request_id, self.finish_reason(request, request.tokens), request.logprobs,
                                  choices)
        self.deliver(request, status or compat.cb_request_status().FINISHED)

    def record_usage(self, request: ServedRequest) -> None:
        """What speculation did for a request that ran alone: its generate() call's statistics (one call at a
        time on this route, so the pair's latest are its own)."""
        stats = self.pair.swiftspec_stats
        self.served.usage.record(request.request_id, RowUsage(
            verifications=stats.verify_steps, proposed=sum(r.budget - 1 for r in stats.rounds),
            accepted=sum(r.accepted for r in stats.rounds),
        ), rounds=len(stats.rounds), plain_rounds=sum(r.budget == 1 for r in stats.rounds))

    def finish_reason(self, request: ServedRequest, tokens: list[int]) -> str:
        """OpenAI's finish_reason: "stop" at an EOS token or a stop string, else "length" at the limit."""
        if len(tokens) < (request.max_new_tokens or 0) or (tokens and tokens[-1] in self.eos_ids()):
            return "stop"
        if request.settings.stop and cut_at_stop(self.pair.tokenizer.decode(tokens), request.settings.stop)[1]:
            return "stop"
        return "length"

    def eos_ids(self) -> set:
        eos = self.generation_config.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple, set)) else {eos}

    def fail(self, request: ServedRequest, error: BaseException) -> None:
        self.deliver(request, compat.cb_request_status().FAILED, error=f"{type(error).__name__}: {error}")

    def deliver(self, request: ServedRequest, status, error: str | None = None) -> None:
        """Hand the request's tokens so far to its handler, forgetting it first once finished: the handler
        answers the client, whose next request must not find this one still in flight (the router sends a
        request that finds company to the batch, where it would not speculate)."""
        output = generation_output(request, status, error)
        if output.is_finished():
            self.forget(request.request_id)
        hand_over(request, output)

    def forget(self, request_id: str | None) -> None:
        with self.lock:
            self.requests.pop(request_id, None)


class SequentialServer(ServingManager):
    """One request at a time on one thread, each speculating alone (`swiftspec serve` without
    --continuous-batching); each response's usage reads its call's statistics."""

    def __init__(self, pair, served: Served | None = None):
        super().__init__(pair, served)
        self.queue: queue.Queue[ServedRequest | None] = queue.Queue()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="swiftspec-sequential", daemon=True)
        self.thread.start()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self.queue.put(None)
        if block and self.thread is not None:
            self.thread.join(timeout)

    def submit(self, request: ServedRequest) -> None:
        self.queue.put(request)

    def run(self) -> None:
        while (request := self.queue.get()) is not None:
            self.served.admission.started(request.request_id)
            if request.cancelled.is_set() and not request.timed_out:
                self.forget(request.request_id)
                continue
            try:
                self.run_request(request)
            except Exception as error:  # the request fails, with the reason; the server goes on
                self.fail(request, error)



class SpeculatingBatcher(ServingManager):
    """Every request speculates in one running batch (--continuous-batching; see the module docstring)."""

    def __init__(self, pair, served: Served | None = None, latency_guard: bool = True):
        super().__init__(pair, served)
        self.engine = pair.continuous_engine(latency_guard)  # ValueError for a pair that cannot batch (the server routes it)
        self.served.usage.engine = self.engine
        self.engine.on_start = self.served.admission.started
        self.engine.max_positions = self.served.admission.limits.cache_positions
        prefixes = self.served.admission.limits.prefix_positions
        if prefixes is not None and getattr(self.engine, "prefixes", None) is not None:
            self.engine.prefixes = PrefixStore(prefixes)

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self.engine.close()

    def submit(self, request: ServedRequest) -> None:
        threading.Thread(target=self.run, args=(request,), name=f"swiftspec-{request.request_id}", daemon=True).start()

    def cancelled(self, request: ServedRequest) -> None:
        self.engine.cancel(request.request_id)  # its row leaves after the round in flight

    def record_usage(self, request: ServedRequest) -> None:
        pass  # the engine keeps each row's (SpeculationUsage reads it there)

    def check_room(self, request: ServedRequest) -> None:
        limit = self.engine.max_positions
        need = len(request.input_ids) + request.max_new_tokens + MAX_BUDGET
        if limit is not None and need > limit:
            raise RequestRefused(
                f"This request needs {need} cache positions (its {len(request.input_ids)}-token prompt, max_tokens="
                f"{request.max_new_tokens} and a {MAX_BUDGET}-node tree); the running batch holds at most {limit} "
                f"(--cache-positions). Ask for max_tokens <= {limit - len(request.input_ids) - MAX_BUDGET}.", "max_tokens",
            )

    def run_answers(self, request: ServedRequest, streamer_class=ServerStreamer, **extra) -> None:
        """The request's answers, each a row of the running batch: its other ones (n > 1) beside its own, taken in
        together so that they share the prompt's prefill (ContinuousEngine.together)."""
        if not request.siblings:
            self.decode(request, streamer_class, **extra)
            return
        errors: list[BaseException] = []

        def answer(one: ServedRequest, streamer) -> None:
            try:
                self.decode(one, streamer, swiftspec=True, swiftspec_engine=(self.engine, one.request_id))
            except BaseException as error:  # noqa: BLE001 (raised below, on the request's own thread)
                errors.append(error)

        answers = [(request, streamer_class)] + [(s, ServerStreamer) for s in request.siblings]
        threads = [threading.Thread(target=answer, args=pair, daemon=True) for pair in answers]
        with self.engine.together([one.request_id for one, _ in answers], lambda: any(t.is_alive() for t in threads)):
            for thread in threads:
                thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, RequestCancelled)), errors[0])

    def run(self, request: ServedRequest) -> None:
        try:
            self.run_request(request, swiftspec=True, swiftspec_engine=(self.engine, request.request_id))
        except Exception as error:  # the request fails, with the reason; the server goes on
            self.fail(request, error)


def generation_output(request, status, error: str | None = None):
    """transformers' GenerationOutput of a request's tokens so far (request_id, input_ids, tokens: a
    ServedRequest or the router's RoutedRequest)."""
    return compat.cb_generation_output()(
        request_id=request.request_id, prompt_ids=request.input_ids, generated_tokens=list(request.tokens),
        error=error, status=status,
    )


def hand_over(request, output) -> None:
    """Hand `output` to the request's handler, on the handler's event loop."""
    if request.handler is not None:
        callback, loop = request.handler
        loop.call_soon_threadsafe(callback, output)
