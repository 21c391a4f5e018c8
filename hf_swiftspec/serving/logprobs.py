"""The log-probabilities a request asked for (`logprobs`, `top_logprobs`): the target's own, at each chosen token.

A request with logprobs decodes with generate()'s `output_logits` (return_dict_in_generate): the target's raw
logits at every emitted position, the very forward that verified it (the root's and each accepted node's logits in
the tree's verification, or the prefill's for the first token). A token's log-probability is log_softmax of those
logits, the model's own distribution before the request's temperature, top-p or penalties (vLLM's default,
`raw_logprobs`), so greedy and sampled requests report the same numbers for the same text, and they equal
`target.generate(output_logits=True)`'s on the same tokens (tests/test_serve_logprobs.py). Only the chosen tokens'
values and their k likeliest alternatives are kept, once the answer is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target, and the `top` likeliest tokens at its position.

    top: (token id, log-probability) pairs, likeliest first
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: tuple[torch.Tensor, ...], tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of `tokens`' log-probability from the target's raw logits at its position, with its `top` alternatives.

    logits: per emitted token, (1, V) raw logits (generate()'s output.logits)
    """
    if len(logits) < len(tokens):
        raise RuntimeError(f"{len(tokens)} tokens but logits for {len(logits)}: the call kept no logits for some")
    out = []
    for step, token in zip(logits, tokens):
        logprobs = torch.log_softmax(step[0].float(), dim=-1)  # (V,)
        values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
        out.append(TokenLogprob(token, float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist()))))
    return out


def within_text(entries: list[TokenLogprob], tokenizer, text: str) -> list[TokenLogprob]:
    """The entries of the tokens that make `text` (an answer cut before its stop string keeps fewer tokens)."""
    kept = []
    for k in range(len(entries)):
        if len(tokenizer.decode([e.token for e in entries[: k + 1]], skip_special_tokens=True)) > len(text):
            break
        kept.append(entries[k])
    return kept


def completion_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """/v1/completions' `logprobs` object: tokens, token_logprobs, top_logprobs (one dict a token), text_offset."""
    piece = lambda token: tokenizer.decode([token])  # noqa: E731
    offsets, at = [], 0
    for entry in entries:
        offsets.append(at)
        at += len(piece(entry.token))
    return {
        "tokens": [piece(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{piece(t): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """/v1/chat/completions' `logprobs` object: `content`, one {token, logprob, bytes, top_logprobs} a token."""

    def described(token: int, value: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {"content": [{**described(e.token, e.logprob), "top_logprobs": [described(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}
