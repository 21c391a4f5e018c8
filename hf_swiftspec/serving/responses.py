"""What `swiftspec serve` changes in transformers' responses, and its errors in OpenAI's shape.

transformers' handler builds each response from the request's first answer's tokens; `ResponseEditor` then makes
it what the request asked for: the text cut at its first stop string (held back while streaming until settled),
finish_reason as the batching manager saw the answer end, `model` as the client named it (transformers writes its
own 'id@revision'), the answers beyond the first (n > 1) as further choices, each answer's logprobs (logprobs.py),
and usage with what speculation did (`usage.speculation`, summed over the answers).
"""

from __future__ import annotations

from .logprobs import chat_logprobs, completion_logprobs, within_text
from .request_settings import BookEntry, Choice, RequestSettings, StopCutter, cut_at_stop


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape (the `openai` client shows its message)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def carries_text(payload: dict) -> bool:
    """Whether a streamed event delivers some of the answer's text: not a chat stream's role-only first chunk, an
    empty closing chunk, nor the responses API's bookkeeping events (time to first token is timed to the first
    event that does)."""
    if payload.get("type") == "response.output_text.delta":
        return bool(payload.get("delta"))
    for choice in payload.get("choices") or []:
        holder, key = ResponseEditor.text_of(choice)
        if holder is not None and holder[key]:
            return True
    return False


class ResponseEditor:
    """One response's JSON payloads as the request's settings make them (see the module docstring).

    served: the app's and batching manager's shared state (batching.Served: the pair's tokenizer decodes further
    answers and logprobs' tokens); model: the name the client sent; chat: a chat completion's shape
    """

    def __init__(self, served, request_id: str, settings: RequestSettings, model: str | None = None, chat: bool = False):
        self.served, self.request_id, self.settings = served, request_id, settings
        self.model, self.chat = model, chat
        self.cutter = StopCutter(settings.stop)

    @property
    def tokenizer(self):
        return self.served.tokenizer

    @property
    def entry(self) -> BookEntry | None:
        return self.served.book.entry(self.request_id)

    def whole(self, payload: dict) -> dict:
        entry = self.entry
        for choice in payload.get("choices") or []:
            holder, key = self.text_of(choice)
            if holder is not None and self.settings.stop:
                holder[key] = cut_at_stop(holder[key], self.settings.stop)[0]
            self.set_finish_reason(choice)
            if entry is not None and entry.logprobs is not None and holder is not None:
                choice["logprobs"] = self.logprobs_of(entry.logprobs, holder[key])
        if entry is not None and entry.choices and payload.get("choices"):
            payload["choices"] += [self.further_choice(payload["choices"][0], i, c)
                                   for i, c in enumerate(entry.choices, start=1)]
        return self.with_figures(self.with_model(payload))

    def event(self, payload: dict) -> dict:
        for choice in payload.get("choices") or []:
            holder, key = self.text_of(choice)
            ending = choice.get("finish_reason") is not None
            if self.settings.stop and (holder is not None or ending):
                text = self.cutter.feed(holder[key] if holder is not None else "") + (self.cutter.flush() if ending else "")
                if holder is None:
                    holder, key = self.holder_for(choice)
                holder[key] = text
            if ending:
                self.set_finish_reason(choice)
        return self.with_figures(self.with_model(payload))

    # ------------------------------------------------ pieces
    @staticmethod
    def text_of(choice: dict) -> tuple[dict | None, str]:
        """Where a choice holds its text: completions' text, chat's message or delta content."""
        if isinstance(choice.get("text"), str):
            return choice, "text"
        for name in ("message", "delta"):
            inner = choice.get(name)
            if isinstance(inner, dict) and isinstance(inner.get("content"), str):
                return inner, "content"
        return None, ""

    @staticmethod
    def holder_for(choice: dict) -> tuple[dict, str]:
        if "delta" in choice:
            return choice["delta"], "content"
        return choice, "text"

    def set_finish_reason(self, choice: dict) -> None:
        entry = self.entry
        if entry is not None and entry.finish_reason is not None and choice.get("finish_reason") in ("stop", "length"):
            choice["finish_reason"] = entry.finish_reason

    def logprobs_of(self, entries: list, text: str) -> dict:
        kept = within_text(entries, self.tokenizer, text)
        return chat_logprobs(kept, self.tokenizer) if self.chat else completion_logprobs(kept, self.tokenizer)

    def further_choice(self, first: dict, index: int, answer: Choice) -> dict:
        """Answer `index` of a request for n, in the first choice's shape."""
        text = self.tokenizer.decode(answer.tokens, skip_special_tokens=True)
        if self.settings.stop:
            text = cut_at_stop(text, self.settings.stop)[0]
        choice = {key: value for key, value in first.items() if key not in ("text", "message", "logprobs")}
        if "message" in first:
            choice["message"] = {**first["message"], "content": text}
        else:
            choice["text"] = text
        choice["index"], choice["finish_reason"] = index, answer.finish_reason
        if answer.logprobs is not None:
            choice["logprobs"] = self.logprobs_of(answer.logprobs, text)
        return choice

    def with_model(self, payload: dict) -> dict:
        """The model as the client named it (transformers' handler writes its own 'id@revision')."""
        if self.model is not None and "model" in payload:
            payload["model"] = self.model
        return payload

    def with_figures(self, payload: dict) -> dict:
        usage = payload.get("usage")
        if not isinstance(usage, dict):
            return payload
        figures = self.served.usage.of(self.request_id)
        entry = self.entry
        if figures is not None and entry is not None and entry.choices:  # a sum over the answers, not the kept one
            figures = type(figures)(figures.verifications, figures.proposed, figures.accepted)
        for answer in entry.choices if entry is not None else ():
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + len(answer.tokens)
            usage["total_tokens"] = usage.get("total_tokens", 0) + len(answer.tokens)
            if figures is not None and answer.usage is not None:
                figures.add(answer.usage)
        if figures is not None:
            usage["speculation"] = figures.as_dict()
        return payload
