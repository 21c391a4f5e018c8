"""What one request to `swiftspec serve` asks of its own generation, read from its OpenAI body.

transformers' server builds one generation config per request but hands its batching manager only
max_new_tokens and eos_token_id (the first request's config becomes the shared one), maps
frequency_penalty to a multiplicative repetition penalty, ignores presence_penalty and n with a
warning, and turns sampling on only through the model's own do_sample. So the server reads the
body itself (`RequestSettings.from_body`, in an app middleware, before transformers' handler), keeps
the settings by request id (`RequestBook`), and each request's generate() call is built from them
(`generation_kwargs`): its sampler, processors, seed, stop strings and length, in its own row.

OpenAI's semantics: temperature 0 is greedy and any temperature above 0 samples, whatever the pair's
do_sample; frequency/presence penalties subtract count x penalty / a flat penalty from the logits of
tokens already generated; a stop string ends the answer, and is not part of the returned text. An
omitted setting takes the pair's generation config. A field the server cannot honour is refused
(`RequestRefused`: a 400 naming it), never ignored.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_TOP_LOGPROBS = {"completions": 5, "chat": 20}  # OpenAI's limits on the alternatives a token's logprobs list
MAX_CHOICES = 16  # the most answers (n) one request may ask for: each is a row of the running batch
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for frequency_penalty and presence_penalty
DEFAULT_MAX_TOKENS = 1024  # transformers' server's default for a request without max_tokens (capped by the context)

# Fields OpenAI defines that would change the answer and that the server does not carry out: refused unless
# sent at their no-op value (clients often send those explicitly).
UNHONOURED = {
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: not v,
    "logit_bias": lambda v: not v,
    "generation_config": lambda v: v is None,  # transformers' extension: a whole config, not per-request settings
}


class RequestRefused(ValueError):
    """A request the server refuses: `param` names the body field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestSettings:
    """One request's own generation settings (None: omitted, the pair's generation config decides).

    max_tokens: the request's limit on new tokens (max_tokens, max_completion_tokens or max_output_tokens)
    stop:       strings that end the answer, checked on the decoded text (not returned)
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    logprobs: int | None = None  # None: not asked; k >= 0: each chosen token's log-probability and its k likeliest
    n: int = 1  # answers to the one prompt (choice i draws with seed + i)

    @classmethod
    def from_body(cls, body: dict, endpoint: str = "completions") -> "RequestSettings":
        """The settings of an OpenAI request body sent to `endpoint` ("completions", "chat" or "responses");
        RequestRefused for a value out of range or a field the server cannot honour."""
        for name, no_op in UNHONOURED.items():
            if name in body and not no_op(body[name]):
                raise RequestRefused(
                    f"{name}={body[name]!r} is not supported by swiftspec serve; leave it out of the request.", name
                )
        n = cls.integer(body, "n", 1)
        if n is not None and n > MAX_CHOICES:
            raise RequestRefused(f"n={n} is above {MAX_CHOICES}, the most answers one request may ask for.", "n")
        if n not in (None, 1) and body.get("stream"):
            raise RequestRefused(f"n={n} with stream=true is not supported; send stream=false, or {n} requests.", "n")
        logprobs = cls.logprobs_asked(body, endpoint)
        max_tokens = cls.first_of(body, "max_completion_tokens", "max_tokens", "max_output_tokens")
        settings = cls(
            temperature=cls.number(body, "temperature", 0.0, 2.0),
            top_p=cls.number(body, "top_p", 0.0, 1.0, low_open=True),
            top_k=cls.integer(body, "top_k", 0),
            min_p=cls.number(body, "min_p", 0.0, 1.0),
            frequency_penalty=cls.number(body, "frequency_penalty", *PENALTY_RANGE) or 0.0,
            presence_penalty=cls.number(body, "presence_penalty", *PENALTY_RANGE) or 0.0,
            seed=cls.integer(body, "seed", None),
            stop=cls.stop_strings(body.get("stop")),
            max_tokens=None if max_tokens is None else cls.integer(body, max_tokens, 1),
            logprobs=logprobs,
            n=n or 1,
        )
        return settings

    @classmethod
    def logprobs_asked(cls, body: dict, endpoint: str) -> int | None:
        """How many alternatives each token's logprobs list (None: no logprobs). Completions: `logprobs` is that
        number (0-5); chat: `logprobs` true, with `top_logprobs` (0-20) alternatives."""
        if endpoint == "chat":
            asked, top = body.get("logprobs"), cls.integer(body, "top_logprobs", 0)
            if asked not in (None, True, False):
                raise RequestRefused(f"logprobs={asked!r} must be true or false in a chat request.", "logprobs")
            if top is not None and not asked:
                raise RequestRefused(f"top_logprobs={top} needs logprobs=true.", "top_logprobs")
            count = (top or 0) if asked else None
            name = "top_logprobs"
        elif endpoint != "completions":
            if body.get("top_logprobs") or body.get("logprobs"):
                raise RequestRefused(f"logprobs are served on /v1/completions and /v1/chat/completions, not /v1/{endpoint}.",
                                     "top_logprobs")
            return None
        else:
            count, name = (None if body.get("logprobs") is False else cls.integer(body, "logprobs", 0)), "logprobs"
        if count is None:
            return None
        if count > MAX_TOP_LOGPROBS[endpoint]:
            raise RequestRefused(f"{name}={count} is above OpenAI's limit of {MAX_TOP_LOGPROBS[endpoint]}.", name)
        if body.get("stream"):
            raise RequestRefused("logprobs with stream=true is not supported yet; send stream=false.", "logprobs")
        return count

    # ------------------------------------------------ reading the body
    @staticmethod
    def first_of(body: dict, *names: str) -> str | None:
        return next((name for name in names if body.get(name) is not None), None)

    @staticmethod
    def number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
        value = body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestRefused(f"{name}={value!r} must be a number.", name)
        if not (low < value <= high if low_open else low <= value <= high):
            bounds = f"{'above' if low_open else 'at least'} {low} and at most {high}"
            raise RequestRefused(f"{name}={value!r} is out of range: it must be {bounds}.", name)
        return float(value)

    @staticmethod
    def integer(body: dict, name: str, low: int | None) -> int | None:
        value = body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestRefused(f"{name}={value!r} must be an integer.", name)
        if low is not None and value < low:
            raise RequestRefused(f"{name}={value!r} must be at least {low}.", name)
        return value

    @staticmethod
    def stop_strings(stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
            raise RequestRefused(f"stop={stop!r} must be a non-empty string or a list of up to {MAX_STOPS} of them.", "stop")
        return tuple(stops)

    # ------------------------------------------------ the request's generate() call
    def samples(self, base) -> bool:
        """Whether the request samples: temperature > 0 does, 0 is greedy, omitted is the pair's do_sample."""
        return bool(base.do_sample) if self.temperature is None else self.temperature > 0

    def generation_config(self, base):
        """The pair's generation config `base` with this request's sampling settings; RequestRefused for a
        sampling setting on a greedy request (it would change nothing)."""
        config = copy.deepcopy(base)
        config.do_sample = self.samples(base)
        config.stop_strings = None  # the request's own stops are checked on decoded text (TextStops)
        if not config.do_sample:
            narrowing = {"top_p": self.top_p not in (None, 1.0), "top_k": self.top_k not in (None, 0),
                         "min_p": self.min_p not in (None, 0.0)}
            for name, given in narrowing.items():
                if given:
                    raise RequestRefused(
                        f"{name}={getattr(self, name)!r} has no effect on a greedy request (temperature 0, or left out "
                        "while the pair's generation config is greedy); send temperature > 0 to sample.", name
                    )
            return config
        if self.temperature is not None:
            config.temperature = self.temperature
        if self.top_p is not None:
            config.top_p = self.top_p
        if self.top_k is not None:
            config.top_k = self.top_k
        if self.min_p is not None:
            config.min_p = self.min_p or None
        return config

    def generation_kwargs(self, base, prompt_length: int, max_new_tokens: int, tokenizer, device) -> dict:
        """generate()'s arguments for this request: its config, penalties, stops and seed."""
        kwargs = {"generation_config": self.generation_config(base)}
        kwargs["generation_config"].max_new_tokens = max_new_tokens
        kwargs["generation_config"].max_length = None
        if self.frequency_penalty or self.presence_penalty:
            kwargs["logits_processor"] = LogitsProcessorList(
                [OpenAIPenalties(prompt_length, self.frequency_penalty, self.presence_penalty)]
            )
        if self.stop:
            kwargs["stopping_criteria"] = StoppingCriteriaList([TextStops(tokenizer, self.stop, prompt_length)])
        if self.seed is not None and kwargs["generation_config"].do_sample:
            kwargs["generator"] = torch.Generator(device=device).manual_seed(self.seed)
        if self.logprobs is not None:  # the target's raw logits at every emitted token, kept for the logprobs
            kwargs["generation_config"].return_dict_in_generate = True
            kwargs["generation_config"].output_logits = True
        return kwargs


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties: each token's logit loses `frequency` x the times it was
    generated so far, and `presence` once if it was (tokens of the prompt do not count).

    input_ids: (B, L) prompt and tokens so far; scores: (B, V)"""

    def __init__(self, prompt_length: int, frequency: float, presence: float):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class TextStops(StoppingCriteria):
    """Stops once the decoded new text contains one of `stops` (OpenAI's stop: on text, not tokens). Only
    the tail that could hold a stop string is decoded (one token adds at least one character, or a byte of
    one; 4 bytes a character)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], prompt_length: int):
        self.tokenizer, self.stops, self.prompt_length = tokenizer, stops, prompt_length
        self.tail = 4 * max(len(s) for s in stops) + 4

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        start = max(self.prompt_length, input_ids.shape[1] - self.tail)
        done = [any(s in self.tokenizer.decode(row[start:]) for s in self.stops) for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """The text before the first stop string in it, and whether one was found."""
    found = [text.index(s) for s in stops if s in text]
    return (text[: min(found)], True) if found else (text, False)


@dataclass
class StopCutter:
    """A streamed answer's text with its stop strings applied: text that could begin a stop string is held
    back until the next piece settles it; after a stop string, nothing more is sent."""

    stops: tuple[str, ...]
    held: str = ""
    stopped: bool = False

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held) that can be sent now."""
        if self.stopped:
            return ""
        self.held += text
        cut, self.stopped = cut_at_stop(self.held, self.stops)
        if self.stopped:
            self.held = ""
            return cut
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        ready, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return ready

    def flush(self) -> str:
        """What was held once the answer ended without completing a stop string."""
        held, self.held = ("" if self.stopped else self.held), ""
        return held


@dataclass
class Choice:
    """One answer of a request: its tokens, how it ended, its logprobs (TokenLogprob, when asked for) and what
    speculation did for it (RowUsage, or None where unknown)."""

    tokens: list[int]
    finish_reason: str
    logprobs: list | None = None
    usage: object = None


@dataclass
class BookEntry:
    """What the server knows of one request besides transformers: its settings and how it ended.

    finish_reason: "stop" (EOS or a stop string) or "length", once it ended
    logprobs:      its first answer's TokenLogprob entries (serving/logprobs.py), when asked for
    choices:       its other answers (n > 1), in order
    timed_out:     it passed --request-timeout and was cancelled (the server's 504)
    """

    settings: RequestSettings
    finish_reason: str | None = None
    logprobs: list | None = None
    choices: list[Choice] = field(default_factory=list)
    timed_out: bool = False


@dataclass
class RequestBook:
    """Requests' settings by request id, from the app middleware (which reads the body) to the batching
    manager (which builds the request's generate() call), and how each ended back to the middleware (the
    response's finish_reason)."""

    entries: dict[str, BookEntry] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self, request_id: str, settings: RequestSettings) -> None:
        with self.lock:
            if request_id in self.entries:
                raise RequestRefused(f"request id {request_id!r} (X-Request-ID) is already in flight; send a new one.")
            self.entries[request_id] = BookEntry(settings)

    def settings(self, request_id: str | None) -> RequestSettings:
        with self.lock:
            entry = self.entries.get(request_id)
        return entry.settings if entry is not None else RequestSettings()

    def finished(self, request_id: str, reason: str, logprobs: list | None = None, choices: list[Choice] = ()) -> None:
        with self.lock:
            if request_id in self.entries:
                entry = self.entries[request_id]
                entry.finish_reason, entry.logprobs, entry.choices = reason, logprobs, list(choices)

    def close(self, request_id: str) -> BookEntry | None:
        with self.lock:
            return self.entries.pop(request_id, None)

    def entry(self, request_id: str) -> BookEntry | None:
        with self.lock:
            return self.entries.get(request_id)
