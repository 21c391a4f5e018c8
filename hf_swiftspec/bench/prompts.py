"""Prompt sets: the bundled excerpts or a user's JSONL / text file, read and tokenised for the pair,
and grouped into left-padded batches for the batch sizes above 1."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .schema import BenchConfig, PromptInfo

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"
BUNDLED_PROMPT_SETS = {
    "humaneval": "eagle_humaneval.jsonl",
    "spec_bench": "spec_bench.jsonl",
    "editing": "editing.jsonl",  # answers that copy the prompt: renames, file copies, quoted answers (bench/editing.py)
}
# Fields a record may carry its prompt in, after EAGLE / Spec-Bench "turns" and chat "messages".
TEXT_FIELDS = ("prompt", "text", "instruction", "question", "input", "content")


@dataclass(frozen=True)
class Prompt:
    text: str
    id: str
    category: str = ""


@dataclass
class PromptSet:
    """A prompt set tokenised for the pair: the warm-up prompt and the timed ones, ids (1, L) each."""

    name: str
    source: Path
    warmup: Prompt
    warmup_ids: torch.Tensor
    infos: list[PromptInfo]
    ids: list[torch.Tensor]


@dataclass
class PromptBatch:
    """The rows of one timed generate() call: prompts left-padded to a common length."""

    prompts: list[int]  # PromptInfo.index of each row
    ids: torch.Tensor  # (B, L): each prompt right-aligned, the pad token before it
    attention_mask: torch.Tensor  # (B, L): 0 on the padding, 1 on the prompt


def prompt_set_path(source: str) -> Path:
    """A bundled set's file by name (humaneval, spec_bench, editing), else `source` as a path."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    name = BUNDLED_PROMPT_SETS.get(source) or (f"{source}.jsonl" if (PROMPTS_DIR / f"{source}.jsonl").is_file() else None)
    if name is not None:
        return PROMPTS_DIR / name
    raise ValueError(
        f"Prompt set {source!r} is neither a file nor a bundled set; use one of {sorted(BUNDLED_PROMPT_SETS)} or a "
        "JSONL / text file (e.g. a full EAGLE or Spec-Bench question.jsonl)."
    )


def prompt_text(record, where: str) -> str:
    """The first user turn of a JSONL record: EAGLE / Spec-Bench "turns", chat "messages", or a text field."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        turns = record.get("turns")
        if isinstance(turns, list) and turns:
            first = turns[0]
            return first if isinstance(first, str) else str(first.get("content", ""))
        for key in ("messages", "conversations"):
            for message in record.get(key) or []:
                if isinstance(message, dict) and (message.get("role") or message.get("from")) in ("user", "human"):
                    return str(message.get("content") or message.get("value") or "")
        for key in TEXT_FIELDS:
            if isinstance(record.get(key), str):
                return record[key]
    raise ValueError(
        f"{where}: no prompt in {str(record)[:120]!r}; a record needs 'turns' (EAGLE / Spec-Bench), 'messages' with a "
        f"user turn, or one of the fields {TEXT_FIELDS}."
    )


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """Up to `limit` prompts from a bundled set or a file: JSONL (.jsonl / .json, one record per
    line) or plain text (one prompt per line). Blank lines are skipped."""
    path = prompt_set_path(source)
    is_json = path.suffix in (".jsonl", ".json")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if is_json:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not valid JSON ({error}); JSONL needs one record per line.") from None
        else:
            record = line
        text = prompt_text(record, where)
        meta = record if isinstance(record, dict) else {}
        prompts.append(Prompt(text, str(meta.get("question_id", number)), str(meta.get("category", ""))))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts


def has_chat_template(tokenizer) -> bool:
    """Whether prompts can be wrapped in the tokenizer's chat template (encode_prompt then does)."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, text: str, max_tokens: int | None, chat_template: bool) -> tuple[torch.Tensor, bool]:
    """Token ids (1, L) of a prompt, and whether it was cut. The text is cut to `max_tokens` before
    the chat template is applied, so the template's generation prompt always survives."""
    body = tokenizer(text, add_special_tokens=False).input_ids
    truncated = max_tokens is not None and len(body) > max_tokens
    if truncated:
        text = tokenizer.decode(body[:max_tokens])
    if chat_template and has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt").input_ids
    return ids, truncated


def prepare_prompt_set(source: str, tokenizer, config: BenchConfig, device, context: int | None) -> PromptSet:
    """Load a set: its first prompt is the warm-up prompt, the next num_prompts are timed (a set
    too small for that times all its prompts and warms up on the first)."""
    prompts = load_prompts(source, config.num_prompts + 1)
    warmup = prompts[0]
    timed = prompts[1:] if len(prompts) > config.num_prompts else prompts
    limit = prompt_token_limit(config, context)
    encoded = [encode_prompt(tokenizer, p.text, limit, config.chat_template) for p in [warmup, *timed]]
    for prompt, (ids, _) in zip([warmup, *timed], encoded):
        check_prompt_fits(ids.shape[1], config.max_new_tokens, context, f"{source} #{prompt.id}")
    infos = [
        PromptInfo(i, p.id, p.category, ids.shape[1], truncated)
        for i, (p, (ids, truncated)) in enumerate(zip(timed, encoded[1:]))
    ]
    name = source if source in BUNDLED_PROMPT_SETS else Path(source).stem
    return PromptSet(
        name, prompt_set_path(source), warmup, encoded[0][0].to(device), infos, [ids.to(device) for ids, _ in encoded[1:]]
    )


def prompt_token_limit(config: BenchConfig, context: int | None) -> int | None:
    """Where prompts are cut: max_prompt_tokens, and never so long that the generation overflows the
    target's context (the demo pair's is 256 tokens)."""
    room = None if context is None else context - config.max_new_tokens
    if room is not None and room < 8:
        raise ValueError(
            f"max_new_tokens={config.max_new_tokens} leaves {room} tokens of the target's {context}-token context "
            "for the prompt; lower max_new_tokens."
        )
    limits = [x for x in (config.max_prompt_tokens, room) if x]
    return min(limits) if limits else None


def check_prompt_fits(prompt_tokens: int, max_new_tokens: int, context: int | None, where: str) -> None:
    if prompt_tokens == 0:
        raise ValueError(f"Prompt {where} is empty after tokenisation; remove it from the set.")
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"Prompt {where} ({prompt_tokens} tokens) plus max_new_tokens={max_new_tokens} exceeds the target's context of "
            f"{context} tokens; lower max_prompt_tokens or max_new_tokens."
        )


def truncation_notes(prompt_sets: list[PromptSet], limit: int | None) -> list[str]:
    notes = []
    for prompt_set in prompt_sets:
        cut = sum(info.truncated for info in prompt_set.infos)
        if cut:
            notes.append(f"{prompt_set.name}: {cut} of {len(prompt_set.infos)} prompts were cut to {limit} tokens.")
    return notes


def padding_token(tokenizer, generation_config) -> int:
    """The id that left-pads a batch: the tokenizer's pad token, else generate()'s pad_token_id, else
    its first EOS id (generate pads finished rows with the same fallback). Masked out, so any id works."""
    config = generation_config
    for candidate in (getattr(tokenizer, "pad_token_id", None), config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    raise ValueError(
        "Batch sizes above 1 left-pad the prompts, but the tokenizer has no pad token and the target's generation "
        "config neither a pad_token_id nor an eos_token_id; set tokenizer.pad_token (or "
        "target.generation_config.pad_token_id), or run --batch-sizes 1."
    )


def left_padded(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, L), attention_mask (B, L)) of prompts ids (1, L_i) each, padded on the left to the longest."""
    length = max(row.shape[1] for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros((len(rows), length), dtype=torch.long, device=rows[0].device)
    for i, row in enumerate(rows):
        ids[i, length - row.shape[1]:] = row[0]
        mask[i, length - row.shape[1]:] = 1
    return ids, mask


def prompt_batches(prompt_set: PromptSet, size: int, pad_id: int) -> list[PromptBatch]:
    """The timed prompts `size` at a time, in order; a group with fewer than `size` prompts left (or a
    set smaller than `size`) repeats its own prompts to fill the batch. Never an earlier group's: the
    swiftspec model keeps its outputs, and a later call would copy the answer it gave that prompt."""
    indices = [info.index for info in prompt_set.infos]
    batches = []
    for start in range(0, len(indices), size):
        group = indices[start:start + size]
        rows = [group[j % len(group)] for j in range(size)]
        batches.append(PromptBatch(rows, *left_padded([prompt_set.ids[i] for i in rows], pad_id)))
    return batches
