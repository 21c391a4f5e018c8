"""The results.json schema: `BenchReport` and the dataclasses it holds, and `BenchConfig`, the run's
settings as results.json records them, with what a BenchConfig may carry in memory (`BenchModels`, `Method`). Keys only change with SCHEMA_VERSION (and the list in docs/source/en/bench.md).

Units are in the names: *_mib are MiB (2**20 bytes: memory); weight_mb / kv_mb are MB (10**6 bytes,
to divide by peak_gbps in 10**9 bytes/s); *_ms milliseconds; *_s seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..stats import SwiftSpecStats

SCHEMA_VERSION = 8  # 8: PromptRun.phases / device_phases; 7: PromptRun.capture_s; 6: PromptRun.overlap; 5: BenchConfig.eagle3; 4: MethodResult.weights_mib; 3: a batch dimension (SetResult.batches), PromptRun.prompts / row_tokens / engine
DEFAULT_METHODS = ("target", "assisted", "prompt_lookup", "swiftspec_serial", "swiftspec_async")
# Timed only when asked for (--methods): swiftspec_compiled (compile=True) compiles its layers first (tens of seconds
# on a CPU).
# swiftspec_suffix: the same target draft-free (suffix proposals only); swiftspec_eagle3: with BenchConfig.eagle3's head.
# target_static: transformers' own fast decoding, a static cache with its forward compiled (CUDA graphs on CUDA),
# timed by default off the CPU (on a CPU it compiles for minutes); assisted_static: assisted generation with that
# static cache (transformers >= 5.24 compiles the target after prefill), by default off the CPU too;
# swiftspec_serial: the round round="auto" takes (the device round wherever it decodes the call exactly);
# swiftspec_eager: swiftspec_serial with capture=False; swiftspec_device: the same pair and settings on the device
# round asked for (SwiftSpecConfig round="device"), skipped with the device round's reason where it cannot decode the
# pair exactly; swiftspec_host: on the host round (round="host"), while the asynchronous engine still drives it;
# swiftspec_async: the draft in a thread (or device) of its own, round="auto" (the device round's asynchronous engine
# where it decodes the call, else the host round's); swiftspec_async_device: that placement on the device round's
# asynchronous engine asked for (round="device": engine/device_async.py), skipped with its reason where it cannot
# decode the pair's calls; swiftspec_async_host: that placement on the host round's engine (round="host").
METHOD_NAMES = DEFAULT_METHODS + ("swiftspec_compiled", "swiftspec_suffix", "swiftspec_eagle3", "target_static",
                                  "swiftspec_eager", "assisted_static", "swiftspec_device", "swiftspec_host",
                                  "swiftspec_async_device", "swiftspec_async_host")
METHOD_LABELS = {
    "target": "target.generate",
    "assisted": "assisted generation",
    "prompt_lookup": "prompt lookup",
    "swiftspec_serial": "swiftspec serial",
    "swiftspec_async": "swiftspec async",
    "swiftspec_compiled": "swiftspec serial, compiled layers",
    "swiftspec_suffix": "swiftspec, suffix proposals only",
    "swiftspec_eagle3": "swiftspec, EAGLE-3 head",
    "target_static": "target.generate, static cache compiled",
    "assisted_static": "assisted generation, static cache compiled",
    "swiftspec_eager": "swiftspec serial, eager forwards",
    "swiftspec_device": "swiftspec, device round",
    "swiftspec_host": "swiftspec, host round",
    "swiftspec_async_device": "swiftspec async, device round",
    "swiftspec_async_host": "swiftspec async, host round",
}


# `swiftspec bench --full` / BenchConfig.full(): the long run, with enough prompts and tokens for
# stable means and a finer num_assistant_tokens search; several times the default run's work.
FULL_RUN = {"num_prompts": 8, "max_new_tokens": 128, "assistant_tokens": (2, 4, 6, 8, 12)}


@dataclass
class BenchModels:
    """A pair already in memory. tokenizer: the target's (None: hf_swiftspec.tools.models's character
    tokenizer, fine for the random test pairs); settings: SwiftSpecConfig fields (tree_budget, ...);
    draft_tokenizer: the draft's own, where it is not the target's (assisted generation then runs as transformers'
    universal assisted generation, swiftspec's draft proposes through text)."""

    target: Any
    draft: Any
    tokenizer: Any = None
    name: str = "in-memory pair"
    settings: dict = field(default_factory=dict)
    draft_tokenizer: Any = None


@dataclass
class Method:
    """One way of generating, timed side by side with the others.

    generate(input_ids (B, L), attention_mask=(B, L), **generation_kwargs) -> sequences (B, L + n),
        like target.generate; B > 1 (a left-padded batch) only where `batched`.
    stats: the SwiftSpecStats of the last call, for tree speculation (None otherwise).
    batched: it decodes a left-padded batch of prompts in one call, as target.generate does.
    tune(input_ids, **generation_kwargs): run once per prompt set on the warm-up prompt, before
        timing at batch size 1; may change `settings` (assisted generation picks
        num_assistant_tokens there).
    tuning: what tune measured, e.g. tokens/s per value tried.
    checkpoint(): returns a function that puts back what the method keeps between calls as it is
        now (swiftspec: the outputs its suffix proposals may copy), so every batch size starts from
        the same state rather than from the answers it just gave the same prompts.
    models: the models the method holds (its memory is their weights plus what its calls allocate).
    """

    name: str
    label: str
    generate: Callable[..., torch.Tensor]
    stats: Callable[[], SwiftSpecStats | None] = lambda: None
    settings: dict = field(default_factory=dict)
    batched: bool = False
    tune: Callable[..., None] | None = None
    tuning: dict = field(default_factory=dict)
    checkpoint: Callable[[], Callable[[], None]] = lambda: lambda: None
    models: tuple = ()


@dataclass
class BenchConfig:
    """What `run_bench` measures. The command line takes its defaults from here. The defaults are a
    quick run (about two minutes for the demo pair on 2 CPU cores); BenchConfig.full() is the long one."""

    pair: str | None = None  # pair repo id or folder; None: the bundled demo pair, else an in-memory agreeing_pair()
    models: BenchModels | None = None  # a pair in memory; wins over `pair`
    model: str | None = None  # a plain causal LM (id or folder): draft-free, wins over `pair`; assisted is skipped
    eagle3: str | None = None  # an EAGLE-3 head (folder, or a pair whose draft is one) for swiftspec_eagle3, added to the methods
    prompts: tuple[str, ...] = ("humaneval", "spec_bench")  # bundled set names or JSONL / text files
    num_prompts: int = 4  # timed prompts per set (full: 8); the set's first prompt is the warm-up prompt
    max_new_tokens: int = 64  # (full: 128)
    max_prompt_tokens: int | None = 256  # cut longer prompts (CNN/DM, RAG articles) so runs stay comparable; None: never
    methods: tuple[str, ...] | None = None  # None: by where the models run (command.default_methods)
    # Prompts per generate() call, each size a column of the report; above 1 the timed prompts are taken
    # that many at a time into left-padded batches (prompts.prompt_batches), and only the methods that
    # decode a batch in one call run (target.generate, swiftspec serial): the others report "unsupported".
    batch_sizes: tuple[int, ...] = (1,)
    extra_methods: tuple[Method, ...] = ()  # your own methods, checked and timed like the built-in ones
    seed: int = 0
    warmup: int = 1  # untimed calls per method on the warm-up prompt before each set
    output_dir: str | None = "bench_results"  # None: return the report without writing files
    assistant_tokens: tuple[int, ...] = (4, 8)  # num_assistant_tokens values tried for assisted generation (full: 2-12)
    prompt_lookup_tokens: int = 10  # transformers' documented example value
    swiftspec: dict = field(default_factory=dict)  # SwiftSpecConfig overrides (tree_budget=..., draft_depth=...)
    device: str | None = None  # for --pair; None: cuda:0 when there is a GPU, else cpu
    dtype: str | None = None  # for --pair; None: float32 on CPU, the checkpoint's own on GPU
    threads: int | None = None  # torch CPU threads per worker; None: 1 on CPU, torch's own on GPU
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    ignore_eos: bool = False  # generate exactly max_new_tokens on every call
    peak_gbps: float | None = None  # memory bandwidth for the floor; None: measure with a tensor copy
    growth_check_tokens: int = 256  # length of the cache-growth check generation; 0 skips the memory budget
    progress: bool = True

    @classmethod
    def full(cls, **changes) -> BenchConfig:
        """The long run (FULL_RUN), with `changes` on top."""
        return cls(**{**FULL_RUN, **changes})


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
    """One timed call of one method: on one prompt, or on a left-padded batch of them (one row each)."""

    prompts: list[int]  # PromptInfo.index of each row (a batch shorter than its size repeats its own prompts)
    seconds: float  # wall time of the generate() call
    row_tokens: list[int]  # each row's own new tokens: up to its first EOS, the padding after it not counted
    new_tokens: int  # sum of row_tokens
    tokens_per_s: float  # new_tokens / seconds: every row's tokens
    speedup: float  # tokens_per_s over target.generate's on the same prompts (the same padded batch)
    tau: float  # new tokens per target verification of one row (see MethodResult.tau)
    target_forwards: int  # target forward calls, prefill included (one call computes every row)
    target_forwards_per_token: float  # target_forwards / new_tokens
    target_idle_fraction: float | None  # async tree speculation only
    overlap: dict | None  # async tree speculation only: stats.OverlapBreakdown's fields (ms per round)
    verify_step_ms: float | None  # tree speculation: target time per verification of one row
    engine: str | None  # swiftspec: SwiftSpecStats.engine ("serial", or "target (batch: why)" where a batch fell back)
    tree_budget: float | None  # swiftspec: mean nodes verified per row and round (the policy's T, rounds weighted by rows)
    draft_expansions: float | None  # swiftspec: mean draft forwards per round
    plain_fraction: float | None  # swiftspec: share of rounds decoded plainly (T = 1)
    ngram_share: float | None  # swiftspec: share of accepted proposals from the n-gram chain
    peak_memory_mib: dict[str, float]  # device -> peak during the call ("cpu": process RSS)
    run_memory_mib: dict[str, float]  # device -> peak minus what was resident before the call
    capture_s: float | None = None  # swiftspec: of `seconds`, spent capturing (or first compiling) steps' buckets
    # swiftspec's serial round: where its time went (stats.RoundPhases.ms_per_round: clock, rounds, then the round
    # and each phase in ms per round, other last); device_phases: on CUDA, the same phases on the device's stream
    phases: dict | None = None
    device_phases: dict | None = None


@dataclass
class MethodResult:
    """One method over one prompt set. Metrics are None where they do not apply, and for a skipped method.

    status: "ok"; "skipped" (this pair or placement cannot run it: see note); "unsupported" (it
        cannot decode a batch of prompts in one call: see note).
    tau: swiftspec: SwiftSpecStats.tau (tokens per tree verification of one row, prefill
        excluded); the transformers methods: new tokens per target forward and row (their first
        forward prefills and verifies at once); target.generate: 1 (less in a batch whose rows
        finish early: generate keeps computing their padding).
    engines: swiftspec: the engines that decoded the calls (SwiftSpecStats.engine), in order seen.
    peak_memory_mib / run_memory_mib: the largest PromptRun values over the prompts.
    tuning: what was measured to pick `settings` (assisted: tokens/s per num_assistant_tokens).
    """

    name: str
    label: str
    status: str  # "ok", "skipped" or "unsupported"
    note: str
    settings: dict
    tuning: dict
    tokens_per_s: Spread | None
    speedup: Spread | None
    tau: Spread | None
    target_forwards_per_token: Spread | None
    target_idle_fraction: Spread | None
    verify_step_ms: Spread | None
    tree_budget: Spread | None
    draft_expansions: Spread | None
    plain_fraction: Spread | None
    ngram_share: Spread | None
    engines: list[str]
    peak_memory_mib: dict[str, float]
    run_memory_mib: dict[str, float]
    runs: list[PromptRun]
    weights_mib: dict[str, float] = field(default_factory=dict)  # device -> weights of the models it holds


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

    extra_mib = draft weights + draft cache + token tree + (target cache - the target's own KV for
    the same context). The caches are the round's: the device round's SlotCache holds the slot bucket
    of the context and its largest round's tree region (capacity_bucket: a power of two), the host
    round's TreeCache the context and the tree budget only; the draft's tree region stays within
    tree_capacity; no_growth: no kv buffer was reallocated and each model used one cache for the
    whole generation.
    """

    context_tokens: int  # prompt + new tokens of the checked generation
    target_weights_mib: float
    draft_weights_mib: float
    target_kv_mib: float  # the target's own KV cache for the same context (what target.generate holds)
    target_tree_cache_mib: float
    draft_tree_cache_mib: float
    token_tree_mib: float
    extra_mib: float
    target_extra_slots: int  # target cache capacity - its scratch slot - context
    tree_budget: int
    draft_extra_slots: int  # draft cache capacity - its scratch slot - context
    tree_capacity: int
    within_tree_region: bool
    no_growth: bool
    traces: list[CacheTrace]


@dataclass
class BatchResult:
    """Every method at one batch size on one prompt set: a MethodResult per method, "unsupported"
    for those that decode one prompt per call when batch_size > 1."""

    batch_size: int
    methods: list[MethodResult]


@dataclass
class SetResult:
    """All methods on one prompt set, at each batch size."""

    name: str
    source: str  # the file the prompts came from
    warmup_prompt: str  # id of the untimed warm-up / tuning prompt
    prompts: list[PromptInfo]
    batches: list[BatchResult]  # in BenchConfig.batch_sizes order, ascending
    limit: LimitReport | None  # from the batch-1 calls; None without them

    def at(self, batch_size: int) -> list[MethodResult]:
        """The methods' results at `batch_size` (empty when the run did not measure it)."""
        return next((b.methods for b in self.batches if b.batch_size == batch_size), [])


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
    threads: int  # torch CPU threads per worker
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
