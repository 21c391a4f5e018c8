"""`swiftspec distill`: the command line of tools/distill.py (train a draft that agrees with a target and
write a pair folder). Defaults come from DistillConfig, TrainSettings and EvalSettings."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace

from ..tools.distill import DRAFT_KINDS, DistillConfig, EvalSettings, distill
from ..tools.distill_train import TrainSettings

TRAIN_FLAGS = {"steps": int, "batch": int, "window": int, "lr": float, "warmup": int, "weight_decay": float,
               "top_k": int, "seed": int}
EVAL_FLAGS = {"prompts": int, "new_tokens": int, "windows": int, "tree_budget": int, "draft_width": int,
              "draft_depth": int}


def add_distill_parser(commands) -> None:
    parser = commands.add_parser(
        "distill", help="train a draft (or an EAGLE-3 head) that agrees with a target and write a pair folder",
        description="Train a draft that agrees with TARGET (KL to its top-k next-token distribution) and write a "
                    "pair folder that SwiftSpecForCausalLM.from_pretrained loads.",
    )
    defaults = DistillConfig(target="", output="")
    parser.add_argument("output", help="pair folder to write (checkpoints go to OUTPUT/checkpoints)")
    parser.add_argument("--target", required=True, help="target Hub id or folder")
    parser.add_argument("--draft", default=defaults.draft, help=f"starting draft: {DRAFT_KINDS} (default: %(default)s)")
    parser.add_argument("--data", nargs="+", default=[], metavar="FILE",
                        help="text files, or .jsonl files with a 'text', 'prompt' (+ 'completion') or 'turns' field per line")
    parser.add_argument("--self-distill", type=int, default=0, metavar="N", dest="self_distill_tokens",
                        help="train on the target's own greedy continuations (N new tokens) of the records' prompts")
    parser.add_argument("--heldout-percent", type=int, default=defaults.heldout_percent,
                        help="records held out for the final measurement (default: %(default)s)")
    parser.add_argument("--heldout-data", nargs="+", default=[], metavar="FILE",
                        help="held-out records in files of their own (then --data is all training)")
    parser.add_argument("--compare-draft", nargs="+", default=[], metavar="ID_OR_DIR", dest="compare_drafts",
                        help="other draft models to measure beside the distilled one, on the same held-out data")
    parser.add_argument("--eval-prompts-file", default=None, metavar="FILE",
                        help="held-out prompts for tau (text or .jsonl; default: the held-out records' prompts)")
    for name, kind in TRAIN_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults.train, name),
                            help="(default: %(default)s)")
    for name, kind in EVAL_FLAGS.items():
        parser.add_argument(f"--eval-{name.replace('_', '-')}", type=kind, default=getattr(defaults.eval, name),
                            dest=f"eval_{name}", help="held-out measurement (default: %(default)s)")
    parser.add_argument("--head-hidden", type=int, default=None, help="EAGLE-3 head width (default: the target's)")
    parser.add_argument("--head-depth", type=int, default=defaults.head_depth,
                        help="EAGLE-3 training-time test levels (default: %(default)s)")
    parser.add_argument("--save-every", type=int, default=defaults.save_every, help="checkpoint every N steps (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUTPUT")
    parser.add_argument("--force", action="store_true", help="write into a non-empty OUTPUT")
    parser.add_argument("--device", default=None, help="default: this rank's cuda device when present, else cpu")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the pair folder to this Hub repo")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def distill_config(args: argparse.Namespace) -> DistillConfig:
    train = TrainSettings(**{name: getattr(args, name) for name in TRAIN_FLAGS})
    evaluation = replace(EvalSettings(), **{name: getattr(args, f"eval_{name}") for name in EVAL_FLAGS})
    return DistillConfig(
        target=args.target, output=args.output, data=tuple(args.data), draft=args.draft, train=train, eval=evaluation,
        self_distill_tokens=args.self_distill_tokens, heldout_percent=args.heldout_percent,
        heldout_data=tuple(args.heldout_data), compare_drafts=tuple(args.compare_drafts),
        eval_prompts_file=args.eval_prompts_file, head_hidden=args.head_hidden, head_depth=args.head_depth,
        save_every=args.save_every, resume=args.resume, force=args.force, device=args.device, dtype=args.dtype,
        push_to_hub=args.push_to_hub, private=args.private, verbose=not args.quiet,
        command=shlex.join(["swiftspec", *sys.argv[1:]]) if sys.argv[1:2] == ["distill"] else None,
    )


def run_distill(args: argparse.Namespace) -> int:
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be at least 1.")
        torch.set_num_threads(args.threads)
    result = distill(distill_config(args))
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    b, a = result.before, result.after
    print(f"wrote pair {result.folder} ({result.steps} steps, {result.train_tokens:,} training tokens)")
    print(f"held-out top-1 agreement {b.agreement:.1%} -> {a.agreement:.1%}; tau {b.tau:.2f} -> {a.tau:.2f} "
          f"({a.new_tokens} tokens from {a.prompts} held-out prompts); identical to target.generate: {a.identical}")
    for name, other in result.compared.items():
        print(f"beside it, {name}: top-1 agreement {other.agreement:.1%}, tau {other.tau:.2f}; identical: {other.identical}")
    print(f"measured on a shared, loaded machine: {result.seconds_per_step:.3f} s/step, peak RSS {result.peak_rss_mib:.0f} MiB")
    return 0 if a.identical else 1
