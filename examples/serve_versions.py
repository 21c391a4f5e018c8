"""p50 / p99 / tokens/s of `swiftspec serve --continuous-batching` at this checkout against an earlier revision's,
alternating server by server on the same prompts, so the machine's drift falls on both alike.

    OMP_NUM_THREADS=1 python examples/serve_versions.py --before 407b1a8 --clients 4,8,16 --runs 2
    OMP_NUM_THREADS=1 python examples/serve_versions.py --before 407b1a8 --pair shape:smollm2-135m --clients 4,16 --runs 1

Each server is examples/serve_latency.py's (one torch thread, a fresh server per run, 4 warm-up requests sent at
once, then the prompts `clients` at a time); the earlier revision's package is `git archive`d into a temporary
folder that leads PYTHONPATH for its server process. Every greedy answer of the earlier revision is checked against
this checkout's (both must be the target's own).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from compare_versions import archive_revision
from serve_latency import free_port, run_clients, shape_pair_folder, start

from hf_swiftspec.bench import load_prompts
from hf_swiftspec.tools.models import SHAPE_PREFIX


def measure(pair: str, path: str | None, clients: int, warmup: list[str], prompts: list[str], max_tokens: int) -> dict:
    """One fresh server (the package at `path` first on PYTHONPATH, or this checkout's): its run of `prompts`."""
    port = free_port()
    command = [sys.executable, "-m", "hf_swiftspec.cli", "serve", pair, "--port", str(port), "--threads", "1",
               "--continuous-batching"]
    saved = os.environ.get("PYTHONPATH")
    if path is not None:  # start() hands the server process this process's environment
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, saved) if p)
    try:
        process, client = start(command, port, pair)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        run_clients(client, pair, warmup, len(warmup), max_tokens)
        return run_clients(client, pair, prompts, clients, max_tokens)
    finally:
        process.terminate()
        process.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib")
    parser.add_argument("--clients", default="4,8,16")
    parser.add_argument("--runs", type=int, default=2, help="runs of each revision per client count, alternating")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    texts = [p.text[-400:] for source in ("humaneval", "spec_bench") for p in load_prompts(source)]
    warmup, prompts = texts[-4:], texts[: args.requests]
    before = str(archive_revision(args.before))
    folder = tempfile.TemporaryDirectory()  # `shape:NAME`: random weights in a real model's shape (serve_latency.py)
    pair = shape_pair_folder(args.pair[len(SHAPE_PREFIX):], Path(folder.name)) if args.pair.startswith(SHAPE_PREFIX) else args.pair
    print(f"{args.pair}: {args.requests} requests of {args.max_tokens} new tokens, greedy, one torch thread per server; "
          f"swiftspec serve --continuous-batching at this checkout and at {args.before}, alternating")
    print("| clients | run | revision | p50 s | p99 s | tokens/s | same text |")
    print("|---|---|---|---|---|---|---|")
    for clients in [int(c) for c in args.clients.split(",")]:
        for run in range(1, args.runs + 1):
            results = {name: measure(pair, path, clients, warmup, prompts, args.max_tokens)
                       for name, path in ((args.before, before), ("this checkout", None))}
            ours = results["this checkout"]["texts"]
            for name, r in results.items():
                same = sum(r["texts"][i] == ours[i] for i in ours)
                print(f"| {clients} | {run} | {name} | {r['p50']:.2f} | {r['p99']:.2f} | {r['tokens_per_s']:.1f} | "
                      f"{same}/{len(ours)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
