"""The `swiftspec` command.

    swiftspec generate [--pair ID] [PROMPT]        stream a completion, then one statistics line
    swiftspec generate --compare                   also time the target alone and print the speed-up
    swiftspec generate --phases                    also print where each round's time went, phase by phase
    swiftspec pair create --target T --draft D DIR write a pair repo (config, tokenizer, model card)
    swiftspec pair check ID_OR_DIR                 check a pair without loading any weights
    swiftspec bench [--pair ID] [--prompts FILE]   time swiftspec against the peers, side by side
    swiftspec distill --target T --data F DIR      train a draft that agrees with T, write a pair repo

Without --pair, `generate` uses the demo pair that ships with hf_swiftspec (a tiny Python
code-completion pair), so it works offline on any machine. Progress and errors go to stderr,
the completion and the statistics to stdout; failures exit with status 1.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from dataclasses import dataclass, fields, replace

import torch
from transformers import TextStreamer

from ..modeling import SwiftSpecForCausalLM
from ..tools.options import (
    THREADS_HELP,
    TREE_OPTIONS,
    add_tree_options,
    load_pair,
    progress,
    resolve_device,
    set_threads,
    tree_overrides,
)
from ..pair import (
    DEMO_PAIR_NAME,
    HubOptions,
    PairConfigError,
    check_pair_files,
    context_length,
    create_pair_repo,
    member_description,
    resolve_pair,
    resolve_pair_folder,
)

DEFAULT_PROMPT = "def read_config(path):\n"
# --compare times whole calls, prefill included: with fewer new tokens than this (a sample that hit
# EOS at once) the ratio measures the prefill, not decoding, so no speed-up is printed.
MIN_TIMED_TOKENS = 8


@dataclass(frozen=True)
class GenerateOptions:
    """What `swiftspec generate` does; argparse takes its defaults from here (None: the pair's own)."""

    pair: str = DEMO_PAIR_NAME
    model: str | None = None  # a plain causal LM (id or folder) to speculate with draft-free; replaces pair
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float | None = None  # with do_sample only; None: 1.0
    top_p: float | None = None  # with do_sample only; None: 1.0
    seed: int = 0
    compare: bool = False
    phases: bool = False  # also print the rounds' breakdown (SwiftSpecStats.phases, or the asynchronous overlap)
    device: str | None = None  # None: cuda:0 when there is a GPU, else cpu
    dtype: str | None = None  # None: float32 on CPU (exact and fast there), the checkpoint's own on GPU
    threads: int | None = None  # None: 1 per worker on CPU, torch's own on GPU (options.THREADS_HELP says why)
    placement: str | None = None  # None: the pair's; "serial", "auto", or JSON like {"target": [0], "draft": [1]}
    tree_budget: int | None = None
    draft_width: int | None = None
    draft_depth: int | None = None


@dataclass(frozen=True)
class RunStats:
    """One timed generation."""

    new_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def parse_placement(text: str):
    """"serial" / "auto" as they are; anything starting with "{" as JSON (device indices or names per role)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PairConfigError(f"--placement {text!r} is not valid JSON ({err}); e.g. '{{\"target\": [0], \"draft\": [1]}}'.") from err


def check_options(options: GenerateOptions) -> None:
    """Refuse what generate would otherwise ignore or crash on, before any weights load (and before the
    prompt is echoed)."""
    if not options.prompt:
        raise ValueError("the prompt is empty; give the text to complete, e.g. swiftspec generate 'def f(x):'.")
    if options.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {options.max_new_tokens}: generate at least 1 token (the default is 128).")
    if options.do_sample and options.temperature == 0:
        raise ValueError(
            "--sample --temperature 0 asks for sampling at temperature 0, which is greedy decoding: drop --sample and "
            "--temperature (greedy is the default)."
        )
    if not options.do_sample:
        for flag, value in (("--temperature", options.temperature), ("--top-p", options.top_p)):
            if value is not None:
                raise ValueError(
                    f"{flag} {value} only applies when sampling, and this run is greedy (the default); add --sample "
                    f"to sample with it, or drop {flag}."
                )


def load_generate_pair(options: GenerateOptions, device: str) -> SwiftSpecForCausalLM:
    settings = tree_overrides(options)
    if options.placement is not None:
        settings["placement"] = parse_placement(options.placement)
    location = options.model or options.pair
    progress(f"loading {'model' if options.model else 'pair'} {location!r} on {device}")
    model = load_pair(location, location, device, options.dtype, **settings)
    if options.model and model.draft is not None:
        progress(f"--model {location!r} is a pair repo, not a plain model: speculating with its draft ({model.config.draft})")
    elif not options.model and model.draft is None:
        progress(f"--pair {location!r} is a plain causal LM, not a pair: speculating draft-free (suffix proposals only)")
    return model


def check_length(prompt_tokens: int, max_new_tokens: int, context: int | None) -> None:
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise PairConfigError(
            f"The prompt ({prompt_tokens} tokens) plus --max-new-tokens {max_new_tokens} exceeds the target's context "
            f"of {context} tokens; shorten the prompt or lower --max-new-tokens."
        )


def generation_kwargs(options: GenerateOptions, input_ids: torch.Tensor) -> dict:
    kwargs = dict(max_new_tokens=options.max_new_tokens, do_sample=options.do_sample, attention_mask=torch.ones_like(input_ids))
    if options.do_sample:
        kwargs.update(
            temperature=1.0 if options.temperature is None else options.temperature,
            top_p=1.0 if options.top_p is None else options.top_p,
        )
    return kwargs


def timed_generate(model, input_ids, options: GenerateOptions, swiftspec: bool, streamer=None) -> tuple[torch.Tensor, RunStats]:
    generator = torch.Generator(device=model.target.device).manual_seed(options.seed)
    torch.manual_seed(options.seed)  # the target-alone path samples from the global RNG
    start = time.perf_counter()
    out = model.generate(input_ids, swiftspec=swiftspec, streamer=streamer, generator=generator, **generation_kwargs(options, input_ids))
    seconds = time.perf_counter() - start
    return out, RunStats(out.shape[1] - input_ids.shape[1], seconds)


def statistics_line(model, run: RunStats, baseline: RunStats | None, identical: bool | None) -> str:
    """The one line `generate` ends with: tokens/s, tau, target forwards (and the speed-up with --compare)."""
    stats = model.swiftspec_stats
    line = (
        f"[swiftspec] {run.new_tokens} tokens in {run.seconds:.2f}s = {run.tokens_per_second:.1f} tokens/s | "
        f"tau {stats.tau:.2f} tokens per verification | {stats.target_forwards} target forwards, "
        f"{f'{stats.draft_forwards} draft forwards' if stats.draft_model else 'no draft model'} | engine {stats.engine}"
    )
    if baseline is not None:
        same = "" if identical is None else f", same output: {'yes' if identical else 'NO'}"
        if identical is False and model.target.dtype in (torch.bfloat16, torch.float16):
            same += (
                f" (in {str(model.target.dtype).removeprefix('torch.')} a verification and a 1-token step round "
                "differently, so near-tied tokens may part: docs/source/en/generate.md, 'What \"exact\" means'; float32 is exact)"
            )
        shortest = min(run.new_tokens, baseline.new_tokens)
        if shortest < MIN_TIMED_TOKENS:
            line += (
                f" | no speed-up: {'a sampled' if identical is None else 'the'} completion ended after {shortest} "
                f"token{'s' if shortest != 1 else ''}, too few to time decoding (the prompt's prefill dominates); "
                f"try another --seed or a larger --max-new-tokens{same}"
            )
        else:
            line += (
                f" | target alone {baseline.tokens_per_second:.1f} tokens/s -> speed-up "
                f"{run.tokens_per_second / baseline.tokens_per_second:.2f}x{same}"
            )
    return line


def run_generate(options: GenerateOptions) -> int:
    check_options(options)
    device = resolve_device(options.device)
    progress(set_threads(options.threads, device))
    model = load_generate_pair(options, device)
    tokenizer = model.tokenizer
    input_ids = tokenizer(options.prompt, return_tensors="pt").input_ids.to(model.target.device)
    if input_ids.shape[1] == 0:
        raise ValueError(f"the prompt {options.prompt!r} is empty after tokenisation; give text to complete.")
    check_length(input_ids.shape[1], options.max_new_tokens, context_length(model.target.config))
    baseline = identical = None
    if options.compare:
        progress("warming up, then timing the target alone")
        warm = replace(options, max_new_tokens=4)  # first calls pay one-time costs; keep them out of both timings
        timed_generate(model, input_ids, warm, swiftspec=True)
        timed_generate(model, input_ids, warm, swiftspec=False)
        expected, baseline = timed_generate(model, input_ids, options, swiftspec=False)
    print(options.prompt, end="", flush=True)
    out, run = timed_generate(model, input_ids, options, swiftspec=True, streamer=TextStreamer(tokenizer, skip_prompt=True))
    if options.compare and not options.do_sample:
        identical = out.tolist() == expected.tolist()
    print()
    print(statistics_line(model, run, baseline, identical), flush=True)
    if options.phases:
        print(breakdown_lines(model.swiftspec_stats), flush=True)
    return 0 if identical in (None, True) else 1


def breakdown_lines(stats) -> str:
    """--phases: where the call's rounds spent their time (the serial round's phases, on CUDA also on the device;
    the asynchronous engine's overlap)."""
    lines = [b.line() for b in (stats.phases, stats.device_phases, stats.overlap) if b is not None]
    return "\n".join(f"[swiftspec] {line}" for line in lines) or f"[swiftspec] no round breakdown from engine {stats.engine}"


def serve_overrides(args) -> dict:
    """The SwiftSpecConfig fields `swiftspec serve` overrides: the tree options, --round and --ngram-size."""
    extra = {"round": args.round, "ngram_size": args.ngram_size}
    return {**tree_overrides(args), **{name: value for name, value in extra.items() if value is not None}}


def run_serve(args) -> int:
    from ..serving.server import ServeOptions, serve  # transformers' server and its dependencies load only for this command

    options = ServeOptions(
        pair=args.pair, host=args.host, port=args.port, device=args.device, dtype=args.dtype, threads=args.threads,
        log_level=args.log_level, enable_cors=args.enable_cors, continuous_batching=args.continuous_batching,
        settings=serve_overrides(args), cb_max_memory_percent=args.cb_max_memory_percent,
        latency_guard=args.latency_guard, max_queue=args.max_queue, request_timeout=args.request_timeout,
        cache_positions=args.cache_positions, prefix_cache_positions=args.prefix_cache_positions,
        api_key=args.api_key, key_metrics=args.key_metrics,
    )
    serve(options)
    return 0


# ---------------------------------------------------------------- pair create / check


def run_pair_create(args) -> int:
    settings = {name: getattr(args, name) for name in TREE_OPTIONS if getattr(args, name) is not None}
    progress(f"checking {args.target} + {args.draft}")
    pair = create_pair_repo(
        args.dir,
        args.target,
        args.draft,
        target_revision=args.target_revision,
        draft_revision=args.draft_revision,
        hub=HubOptions(local_files_only=args.offline),
        title=args.title,
        license=args.license,
        license_name=args.license_name,
        license_link=args.license_link,
        force=args.force,
        **settings,
    )
    config = pair.config
    target = member_description(config.target, config.target_revision)
    draft = member_description(config.draft, config.draft_revision)
    print(f"wrote pair repo {args.dir} (target {target}, draft {draft})")
    return 0


def member_location(member) -> str:
    """A Hub member with its revision (or "default branch" when unpinned); a local folder has no branch."""
    if member.is_local:
        return f"{member.location} (local folder)"
    return f"{member.location} @ {member.revision or 'default branch'}"


def run_pair_check(args) -> int:
    hub = HubOptions(local_files_only=args.offline)
    folder = resolve_pair_folder(args.pair, args.revision, hub)
    check_pair_files(folder)
    print(f"{args.pair}: config.json and README.md model card are valid")
    if args.config_only:
        return 0
    pair = resolve_pair(folder, hub=hub)
    for role, member in pair.members.items():
        config = pair.member_configs[role].get_text_config()
        tokenizer = pair.member_tokenizers[role]
        print(
            f"{role}: {member_location(member)}: {config.model_type}, vocab_size "
            f"{config.vocab_size}, context {getattr(config, 'max_position_embeddings', '?')}, tokenizer "
            f"{'yes' if tokenizer is not None else 'none (checked by size)'}"
        )
    print(f"{args.pair}: compatible (architecture, vocabulary, special tokens, context length)")
    return 0


# ---------------------------------------------------------------- argument parsing


def build_parser() -> argparse.ArgumentParser:
    defaults = GenerateOptions()
    parser = argparse.ArgumentParser(prog="swiftspec", description="Lossless tree speculative decoding (SwiftSpec).")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream a completion and print its statistics")
    gen.add_argument("prompt", nargs="?", default=defaults.prompt, help="text to complete (default: %(default)r)")
    gen.add_argument("--pair", default=defaults.pair, help="pair repo id, folder or bundled name (default: %(default)s)")
    gen.add_argument(
        "--model", default=defaults.model, metavar="ID_OR_DIR",
        help="a plain causal LM (Hub id or folder): speculate draft-free, from the text's own repetition",
    )
    gen.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="(default: %(default)s)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="do_sample", action="store_false", help="greedy decoding (the default)")
    mode.add_argument("--sample", dest="do_sample", action="store_true", help="sample from the target's distribution")
    gen.set_defaults(do_sample=defaults.do_sample)
    gen.add_argument("--temperature", type=float, default=defaults.temperature, help="with --sample only (default: 1.0)")
    gen.add_argument("--top-p", type=float, default=defaults.top_p, help="with --sample only (default: 1.0)")
    gen.add_argument("--seed", type=int, default=defaults.seed, help="sampling seed (default: %(default)s)")
    gen.add_argument("--compare", action="store_true", help="also time the target alone and print the speed-up")
    gen.add_argument("--phases", action="store_true",
                     help="also print where each round's time went, phase by phase (ms per round)")
    gen.add_argument("--device", default=defaults.device, help="device for both models (default: cuda:0 if present, else cpu)")
    gen.add_argument("--dtype", default=defaults.dtype, help="float32 | bfloat16 | float16 | auto (default: float32 on CPU, auto on GPU)")
    gen.add_argument("--threads", type=int, default=defaults.threads, help=THREADS_HELP)
    gen.add_argument(
        "--placement",
        default=defaults.placement,
        help='where the two models run: serial | auto | JSON such as \'{"target": [0], "draft": [1]}\' (default: the pair\'s)',
    )
    add_tree_options(gen)

    pair = commands.add_parser("pair", help="create or check pair repos").add_subparsers(dest="pair_command", required=True)
    create = pair.add_parser("create", help="write a pair repo for a target and a draft")
    create.add_argument("dir", help="folder to write")
    create.add_argument("--target", required=True, help="target Hub id or folder")
    create.add_argument("--draft", required=True, help="draft Hub id or folder")
    create.add_argument("--target-revision", default=None, help="pin (default: the current commit of its default branch)")
    create.add_argument("--draft-revision", default=None, help="pin (default: the current commit of its default branch)")
    create.add_argument("--license", default="unknown", help="Hub licence id of the pair repo (default: %(default)s)")
    create.add_argument("--license-name", default=None, help="with --license other")
    create.add_argument("--license-link", default=None, help="with --license other")
    create.add_argument("--title", default=None, help="model card title")
    create.add_argument("--offline", action="store_true", help="use only the Hugging Face cache")
    create.add_argument(
        "--force", action="store_true", help="replace the pair repo already in DIR (any other non-empty folder is refused)"
    )
    add_tree_options(create)

    check = pair.add_parser("check", help="check a pair repo without loading weights")
    check.add_argument("pair", help="pair repo id, folder or bundled name")
    check.add_argument("--revision", default=None, help="revision of the pair repo")
    check.add_argument("--config-only", action="store_true", help="check only the pair's own files, not its members")
    check.add_argument("--offline", action="store_true", help="use only the Hugging Face cache")
    srv = commands.add_parser(
        "serve", help="serve a pair with transformers' OpenAI-compatible server (transformers serve), speculating"
    )
    srv.add_argument("pair", help="pair repo id, folder or bundled name, or a plain causal LM (draft-free)")
    srv.add_argument("--host", default="localhost", help="listen address (default: %(default)s)")
    srv.add_argument("--port", type=int, default=8000, help="listen port (default: %(default)s)")
    srv.add_argument("--device", default=None, help="device for both models (default: cuda:0 if present, else cpu)")
    srv.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | auto (default: float32 on CPU, auto on GPU)")
    srv.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    srv.add_argument("--log-level", default="warning", help="transformers' log level (default: %(default)s)")
    srv.add_argument("--enable-cors", action="store_true", help="permissive CORS, as transformers serve's flag")
    srv.add_argument(
        "--continuous-batching", action="store_true",
        help="every request speculates inside one running batch, joining and leaving it between rounds (a pair "
        "that cannot batch: speculating alone, else in transformers' batch of the target); default: one "
        "request at a time, each speculating",
    )
    srv.add_argument(
        "--cb-max-memory-percent", type=float, default=None, metavar="FRACTION",
        help="with --continuous-batching, for a pair that cannot batch: the share of free memory (0 to 1) "
        "transformers' continuous batch of the target gives its paged cache (default: transformers' own)",
    )
    srv.add_argument(
        "--no-latency-guard", dest="latency_guard", action="store_false",
        help="with --continuous-batching: size the running batch's trees for its goodput alone, without capping "
        "them so that no request decodes slower than the batch would plainly (serving.md)",
    )
    srv.add_argument("--max-queue", type=int, default=None, metavar="N",
                     help="the most requests waiting to decode; one more is answered 429 with Retry-After (default: no limit)")
    srv.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="cancel a request not done this long after it arrived, answering 504 (default: none)")
    srv.add_argument(
        "--cache-positions", type=int, default=None, metavar="N",
        help="with --continuous-batching: the most cache positions the running batch holds (rows x each row's prompt, "
        "max_tokens and largest tree); requests past it wait in the queue (default: no limit)",
    )
    srv.add_argument(
        "--prefix-cache-positions", type=int, default=None, metavar="N",
        help="with --continuous-batching: the most cache slots of recent prompts kept so that a request starting with "
        "the same tokens (a shared system prompt) copies their KV instead of prefilling them; 0: none (default: 8192, "
        "or a quarter of --cache-positions)",
    )
    srv.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="answer only requests carrying 'Authorization: Bearer KEY' under /v1 (others: 401); default: the "
        "SWIFTSPEC_API_KEY environment variable's key, which stays out of the process list, else none (serving.md)",
    )
    srv.add_argument("--key-metrics", action="store_true",
                     help="with an API key: /metrics and /health need it too (default: open, for a scraper and probes)")
    srv.add_argument(
        "--round", choices=("auto", "host", "device"), default=None,
        help="override the pair's round (default 'auto': the device round on CUDA where it applies): 'device' runs "
        "each round on the models' device, read once a round (with "
        "--continuous-batching too: the running batch's rows in power-of-two buckets of replayed phases); a pair it "
        "cannot decode exactly is refused, naming why (serving.md)",
    )
    srv.add_argument("--ngram-size", type=int, default=None,
                     help="override the pair's ngram_size (0: no suffix proposals)")
    add_tree_options(srv)

    from .distill import add_distill_parser

    add_distill_parser(commands)
    from ..bench import add_bench_arguments  # the bench imports these options: the command wires it in late

    add_bench_arguments(
        commands.add_parser("bench", help="time swiftspec against target.generate, assisted generation and prompt lookup")
    )
    return parser


def generate_options(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(**{f.name: getattr(args, f.name) for f in fields(GenerateOptions)})


def quiet_progress_bars() -> None:
    """Loading bars would interleave with the streamed completion; our own progress lines say enough."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` ran (`swiftspec generate ...`: generate's), whose usage an error shows."""
    for action in parser._actions:  # (argparse keeps its subcommands there; no public accessor)
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return command_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """argparse's parse_args, except that an unknown flag is reported by the subcommand it was given to: its usage,
    the flag, and its closest options (argparse's top-level parser would show `swiftspec`'s usage instead)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = command_parser(parser, args)
        options = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
        close = [m for flag in unknown for m in difflib.get_close_matches(flag.split("=")[0], options, n=2, cutoff=0.6)]
        hint = f" (did you mean {' or '.join(close)}?)" if close else f"; `{command.prog} --help` lists its options"
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    quiet_progress_bars()
    try:
        if args.command == "generate":
            return run_generate(generate_options(args))
        if args.command == "bench":
            from ..bench import bench_main

            return bench_main(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "distill":
            from .distill import run_distill

            return run_distill(args)
        if args.pair_command == "create":
            return run_pair_create(args)
        return run_pair_check(args)
    except (PairConfigError, ValueError, OSError) as err:
        print(f"swiftspec: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nswiftspec: interrupted", file=sys.stderr)
        return 130
