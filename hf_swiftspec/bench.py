"""`swiftspec bench`: SwiftSpec against what a user would otherwise run, on their pair and hardware.

    python -m hf_swiftspec.bench [--pair PATH] [--prompts humaneval --prompts spec_bench]
                                 [--num-prompts 8] [--max-new-tokens 128] [--out bench_results]

For each prompt set, every method decodes greedily from the same prompts with the same settings,
interleaved prompt by prompt (the order rotates, so no method always runs first or last):

    target            target.generate: the baseline of every speed-up
    assisted          transformers assisted generation with the pair's draft; num_assistant_tokens
                      tuned on the warm-up prompt (the fastest of `assistant_tokens` is kept)
    prompt_lookup     transformers prompt-lookup decoding (prompt_lookup_num_tokens)
    swiftspec_serial  tree speculation, draft and target on one device, one after the other
    swiftspec_async   tree speculation with the draft in its own thread (CPU) or on its own GPU;
                      skipped, with a note, when the devices do not allow it

Every method's tokens must equal target.generate's on every prompt, or the run stops with
OutputMismatchError and writes nothing. Warm-up calls and tuning are not timed. The output
directory receives results.json (schema: `BenchReport` and the dataclasses it holds, version
SCHEMA_VERSION), results.md and, when matplotlib is installed, results.png.

`run_bench(BenchConfig(...))` is the API; `add_bench_arguments` / `bench_main` wire it as a
command. Nothing runs at import.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

import torch

from .cache import TreeCache
from .config import SwiftSpecConfig
from .modeling import SwiftSpecForCausalLM
from .pair import DEMO_PAIR_NAME, bundled_pair, context_length
from .stats import SwiftSpecStats
from .tree import new_tree

SCHEMA_VERSION = 1
METHOD_NAMES = ("target", "assisted", "prompt_lookup", "swiftspec_serial", "swiftspec_async")
METHOD_LABELS = {
    "target": "target.generate",
    "assisted": "assisted generation",
    "prompt_lookup": "prompt lookup",
    "swiftspec_serial": "swiftspec serial",
    "swiftspec_async": "swiftspec async",
}
PROMPTS_DIR = Path(__file__).resolve().parent / "data" / "prompts"
BUNDLED_PROMPT_SETS = {"humaneval": "eagle_humaneval.jsonl", "spec_bench": "spec_bench.jsonl"}
# Fields a record may carry its prompt in, after EAGLE / Spec-Bench "turns" and chat "messages".
TEXT_FIELDS = ("prompt", "text", "instruction", "question", "input", "content")
SWIFTSPEC_FIELDS = ("tree_budget", "draft_width", "draft_depth", "tree_capacity", "attention", "worker_timeout_s")
TREE_OPTIONS = ("tree_budget", "draft_width", "draft_depth")  # the ones the command line overrides
MIB = 2**20


# ---------------------------------------------------------------- configuration


@dataclass
class BenchModels:
    """A pair already in memory. tokenizer: the target's (None: hf_swiftspec.testing's character
    tokenizer, fine for the random test pairs); settings: SwiftSpecConfig fields (tree_budget, ...)."""

    target: Any
    draft: Any
    tokenizer: Any = None
    name: str = "in-memory pair"
    settings: dict = field(default_factory=dict)


@dataclass
class Method:
    """One way of generating, timed side by side with the others.

    generate(input_ids (1, L), **generation_kwargs) -> sequences (1, L + n), like target.generate.
    stats: the SwiftSpecStats of the last call, for tree speculation (None otherwise).
    tune(input_ids, **generation_kwargs): run once per prompt set on the warm-up prompt, before
        timing; may change `settings` (assisted generation picks num_assistant_tokens there).
    tuning: what tune measured, e.g. tokens/s per value tried.
    """

    name: str
    label: str
    generate: Callable[..., torch.Tensor]
    stats: Callable[[], SwiftSpecStats | None] = lambda: None
    settings: dict = field(default_factory=dict)
    tune: Callable[..., None] | None = None
    tuning: dict = field(default_factory=dict)


@dataclass
class BenchConfig:
    """What `run_bench` measures. The command line takes its defaults from here."""

    pair: str | None = None  # pair repo id or folder; None: the bundled demo pair, else an in-memory agreeing_pair()
    models: BenchModels | None = None  # a pair in memory; wins over `pair`
    prompts: tuple[str, ...] = ("humaneval", "spec_bench")  # bundled set names or JSONL / text files
    num_prompts: int = 8  # timed prompts per set; the set's first prompt is the warm-up prompt
    max_new_tokens: int = 128
    max_prompt_tokens: int | None = 256  # cut longer prompts (CNN/DM, RAG articles) so runs stay comparable; None: never
    methods: tuple[str, ...] = METHOD_NAMES
    extra_methods: tuple[Method, ...] = ()  # your own methods, checked and timed like the built-in ones
    seed: int = 0
    warmup: int = 1  # untimed calls per method on the warm-up prompt before each set
    output_dir: str | None = "bench_results"  # None: return the report without writing files
    assistant_tokens: tuple[int, ...] = (2, 4, 6, 8, 12)  # num_assistant_tokens values tried for assisted generation
    prompt_lookup_tokens: int = 10  # transformers' documented example value
    swiftspec: dict = field(default_factory=dict)  # SwiftSpecConfig overrides (tree_budget=..., draft_depth=...)
    device: str | None = None  # for --pair; None: cuda:0 when there is a GPU, else cpu
    dtype: str | None = None  # for --pair; None: float32 on CPU, the checkpoint's own on GPU
    threads: int | None = None  # torch CPU threads; None: leave torch's setting
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    ignore_eos: bool = False  # generate exactly max_new_tokens on every call
    peak_gbps: float | None = None  # memory bandwidth for the floor; None: measure with a tensor copy
    growth_check_tokens: int = 256  # length of the cache-growth check generation; 0 skips the memory budget
    progress: bool = True


# ---------------------------------------------------------------- results (the results.json schema)


@dataclass
class Spread:
    """A metric over the timed prompts: mean, sample standard deviation (0 for one prompt), min, max."""

    mean: float
    sd: float
    min: float
    max: float


@dataclass
class PromptInfo:
    """One timed prompt of a set."""

    index: int  # position among the timed prompts, as in PromptRun.prompt
    id: str  # the record's question_id, else its line number in the file
    category: str
    prompt_tokens: int  # after the chat template and truncation
    truncated: bool  # cut to max_prompt_tokens


@dataclass
class PromptRun:
    """One timed call of one method on one prompt."""

    prompt: int  # PromptInfo.index
    seconds: float  # wall time of the generate() call
    new_tokens: int
    tokens_per_s: float
    speedup: float  # tokens_per_s over target.generate's on the same prompt
    tau: float  # new tokens per target verification (see MethodResult.tau)
    target_forwards: int  # target forward calls, prefill included
    target_forwards_per_token: float
    target_idle_fraction: float | None  # async tree speculation only
    verify_step_ms: float | None  # mean target verification step, tree speculation only
    peak_memory_mib: dict[str, float]  # device -> peak during the call ("cpu": process RSS)
    run_memory_mib: dict[str, float]  # device -> peak minus what was resident before the call


@dataclass
class MethodResult:
    """One method over one prompt set. Metrics are None where they do not apply, and for a skipped method.

    tau: swiftspec: SwiftSpecStats.tau (tokens per tree verification, prefill excluded); the
        transformers methods: new tokens per target forward (their first forward prefills and
        verifies at once); target.generate: 1.
    peak_memory_mib / run_memory_mib: the largest PromptRun values over the prompts.
    tuning: what was measured to pick `settings` (assisted: tokens/s per num_assistant_tokens).
    """

    name: str
    label: str
    status: str  # "ok" or "skipped"
    note: str
    settings: dict
    tuning: dict
    tokens_per_s: Spread | None
    speedup: Spread | None
    tau: Spread | None
    target_forwards_per_token: Spread | None
    target_idle_fraction: Spread | None
    verify_step_ms: Spread | None
    peak_memory_mib: dict[str, float]
    run_memory_mib: dict[str, float]
    runs: list[PromptRun]


@dataclass
class LimitReport:
    """How close one target verification step is to the memory-bandwidth floor on this device.

    floor = (weights read + KV read) / peak bandwidth: a batch-1 step streams every weight once
    (an untied input embedding only for its few rows) and the KV of the whole context.
    """

    method: str  # the swiftspec method whose steps were measured
    device: str
    peak_gbps: float
    peak_source: str  # "given" or how it was measured
    weight_mb: float
    kv_mb: float  # at context_tokens
    context_tokens: float  # mean context of a step: prompt + half the new tokens
    floor_ms: float
    verify_step_ms: float  # measured mean tree verification step
    verify_over_floor: float
    target_step_ms: float  # target.generate's mean time per token, for comparison
    target_step_over_floor: float
    tau: float
    ceiling_tokens_per_s: float  # tau / floor
    tokens_per_s: float  # what the method measured


@dataclass
class CacheTrace:
    """What one model's TreeCache looked like across the forwards of one generation."""

    role: str  # "target" or "draft"
    forwards: int
    caches: int  # distinct TreeCache objects seen (1: one per generation)
    buffers: int  # distinct kv buffers (data pointer and shape) seen (1: never reallocated)
    shape: list[int]  # (layers, 2, batch, kv heads, capacity, head dim)
    capacity: int
    max_length: int  # most positions ever in use
    max_tree_slots: int  # most tree-region positions ever in use
    mib: float  # size of the kv buffer


@dataclass
class MemoryBudget:
    """SwiftSpec's memory over target.generate alone, for one generation of context_tokens.

    extra_mib = draft weights + draft TreeCache + token tree + (target TreeCache - the target's own
    KV for the same context). The target cache may exceed its own KV by the tree budget only and
    the draft's tree region stays within tree_capacity; no_growth: no kv buffer was reallocated
    and each model used one cache for the whole generation.
    """

    context_tokens: int  # prompt + new tokens of the checked generation
    target_weights_mib: float
    draft_weights_mib: float
    target_kv_mib: float  # the target's own KV cache for the same context (what target.generate holds)
    target_tree_cache_mib: float
    draft_tree_cache_mib: float
    token_tree_mib: float
    extra_mib: float
    target_extra_slots: int  # target TreeCache capacity - context
    tree_budget: int
    draft_extra_slots: int  # draft TreeCache capacity - context
    tree_capacity: int
    within_tree_region: bool
    no_growth: bool
    traces: list[CacheTrace]


@dataclass
class SetResult:
    """All methods on one prompt set."""

    name: str
    source: str  # the file the prompts came from
    warmup_prompt: str  # id of the untimed warm-up / tuning prompt
    prompts: list[PromptInfo]
    methods: list[MethodResult]
    limit: LimitReport | None


@dataclass
class PairInfo:
    name: str
    target: str
    draft: str
    target_params_m: float
    draft_params_m: float
    dtype: str
    target_device: str
    draft_device: str
    tokenizer: str
    settings: dict  # SwiftSpecConfig fields the swiftspec methods ran with


@dataclass
class Environment:
    created: str  # UTC, ISO 8601
    hf_swiftspec: str
    transformers: str
    torch: str
    python: str
    platform: str
    device: str  # the target's device and what it is
    threads: int  # torch CPU threads
    cpu_count: int
    memory_source: str  # how peak memory was measured


@dataclass
class BenchReport:
    """results.json. Keys only change with SCHEMA_VERSION.

    Units are in the names: *_mib are MiB (2**20 bytes: memory); weight_mb / kv_mb are MB (10**6
    bytes, to divide by peak_gbps in 10**9 bytes/s); *_ms milliseconds; *_s seconds.
    """

    schema_version: int
    environment: Environment
    pair: PairInfo
    config: dict  # BenchConfig without models / extra_methods
    sets: list[SetResult]
    memory: MemoryBudget | None
    notes: list[str]


class OutputMismatchError(RuntimeError):
    """A method's greedy tokens differ from target.generate's: the run is invalid."""


# ---------------------------------------------------------------- prompts


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


def prompt_set_path(source: str) -> Path:
    """A bundled set's file by name (humaneval, spec_bench), else `source` as a path."""
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


def encode_prompt(tokenizer, text: str, max_tokens: int | None, chat_template: bool) -> tuple[torch.Tensor, bool]:
    """Token ids (1, L) of a prompt, and whether it was cut. The text is cut to `max_tokens` before
    the chat template is applied, so the template's generation prompt always survives."""
    body = tokenizer(text, add_special_tokens=False).input_ids
    truncated = max_tokens is not None and len(body) > max_tokens
    if truncated:
        text = tokenizer.decode(body[:max_tokens])
    if chat_template and getattr(tokenizer, "chat_template", None):
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


# ---------------------------------------------------------------- the pair


def default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def load_dtype(name: str | None, device: str):
    """float32 on CPU unless asked (exact and fast there), the checkpoint's own dtype on GPU."""
    if name is None:
        return torch.float32 if device == "cpu" else "auto"
    if name == "auto":
        return "auto"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype; use float32, bfloat16, float16 or auto.")
    return dtype


def load_models(config: BenchConfig, notes: list[str]) -> BenchModels:
    """The pair to measure: config.models, else config.pair, else the demo pair, else agreeing_pair()."""
    if config.models is not None:
        return config.models
    location = config.pair
    if location is None:
        demo = bundled_pair(DEMO_PAIR_NAME)
        if demo is None:
            return fallback_pair(notes)
        location = str(demo)
    device = config.device or default_device()
    model = SwiftSpecForCausalLM.from_pretrained(location, dtype=load_dtype(config.dtype, device), device_map=device)
    if model.tokenizer is None:
        raise ValueError(f"The pair {location!r} ships no tokenizer (neither its repo nor its target has one); add one.")
    settings = {name: getattr(model.config, name) for name in SWIFTSPEC_FIELDS}
    return BenchModels(model.target, model.draft, model.tokenizer, config.pair or DEMO_PAIR_NAME, settings)


def fallback_pair(notes: list[str]) -> BenchModels:
    from .testing import agreeing_pair, char_tokenizer

    notes.append(
        f"The demo pair {DEMO_PAIR_NAME!r} was not found in model_cards/, so this run used the in-memory "
        "hf_swiftspec.testing.agreeing_pair() (random weights, character tokenizer): its speed-ups show the "
        "machinery, not a real model's. Pass --pair PATH to measure a real pair."
    )
    target, draft = agreeing_pair()
    return BenchModels(target, draft, char_tokenizer(), "agreeing_pair (in-memory, random weights)")


def tokenizer_for(models: BenchModels, notes: list[str]):
    if models.tokenizer is not None:
        return models.tokenizer
    from .testing import CHAR_SPECIALS, char_tokenizer

    vocab = models.target.config.get_text_config().vocab_size
    if vocab < len(CHAR_SPECIALS) + 95:
        raise ValueError(
            f"The pair has no tokenizer and its vocabulary ({vocab}) is too small for the character tokenizer; "
            "pass BenchModels(tokenizer=...)."
        )
    notes.append("The pair has no tokenizer; prompts were encoded with hf_swiftspec.testing.char_tokenizer().")
    return char_tokenizer()


def swiftspec_settings(models: BenchModels, config: BenchConfig) -> dict:
    """The pair's own SwiftSpecConfig fields, overridden by config.swiftspec; checked by SwiftSpecConfig."""
    settings = {**models.settings, **config.swiftspec}
    unknown = sorted(set(settings) - set(SWIFTSPEC_FIELDS))
    if unknown:
        raise ValueError(f"Unknown swiftspec settings {unknown}; use {list(SWIFTSPEC_FIELDS)}.")
    SwiftSpecConfig(**settings)  # raises, naming the bad value
    return settings


def parameter_bytes(model) -> int:
    """Bytes of a model's parameters (tied weights counted once, as parameters() yields them)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def pair_info(models: BenchModels, settings: dict, tokenizer) -> PairInfo:
    target, draft = models.target, models.draft
    return PairInfo(
        name=models.name,
        target=target.name_or_path or type(target).__name__,
        draft=draft.name_or_path or type(draft).__name__,
        target_params_m=round(sum(p.numel() for p in target.parameters()) / 1e6, 2),
        draft_params_m=round(sum(p.numel() for p in draft.parameters()) / 1e6, 2),
        dtype=str(target.dtype).removeprefix("torch."),
        target_device=str(target.device),
        draft_device=str(draft.device),
        tokenizer=getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
        settings=resolved_settings(settings),
    )


def resolved_settings(settings: dict) -> dict:
    """Every SwiftSpecConfig field the methods use, defaults included, as the report states them."""
    resolved = SwiftSpecConfig(**settings)
    return {name: getattr(resolved, name) for name in SWIFTSPEC_FIELDS}


# ---------------------------------------------------------------- methods


def generation_kwargs(ids: torch.Tensor, max_new_tokens: int) -> dict:
    """The same greedy settings for every method; ids (1, L)."""
    return dict(do_sample=False, max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids))


def synchronize() -> None:
    """Wait for queued kernels on every GPU, so a timing covers the work it started."""
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def timed_call(generate: Callable[..., torch.Tensor], ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, float]:
    synchronize()
    start = time.perf_counter()
    out = generate(ids, **kwargs)
    synchronize()
    return out, time.perf_counter() - start


def tokens_per_second(generate: Callable[..., torch.Tensor], ids: torch.Tensor, kwargs: dict) -> float:
    out, seconds = timed_call(generate, ids, kwargs)
    return (out.shape[1] - ids.shape[1]) / seconds


@contextlib.contextmanager
def assistant_settings(draft, num_assistant_tokens: int):
    """Give the draft a fixed number of tokens per assisted step, then its own generation config
    back: transformers keeps adapted values on it between calls, which would leak across methods."""
    original = draft.generation_config
    tuned = copy.deepcopy(original)
    tuned.num_assistant_tokens = num_assistant_tokens
    tuned.num_assistant_tokens_schedule = "constant"
    draft.generation_config = tuned
    try:
        yield
    finally:
        draft.generation_config = original


def target_method(target) -> Method:
    return Method("target", METHOD_LABELS["target"], lambda ids, **kwargs: target.generate(ids, **kwargs))


def assisted_method(target, draft, candidates: tuple[int, ...]) -> Method:
    """transformers assisted generation; tune() keeps the fastest num_assistant_tokens on the warm-up prompt."""
    settings = {"num_assistant_tokens": max(candidates), "num_assistant_tokens_schedule": "constant"}
    tuning: dict[str, float] = {}

    def generate(ids, **kwargs):
        with assistant_settings(draft, settings["num_assistant_tokens"]):
            return target.generate(ids, assistant_model=draft, **kwargs)

    def tune(ids, **kwargs):
        tuning.clear()
        for n in candidates:
            settings["num_assistant_tokens"] = n
            tuning[str(n)] = round(tokens_per_second(generate, ids, kwargs), 3)
        settings["num_assistant_tokens"] = int(max(tuning, key=lambda n: (tuning[n], -int(n))))

    return Method("assisted", METHOD_LABELS["assisted"], generate, settings=settings, tune=tune, tuning=tuning)


def prompt_lookup_method(target, num_tokens: int) -> Method:
    def generate(ids, **kwargs):
        return target.generate(ids, prompt_lookup_num_tokens=num_tokens, **kwargs)

    return Method("prompt_lookup", METHOD_LABELS["prompt_lookup"], generate, settings={"prompt_lookup_num_tokens": num_tokens})


def swiftspec_method(name: str, model: SwiftSpecForCausalLM, seed: int) -> Method:
    def generate(ids, **kwargs):
        model.swiftspec_stats = None  # a failed call must not leave the previous call's stats behind
        generator = torch.Generator(device=model.target.device).manual_seed(seed)
        return model.generate(ids, swiftspec=True, generator=generator, **kwargs)

    placement = model.placement
    where = str(model.target.device) if placement.mode == "serial" else (
        f"{placement.mode}: target {placement.target[0]}, draft {placement.draft[0]}"
    )
    return Method(name, METHOD_LABELS[name], generate, stats=lambda: model.swiftspec_stats, settings={"placement": where})


def async_placement(target) -> tuple[dict | None, str]:
    """Where the asynchronous engine can put the draft beside the target in this process, or why it cannot."""
    device = target.device
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None, (
            "skipped: under torchrun every rank would run the whole bench; time the asynchronous engine across ranks "
            "with examples/torchrun_generate.py"
        )
    if device.type == "cpu":
        return {"target": ["cpu"], "draft": ["cpu"]}, "the draft runs in a second CPU thread"
    spare = [i for i in range(torch.cuda.device_count()) if i != (device.index or 0)] if device.type == "cuda" else []
    if spare:
        return {"target": [device.index or 0], "draft": [spare[-1]]}, f"the draft runs on cuda:{spare[-1]}"
    return None, (
        f"skipped: the target is on {device} and there is no second GPU for the draft (the asynchronous engine "
        "needs the draft on its own device, or its own rank under torchrun)"
    )


def skipped_result(name: str, note: str) -> MethodResult:
    return MethodResult(
        name, METHOD_LABELS.get(name, name), "skipped", note, {}, {}, None, None, None, None, None, None, {}, {}, []
    )


def async_method(models: BenchModels, settings: dict, seed: int, notes: list[str]) -> Method | MethodResult:
    """swiftspec_async, or a skipped result saying why the placement does not allow it."""
    spec, note = async_placement(models.target)
    if spec is None:
        notes.append(f"swiftspec_async {note}.")
        return skipped_result("swiftspec_async", note)
    draft = models.draft
    if torch.device(spec["draft"][0]) != draft.device:
        draft = copy.deepcopy(draft)  # the other methods keep the draft beside the target
    try:
        model = SwiftSpecForCausalLM.from_models(models.target, draft, placement=spec, **settings)
    except ValueError as error:
        notes.append(f"swiftspec_async skipped: {error}")
        return skipped_result("swiftspec_async", f"skipped: {error}")
    if models.target.device.type == "cpu":
        notes.append(
            f"swiftspec_async: {note}, so it uses a second core while every other method computes on "
            f"{torch.get_num_threads()} torch thread(s)."
        )
    method = swiftspec_method("swiftspec_async", model, seed)
    method.settings["note"] = note
    return method


def build_methods(models: BenchModels, config: BenchConfig, settings: dict, notes: list[str]):
    """(methods to run, results of methods skipped) in config.methods order, then config.extra_methods."""
    target, draft = models.target, models.draft
    builders = {
        "target": lambda: target_method(target),
        "assisted": lambda: assisted_method(target, draft, config.assistant_tokens),
        "prompt_lookup": lambda: prompt_lookup_method(target, config.prompt_lookup_tokens),
        "swiftspec_serial": lambda: swiftspec_method(
            "swiftspec_serial", SwiftSpecForCausalLM.from_models(target, draft, **settings), config.seed
        ),
        "swiftspec_async": lambda: async_method(models, settings, config.seed, notes),
    }
    built = [builders[name]() for name in config.methods] + list(config.extra_methods)
    return [m for m in built if isinstance(m, Method)], [m for m in built if isinstance(m, MethodResult)]


def check_config(config: BenchConfig) -> None:
    """Raise ValueError naming the first bad setting and what would be valid."""
    unknown = [name for name in config.methods if name not in METHOD_NAMES]
    if unknown:
        raise ValueError(f"Unknown methods {unknown}; choose from {list(METHOD_NAMES)}, or pass Method objects as extra_methods.")
    if "target" not in config.methods:
        raise ValueError(
            "methods must include 'target': it is the reference of the identical-output check and of every speed-up."
        )
    names = [*config.methods, *(m.name for m in config.extra_methods)]
    if len(set(names)) != len(names):
        raise ValueError(f"Method names repeat in {names}; give each method once, with a unique name.")
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(config, name) < 1:
            raise ValueError(f"BenchConfig.{name} must be at least 1, got {getattr(config, name)!r}.")
    for name in ("warmup", "growth_check_tokens"):
        if getattr(config, name) < 0:
            raise ValueError(f"BenchConfig.{name} must be 0 or more, got {getattr(config, name)!r}.")
    if not config.prompts:
        raise ValueError("BenchConfig.prompts is empty; name at least one bundled set or file.")
    if not config.assistant_tokens or min(config.assistant_tokens) < 1:
        raise ValueError(f"BenchConfig.assistant_tokens must be positive ints, got {config.assistant_tokens!r}.")
    if config.max_prompt_tokens is not None and config.max_prompt_tokens < 1:
        raise ValueError(f"BenchConfig.max_prompt_tokens must be None or at least 1, got {config.max_prompt_tokens!r}.")
    if config.peak_gbps is not None and not config.peak_gbps > 0:
        raise ValueError(f"BenchConfig.peak_gbps must be a positive GB/s figure or None (measure), got {config.peak_gbps!r}.")


@contextlib.contextmanager
def eos_ignored(model, ignore: bool):
    """With ignore, every call runs to max_new_tokens; the swiftspec wrappers share this generation config."""
    saved = model.generation_config.eos_token_id
    if ignore:
        model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


# ---------------------------------------------------------------- measuring one call


class ForwardCounter:
    """Counts forward calls of the module it hooks (the target: one per prefill or verification)."""

    def __init__(self):
        self.count = 0

    def __call__(self, module, args) -> None:
        self.count += 1


@contextlib.contextmanager
def counting_forwards(model):
    counter = ForwardCounter()
    handle = model.register_forward_pre_hook(counter)
    try:
        yield counter
    finally:
        handle.remove()


PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def proc_status_mib(key: str) -> float | None:
    """A "VmRSS:   1234 kB" line of /proc/self/status in MiB, or None off Linux."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_resident_mib() -> float:
    resident = proc_status_mib("VmRSS")
    if resident is not None:
        return resident
    import psutil  # accelerate depends on it

    return psutil.Process().memory_info().rss / MIB


def cpu_peak_mib() -> float:
    """The process's RSS high-water mark (since start, or since the last reset_cpu_peak)."""
    peak = proc_status_mib("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB on Linux


def reset_cpu_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: "5" > /proc/self/clear_refs); False where impossible."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


@dataclass
class MemoryProbe:
    """Peak memory of one call per device: "cpu" is the process RSS high-water mark, "cuda:i" what
    torch.cuda.max_memory_allocated reports. per_call: the CPU peak is reset before each call
    (else it is the process's peak since start, and run_memory_mib["cpu"] means little)."""

    cuda_devices: tuple[int, ...]
    per_call: bool

    @classmethod
    def create(cls, device: torch.device) -> "MemoryProbe":
        """With the target on a GPU, every visible GPU is watched (the async draft may sit on another)."""
        cuda = tuple(range(torch.cuda.device_count())) if device.type == "cuda" else ()
        return cls(cuda, reset_cpu_peak())

    @property
    def source(self) -> str:
        cpu = "process RSS high-water mark, reset before each call" if self.per_call else (
            "process RSS high-water mark since start (ru_maxrss; cannot be reset here)"
        )
        return cpu + ("; torch.cuda.max_memory_allocated per device" if self.cuda_devices else "")

    def start(self) -> dict[str, float]:
        """Reset the peaks; return what is resident now, per device (MiB)."""
        if self.per_call:
            reset_cpu_peak()
        for index in self.cuda_devices:
            torch.cuda.reset_peak_memory_stats(index)
        return {"cpu": cpu_resident_mib(), **{f"cuda:{i}": torch.cuda.memory_allocated(i) / MIB for i in self.cuda_devices}}

    def stop(self, before: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """(peak per device, peak minus what was resident at start) in MiB."""
        peak = {"cpu": cpu_peak_mib(), **{f"cuda:{i}": torch.cuda.max_memory_allocated(i) / MIB for i in self.cuda_devices}}
        return {k: round(v, 1) for k, v in peak.items()}, {k: round(max(peak[k] - before[k], 0.0), 1) for k in peak}


@dataclass
class Harness:
    """What every timed call of a run shares."""

    probe: MemoryProbe
    forwards: ForwardCounter
    seed: int
    warmup: int
    max_new_tokens: int


def timed_run(method: Method, ids: torch.Tensor, index: int, harness: Harness) -> tuple[list[int], PromptRun]:
    """One timed call on prompt `index` (ids (1, L)): its new tokens and its measurements."""
    torch.manual_seed(harness.seed)
    before = harness.probe.start()
    harness.forwards.count = 0
    out, seconds = timed_call(method.generate, ids, generation_kwargs(ids, harness.max_new_tokens))
    peak, extra = harness.probe.stop(before)
    tokens = out[0, ids.shape[1] :].tolist()
    stats, n, forwards = method.stats(), len(tokens), harness.forwards.count
    return tokens, PromptRun(
        prompt=index,
        seconds=seconds,
        new_tokens=n,
        tokens_per_s=n / seconds,
        speedup=0.0,  # known once target.generate has run on this prompt
        tau=stats.tau if stats is not None else (n / forwards if forwards else 0.0),
        target_forwards=forwards,
        target_forwards_per_token=forwards / n if n else 0.0,
        target_idle_fraction=stats.target_idle_fraction if stats is not None and stats.engine != "serial" else None,
        verify_step_ms=1000 * stats.target_time_s / stats.verify_steps if stats is not None and stats.verify_steps else None,
        peak_memory_mib=peak,
        run_memory_mib=extra,
    )


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_identical(outputs: dict[str, list[int]], set_name: str, info: PromptInfo) -> None:
    """Raise OutputMismatchError when any method's greedy tokens differ from target.generate's."""
    expected = outputs["target"]
    for name, tokens in outputs.items():
        if tokens == expected:
            continue
        at = first_difference(expected, tokens)
        got = tokens[at] if at < len(tokens) else "end"
        want = expected[at] if at < len(expected) else "end"
        raise OutputMismatchError(
            f"method {name!r} generated different tokens from target.generate on prompt {info.index} of set {set_name!r} "
            f"(id {info.id}): first difference at new token {at} (target.generate: {want}, {name}: {got}; "
            f"{len(expected)} vs {len(tokens)} new tokens). Greedy decoding must reproduce target.generate exactly, so "
            f"this run is invalid and nothing was written. Reproduce it with --prompts {set_name} --methods target,{name}."
        )


# ---------------------------------------------------------------- one prompt set


def rotated(methods: list[Method], shift: int) -> list[Method]:
    """The methods in turn order for one prompt: each prompt starts one method later."""
    shift %= len(methods)
    return methods[shift:] + methods[:shift]


def warm_up(methods: list[Method], prompt_set: PromptSet, harness: Harness, bar) -> None:
    """Untimed calls on the warm-up prompt (first-call costs stay out of every number), then tuning."""
    ids = prompt_set.warmup_ids
    kwargs = generation_kwargs(ids, harness.max_new_tokens)
    for method in methods:
        bar.set_postfix_str(f"{prompt_set.name}: warm-up {method.name}")
        for _ in range(harness.warmup):
            method.generate(ids, **kwargs)
        if method.tune is not None:
            bar.set_postfix_str(f"{prompt_set.name}: tuning {method.name}")
            method.tune(ids, **kwargs)


def spread(values) -> Spread | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return Spread(*(round(v, 6) for v in (statistics.mean(values), sd, min(values), max(values))))


def largest_per_device(maps: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for entry in maps:
        for device, value in entry.items():
            out[device] = max(out.get(device, 0.0), value)
    return out


def method_result(method: Method, runs: list[PromptRun]) -> MethodResult:
    def metric(name):
        return spread(getattr(run, name) for run in runs)

    return MethodResult(
        name=method.name,
        label=method.label,
        status="ok",
        note="",
        settings=copy.deepcopy(method.settings),
        tuning=dict(method.tuning),
        tokens_per_s=metric("tokens_per_s"),
        speedup=metric("speedup"),
        tau=metric("tau"),
        target_forwards_per_token=metric("target_forwards_per_token"),
        target_idle_fraction=metric("target_idle_fraction"),
        verify_step_ms=metric("verify_step_ms"),
        peak_memory_mib=largest_per_device([run.peak_memory_mib for run in runs]),
        run_memory_mib=largest_per_device([run.run_memory_mib for run in runs]),
        runs=runs,
    )


def run_prompt_set(prompt_set: PromptSet, methods: list[Method], skipped: list[MethodResult], order: list[str],
                   harness: Harness, bar) -> SetResult:
    """Warm up and tune, then every method on every prompt, interleaved; outputs checked per prompt."""
    warm_up(methods, prompt_set, harness, bar)
    runs: dict[str, list[PromptRun]] = {m.name: [] for m in methods}
    for info, ids in zip(prompt_set.infos, prompt_set.ids):
        outputs = {}
        for method in rotated(methods, info.index):
            bar.set_postfix_str(f"{prompt_set.name} #{info.id}: {method.name}")
            outputs[method.name], run = timed_run(method, ids, info.index, harness)
            runs[method.name].append(run)
            bar.update()
        check_identical(outputs, prompt_set.name, info)
        baseline = runs["target"][-1].tokens_per_s
        for method_runs in runs.values():
            method_runs[-1].speedup = method_runs[-1].tokens_per_s / baseline if baseline else 0.0
    results = {m.name: method_result(m, runs[m.name]) for m in methods} | {r.name: r for r in skipped}
    return SetResult(
        prompt_set.name, str(prompt_set.source), prompt_set.warmup.id, prompt_set.infos, [results[n] for n in order], None
    )


# ---------------------------------------------------------------- the limit: the memory-bandwidth floor


def measure_bandwidth_gbps(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth of `device` in GB/s (bytes read + written), best of `repeats` copies of `mib` MiB.

    A rough peak: on CPU it is what torch's copy reaches with the current thread count."""
    src = torch.ones(mib * MIB, dtype=torch.uint8, device=device)  # ones, not empty: pages must be touched
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def peak_bandwidth(config: BenchConfig, device: torch.device) -> tuple[float, str]:
    """(GB/s, where the figure comes from): config.peak_gbps, else a tensor-copy measurement."""
    if config.peak_gbps is not None:
        return config.peak_gbps, "given"
    mib = 1024 if device.type == "cuda" else 256
    gbps = measure_bandwidth_gbps(device, mib)
    return gbps, f"measured: best of 5 copies of a {mib} MiB tensor on {device}, {torch.get_num_threads()} thread(s)"


def weight_bytes_read(model) -> int:
    """Bytes one forward streams from memory: every parameter once, except an input embedding not
    shared with the output head, of which a step reads only the rows of its T tokens."""
    total = parameter_bytes(model)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    """KV cache bytes per position of context: layers x (K, V) x KV heads x head dim x dtype size."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * model.dtype.itemsize


def limit_report(result: SetResult, target, peak_gbps: float, peak_source: str) -> LimitReport | None:
    """The floor of one verification step at the set's mean context, against the measured step."""
    methods = {m.name: m for m in result.methods if m.status == "ok"}
    spec = next((methods[n] for n in ("swiftspec_serial", "swiftspec_async") if n in methods), None)
    base = methods.get("target")
    if spec is None or spec.verify_step_ms is None or base is None or not base.runs:
        return None
    new_tokens = {run.prompt: run.new_tokens for run in base.runs}
    context = statistics.mean(info.prompt_tokens + new_tokens[info.index] / 2 for info in result.prompts)
    weights, kv = weight_bytes_read(target), kv_bytes_per_token(target) * context
    floor_ms = 1000 * (weights + kv) / (peak_gbps * 1e9)
    target_step_ms = statistics.mean(1000 * run.seconds / run.new_tokens for run in base.runs if run.new_tokens)
    return LimitReport(
        method=spec.name,
        device=str(target.device),
        peak_gbps=round(peak_gbps, 3),
        peak_source=peak_source,
        weight_mb=round(weights / 1e6, 3),
        kv_mb=round(kv / 1e6, 3),
        context_tokens=round(context, 1),
        floor_ms=round(floor_ms, 4),
        verify_step_ms=round(spec.verify_step_ms.mean, 4),
        verify_over_floor=round(spec.verify_step_ms.mean / floor_ms, 3),
        target_step_ms=round(target_step_ms, 4),
        target_step_over_floor=round(target_step_ms / floor_ms, 3),
        tau=round(spec.tau.mean, 3),
        ceiling_tokens_per_s=round(1000 * spec.tau.mean / floor_ms, 2),
        tokens_per_s=round(spec.tokens_per_s.mean, 2),
    )


# ---------------------------------------------------------------- the memory budget


@dataclass(frozen=True)
class CacheSample:
    """A TreeCache right after one forward."""

    cache_id: int
    data_ptr: int
    shape: tuple[int, ...]
    capacity: int
    length: int
    tree_slots: int | None  # positions in the tree region after a tree step; None after a prefill
    nbytes: int


@contextlib.contextmanager
def sampling_caches(model, samples: list[CacheSample]):
    """Record the TreeCache each forward of `model` wrote into (nothing else is touched)."""

    def record(module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, TreeCache) and cache.kv is not None:
            # Tree steps pass a mask; a prefill (or the draft's first chain) does not, and its
            # tokens join the prefix only after the forward, so they are not tree slots.
            tree = cache.length - cache.prefix_len if kwargs.get("attention_mask") is not None else None
            samples.append(CacheSample(
                id(cache), cache.kv.data_ptr(), tuple(cache.kv.shape), cache.capacity, cache.length, tree,
                cache.kv.numel() * cache.kv.element_size(),
            ))

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        yield samples
    finally:
        handle.remove()


def cache_trace(role: str, samples: list[CacheSample]) -> CacheTrace:
    if not samples:
        raise RuntimeError(f"The {role} wrote no TreeCache during the memory check; the engine no longer uses TreeCache?")
    last = samples[-1]
    return CacheTrace(
        role=role,
        forwards=len(samples),
        caches=len({s.cache_id for s in samples}),
        buffers=len({(s.cache_id, s.data_ptr, s.shape) for s in samples}),
        shape=list(last.shape),
        capacity=last.capacity,
        max_length=max(s.length for s in samples),
        max_tree_slots=max((s.tree_slots for s in samples if s.tree_slots is not None), default=0),
        mib=round(last.nbytes / MIB, 3),
    )


def token_tree_bytes(capacity: int) -> int:
    """Bytes of the draft's TokenTree tensors at `capacity` nodes (built on the meta device: no memory)."""
    tree = new_tree(0, capacity, "meta")
    tensors = [getattr(tree, f.name) for f in fields(tree)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def memory_budget(models: BenchModels, settings: dict, ids: torch.Tensor, new_tokens: int) -> MemoryBudget:
    """Generate `new_tokens` from ids (1, L) with serial tree speculation, watching both caches."""
    model = SwiftSpecForCausalLM.from_models(models.target, models.draft, **settings)
    samples: dict[str, list[CacheSample]] = {"target": [], "draft": []}
    with sampling_caches(models.target, samples["target"]), sampling_caches(models.draft, samples["draft"]):
        model.generate(ids, swiftspec=True, **generation_kwargs(ids, new_tokens))
    target, draft = cache_trace("target", samples["target"]), cache_trace("draft", samples["draft"])
    context = ids.shape[1] + new_tokens
    config = model.config
    target_kv = kv_bytes_per_token(models.target) * context / MIB
    tree = token_tree_bytes(config.tree_capacity) / MIB
    draft_weights = parameter_bytes(models.draft) / MIB
    target_extra, draft_extra = target.capacity - context, draft.capacity - context
    return MemoryBudget(
        context_tokens=context,
        target_weights_mib=round(parameter_bytes(models.target) / MIB, 3),
        draft_weights_mib=round(draft_weights, 3),
        target_kv_mib=round(target_kv, 3),
        target_tree_cache_mib=target.mib,
        draft_tree_cache_mib=draft.mib,
        token_tree_mib=round(tree, 3),
        extra_mib=round(draft_weights + draft.mib + tree + target.mib - target_kv, 3),
        target_extra_slots=target_extra,
        tree_budget=config.tree_budget,
        draft_extra_slots=draft_extra,
        tree_capacity=config.tree_capacity,
        within_tree_region=target_extra <= config.tree_budget and draft.max_tree_slots <= config.tree_capacity,
        no_growth=all(t.caches == 1 and t.buffers == 1 for t in (target, draft)),
        traces=[target, draft],
    )


# ---------------------------------------------------------------- reports


def fmt(value: Spread | None, digits: int = 2, suffix: str = "") -> str:
    """"mean ± sd" of a Spread, "–" when the metric does not apply."""
    if value is None:
        return "–"
    return f"{value.mean:.{digits}f} ± {value.sd:.{digits}f}{suffix}"


def settings_text(method: MethodResult) -> str:
    if method.status != "ok":
        return method.note
    shown = {k: v for k, v in method.settings.items() if k not in ("num_assistant_tokens_schedule", "note")}
    text = ", ".join(f"{k}={v}" for k, v in shown.items())
    return f"{text} (fastest of {', '.join(method.tuning)})" if method.tuning else text


def memory_text(peak: dict[str, float], run: dict[str, float]) -> str:
    return "; ".join(f"{device} {peak[device]:.0f} (+{run.get(device, 0.0):.0f})" for device in peak) or "–"


def method_table(methods: list[MethodResult]) -> list[str]:
    lines = [
        "| method | settings | tokens/s | speed-up | τ | target fwd / token | target idle | peak MiB (+ during call) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        idle = None if m.target_idle_fraction is None else Spread(
            *(100 * getattr(m.target_idle_fraction, k) for k in ("mean", "sd", "min", "max"))
        )
        lines.append(
            f"| {m.label} | {settings_text(m)} | {fmt(m.tokens_per_s, 1)} | {fmt(m.speedup, 2, '×')} | {fmt(m.tau)} | "
            f"{fmt(m.target_forwards_per_token)} | {fmt(idle, 0, '%')} | {memory_text(m.peak_memory_mib, m.run_memory_mib)} |"
        )
    return lines


def limit_lines(limit: LimitReport) -> list[str]:
    return [
        f"**Limit** ({limit.method}, {limit.device}; peak bandwidth {limit.peak_gbps:.1f} GB/s, {limit.peak_source}): "
        f"one verification step reads {limit.weight_mb:.1f} MB of weights + {limit.kv_mb:.1f} MB of KV (mean context "
        f"{limit.context_tokens:.0f} tokens), so its floor is {limit.floor_ms:.2f} ms. Measured: {limit.verify_step_ms:.2f} ms "
        f"per verification ({limit.verify_over_floor:.2f}× the floor); target.generate {limit.target_step_ms:.2f} ms per "
        f"token ({limit.target_step_over_floor:.2f}×). Ceiling τ / floor = {limit.tau:.2f} / {limit.floor_ms:.2f} ms = "
        f"{limit.ceiling_tokens_per_s:.0f} tokens/s; measured {limit.tokens_per_s:.1f} tokens/s.",
        "",
    ]


def memory_lines(memory: MemoryBudget) -> list[str]:
    verdict = "no reallocation, one cache per model" if memory.no_growth else "**GREW: a kv buffer was reallocated**"
    lines = [
        f"## Memory budget ({memory.context_tokens} tokens of context)",
        "",
        "| item | MiB |",
        "|---|---|",
        f"| draft weights | {memory.draft_weights_mib:.1f} |",
        f"| draft TreeCache (context + {memory.draft_extra_slots} tree slots) | {memory.draft_tree_cache_mib:.1f} |",
        f"| token tree ({memory.tree_capacity} nodes) | {memory.token_tree_mib:.1f} |",
        f"| target TreeCache (context + {memory.target_extra_slots} slots) − its own KV ({memory.target_kv_mib:.1f}) | "
        f"{memory.target_tree_cache_mib - memory.target_kv_mib:.1f} |",
        f"| **extra over target alone** (target weights {memory.target_weights_mib:.1f}) | **{memory.extra_mib:.1f}** |",
        "",
    ]
    for t in memory.traces:
        lines.append(
            f"- {t.role}: {t.forwards} forwards, {t.caches} cache, {t.buffers} kv buffer {tuple(t.shape)}; at most "
            f"{t.max_length} of {t.capacity} positions and {t.max_tree_slots} tree slots in use."
        )
    lines += [
        f"- Within the tree region (target ≤ tree_budget={memory.tree_budget} extra slots, draft tree ≤ tree_capacity="
        f"{memory.tree_capacity}): {'yes' if memory.within_tree_region else '**no**'}; growth: {verdict}.",
        "",
    ]
    return lines


def markdown_report(report: BenchReport) -> str:
    """results.md: a header saying what ran where, one table per prompt set, the limit and the memory budget."""
    pair, env, config = report.pair, report.environment, report.config
    tree = ", ".join(f"{k}={'auto' if v is None else v}" for k, v in pair.settings.items() if k in TREE_OPTIONS)
    cut = (
        f"prompts cut to at most {config['max_prompt_tokens']} tokens and to fit the context"
        if config["max_prompt_tokens"]
        else "prompts cut only to fit the context"
    )
    lines = [
        "# SwiftSpec benchmark",
        "",
        f"Pair **{pair.name}**: target {pair.target} ({pair.target_params_m:g}M parameters), draft {pair.draft} "
        f"({pair.draft_params_m:g}M), {pair.dtype}; {env.device}, {env.threads} torch thread(s). Greedy, "
        f"{config['max_new_tokens']} new tokens at most, {cut}; mean ± sd over prompts; warm-up and tuning untimed; "
        f"every method's tokens identical to target.generate's on every prompt. swiftspec: {tree}.",
        "",
        f"hf_swiftspec {env.hf_swiftspec}, transformers {env.transformers}, torch {env.torch}, Python {env.python}; "
        f"{env.created}. Peak memory: {env.memory_source}.",
        "",
    ]
    for result in report.sets:
        lines += [f"## {result.name}: {len(result.prompts)} prompts", ""]
        lines += [f"From `{result.source}`; warm-up prompt {result.warmup_prompt}.", ""]
        lines += method_table(result.methods) + [""]
        if result.limit is not None:
            lines += limit_lines(result.limit)
    if report.memory is not None:
        lines += memory_lines(report.memory)
    if report.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in report.notes] + [""]
    return "\n".join(lines)


def write_plot(report: BenchReport, path: Path) -> None:
    """Speed-up and tokens/s per method, one bar per prompt set, sd as error bars."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display backend

    names = list(dict.fromkeys(m.name for s in report.sets for m in s.methods if m.status == "ok"))
    labels = {m.name: m.label for s in report.sets for m in s.methods}
    fig = Figure(figsize=(4 + 1.6 * len(names), 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / len(report.sets)
    for k, result in enumerate(report.sets):
        by_name = {m.name: m for m in result.methods if m.status == "ok"}
        xs = [i + (k - (len(report.sets) - 1) / 2) * width for i in range(len(names))]
        for ax, metric in zip(axes, ("speedup", "tokens_per_s")):
            values = [getattr(by_name[n], metric) if n in by_name else None for n in names]
            ax.bar(xs, [v.mean if v else 0 for v in values], width, yerr=[v.sd if v else 0 for v in values],
                   capsize=3, label=result.name)
    for ax, title in zip(axes, ("speed-up over target.generate", "tokens/s")):
        ax.set_title(title)
        ax.set_xticks(range(len(names)), [labels[n] for n in names], rotation=20, ha="right")
        ax.legend(fontsize="small")
    axes[0].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    fig.suptitle(f"{report.pair.name} on {report.environment.device}", fontsize="medium")
    fig.savefig(path, dpi=120)


def write_outputs(report: BenchReport, directory: str | Path) -> list[Path]:
    """results.json, results.md and (with matplotlib) results.png in `directory`; returns their paths."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    plot = find_spec("matplotlib") is not None
    if not plot:
        report.notes.append("No results.png: matplotlib is not installed (pip install 'hf_swiftspec[bench]').")
    paths = [folder / "results.json", folder / "results.md"]
    paths[0].write_text(json.dumps(asdict(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    paths[1].write_text(markdown_report(report), encoding="utf-8")
    if plot:
        paths.append(folder / "results.png")
        write_plot(report, paths[-1])
    return paths


# ---------------------------------------------------------------- the run


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    name = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{device} ({name})" if name else str(device)


def environment(device: torch.device, probe: MemoryProbe) -> Environment:
    import transformers

    from . import __version__

    return Environment(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        hf_swiftspec=__version__,
        transformers=transformers.__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        device=device_description(device),
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count() or 0,
        memory_source=probe.source,
    )


def config_record(config: BenchConfig) -> dict:
    """BenchConfig as results.json states it: everything but the objects (models, extra methods)."""
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("models", "extra_methods")}


def truncation_notes(prompt_sets: list[PromptSet], limit: int | None) -> list[str]:
    notes = []
    for prompt_set in prompt_sets:
        cut = sum(info.truncated for info in prompt_set.infos)
        if cut:
            notes.append(f"{prompt_set.name}: {cut} of {len(prompt_set.infos)} prompts were cut to {limit} tokens.")
    return notes


def progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="swiftspec bench", unit="call", disable=not enabled, file=sys.stderr, leave=False)


def run_bench(config: BenchConfig) -> BenchReport:
    """Run every method on every prompt set; raise OutputMismatchError if any output differs from
    target.generate's. Writes results.json / results.md / results.png when config.output_dir is set."""
    check_config(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    notes: list[str] = []
    models = load_models(config, notes)
    tokenizer = tokenizer_for(models, notes)
    settings = swiftspec_settings(models, config)
    device = models.target.device
    context = context_length(models.target.config)
    prompt_sets = [prepare_prompt_set(source, tokenizer, config, device, context) for source in config.prompts]
    notes += truncation_notes(prompt_sets, prompt_token_limit(config, context))
    probe = MemoryProbe.create(device)
    order = [*config.methods, *(m.name for m in config.extra_methods)]
    with eos_ignored(models.target, config.ignore_eos):
        methods, skipped = build_methods(models, config, settings, notes)
        total = len(methods) * sum(len(ps.ids) for ps in prompt_sets)
        with counting_forwards(models.target) as forwards, progress_bar(total, config.progress) as bar:
            harness = Harness(probe, forwards, config.seed, config.warmup, config.max_new_tokens)
            sets = [run_prompt_set(ps, methods, skipped, order, harness, bar) for ps in prompt_sets]
        memory = None
        if config.growth_check_tokens:
            ids = prompt_sets[0].warmup_ids
            room = config.growth_check_tokens if context is None else min(config.growth_check_tokens, context - ids.shape[1])
            memory = memory_budget(models, settings, ids, room)
            if not memory.no_growth:
                notes.append("The memory check saw a TreeCache kv buffer reallocated during one generation: a regression.")
    if {"swiftspec_serial", "swiftspec_async"} & {m.name for m in methods}:
        gbps, source = peak_bandwidth(config, device)
        for result in sets:
            result.limit = limit_report(result, models.target, gbps, source)
    report = BenchReport(
        schema_version=SCHEMA_VERSION,
        environment=environment(device, probe),
        pair=pair_info(models, settings, tokenizer),
        config=config_record(config),
        sets=sets,
        memory=memory,
        notes=notes,
    )
    if config.output_dir is not None:
        write_outputs(report, config.output_dir)
    return report


# ---------------------------------------------------------------- command line


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints (e.g. 2,4,8)") from None


def name_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench` options; defaults come from BenchConfig so the two never drift apart."""
    d = BenchConfig()
    parser.add_argument(
        "--pair", default=d.pair, help="pair repo id or folder (default: the demo pair, else an in-memory test pair)"
    )
    parser.add_argument(
        "--prompts", action="append", default=None, metavar="SET_OR_FILE",
        help=f"bundled set ({', '.join(BUNDLED_PROMPT_SETS)}) or a JSONL / text file; repeat for several "
        f"(default: {' '.join(d.prompts)})",
    )
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts, help="timed prompts per set (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="(default: %(default)s)")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="cut longer prompts; 0: never (default: %(default)s)"
    )
    parser.add_argument(
        "--methods", type=name_list, default=d.methods, help=f"comma-separated subset of {','.join(METHOD_NAMES)} (default: all)"
    )
    parser.add_argument(
        "--assistant-tokens", type=int_list, default=d.assistant_tokens,
        help="num_assistant_tokens values tried for assisted generation (default: %s)" % ",".join(map(str, d.assistant_tokens)),
    )
    parser.add_argument("--prompt-lookup-tokens", type=int, default=d.prompt_lookup_tokens, help="(default: %(default)s)")
    for name in TREE_OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the pair's {name}")
    parser.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=d.warmup, help="untimed calls per method before each set (default: %(default)s)"
    )
    parser.add_argument("--out", default=d.output_dir, help="output directory (default: %(default)s)")
    parser.add_argument("--device", default=d.device, help="device for --pair (default: cuda:0 if present, else cpu)")
    parser.add_argument(
        "--dtype", default=d.dtype, help="float32 | bfloat16 | float16 | auto (default: float32 on CPU, auto on GPU)"
    )
    parser.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false", help="feed prompts as plain text")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens on every call")
    parser.add_argument(
        "--peak-gbps", type=float, default=d.peak_gbps, help="peak memory bandwidth for the floor (default: measure)"
    )
    parser.add_argument(
        "--growth-check-tokens", type=int, default=d.growth_check_tokens,
        help="length of the memory-budget generation; 0 skips it (default: %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def bench_config(args: argparse.Namespace) -> BenchConfig:
    tree = {name: getattr(args, name) for name in TREE_OPTIONS if getattr(args, name) is not None}
    return BenchConfig(
        pair=args.pair,
        prompts=tuple(args.prompts) if args.prompts else BenchConfig().prompts,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens or None,
        methods=tuple(args.methods),
        seed=args.seed,
        warmup=args.warmup,
        output_dir=args.out,
        assistant_tokens=tuple(args.assistant_tokens),
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        swiftspec=tree,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        chat_template=args.chat_template,
        ignore_eos=args.ignore_eos,
        peak_gbps=args.peak_gbps,
        growth_check_tokens=args.growth_check_tokens,
        progress=not args.quiet,
    )


def bench_main(args: argparse.Namespace) -> int:
    """`swiftspec bench`: print the Markdown report; 1 on a failed run (differing outputs) or bad input."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the peers' deprecation warnings would break up the progress bar
    try:
        config = bench_config(args)
        report = run_bench(config)
    except OutputMismatchError as error:
        print(f"swiftspec bench: FAILED: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        print(f"swiftspec bench: error: {error}", file=sys.stderr)
        return 1
    finally:
        hf_logging.set_verbosity(verbosity)
    print(markdown_report(report))
    if config.output_dir is not None:
        print(f"swiftspec bench: results in {config.output_dir}/", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_swiftspec.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(bench_main(build_parser().parse_args()))
