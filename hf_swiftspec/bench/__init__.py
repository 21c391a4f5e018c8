"""`swiftspec bench`: SwiftSpec against what a user would otherwise run, on their pair and hardware.

    swiftspec bench [--pair PATH] [--prompts humaneval --prompts spec_bench] [--full] [--batch-sizes 1,2,4,8,16]
                    [--out bench_results]

For each prompt set, every method decodes greedily from the same prompts with the same settings,
interleaved call by call (the order rotates, so no method always runs first or last):

    target            target.generate: the baseline of every speed-up
    assisted          transformers assisted generation with the pair's draft; num_assistant_tokens
                      tuned on the warm-up prompt (the fastest of `assistant_tokens` is kept)
    prompt_lookup     transformers prompt-lookup decoding (prompt_lookup_num_tokens)
    swiftspec_serial  tree speculation, draft and target on one device, one after the other (the round
                      round="auto" takes: the device round wherever it decodes the call exactly)
    swiftspec_async   tree speculation with the draft on its own GPU (in its own thread on a CPU, when asked for);
                      skipped, with a note, when the devices do not allow it

At each batch size B > 1 (--batch-sizes; default 1 alone) the timed prompts are taken B at a time
into left-padded batches (a last, short group repeats its own prompts to fill B rows), and each
batch is one generate() call: target.generate (the baseline at that B) and swiftspec serial decode
it; assisted generation, prompt lookup (transformers runs them at batch 1 only) and swiftspec async
(batches decode on the serial engine) are reported as "unsupported". Throughput counts every row's
own new tokens (up to its EOS, not the padding after it). Each batch size starts from the swiftspec
model's state at the start of the set, so it never copies answers it gave the same prompts.

Every method's tokens must equal target.generate's on every prompt, row by row, or the run stops with
OutputMismatchError and writes nothing. Warm-up calls and tuning are not timed. The output
directory receives results.json (schema: `BenchReport` and the dataclasses it holds, version
SCHEMA_VERSION), results.md and, when matplotlib is installed, results.png.

`run_bench(BenchConfig(...))` is the API; `add_bench_arguments` / `bench_main` wire it as a
command. Nothing runs at import. Modules, one job each:

    schema    BenchConfig and the results.json dataclasses
    prompts   prompt sets: reading, tokenising, cutting to the context, left-padded batches
    methods   the pair under test, the methods timed on it, which of them decode batches
    measure   one timed call: wall time, rows' new tokens, target forwards, peak memory, identical outputs
    limits    the bandwidth floor of a verification step and the memory budget
    report    results.json, results.md, results.png
    command   run_bench and the command line
"""

from .command import add_bench_arguments, bench_config, bench_main, build_parser, run_bench
from .limits import memory_budget
from .methods import BenchModels, Method
from .prompts import PromptBatch, encode_prompt, load_prompts, prompt_batches
from .report import markdown_report, write_outputs
from .schema import (
    DEFAULT_METHODS,
    METHOD_NAMES,
    SCHEMA_VERSION,
    BatchResult,
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
    "DEFAULT_METHODS",
    "METHOD_NAMES",
    "SCHEMA_VERSION",
    "BatchResult",
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
    "PromptBatch",
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
    "prompt_batches",
    "memory_budget",
    "run_bench",
    "write_outputs",
]
