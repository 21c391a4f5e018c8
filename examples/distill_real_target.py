"""Issue 75's measurements: `swiftspec distill` on a real pretrained target, one thread, a one-text-file corpus.

For each run: `swiftspec distill OUT/NAME --target TARGET --data CORPUS --minutes M --threads 1 [--draft D]`, its
output and the files it wrote (the card, distill.json, bench/) copied under the results folder; then one
`swiftspec bench` of the default 12-minute pair (target.generate, prompt lookup, assisted generation, the pair,
its target draft-free), and a summary.md with each run's phases, steps, tokens trained on, held-out agreement and
tau, and where the in-run bench's speed-up came from. Run it on a quiet machine (it takes about two hours):

    python examples/distill_real_target.py --target /path/to/SmolLM2-135M-Instruct --work /tmp/distill-real \
        --out examples/results/cpu-distill-real-target

--corpus: a text file to distill from (default: one written from the Python standard library's .py files and this
repository's docs, about 2 MB, the kind of single text file the docs suggest). --runs picks some of RUNS.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> (minutes, extra distill flags)
RUNS = {
    "auto-12": (12, []),
    "auto-30": (30, []),
    "small-12": (12, ["--draft", "small"]),
    "eagle3-12": (12, ["--draft", "eagle3"]),
}
BENCH_METHODS = "target,prompt_lookup,assisted,swiftspec_serial,swiftspec_suffix"


def write_corpus(path: Path, chars: int = 2_000_000) -> Path:
    """One text file: the standard library's .py files (sorted), then this repository's docs, up to `chars`."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")) + sorted((ROOT / "docs" / "source" / "en").glob("*.md"))
    with path.open("w") as out:
        written = 0
        for source in sources:
            text = source.read_text(errors="replace")
            out.write(text + "\n")
            written += len(text) + 1
            if written >= chars:
                break
    return path


def run(command: list[str], log: Path) -> None:
    print("$", shlex.join(command), flush=True)
    with log.open("w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, cwd=ROOT)


def summary_row(name: str, folder: Path) -> str:
    d = json.loads((folder / "distill.json").read_text())
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in d["phases"].items())
    s = d["speed"] or {}
    speed = (f"{s['speedup']:.2f}x (draft-free {s['draft_free_speedup']:.2f}x, {s['draft_forwards']:.1f} draft fwd/round, "
             f"n-gram {s['ngram_share']:.0%})" if s else d.get("speed_skipped") or "not timed")
    train = d["phases"].get("train", 0.0) / d["seconds"]
    return (f"| {name} | {d['draft']} | {d['seconds'] / 60:.1f} min ({train:.0%} training) | {phases} | {d['steps']} | "
            f"{d['train_tokens']:,} | {d['before']['agreement']:.1%} -> {d['after']['agreement']:.1%} | "
            f"{d['before']['tau']:.2f} -> {d['after']['tau']:.2f} | {speed} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--work", type=Path, required=True, help="where the pairs are written")
    parser.add_argument("--out", type=Path, default=ROOT / "examples" / "results" / "cpu-distill-real-target")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.corpus or write_corpus(args.work / "corpus.txt")
    commands = []
    for name in args.runs:
        minutes, extra = RUNS[name]
        pair = args.work / name
        command = [sys.executable, "-m", "hf_swiftspec.cli", "distill", str(pair), "--target", args.target, "--data",
                   str(corpus), "--minutes", str(minutes), "--threads", "1", "--force", *extra]
        commands.append(shlex.join(["swiftspec", *command[3:]]))
        saved = args.out / name
        saved.mkdir(exist_ok=True)
        run(command, saved / "output.txt")
        (saved / "command.txt").write_text(shlex.join(["swiftspec", *command[3:]]) + "\n")
        for item in ("README.md", "distill.json", "config.json", "bench"):
            source = pair / item
            if source.is_dir():
                shutil.copytree(source, saved / item, dirs_exist_ok=True)
            elif source.is_file():
                shutil.copy2(source, saved / item)
    if "auto-12" in args.runs:
        pair = args.work / "auto-12"
        command = [sys.executable, "-m", "hf_swiftspec.cli", "bench", "--pair", str(pair), "--prompts",
                   str(pair / "heldout_prompts.jsonl"), "--prompts", "humaneval", "--prompts", "spec_bench", "--num-prompts", "4",
                   "--max-new-tokens", "64", "--methods", BENCH_METHODS, "--threads", "1", "--out", str(args.out / "bench")]
        commands.append(shlex.join(["swiftspec", *command[3:]]))
        run(command, args.out / "bench-output.txt")
    done = [name for name in RUNS if (args.out / name / "distill.json").is_file()]  # this call's runs and earlier ones
    rows = [summary_row(name, args.out / name) for name in done]
    (args.out / "summary.md").write_text(
        "| run | draft | run time | phases | steps | tokens trained on | held-out top-1 agreement | tau (fixed tree) | "
        "in-run bench: speed-up over target.generate |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    log = args.out / "command.txt"  # every invocation's commands, appended (a folder's runs may come from several)
    with log.open("a") as out:
        out.write(f"# from the repository root, one torch thread; target {args.target}; corpus {corpus}\n"
                  f"python examples/distill_real_target.py --target {args.target} --work {args.work} --out {args.out} "
                  f"--runs {' '.join(args.runs)}\n# which ran (each run's own command also in its folder's command.txt):\n"
                  + "\n".join(commands) + "\n")
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
