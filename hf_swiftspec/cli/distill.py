"""`swiftspec distill`: the command line of tools/distill.py (train a draft that agrees with a target and
write a pair folder), and the pair's speed measurement, which runs `swiftspec bench` on the held-out prompts.
Defaults come from DistillConfig, TrainSettings, EvalSettings and DataOptions."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from ..tools.distill import DRAFT_KINDS, DistillConfig, EvalSettings, distill
from ..tools.distill_corpus import HUB_PREFIX, DataOptions
from ..tools.distill_report import SPEED_FOLDER, Speed
from ..tools.distill_train import DEFAULT_STEPS, TrainSettings
from ..tools.options import add_tree_options, set_threads, tree_overrides

TRAIN_FLAGS = {"batch": int, "window": int, "lr": float, "warmup": int, "weight_decay": float, "top_k": int, "seed": int}
EVAL_FLAGS = {"prompts": int, "new_tokens": int, "windows": int, "tree_budget": int, "draft_width": int,
              "draft_depth": int}


def add_distill_parser(commands) -> None:
    parser = commands.add_parser(
        "distill", help="train a draft that agrees with a target and write a pair folder",
        description="Train a draft that agrees with TARGET (KL to its top-k next-token distribution) and write a "
                    "pair folder that SwiftSpecForCausalLM.from_pretrained loads.",
    )
    defaults = DistillConfig(target="", output="")
    parser.add_argument("output", help="pair folder to write (checkpoints go to OUTPUT/checkpoints)")
    parser.add_argument("--target", required=True, help="target Hub id or folder")
    parser.add_argument("--draft", default=defaults.draft, help=f"starting draft: {DRAFT_KINDS} (default: %(default)s)")
    parser.add_argument("--data", nargs="+", default=[], metavar="SOURCE",
                        help="text files, folders of them, .jsonl files (a 'text', 'prompt' (+ 'completion') or 'turns' "
                             f"field a line), a folder a `datasets` dataset was saved to, or {HUB_PREFIX}ID for a dataset on the Hub")
    parser.add_argument("--data-split", default=DataOptions.split, help="a dataset's split (default: %(default)s)")
    parser.add_argument("--data-column", default=None,
                        help="a dataset's (or jsonl's) text or messages column (default: text, messages, conversations or prompt)")
    parser.add_argument("--data-limit", type=int, default=None, metavar="N", help="the first N records of each source")
    parser.add_argument("--record-chars", type=int, default=DataOptions.record_chars,
                        help="plain text is cut at line ends into records of at most this many characters (default: %(default)s)")
    parser.add_argument("--self-distill", type=int, default=None, metavar="N", dest="self_distill_tokens",
                        help="train on the target's own greedy answers (N new tokens) to every record's prompt; 0: never "
                             "(default: the conversations' prompts are answered, plain text trains as it is)")
    parser.add_argument("--heldout-percent", type=int, default=defaults.heldout_percent,
                        help="records held out for the final measurement (default: %(default)s)")
    parser.add_argument("--heldout-data", nargs="+", default=[], metavar="SOURCE",
                        help="held-out records in sources of their own (then --data is all training)")
    parser.add_argument("--compare-draft", nargs="+", default=[], metavar="ID_OR_DIR", dest="compare_drafts",
                        help="other draft models to measure beside the distilled one, on the same held-out data")
    parser.add_argument("--eval-prompts-file", default=None, metavar="FILE",
                        help="held-out prompts for tau (text or .jsonl; default: the held-out records' prompts)")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default: {DEFAULT_STEPS}; not with --minutes)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="the whole run's time: train as long as the other phases leave, the schedule sized to it")
    parser.add_argument("--measure-share", type=float, default=defaults.measure_share,
                        help="under --minutes: the share of them the held-out measurements, the in-run bench and "
                             "self-distillation may take together (fewer prompts and tokens where the target is slow; "
                             "default: %(default)s)")
    for name, kind in TRAIN_FLAGS.items():
        default = getattr(defaults.train, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                            help="(default: the draft's recipe: 4 x 192 for early-exit, 8 x 256 otherwise)" if default is None
                            else "(default: %(default)s)")
    for name, kind in EVAL_FLAGS.items():
        parser.add_argument(f"--eval-{name.replace('_', '-')}", type=kind, default=getattr(defaults.eval, name),
                            dest=f"eval_{name}", help="held-out measurement (default: %(default)s)")
    add_tree_options(parser)  # the written pair's own tree settings; not given: the library's (the goodput policy)
    parser.add_argument("--no-speed", dest="speed", action="store_false",
                        help="do not time the pair against target.generate and prompt lookup at the end")
    parser.add_argument("--head-hidden", type=int, default=None, help="EAGLE-3 head width (default: the target's)")
    parser.add_argument("--head-depth", type=int, default=defaults.head_depth,
                        help="EAGLE-3 training-time test levels (default: %(default)s)")
    parser.add_argument("--save-every", type=int, default=defaults.save_every, help="checkpoint every N steps (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUTPUT")
    parser.add_argument("--force", action="store_true", help="write into a non-empty OUTPUT")
    parser.add_argument("--device", default=None, help="default: this rank's cuda device when present, else cpu")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default on a CPU: 1, as every swiftspec command; on a GPU: torch's choice)")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the pair folder to this Hub repo")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def distill_config(args: argparse.Namespace) -> DistillConfig:
    train = TrainSettings(steps=args.steps, minutes=args.minutes, **{name: getattr(args, name) for name in TRAIN_FLAGS})
    evaluation = replace(EvalSettings(), **{name: getattr(args, f"eval_{name}") for name in EVAL_FLAGS})
    data_options = DataOptions(split=args.data_split, column=args.data_column, limit=args.data_limit,
                               record_chars=args.record_chars)
    return DistillConfig(
        target=args.target, output=args.output, data=tuple(args.data), data_options=data_options, draft=args.draft,
        train=train, eval=evaluation, self_distill_tokens=args.self_distill_tokens, heldout_percent=args.heldout_percent,
        heldout_data=tuple(args.heldout_data), compare_drafts=tuple(args.compare_drafts),
        eval_prompts_file=args.eval_prompts_file, pair_settings=tree_overrides(args), head_hidden=args.head_hidden,
        measure_share=args.measure_share,
        head_depth=args.head_depth, save_every=args.save_every, resume=args.resume, force=args.force, device=args.device,
        dtype=args.dtype, push_to_hub=args.push_to_hub, private=args.private, verbose=not args.quiet,
        command=shlex.join(["swiftspec", *sys.argv[1:]]) if sys.argv[1:2] == ["distill"] else None,
    )


def bench_speed(pair, prompts_file: Path, folder: Path, config: DistillConfig) -> Speed:
    """The written pair against target.generate, prompt lookup and its own target draft-free (suffix proposals
    alone: what the draft adds) on the held-out prompts: `swiftspec bench` (interleaved, greedy, every output
    checked against target.generate's), its files under OUTPUT/bench/."""
    import torch

    from ..bench import BenchConfig, BenchModels, run_bench

    settings = {name: getattr(pair.config, name) for name in ("tree_budget", "draft_width", "draft_depth")}
    models = BenchModels(pair.target, pair.draft, pair.tokenizer, name=folder.name, settings=settings)
    prompts = sum(1 for line in prompts_file.read_text().splitlines() if line.strip())
    threads = torch.get_num_threads() if pair.target.device.type == "cpu" else None
    report = run_bench(BenchConfig(
        models=models, prompts=(str(prompts_file),), num_prompts=max(prompts - 1, 1), max_new_tokens=config.eval.new_tokens,
        methods=("target", "prompt_lookup", "swiftspec_serial", "swiftspec_suffix"), output_dir=str(folder / SPEED_FOLDER),
        threads=threads, chat_template=False, growth_check_tokens=0, progress=config.verbose,
    ))
    methods = {m.name: m for m in report.sets[0].at(1)}
    ours, lookup, free = methods["swiftspec_serial"], methods["prompt_lookup"], methods["swiftspec_suffix"]
    return Speed(len(report.sets[0].prompts), config.eval.new_tokens, ours.speedup.mean, lookup.speedup.mean,
                 ours.tau.mean, threads, SPEED_FOLDER, free.speedup.mean if free.speedup else None,
                 ours.draft_expansions.mean if ours.draft_expansions else None,
                 ours.ngram_share.mean if ours.ngram_share else None)


def process_seconds() -> float:
    """Seconds since this process started (its imports included: what a user timing the command counts), 0.0
    where psutil cannot tell."""
    import time

    try:
        import psutil  # accelerate depends on it
    except ImportError:
        return 0.0
    return max(time.time() - psutil.Process().create_time(), 0.0)


def run_distill(args: argparse.Namespace) -> int:
    from ..tools.distill import resolve_device

    set_threads(args.threads, resolve_device(args.device))  # the run's loading line says how many are in force
    result = distill(distill_config(args), speed=bench_speed if args.speed else None, started_ago=process_seconds())
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    b, a = result.before, result.after
    run = f" of a {result.seconds / 60:.1f}-minute run" if result.seconds is not None else ""
    print(f"wrote pair {result.folder} ({result.steps} steps x {result.batch} x {result.window} tokens: {result.train_tokens:,} "
          f"tokens trained on in {result.training_seconds / 60:.1f} minutes of training{run})")
    print(f"held-out top-1 agreement {b.agreement:.1%} -> {a.agreement:.1%}; tau {b.tau:.2f} -> {a.tau:.2f} with a fixed tree, "
          f"{a.policy_tau:.2f} under the pair's own settings ({a.new_tokens} tokens from {a.prompts} held-out prompts); "
          f"identical to target.generate: {a.identical}")
    for name, other in result.compared.items():
        print(f"beside it, {name}: top-1 agreement {other.agreement:.1%}, tau {other.tau:.2f}; identical: {other.identical}")
    if result.speed is not None:
        s = result.speed
        print(f"speed on {s.prompts} held-out prompts: {s.speedup:.2f}x target.generate, {s.over_prompt_lookup:.2f}x prompt "
              f"lookup ({result.folder / s.files})")
        if s.over_draft_free is not None:
            pays = "the draft pays" if s.draft_pays else "the draft does not pay on this machine"
            print(f"where it came from: draft-free {s.draft_free_speedup:.2f}x target.generate, so {pays} "
                  f"({s.over_draft_free:.2f}x draft-free); {s.draft_forwards:.1f} draft forwards a round, n-gram share "
                  f"{s.ngram_share:.0%}")
    return 0 if a.identical else 1
