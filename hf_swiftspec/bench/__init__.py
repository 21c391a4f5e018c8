"""`swiftspec bench`: SwiftSpec against what a user would otherwise run, on their pair and hardware.

    swiftspec bench [--pair PATH] [--prompts humaneval --prompts spec_bench] [--full] [--out bench_results]

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
command. Nothing runs at import. Modules, one job each:

    schema    BenchConfig and the results.json dataclasses
    prompts   prompt sets: reading, tokenising, cutting to the context
    methods   the pair under test and the methods timed on it
    measure   one timed call: wall time, target forwards, peak memory, identical outputs
    limits    the bandwidth floor of a verification step and the memory budget
    report    results.json, results.md, results.png
    command   run_bench and the command line
"""

from .command import add_bench_arguments, bench_config, bench_main, build_parser, run_bench
from .limits import memory_budget
from .methods import BenchModels, Method
from .prompts import encode_prompt, load_prompts
from .report import markdown_report, write_outputs
from .schema import (
    METHOD_NAMES,
    SCHEMA_VERSION,
    BenchConfig,
    BenchReport,
    CacheTrace,
    Environment,
    LimitReport,
    MemoryBudget,
    MethodResult,
    OutputMismatchError,
    PairInfo,
    PromptInfo,
    PromptRun,
    SetResult,
    Spread,
)

__all__ = [
    "METHOD_NAMES",
    "SCHEMA_VERSION",
    "BenchConfig",
    "BenchModels",
    "BenchReport",
    "CacheTrace",
    "Environment",
    "LimitReport",
    "MemoryBudget",
    "Method",
    "MethodResult",
    "OutputMismatchError",
    "PairInfo",
    "PromptInfo",
    "PromptRun",
    "SetResult",
    "Spread",
    "add_bench_arguments",
    "bench_config",
    "bench_main",
    "build_parser",
    "encode_prompt",
    "load_prompts",
    "markdown_report",
    "memory_budget",
    "run_bench",
    "write_outputs",
]
