"""What `swiftspec distill` trains on: records read from text and jsonl files, rendered through the
tokenizer's chat template where it has one, optionally continued by the target itself
(self-distillation), split into training and held-out, and tokenised.

A record is one document: a plain text file is one record; a jsonl line is one record with a "text"
field (used as it is), or a "prompt" field (with an optional "completion" or "response") or a "turns"
field (a list of messages: strings alternating user / assistant, or {"role", "content"} dicts).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch


class DistillError(ValueError):
    """Bad input to `swiftspec distill`: the message names the value and the fix."""


@dataclass(frozen=True)
class Record:
    """One document. messages: a conversation (role/content dicts) or None for plain text;
    open_ended: it ends with the user's turn, so the target may continue it (self-distillation)."""

    source: str  # "file:line", for errors and the split
    text: str | None
    messages: tuple[dict, ...] | None = None

    @property
    def open_ended(self) -> bool:
        return self.messages is not None and self.messages[-1]["role"] == "user"


@dataclass
class Sequence:
    """A tokenised record: ids (list of ints); prompt: how many of its first ids are the prompt (what a
    held-out tau measurement gives the pair), 0 for plain text."""

    ids: list[int]
    prompt: int


@dataclass
class Dataset:
    train: list[Sequence]
    heldout: list[Sequence]
    files: tuple[str, ...]

    @property
    def train_tokens(self) -> int:
        return sum(len(s.ids) for s in self.train)


# ---------------------------------------------------------------- reading files


def read_records(paths) -> list[Record]:
    """Every record of `paths` (text or .jsonl files), in order; DistillError for a missing file, a bad
    line, or no records at all."""
    records = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DistillError(f"--data {path}: no such file; give text or .jsonl files.")
        if path.suffix == ".jsonl":
            records += jsonl_records(path)
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                records.append(Record(str(path), text))
    if not records:
        listed = ", ".join(map(str, paths)) or "none given"
        raise DistillError(
            f"no training data: the --data files ({listed}) hold no text. Give text files, or .jsonl files with a "
            "'text', 'prompt' or 'turns' field per line."
        )
    return records


def jsonl_records(path: Path) -> list[Record]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise DistillError(f"{where} is not valid JSON ({err}); each line of a .jsonl file is one JSON object.") from err
        records.append(record_of(data, where))
    return records


def record_of(data, where: str) -> Record:
    if not isinstance(data, dict):
        raise DistillError(f"{where}: a line must be a JSON object, got {type(data).__name__}.")
    if isinstance(data.get("text"), str):
        return Record(where, data["text"])
    if isinstance(data.get("prompt"), str):
        messages = [{"role": "user", "content": data["prompt"]}]
        answer = data.get("completion", data.get("response"))
        if isinstance(answer, str):
            messages.append({"role": "assistant", "content": answer})
        return Record(where, None, tuple(messages))
    if isinstance(data.get("turns"), list) and data["turns"]:
        return Record(where, None, tuple(message_of(turn, i, where) for i, turn in enumerate(data["turns"])))
    raise DistillError(
        f"{where}: no 'text' (a string), 'prompt' (a string) or 'turns' (a non-empty list) field; got keys {sorted(data)}."
    )


def message_of(turn, index: int, where: str) -> dict:
    if isinstance(turn, str):
        return {"role": "user" if index % 2 == 0 else "assistant", "content": turn}
    if isinstance(turn, dict) and isinstance(turn.get("content"), str) and turn.get("role"):
        return {"role": turn["role"], "content": turn["content"]}
    raise DistillError(f"{where}: turn {index} must be a string or a {{'role', 'content'}} object, got {turn!r}.")


def is_heldout(record: Record, percent: int) -> bool:
    """A stable `percent`% of records, chosen by a hash of their content (not their order)."""
    content = record.text if record.text is not None else json.dumps(record.messages)
    return int(hashlib.sha1(content.encode()).hexdigest(), 16) % 100 < percent


def split_records(records: list[Record], percent: int) -> tuple[list[Record], list[Record]]:
    """(training, held-out); with fewer than two records in either, the last record is held out."""
    heldout = [r for r in records if is_heldout(r, percent)]
    train = [r for r in records if not is_heldout(r, percent)]
    if not heldout or not train:
        if len(records) < 2:
            raise DistillError(
                f"only {len(records)} record in the data: distill needs at least two, one to train on and one held out "
                "to measure agreement and tau on."
            )
        train, heldout = records[:-1], records[-1:]
    return train, heldout


# ---------------------------------------------------------------- tokenising


def render(record: Record, tokenizer, continue_it: bool) -> tuple[str, str]:
    """(prompt text, full text) of a record: a conversation through the tokenizer's chat template where
    it has one (else its contents joined by newlines). continue_it: end on a generation prompt."""
    if record.messages is None:
        return "", record.text
    messages = list(record.messages)
    if getattr(tokenizer, "chat_template", None):
        prompt_messages = messages[:-1] if messages[-1]["role"] == "assistant" else messages
        prompt = tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True)
        if continue_it or messages[-1]["role"] == "user":
            return prompt, prompt
        return prompt, tokenizer.apply_chat_template(messages, tokenize=False)
    joined = "\n".join(m["content"] for m in messages)
    prompt = "\n".join(m["content"] for m in messages[:-1]) if messages[-1]["role"] == "assistant" else joined
    return prompt, joined


def encode(tokenizer, text: str, templated: bool) -> list[int]:
    # A chat template writes its own special tokens (BOS among them); plain text gets the tokenizer's.
    return tokenizer(text, add_special_tokens=not templated).input_ids


def tokenise(record: Record, tokenizer) -> Sequence:
    templated = record.messages is not None and bool(getattr(tokenizer, "chat_template", None))
    prompt, full = render(record, tokenizer, continue_it=False)
    ids = encode(tokenizer, full, templated)
    return Sequence(ids, len(encode(tokenizer, prompt, templated)) if prompt else 0)


@torch.no_grad()
def self_distilled(records: list[Record], tokenizer, target, new_tokens: int, batch: int = 8) -> list[Sequence]:
    """Each record's prompt (a conversation ending with the user, through the chat template; or a text's
    first half) continued greedily by `target` for `new_tokens` tokens: the text the draft then learns is
    the target's own, which is what verification accepts."""
    prompts = []
    for record in records:
        if record.messages is not None:
            templated = bool(getattr(tokenizer, "chat_template", None))
            prompts.append(encode(tokenizer, render(record, tokenizer, continue_it=True)[0], templated))
        else:
            ids = encode(tokenizer, record.text, False)
            prompts.append(ids[: max(len(ids) // 2, 1)])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_ids(target, tokenizer)
    sequences = []
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad or 0] * (width - len(r)) + r for r in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=pad)
        for row, prompt in zip(out[:, width:].tolist(), rows):
            sequences.append(Sequence(prompt + until_stop(row, stops), len(prompt)))
    return sequences


def stop_ids(target, tokenizer) -> set[int]:
    """The ids generate() stops a row at (the target's generation config, else the tokenizer's EOS)."""
    eos = target.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def until_stop(row: list[int], stops: set[int]) -> list[int]:
    """A batched row up to its first stop token (kept): after it generate() pads the finished row."""
    for i, token in enumerate(row):
        if token in stops:
            return row[: i + 1]
    return row


def token_stream(sequences: list[Sequence], eos: int | None) -> torch.Tensor:
    """(N,) the sequences one after another, an end-of-sequence token between documents."""
    ids = []
    for s in sequences:
        ids += s.ids + ([eos] if eos is not None else [])
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, length) windows of the stream at random starts drawn from `generator` (saved in checkpoints,
    so a resumed run draws the same windows)."""
    starts = torch.randint(0, stream.numel() - length + 1, (rows,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def even_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """(count', length): up to `count` evenly spaced windows, the same every run (held-out measurement)."""
    last = stream.numel() - length
    starts = sorted(set(torch.linspace(0, last, count).long().tolist())) if last > 0 else [0]
    return torch.stack([stream[s : s + length] for s in starts])
