"""`swiftspec serve PAIR`: transformers' own OpenAI-compatible server (`transformers serve`) with a pair
loaded where it would load a plain model, so every request decodes by tree speculation.

No server of our own: the endpoints (/v1/chat/completions, /v1/completions, /v1/responses,
/v1/models, /health), chat templates and streaming are transformers'. What changes: the server's model
manager loads the pair (or a plain causal LM, which then speculates draft-free) and hands out the
pair's tokenizer as the processor; an app middleware reads each generating request's body before
transformers' handler (its own settings, serving/request_settings.py, kept by request id; a setting the
server cannot honour is a 400 naming it) and edits its response (stop strings cut from the text,
finish_reason, usage.speculation); every error is in OpenAI's error shape.

Every mode runs through one of the pair's batching managers (batching.py), which is where a request's
id, and so its settings, reach its generate() call: one request at a time (the default), or with
`--continuous-batching` every request speculating inside one running batch; a pair whose models cannot
share a batch (recurrent or chain-shaped) keeps the older rule: a request speculates when alone and
joins transformers' continuous batch of the target when others decode (routing.py). Each response's
usage says what speculation did for it (`usage.speculation`: verifications, proposed and accepted
tokens); GET /v1/swiftspec/usage gives the server's totals, GET /metrics the server's Prometheus metrics
(metrics.py). The same middleware admits each request or answers 429 past --max-queue and arms its
--request-timeout (admission.py); responses.py edits what transformers' handler answered (the model's name,
logprobs, n answers).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from ..models import compat
from ..tools.options import load_pair, progress, resolve_device, set_threads
from ..modeling import SwiftSpecForCausalLM
from .access import Access
from .admission import Admission, Busy, Limits
from .batching import SequentialServer, Served, SpeculatingBatcher
from .request_settings import DEFAULT_MAX_TOKENS, RequestRefused, RequestSettings
from .responses import ResponseEditor, carries_text, error_body
from ..pair import PairConfigError
from ..pair.checks import context_length


@dataclass
class ServeOptions:
    """What `swiftspec serve` was asked for.

    pair:     pair repo id, folder or bundled name, or a plain causal LM (draft-free)
    settings: SwiftSpecConfig overrides (tree_budget, ...)
    """

    pair: str
    host: str = "localhost"
    port: int = 8000
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    log_level: str = "warning"
    enable_cors: bool = False
    continuous_batching: bool = False
    settings: dict = field(default_factory=dict)
    # the share of free memory transformers' own continuous batch (the router's, for a pair that cannot batch)
    # gives its paged cache; None: transformers' default (60% of RAM on a CPU)
    cb_max_memory_percent: float | None = None
    latency_guard: bool = True  # the running batch caps its trees for its slowest row (policy/guard.py)
    # admission control (serving/admission.py; None: no limit): requests waiting to decode, seconds a request may
    # take, cache positions the running batch holds
    max_queue: int | None = None
    request_timeout: float | None = None
    cache_positions: int | None = None
    prefix_cache_positions: int | None = None  # slots of shared prompt prefixes kept (0: none; None: the default)
    # who is answered (serving/access.py): the API key (None: SWIFTSPEC_API_KEY's, else none), and whether /metrics
    # and /health need it too; the key is never in a repr
    api_key: str | None = field(default=None, repr=False)
    key_metrics: bool = False

    def __post_init__(self):
        share = self.cb_max_memory_percent
        if share is not None and not 0 < share <= 1:
            raise ValueError(
                f"--cb-max-memory-percent {share}: it is the share of free memory the paged cache may take, above 0 "
                "and at most 1 (0.6 for 60%)."
            )
        self.limits  # noqa: B018 (a limit out of range is refused here, naming its flag)
        self.access  # noqa: B018 (an empty key, or --key-metrics without one)

    @property
    def limits(self) -> Limits:
        return Limits(self.max_queue, self.request_timeout, self.cache_positions, self.prefix_cache_positions)

    @property
    def access(self) -> Access:
        return Access.from_flags(self.api_key, self.key_metrics)


class ServedPair(SwiftSpecForCausalLM):
    """The pair as the server runs it: a request must fit the target's context (a direct generate() call
    decodes on exactly as target.generate would), and its batching manager is the mode's (batching.py)."""

    served: Served | None = None  # what the app and the batching manager share (set by the model manager)
    sequential: bool = True  # `swiftspec serve` without --continuous-batching
    latency_guard: bool = True  # ServeOptions.latency_guard (set by the model manager)

    def context(self) -> int | None:
        return context_length(self.target.config)

    def check_request(self, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        """ValueError (the server's 400) for an empty prompt, one the target cannot read, or a length below 1."""
        if prompt_tokens < 1:  # generate() would refuse it, and a refusal from the decoding loop is a 500
            raise RequestRefused(
                "The prompt is empty: it encodes to no tokens, and a completion continues a text. Send a prompt of "
                "at least one character.", "prompt",
            )
        context = self.context()
        if context is not None and prompt_tokens >= context:
            raise RequestRefused(
                f"The prompt has {prompt_tokens} tokens; {self.config.name_or_path!r} reads at most {context} "
                f"(its target's max_position_embeddings), leaving no room for an answer. Shorten the prompt.",
                "prompt",
            )
        if max_new_tokens is not None and max_new_tokens < 1:
            raise RequestRefused(f"`max_new_tokens` must be greater than 0, but is {max_new_tokens}.", "max_tokens")

    def request_length(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The new tokens a request gets: its max_tokens, refused (RequestRefused, a 400) past the target's
        context; without one, the pair's max_new_tokens (at least DEFAULT_MAX_TOKENS, as transformers' server)
        up to what the context leaves (finish_reason "length" if it gets there)."""
        self.check_request(prompt_tokens, max_tokens)
        context = self.context()
        room = None if context is None else context - prompt_tokens
        if max_tokens is not None:
            if room is not None and max_tokens > room:
                raise RequestRefused(
                    f"max_tokens={max_tokens} with a {prompt_tokens}-token prompt reaches {prompt_tokens + max_tokens} "
                    f"positions; {self.config.name_or_path!r} reads at most {context} (its target's "
                    f"max_position_embeddings). Ask for max_tokens <= {room}, or shorten the prompt.",
                    "max_tokens",
                )
            return max_tokens
        default = max(self.generation_config.max_new_tokens or 0, DEFAULT_MAX_TOKENS)
        return default if room is None else min(default, room)

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if prompt is not None:
            self.check_request(prompt.shape[-1])
        return super().generate(inputs, *args, **kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, **kwargs):
        """The server's batching manager (every mode runs through one: transformers hands a manager the request
        id, by which it finds the request's own settings). The generation config transformers passes is its
        first request's; it is not used: each request's settings are its own.
        Sequential: one at a time. --continuous-batching: every request speculates in one running batch
        (batching.py); for a pair that cannot batch, a request speculates alone or joins the target's batch
        (routing.py), or, where transformers cannot batch the target either, runs one at a time."""
        from .routing import SpeculationRouter

        if self.sequential:
            return SequentialServer(self, self.served)
        try:
            return SpeculatingBatcher(self, self.served, self.latency_guard)
        except ValueError as reason:
            if self.config.round == "device":  # asked for: refused by name, never routed to the host round instead
                raise ValueError(f"--round device with --continuous-batching: {reason}") from reason
            why_not_batched = reason
        try:
            router = SpeculationRouter(self, self.served, continuous_batching_config)
        except ValueError as reason:  # transformers' continuous batching refuses the target too (a recurrent one)
            progress(f"requests run one at a time, each speculating: {why_not_batched}; and transformers' continuous "
                     f"batching of the target refuses it ({reason})")
            return SequentialServer(self, self.served)
        progress(f"requests speculate alone and batch without speculation: {why_not_batched}")
        return router


def split_revision(model_id_and_revision: str) -> tuple[str, str | None]:
    """The server's name of a model -> (id or path, revision). transformers names Hub repos 'id@revision'
    ('@main' by default); 5.24 keeps an existing local path as it is, 5.23 appends '@main' to it too."""
    if os.path.exists(model_id_and_revision):
        return model_id_and_revision, None
    name, at, revision = model_id_and_revision.rpartition("@")
    return (name, revision) if at else (model_id_and_revision, None)


def pair_model_manager(options: ServeOptions, device: str, served: Served | None = None) -> type:
    """transformers' ModelManager, loading the served pair with hf_swiftspec's loader instead of
    `getattr(transformers, config.architectures[0])` (which knows no pair)."""

    class PairModelManager(compat.serving_model_manager()):
        """Loads the pair once; its tokenizer is the processor (the server asks for the processor first)."""

        def __init__(self, *args, **kwargs):
            self.loading: dict[str, ServedPair] = {}
            super().__init__(*args, **kwargs)

        def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
            if gguf_file is not None:
                raise PairConfigError(f"{gguf_file!r}: swiftspec serve loads pairs and safetensors models, not GGUF files.")
            name, revision = split_revision(model_id_and_revision)
            settings = dict(options.settings)
            if revision not in (None, "main"):
                settings["revision"] = revision
            model = load_pair(name, name, device, options.dtype, model_class=ServedPair, **settings)
            model.served, model.sequential = served or Served(), not options.continuous_batching
            model.served.tokenizer = model.tokenizer
            model.latency_guard = options.latency_guard
            self.loading[model_id_and_revision] = model
            return model.tokenizer

        def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None, gguf_file=None):
            return self.loading.pop(model_id_and_revision)

        def list_models(self, cache_dir: str | None = None) -> list[dict]:
            """/v1/models: the served model alone, under the name requests give it (5.24's answer for a pinned
            server; 5.23 scanned the Hub cache instead, and failed with a 500 where there is none)."""
            owner = options.pair.split("/")[0] if "/" in options.pair and not os.path.exists(options.pair) else ""
            return [{"id": options.pair, "object": "model", "created": 0, "owned_by": owner}]

        get_gen_models = list_models  # 5.23's name for it

    return PairModelManager


def answer_errors(app):
    """Every error in OpenAI's error shape, the server going on serving: a ValueError raised while handling a
    request (its check or generate() refusing its arguments) is a 400 with its reason (transformers' server
    answers a bare 500); transformers' own refusals ({"detail": ...}: another model's name, unknown fields)
    keep their status; anything else is a 500 with its reason."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def refused(_request, error: ValueError):
        return JSONResponse(error_body(str(error), 400, getattr(error, "param", None)), status_code=400)

    async def http_error(_request, error: HTTPException):
        pinned = isinstance(error.detail, str) and error.detail.startswith("Server is pinned")
        body = error_body(str(error.detail), error.status_code, "model" if pinned else None,
                          "model_not_found" if pinned else None)
        return JSONResponse(body, status_code=error.status_code)

    async def failed(_request, error: Exception):
        return JSONResponse(error_body(f"{type(error).__name__}: {error}", 500), status_code=500)

    app.add_exception_handler(ValueError, refused)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RuntimeError, failed)
    return app


GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
EXTENSIONS = {"top_k", "min_p"}  # settings honoured per request that OpenAI's schema (so transformers' handler) lacks


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses"}


def keyed_access(access: Access):
    """An app hook: with an API key, a request to a keyed path without it is a 401 in OpenAI's shape (access.py),
    before anything else reads it."""
    from fastapi.responses import JSONResponse

    def hook(app):
        if access.key is None:
            return app

        @app.middleware("http")  # added last, so it runs first
        async def key_needed(request, call_next):
            if not access.keyed(request.method, request.url.path):
                return await call_next(request)
            authorization = request.headers.get("authorization")
            if access.admits(authorization):
                return await call_next(request)
            message, code = access.refusal(authorization)
            return JSONResponse(error_body(message, 401, None, code), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})

        return app

    return hook


def serve_requests(served: Served):
    """An app hook: each generating request is admitted or refused (admission.py: a 429 past --max-queue), its
    body read before transformers' handler (its settings kept by request id for the batching manager; a refused
    one is a 400 naming the field), its timeout armed, and its response edited (responses.ResponseEditor),
    streamed or not. GET /v1/swiftspec/usage answers the server's totals (requests, usage, rounds by batch size);
    GET /metrics its Prometheus metrics (metrics.py)."""
    import asyncio
    import time
    import uuid

    from fastapi.responses import JSONResponse, Response

    from .metrics import ServerMetrics

    metrics = ServerMetrics(served)

    def edited_event(line: bytes, editor: ResponseEditor, seen: dict) -> bytes:
        if not line.startswith(b"data: {"):
            return line
        payload = json.loads(line[6:])
        if "error" in payload:  # transformers' {"error": "reason"}: in OpenAI's shape, a timeout's named as such
            seen["error"] = True
            entry = editor.entry
            late = entry is not None and entry.timed_out
            if isinstance(payload["error"], str):
                return b"data: " + json.dumps(error_body(payload["error"], 504 if late else 500, None,
                                                         "request_timeout" if late else None)).encode()
        elif payload.get("usage") is not None:
            seen["usage"] = payload["usage"]
        edited = editor.event(payload)
        if carries_text(edited):  # what the client is sent (stops held back)
            text_sent(seen)
        return b"data: " + json.dumps(edited).encode()

    def text_sent(seen: dict) -> None:
        """An event with some of the answer's text goes out: the first is the time to first token (a chat stream's
        first chunk carries only the role, and comes before any token is decoded); each later one, the time since
        the one before it (inter-token latency: a round's tokens go out in one event)."""
        now = time.perf_counter()
        if "first_at" not in seen:
            seen["first_at"] = now
            metrics.first_token.observe(now - seen["arrived"])
        else:
            metrics.inter_token.observe(now - seen["last_at"])
        seen["last_at"] = now

    async def streamed(chunks, editor: ResponseEditor, arrived: float, release):
        pending, seen = b"", {"arrived": arrived}
        try:
            async for chunk in chunks:
                pending += chunk if isinstance(chunk, bytes) else chunk.encode()
                *lines, pending = pending.split(b"\n")
                if lines:
                    yield b"\n".join(edited_event(line, editor, seen) for line in lines) + b"\n"
            if pending:
                yield edited_event(pending, editor, seen)
        finally:
            entry = editor.entry
            if entry is not None and entry.timed_out:
                release("timed_out")
            elif "usage" in seen and "error" not in seen:
                release("finished", seen["usage"], seen)
            else:
                release("failed" if "error" in seen else "cancelled")

    def busy(refusal: Busy) -> JSONResponse:
        metrics.ended("busy")
        return JSONResponse(error_body(str(refusal), 429, None, "server_busy"), status_code=429,
                            headers={"Retry-After": str(refusal.retry_after)})

    def timed_out() -> JSONResponse:
        timeout = served.admission.limits.request_timeout
        message = f"The request took longer than --request-timeout {timeout:g} s and was cancelled."
        return JSONResponse(error_body(message, 504, None, "request_timeout"), status_code=504)

    def arm_timeout(request_id: str):
        """Cancel the request once it passes --request-timeout (None: no timeout)."""
        timeout = served.admission.limits.request_timeout
        if timeout is None:
            return None

        def expire() -> None:
            entry = served.book.entry(request_id)
            if entry is None:
                return
            entry.timed_out = True
            if served.manager is not None:
                served.manager.time_out(request_id)

        return asyncio.get_running_loop().call_later(timeout, expire)

    def hook(app):
        @app.get("/v1/swiftspec/usage")
        def speculation_totals():
            return JSONResponse(served.usage.totals())

        @app.get("/metrics")
        def scrape():
            body, content_type = metrics.exposition()
            return Response(body, media_type=content_type)

        @app.middleware("http")
        async def per_request(request, call_next):
            if request.method != "POST" or request.url.path not in GENERATING:
                return await call_next(request)
            arrived = time.perf_counter()
            try:
                body = await request.json()
                endpoint = ENDPOINTS[request.url.path]
                settings = RequestSettings.from_body(body, endpoint) if isinstance(body, dict) else RequestSettings()
            except RequestRefused as refusal:
                metrics.ended("refused")
                return JSONResponse(error_body(str(refusal), 400, refusal.param), status_code=400)
            except ValueError:  # not JSON: transformers' handler answers it
                return await call_next(request)
            if isinstance(body, dict) and EXTENSIONS & set(body):  # transformers' handler refuses fields OpenAI lacks
                passed_on = json.dumps({k: v for k, v in body.items() if k not in EXTENSIONS}).encode()
                request._body = passed_on  # what call_next's app reads (Starlette replays the body it read)
                request.scope["headers"] = [(k, str(len(passed_on)).encode() if k == b"content-length" else v)
                                            for k, v in request.scope["headers"]]
            request_id = request.headers.get("x-request-id")
            if request_id is None:  # transformers' middleware takes the request's id from this header
                request_id = str(uuid.uuid4())
                request.scope["headers"] = [*request.scope["headers"], (b"x-request-id", request_id.encode())]
            try:
                served.book.open(request_id, settings)
            except RequestRefused as refusal:
                metrics.ended("refused")
                return JSONResponse(error_body(str(refusal), 400, "X-Request-ID"), status_code=400)
            try:
                served.admission.admit(request_id)
            except Busy as refusal:
                served.book.close(request_id)
                return busy(refusal)
            timer = arm_timeout(request_id)

            def release(outcome: str, usage: dict | None = None, seen: dict | None = None) -> None:
                """The request ends: counted (a stream's text times with it: `seen`), its place and its settings let
                go."""
                latency = time.perf_counter() - arrived
                if outcome == "finished":
                    metrics.finished(usage, latency, seen)
                else:
                    metrics.ended(outcome)
                if timer is not None:
                    timer.cancel()
                served.admission.ended(request_id, latency if outcome == "finished" else None)
                served.book.close(request_id)

            model = body.get("model") if isinstance(body, dict) else None
            editor = ResponseEditor(served, request_id, settings, model, chat=endpoint == "chat")
            try:
                response = await call_next(request)
            except BaseException:
                release("failed")
                raise
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                response.body_iterator = streamed(response.body_iterator, editor, arrived, release)
                return response
            outcome, usage = "failed", None
            try:
                body = b"".join([chunk async for chunk in response.body_iterator])
                entry = editor.entry
                if entry is not None and entry.timed_out:
                    outcome = "timed_out"
                    return timed_out()
                if response.status_code == 200:
                    try:
                        payload = editor.whole(json.loads(body))
                        body, outcome, usage = json.dumps(payload).encode(), "finished", payload.get("usage")
                    except (ValueError, AttributeError):
                        pass
                elif response.status_code < 500:
                    outcome = "refused"
            finally:
                release(outcome, usage)
            headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
            return Response(body, status_code=response.status_code, headers=headers, media_type=response.media_type)

        return app

    return hook

def serve(options: ServeOptions, blocking: bool = True):
    """Start transformers' server with the pair loaded (blocking: until interrupted). Returns
    transformers' `Serve` object; with blocking=False it serves from a thread and `kill_server()` stops it."""
    if not compat.serving_available():
        raise PairConfigError(
            "swiftspec serve needs transformers' server dependencies: pip install 'hf_swiftspec[serve]' "
            "(fastapi, uvicorn, openai)."
        )
    device = resolve_device(options.device)
    progress(set_threads(options.threads, device))
    progress(f"loading {options.pair!r} on {device}; serving it at http://{options.host}:{options.port}/v1")
    access = options.access
    if (line := access.line(options.host)) is not None:
        progress(line)
    served = Served(admission=Admission(options.limits))
    finish_app = lambda app: keyed_access(access)(serve_requests(served)(answer_errors(app)))  # noqa: E731
    with compat.serving_built_with(pair_model_manager(options, device, served), finish_app):
        return compat.serving_server()(
            force_model=options.pair,
            continuous_batching=True,  # every mode runs through the pair's batching manager (ServedPair)
            device=device,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            enable_cors=options.enable_cors,
            non_blocking=not blocking,
            **({} if options.cb_max_memory_percent is None else {"cb_max_memory_percent": options.cb_max_memory_percent}),
        )
