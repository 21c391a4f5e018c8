"""`swiftspec serve PAIR`: transformers' own OpenAI-compatible server (`transformers serve`) with a pair
loaded where it would load a plain model, so every request decodes by tree speculation.

No server of our own: the endpoints (/v1/chat/completions, /v1/completions, /v1/responses,
/v1/models, /health), chat templates, streaming and request validation are transformers'. Two
things change: the server's model manager loads the pair (or a plain causal LM, which then
speculates draft-free) and hands out the pair's tokenizer as the processor; and a request that
generate() refuses (a ValueError: max_tokens below 1, a prompt longer than the model's context)
gets a 400 with the reason in OpenAI's error shape, where transformers' server answers a bare 500.
The server is pinned to the one model: a request naming another gets transformers' 400.

Requests run one at a time through `pair.generate()` (transformers' sequential mode), or with
`--continuous-batching` every request speculates inside one running batch (batching.py), and each
response's usage says what speculation did for it (`usage.speculation`: verifications, proposed and
accepted tokens); GET /v1/swiftspec/usage gives the server's totals. A pair whose models cannot
share a batch (recurrent or chain-shaped) keeps the older rule: a request speculates when alone and
joins transformers' continuous batch of the target when others decode (routing.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from ..models import compat
from ..tools.options import load_pair, progress, resolve_device, set_threads
from ..modeling import SwiftSpecForCausalLM
from .batching import SpeculatingBatcher, SpeculationUsage
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


class ServedPair(SwiftSpecForCausalLM):
    """The pair as the server runs it: generate() refuses a prompt the target cannot read (longer than its
    context) by name, as a server must, where a direct call decodes on exactly as target.generate would."""

    def check_request(self, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        """ValueError (the server's 400) for a prompt the target cannot read or a length below 1."""
        context = context_length(self.target.config)
        if context is not None and prompt_tokens >= context:
            raise ValueError(
                f"The prompt has {prompt_tokens} tokens; {self.config.name_or_path!r} reads at most {context} "
                f"(its target's max_position_embeddings), leaving no room for an answer. Shorten the prompt."
            )
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be greater than 0, but is {max_new_tokens}.")

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if prompt is not None:
            self.check_request(prompt.shape[-1])
        return super().generate(inputs, *args, **kwargs)

    speculation_usage: SpeculationUsage | None = None  # where the server reads each request's figures

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, **kwargs):
        """`swiftspec serve --continuous-batching`: every request speculates in one running batch (cli/batching.py);
        for a pair that cannot batch, a request speculates alone or joins the target's batch (cli/routing.py)."""
        from .routing import SpeculationRouter

        config = generation_config or self.generation_config
        try:
            return SpeculatingBatcher(self, config, self.speculation_usage)
        except ValueError as reason:
            progress(f"requests speculate alone and batch without speculation: {reason}")
            return SpeculationRouter(self, config, continuous_batching_config)


def split_revision(model_id_and_revision: str) -> tuple[str, str | None]:
    """The server's name of a model -> (id or path, revision). transformers names Hub repos 'id@revision'
    ('@main' by default); 5.24 keeps an existing local path as it is, 5.23 appends '@main' to it too."""
    if os.path.exists(model_id_and_revision):
        return model_id_and_revision, None
    name, at, revision = model_id_and_revision.rpartition("@")
    return (name, revision) if at else (model_id_and_revision, None)


def pair_model_manager(options: ServeOptions, device: str, usage: SpeculationUsage | None = None) -> type:
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
            model.speculation_usage = usage
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


def answer_refusals(app):
    """A ValueError raised while handling a request (generate() refusing its arguments) answers 400 with
    the message, in OpenAI's error shape; the server goes on serving."""
    from fastapi.responses import JSONResponse

    async def refused(_request, error: ValueError):
        return JSONResponse(
            {"error": {"message": str(error), "type": "invalid_request_error", "param": None, "code": None}},
            status_code=400,
        )

    app.add_exception_handler(ValueError, refused)
    return app


def report_speculation(usage: SpeculationUsage):
    """An app hook: each completion's usage gains `speculation` (what it did for that request: verifications,
    proposed and accepted tokens, tokens per verification), streamed or not, and GET /v1/swiftspec/usage
    answers the server's totals (requests, usage, rounds by batch size)."""
    from fastapi.responses import JSONResponse, Response

    def with_figures(payload: dict) -> dict:
        figures = usage.of(payload.get("id", "")) if isinstance(payload.get("usage"), dict) else None
        if figures is not None:
            payload["usage"]["speculation"] = figures.as_dict()
        return payload

    def event_with_figures(line: bytes) -> bytes:
        if not line.startswith(b"data: {") or b'"usage"' not in line:
            return line
        return b"data: " + json.dumps(with_figures(json.loads(line[6:]))).encode()

    async def streamed(chunks):
        pending = b""
        async for chunk in chunks:
            pending += chunk if isinstance(chunk, bytes) else chunk.encode()
            *lines, pending = pending.split(b"\n")
            if lines:
                yield b"\n".join(event_with_figures(line) for line in lines) + b"\n"
        if pending:
            yield event_with_figures(pending)

    def hook(app):
        @app.get("/v1/swiftspec/usage")
        def speculation_totals():
            return JSONResponse(usage.totals())

        @app.middleware("http")
        async def add_figures(request, call_next):
            response = await call_next(request)
            if request.method != "POST" or not request.url.path.endswith("completions") or usage.engine is None:
                return response
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                response.body_iterator = streamed(response.body_iterator)
                return response
            body = b"".join([chunk async for chunk in response.body_iterator])
            try:
                body = json.dumps(with_figures(json.loads(body))).encode()
            except (ValueError, AttributeError):
                pass
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
    usage = SpeculationUsage()
    finish_app = lambda app: report_speculation(usage)(answer_refusals(app))  # noqa: E731
    with compat.serving_built_with(pair_model_manager(options, device, usage), finish_app):
        return compat.serving_server()(
            force_model=options.pair,
            continuous_batching=options.continuous_batching,
            device=device,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            enable_cors=options.enable_cors,
            non_blocking=not blocking,
        )
