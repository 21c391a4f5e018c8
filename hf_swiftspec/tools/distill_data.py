"""What `swiftspec distill` trains on, from the records distill_corpus.py read: rendered through the
tokenizer's chat template where it has one, tokenised, optionally answered by the target itself
(self-distillation), and packed into one token stream that training draws windows from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .distill_corpus import Record
from .distill_progress import Progress


@dataclass
class Sequence:
    """A tokenised record: ids (list of ints); prompt: how many of its first ids are the prompt (what a
    held-out tau measurement gives the pair), 0 for plain text; follows: it continues the previous sequence's
    document (packed with no end-of-sequence token between them)."""

    ids: list[int]
    prompt: int
    follows: bool = False


@dataclass
class Dataset:
    train: list[Sequence]
    heldout: list[Sequence]

    @property
    def train_tokens(self) -> int:
        return sum(len(s.ids) for s in self.train)


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
    # verbose=False: a record longer than the model's context is fine here (training reads windows of it), so
    # transformers' "Token indices sequence length is longer than ..." warning does not apply.
    return tokenizer(text, add_special_tokens=not templated, verbose=False).input_ids


def templated(record: Record, tokenizer) -> bool:
    return record.messages is not None and bool(getattr(tokenizer, "chat_template", None))


def tokenise(record: Record, tokenizer) -> Sequence:
    prompt, full = render(record, tokenizer, continue_it=False)
    ids = encode(tokenizer, full, templated(record, tokenizer))
    return Sequence(ids, len(encode(tokenizer, prompt, templated(record, tokenizer))) if prompt else 0)


def tokenise_all(records: list[Record], tokenizer, progress: Progress) -> list[Sequence]:
    """Every record tokenised, in order, each piece of a document marked as following the one before it."""
    sequences = []
    for i, record in enumerate(records):
        sequence = tokenise(record, tokenizer)
        before = records[i - 1] if i else None
        sequence.follows = bool(before is not None and record.document and before.document == record.document
                                and record.part == before.part + 1 and record.messages is None)
        if sequence.follows and tokenizer.bos_token_id is not None and sequence.ids[:1] == [tokenizer.bos_token_id]:
            sequence.ids = sequence.ids[1:]  # the tokenizer's BOS begins a document, not each of its pieces
        sequences.append(sequence)
        progress.advance()
    return sequences


# ---------------------------------------------------------------- self-distillation


def self_distill_prompt(record: Record, tokenizer, longest: int) -> list[int]:
    """A record's prompt for the target to answer: a conversation up to its last user turn, through the chat
    template with its generation prompt; a text's first half; at most `longest` tokens (its last ones)."""
    if record.messages is not None:
        ids = encode(tokenizer, render(record, tokenizer, continue_it=True)[0], templated(record, tokenizer))
    else:
        ids = encode(tokenizer, record.text, False)
        ids = ids[: max(len(ids) // 2, 1)]
    return ids[-longest:]


@torch.no_grad()
def self_distilled(records: list[Record], tokenizer, target, new_tokens: int, progress: Progress, batch: int = 8) -> list[Sequence]:
    """Each record's prompt (self_distill_prompt) continued greedily by `target` for `new_tokens` tokens: the
    text the draft then learns is the target's own, which is what verification accepts."""
    context = getattr(target.config.get_text_config(decoder=True), "max_position_embeddings", None) or 1 << 30
    longest = max(context - new_tokens, 1)
    prompts = [self_distill_prompt(r, tokenizer, longest) for r in records]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_ids(target, tokenizer)
    # Prompts of like length batch together (less padding); the sequences come back in the records' order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answered: dict[int, Sequence] = {}
    for start in range(0, len(order), batch):
        chosen = order[start : start + batch]
        rows = [prompts[i] for i in chosen]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad or 0] * (width - len(r)) + r for r in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=pad)
        for i, row, prompt in zip(chosen, out[:, width:].tolist(), rows):
            answered[i] = Sequence(prompt + until_stop(row, stops), len(prompt))
        progress.advance(len(chosen))
    return [answered[i] for i in range(len(prompts))]


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


# ---------------------------------------------------------------- the stream and its windows


def token_stream(sequences: list[Sequence], eos: int | None) -> torch.Tensor:
    """(N,) the sequences one after another, an end-of-sequence token between documents (none between the
    pieces of one document that follow each other)."""
    ids = []
    for i, s in enumerate(sequences):
        if i and not s.follows and eos is not None:
            ids.append(eos)
        ids += s.ids
    if eos is not None and sequences:
        ids.append(eos)
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
