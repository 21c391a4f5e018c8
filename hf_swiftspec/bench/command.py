"""`run_bench` (the orchestration: every method on every prompt set at every batch size,
interleaved) and the `swiftspec bench` command around it."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from dataclasses import fields, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..tools.options import THREADS_HELP, add_tree_options, progress, resolve_device, set_threads, tree_overrides
from ..pair import context_length
from ..tools.models import REAL_SHAPES
from .limits import limit_report, memory_budget, peak_bandwidth
from .measure import (
    Harness,
    MemoryProbe,
    check_identical,
    counting_forwards,
    eos_token_ids,
    generation_kwargs,
    method_result,
    timed_run,
)
from .methods import (
    Method,
    build_methods,
    eos_ignored,
    load_models,
    methods_at,
    pair_info,
    swiftspec_settings,
    tokenizer_for,
)
from .prompts import (
    BUNDLED_PROMPT_SETS,
    PromptSet,
    has_chat_template,
    padding_token,
    prepare_prompt_set,
    prompt_batches,
    prompt_token_limit,
    truncation_notes,
)
from .report import markdown_report, write_outputs
from .schema import (
    DEFAULT_METHODS,
    FULL_RUN,
    METHOD_NAMES,
    SCHEMA_VERSION,
    BenchConfig,
    BatchResult,
    BenchReport,
    Environment,
    MethodResult,
    OutputMismatchError,
    PromptRun,
    SetResult,
)


def default_methods(where: torch.device | str) -> tuple[tuple[str, ...], str | None]:
    """(methods, note) when none are named: DEFAULT_METHODS, less swiftspec_async where the models run on
    the CPU (its two threads then share the interpreter and the cores, where it has run at 0.5-0.6x)."""
    if torch.device(where).type != "cpu":  # transformers' compiled static-cache decoding is the peer there
        return DEFAULT_METHODS[:1] + ("target_static",) + DEFAULT_METHODS[1:2] + ("assisted_static",) + DEFAULT_METHODS[2:], None
    methods = tuple(name for name in DEFAULT_METHODS if name != "swiftspec_async")
    return methods, (
        "swiftspec_async was not run: both models are on the CPU, where the asynchronous engine only shares its "
        f"cores; --methods {','.join(DEFAULT_METHODS)} times it too."
    )


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
    sizes = config.batch_sizes
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"BenchConfig.batch_sizes must be distinct positive ints, e.g. (1, 2, 4, 8, 16); got {sizes!r}.")
    if config.peak_gbps is not None and not config.peak_gbps > 0:
        raise ValueError(f"BenchConfig.peak_gbps must be a positive GB/s figure or None (measure), got {config.peak_gbps!r}.")


def rotated(methods: list[Method], shift: int) -> list[Method]:
    """The methods in turn order for one prompt: each prompt starts one method later."""
    shift %= len(methods)
    return methods[shift:] + methods[:shift]


def warm_up(methods: list[Method], prompt_set: PromptSet, size: int, harness: Harness, bar) -> None:
    """Untimed calls on `size` copies of the warm-up prompt (first-call costs, and the goodput
    policy's first measurements at this batch size, stay out of every number); tuning at size 1."""
    ids = prompt_set.warmup_ids.repeat(size, 1)  # (size, L)
    kwargs = generation_kwargs(ids, harness.max_new_tokens)
    for method in methods:
        bar.set_postfix_str(f"{prompt_set.name} B={size}: warm-up {method.name}")
        for _ in range(harness.warmup):
            method.generate(ids, **kwargs)
        if method.tune is not None and size == 1:
            bar.set_postfix_str(f"{prompt_set.name}: tuning {method.name}")
            method.tune(ids, **kwargs)


def run_batch_size(prompt_set: PromptSet, size: int, methods: list[Method], absent: list[MethodResult],
                   order: list[str], harness: Harness, bar) -> BatchResult:
    """Warm up, then every method on every batch of `size` prompts, interleaved (each batch starts
    one method later); outputs checked row by row against target.generate's on the same batch."""
    warm_up(methods, prompt_set, size, harness, bar)
    runs: dict[str, list[PromptRun]] = {m.name: [] for m in methods}
    for k, batch in enumerate(prompt_batches(prompt_set, size, harness.pad_token_id)):
        rows = [prompt_set.infos[i] for i in batch.prompts]
        where = f"#{rows[0].id}" if size == 1 else f"batch {k} of {size}"
        outputs = {}
        for method in rotated(methods, k):
            bar.set_postfix_str(f"{prompt_set.name} {where}: {method.name}")
            outputs[method.name], run = timed_run(method, batch, harness)
            runs[method.name].append(run)
            bar.update()
        check_identical(outputs, prompt_set.name, rows)
        baseline = runs["target"][-1].tokens_per_s
        for method_runs in runs.values():
            method_runs[-1].speedup = method_runs[-1].tokens_per_s / baseline if baseline else 0.0
    results = {m.name: method_result(m, runs[m.name]) for m in methods} | {r.name: r for r in absent}
    return BatchResult(size, [results[n] for n in order])


def run_prompt_set(prompt_set: PromptSet, methods: list[Method], skipped: list[MethodResult], order: list[str],
                   harness: Harness, bar) -> SetResult:
    """Every batch size in turn, each from the state the set began in (Method.checkpoint): a later
    size must not copy the answers an earlier one gave the same prompts."""
    restores = [method.checkpoint() for method in methods]
    batches = []
    for k, size in enumerate(harness.batch_sizes):
        if k:
            for restore in restores:
                restore()
        running, absent = methods_at(size, methods, skipped)
        batches.append(run_batch_size(prompt_set, size, running, absent, order, harness, bar))
    return SetResult(prompt_set.name, str(prompt_set.source), prompt_set.warmup.id, prompt_set.infos, batches, None)


def calls(prompt_sets: list[PromptSet], methods: list[Method], skipped: list[MethodResult], sizes: tuple[int, ...]) -> int:
    """Timed generate() calls of the whole run (the progress bar's length)."""
    return sum(
        len(methods_at(size, methods, skipped)[0]) * -(-len(ps.ids) // size) for ps in prompt_sets for size in sizes
    )


def fallback_notes(sets: list[SetResult]) -> list[str]:
    """Where swiftspec decoded a batch with transformers' own loop: its figures there are not speculation's."""
    return [
        f"{result.name}, batch size {batch.batch_size}: {m.label} ran as {engine}; its figures there measure "
        "transformers' own decoding loop, not speculation."
        for result in sets for batch in result.batches for m in batch.methods for engine in m.engines
        if engine.startswith("target")
    ]


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

    from .. import __version__

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


def config_record(config: BenchConfig, tokenizer=None) -> dict:
    """BenchConfig as results.json states it: everything but the objects (models, extra methods), with
    chat_template saying whether prompts were wrapped in one (False where the tokenizer has none)."""
    record = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("models", "extra_methods")}
    record["chat_template"] = bool(config.chat_template and has_chat_template(tokenizer))
    return record


def progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="swiftspec bench", unit="call", disable=not enabled, file=sys.stderr, leave=False)


def run_bench(config: BenchConfig) -> BenchReport:
    """Run every method on every prompt set; raise OutputMismatchError if any output differs from
    target.generate's. Writes results.json / results.md / results.png when config.output_dir is set."""
    where = config.models.target.device if config.models is not None else resolve_device(config.device)
    notes: list[str] = []
    if config.methods is None:
        methods, note = default_methods(where)
        config = replace(config, methods=methods)
        notes += [note] if note else []
    if config.eagle3 and "swiftspec_eagle3" not in config.methods:  # a head given: time it
        config = replace(config, methods=(*config.methods, "swiftspec_eagle3"))
    check_config(config)
    threads = set_threads(config.threads, where)
    if config.progress:
        progress(threads, prefix="swiftspec bench")
    models = load_models(config, notes)
    tokenizer = tokenizer_for(models, notes)
    settings = swiftspec_settings(models, config)
    device = models.target.device
    context = context_length(models.target.config)
    prompt_sets = [prepare_prompt_set(source, tokenizer, config, device, context) for source in config.prompts]
    notes += truncation_notes(prompt_sets, prompt_token_limit(config, context))
    if config.chat_template and not has_chat_template(tokenizer):
        notes.append("The tokenizer has no chat template: prompts went in as plain text.")
    probe = MemoryProbe.create(device)
    order = [*config.methods, *(m.name for m in config.extra_methods)]
    sizes = tuple(sorted(config.batch_sizes))
    pad = padding_token(tokenizer, models.target.generation_config) if max(sizes) > 1 else 0
    with eos_ignored(models.target, config.ignore_eos):
        methods, skipped = build_methods(models, config, settings, notes)
        eos = eos_token_ids(models.target.generation_config)
        total = calls(prompt_sets, methods, skipped, sizes)
        with counting_forwards(models.target) as forwards, progress_bar(total, config.progress) as bar:
            harness = Harness(probe, forwards, config.seed, config.warmup, config.max_new_tokens, sizes, pad, eos)
            sets = [run_prompt_set(ps, methods, skipped, order, harness, bar) for ps in prompt_sets]
        notes += fallback_notes(sets)
        memory = None
        if config.growth_check_tokens and models.draft is None:
            notes.append("The memory check was skipped: it measures the draft's tree region, and there is no draft.")
        elif config.growth_check_tokens:
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
        config=config_record(config, tokenizer),
        sets=sets,
        memory=memory,
        notes=notes,
    )
    if config.output_dir is not None:
        write_outputs(report, config.output_dir)
    return report


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
        "--pair", default=d.pair, help="pair repo id or folder, or shape:NAME for a random-weight pair shaped like a real model (NAME: "
        + ", ".join(REAL_SHAPES) + "); default: the demo pair, else an in-memory test pair"
    )
    parser.add_argument(
        "--model", default=d.model, metavar="ID_OR_DIR",
        help="a plain causal LM (Hub id or folder) to speculate with draft-free; replaces --pair (assisted generation "
        "and the asynchronous engine are skipped)",
    )
    parser.add_argument(
        "--eagle3", default=d.eagle3, metavar="HEAD",
        help="an EAGLE-3 head for the target (its folder, or a pair whose draft is one, e.g. swiftspec-demo-pystdlib-eagle3): "
        "adds the method swiftspec_eagle3",
    )
    parser.add_argument(
        "--prompts", action="append", default=None, metavar="SET_OR_FILE",
        help=f"bundled set ({', '.join(BUNDLED_PROMPT_SETS)}) or a JSONL / text file; repeat for several "
        f"(default: {' '.join(d.prompts)})",
    )
    parser.add_argument(
        "--full", action="store_true",
        help=f"the long run: {FULL_RUN['num_prompts']} prompts per set, {FULL_RUN['max_new_tokens']} new tokens, "
        f"num_assistant_tokens tuned over {','.join(map(str, FULL_RUN['assistant_tokens']))}; several times longer "
        "than the default quick run (options given explicitly still win)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None,
        help=f"timed prompts per set (default: {d.num_prompts}; --full: {FULL_RUN['num_prompts']})",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None,
        help=f"(default: {d.max_new_tokens}; --full: {FULL_RUN['max_new_tokens']})",
    )
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="cut longer prompts; 0: never (default: %(default)s)"
    )
    parser.add_argument(
        "--methods", type=name_list, default=d.methods, help=f"comma-separated subset of {','.join(METHOD_NAMES)} (default: all but swiftspec_compiled, and "
        "swiftspec_async only where the draft gets a device of its own)"
    )
    parser.add_argument(
        "--assistant-tokens", type=int_list, default=None,
        help=f"num_assistant_tokens values tried for assisted generation (default: {','.join(map(str, d.assistant_tokens))}; "
        f"--full: {','.join(map(str, FULL_RUN['assistant_tokens']))})",
    )
    parser.add_argument(
        "--batch-sizes", type=int_list, default=d.batch_sizes, metavar="B,B,...",
        help="prompts per generate() call, e.g. 1,2,4,8,16: above 1 the prompts are left-padded into batches, and "
        "target.generate and swiftspec serial decode each in one call (the other methods: unsupported) "
        "(default: %(default)s)",
    )
    parser.add_argument("--prompt-lookup-tokens", type=int, default=d.prompt_lookup_tokens, help="(default: %(default)s)")
    add_tree_options(parser)
    parser.add_argument("--ngram-size", type=int, default=None,
                        help="override the pair's ngram_size (0: no suffix proposals)")
    parser.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=d.warmup, help="untimed calls per method before each set (default: %(default)s)"
    )
    parser.add_argument("--out", default=d.output_dir, help="output directory (default: %(default)s)")
    parser.add_argument("--device", default=d.device, help="device for --pair (default: cuda:0 if present, else cpu)")
    parser.add_argument(
        "--dtype", default=d.dtype, help="float32 | bfloat16 | float16 | auto (default: float32 on CPU, auto on GPU)"
    )
    parser.add_argument("--threads", type=int, default=d.threads, help=THREADS_HELP)
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
    """BenchConfig from parsed `bench` options: the defaults (or FULL_RUN with --full), then what was given."""
    given = {name: getattr(args, name) for name in FULL_RUN if getattr(args, name) is not None}
    sizes = {**(FULL_RUN if args.full else {}), **given}
    return BenchConfig(
        **sizes,
        pair=args.pair,
        model=args.model,
        eagle3=args.eagle3,
        prompts=tuple(args.prompts) if args.prompts else BenchConfig().prompts,
        max_prompt_tokens=args.max_prompt_tokens or None,
        methods=tuple(args.methods) if args.methods else None,
        batch_sizes=tuple(args.batch_sizes),
        seed=args.seed,
        warmup=args.warmup,
        output_dir=args.out,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        swiftspec={**tree_overrides(args), **({} if args.ngram_size is None else {"ngram_size": args.ngram_size})},
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
    overview = sys.modules[__package__].__doc__  # the package's docstring: what the bench runs and writes
    parser = argparse.ArgumentParser(
        prog="python -m hf_swiftspec.bench", description=overview, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_arguments(parser)
    return parser
