"""Latency and throughput of `swiftspec serve` against `transformers serve` with the target alone.

Each server runs in its own process with one torch thread (swiftspec: --threads 1; transformers:
OMP_NUM_THREADS=1), one after the other on the same machine. For 1, 4 and 16 concurrent clients,
the clients send their share of the same prompts to a fresh server (streamed /v1/completions, a fixed
max_tokens) with the real `openai` client; the table gives each request's latency to its last event (p50 / p99,
seconds), its time to first token (TTFT: to the first event with text, p50 / p99), its time per token after the
first (ITL, the median request's, ms), and the total new tokens per second of the whole run, and checks that both
servers answered every greedy prompt with the same text. TTFT and ITL are timed by the stream's text events: "n/a"
where most streams carried fewer than two (a `shape:` pair's random tokens mostly decode to no text). Requests are greedy, or with --sampled-fraction F that share of them
(every 1/F-th) samples (temperature 0.8, top_p 0.95, a seed per request): sampled answers are timed, not
compared (the two servers draw differently).

    python examples/serve_latency.py                                   # the demo pair, 32 prompts
    python examples/serve_latency.py --clients 1,4 --requests 16 --max-tokens 48
    python examples/serve_latency.py --target-cb --swiftspec-cb        # both with --continuous-batching
    python examples/serve_latency.py --target-cb --swiftspec-cb --pair shape:smollm2-135m
    python examples/serve_latency.py --target-cb --swiftspec-cb --sampled-fraction 0.25
    python examples/serve_latency.py --target-cb --swiftspec-cb --no-latency-guard   # the running batch unguarded
    python examples/serve_latency.py --target-cb --swiftspec-cb --pair shape:smollm2-135m --shared-prefix-chars 300 \
        --prefix-cache both                                            # a system prompt: reused, and prefilled each time

`--pair shape:NAME` serves random weights in a real model's shape (tools/models.REAL_SHAPES) with a
draft of its first 2 layers and a character tokenizer, written to a temporary folder first: the
costs of a real pair (its vocabulary head above all), not its acceptance.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from hf_swiftspec.bench import load_prompts
from hf_swiftspec.pair import bundled_pair
from hf_swiftspec.tools.models import SHAPE_PREFIX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int, model: str) -> tuple[subprocess.Popen, openai.OpenAI]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    deadline = time.monotonic() + 180
    while True:
        try:
            client.completions.create(model=model, prompt="def f", max_tokens=2, temperature=0)
            return process, client
        except (openai.APIConnectionError, openai.InternalServerError):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"{' '.join(command)} did not start:\n{process.stderr.read()[-3000:]}")
            time.sleep(0.5)


SAMPLING = {"temperature": 0.8, "top_p": 0.95}  # a sampled request's settings (and its own seed)


def sampled_requests(count: int, fraction: float) -> set[int]:
    """The requests (indices) that sample: every 1/fraction-th, spread over the run."""
    if not 0 <= fraction <= 1:
        raise SystemExit(f"--sampled-fraction {fraction}: give a share of the requests, from 0 to 1 (0.25: every 4th).")
    return {i for i in range(count) if int((i + 1) * fraction) > int(i * fraction)}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def run_clients(client, model: str, prompts: list[str], clients: int, max_tokens: int, sampled: set[int] = frozenset()) -> dict:
    """Every prompt once, `clients` at a time (the `sampled` ones sampling with their index as seed), streamed:
    latencies to the last event, time to the first text (TTFT), time per token after it (ITL), texts (by prompt
    index), tokens per second of the whole run."""

    def ask(index: int) -> tuple[int, float, str, int, float, float | None]:
        settings = {**SAMPLING, "seed": index} if index in sampled else {"temperature": 0}
        start = time.perf_counter()
        first = last = None
        pieces, usage = [], None
        for chunk in client.completions.create(model=model, prompt=prompts[index], max_tokens=max_tokens, stream=True,
                                               **settings):
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
                pieces.append(chunk.choices[0].text)
            usage = chunk.usage or usage
        end = time.perf_counter()
        tokens = usage.completion_tokens if usage is not None else len(pieces)
        per_token = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
        return index, end - start, "".join(pieces), tokens, (first or end) - start, per_token, len(pieces)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(ask, range(len(prompts))))
    wall = time.perf_counter() - start
    latencies, firsts = [r[1] for r in results], [r[4] for r in results]
    per_token = [r[5] for r in results if r[5] is not None]
    # a stream times its tokens by its text events: where most streams carried fewer than two (a shape: pair's random
    # tokens mostly decode to no text), its first text is not its first token, and neither figure is given
    timed = statistics.median(r[6] for r in results) >= 2
    return {
        "p50": statistics.median(latencies),
        "p99": percentile(latencies, 0.99),
        "ttft_p50": statistics.median(firsts) if timed else None,
        "ttft_p99": percentile(firsts, 0.99) if timed else None,
        "itl_p50_ms": 1000 * statistics.median(per_token) if timed and per_token else None,
        "tokens_per_s": sum(r[3] for r in results) / wall,
        "texts": {r[0]: r[2] for r in results},
    }


SYSTEM_HEADER = ("# You are a careful Python assistant. Complete the code below: keep the style of the file, write "
                 "docstrings and type hints, handle edge cases, prefer the standard library, and never print debug "
                 "output. Answer with code only.\n")


def shared_header(chars: int) -> str:
    """A fixed header of `chars` characters (a system prompt every request carries), "" for none."""
    if chars < 0:
        raise SystemExit(f"--shared-prefix-chars {chars}: give a length of 0 or more.")
    return (SYSTEM_HEADER * (chars // len(SYSTEM_HEADER) + 1))[:chars]


def shape_pair_folder(shape: str, root: Path) -> str:
    """A pair folder (and its target/, with the tokenizer, for transformers serve) of random weights in `shape`."""
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.tools.models import char_tokenizer, real_shaped_pair

    target, draft = real_shaped_pair(shape)
    tokenizer = char_tokenizer()
    SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tokenizer).save_pretrained(root, save_members=True)
    tokenizer.save_pretrained(root / "target")
    return str(root)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib")
    parser.add_argument("--target", default=None, help="the target's folder (default: the pair's target/)")
    parser.add_argument("--prompts", default="humaneval,spec_bench", help="bundled sets or files, comma-separated")
    parser.add_argument("--clients", default="1,2,4,8,16,32")
    parser.add_argument("--requests", type=int, default=32, help="requests per client count (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-chars", type=int, default=400, help="the demo target reads 256 tokens")
    parser.add_argument("--target-cb", action="store_true", help="run the target with transformers' --continuous-batching")
    parser.add_argument("--swiftspec-cb", action="store_true", help="run swiftspec serve with --continuous-batching")
    parser.add_argument("--sampled-fraction", type=float, default=0.0,
                        help="share of the requests that sample (temperature 0.8, top_p 0.95, a seed each; default: none)")
    parser.add_argument("--no-latency-guard", action="store_true", help="run swiftspec serve with --no-latency-guard")
    parser.add_argument("--shared-prefix-chars", type=int, default=0, metavar="N",
                        help="put the same N-character header (a system prompt) before every prompt (default: none)")
    parser.add_argument("--prefix-cache", choices=("on", "off", "both"), default="on",
                        help="swiftspec serve's reuse of shared prompt prefixes (off: --prefix-cache-positions 0; "
                        "both: a server of each, side by side)")
    args = parser.parse_args()
    folder = tempfile.TemporaryDirectory()
    pair = shape_pair_folder(args.pair[len(SHAPE_PREFIX):], Path(folder.name)) if args.pair.startswith(SHAPE_PREFIX) else args.pair
    target = args.target or str((Path(pair) if Path(pair).is_dir() else bundled_pair(pair)) / "target")
    counts = [int(c) for c in args.clients.split(",")]
    header = shared_header(args.shared_prefix_chars)
    texts = [header + p.text[-args.max_prompt_chars:] for source in args.prompts.split(",") for p in load_prompts(source)]
    if len(texts) < args.requests + 4:
        raise SystemExit(f"{args.prompts} has {len(texts)} prompts; {args.requests + 4} distinct ones are needed.")
    warmup, prompts = texts[-4:], texts[: args.requests]
    sampled = sampled_requests(args.requests, args.sampled_fraction)
    greedy = [i for i in range(args.requests) if i not in sampled]
    def swiftspec(prefix_cache: bool):
        return lambda port: [
            sys.executable, "-m", "hf_swiftspec.cli", "serve", pair, "--port", str(port), "--threads", "1",
            *(["--continuous-batching"] if args.swiftspec_cb else []),
            *(["--no-latency-guard"] if args.no_latency_guard else []),
            *([] if prefix_cache else ["--prefix-cache-positions", "0"]),
        ]

    servers = {
        **({"swiftspec serve": swiftspec(args.prefix_cache != "off")}),
        **({"swiftspec serve (no prefix cache)": swiftspec(False)} if args.prefix_cache == "both" else {}),
        "transformers serve (target)": lambda port: [
            sys.executable, "-m", "transformers.cli.transformers", "serve", target, "--port", str(port), "--device", "cpu",
            "--dtype", "float32", *(["--continuous-batching"] if args.target_cb else []),
        ],
    }
    results: dict[str, dict[int, dict]] = {name: {} for name in servers}
    for n in counts:  # a fresh server for each count: swiftspec's suffix proposals copy from earlier answers
        for name, command in servers.items():  # (model.output_history), so a second pass would copy its own
            port = free_port()
            model = pair if name.startswith("swiftspec") else target
            process, client = start(command(port), port, model)
            try:
                # warm-up: 4 at once, so a batching server's first batch (transformers' continuous batching
                # spends ~9 s on its first one here) is paid before the timing, by both servers alike
                run_clients(client, model, warmup, len(warmup), args.max_tokens)
                results[name][n] = run_clients(client, model, prompts, n, args.max_tokens, sampled)
            finally:
                process.terminate()
                process.wait(30)
    print(
        f"{args.pair}: {args.requests} requests of {args.max_tokens} new tokens ({args.prompts}), "
        f"{f'{len(sampled)} sampled ({SAMPLING}, a seed each), the rest greedy' if sampled else 'greedy'}, "
        f"{f'a shared {len(header)}-character header before each, ' if header else ''}one torch thread per server; "
        f"swiftspec {'--continuous-batching' if args.swiftspec_cb else 'sequential'}"
        f"{' --no-latency-guard' if args.no_latency_guard else ''}"
        f"{' --prefix-cache-positions 0' if args.prefix_cache == 'off' else ''}, "
        f"target {'--continuous-batching' if args.target_cb else 'sequential'}"
    )
    print("| clients | server | p50 s | p99 s | TTFT p50 s | TTFT p99 s | ITL p50 ms | tokens/s | speed-up (tokens/s) "
          "| p50 ratio | same text |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    theirs = results["transformers serve (target)"]
    for n in counts:
        for name, by_clients in results.items():
            r = by_clients[n]
            same = sum(r["texts"][i] == theirs[n]["texts"][i] for i in greedy)
            extra = (
                f"{r['tokens_per_s'] / theirs[n]['tokens_per_s']:.2f}x | {theirs[n]['p50'] / r['p50']:.2f}x lower | {same}/{len(greedy)}"
                if by_clients is not theirs else " | | "
            )
            timed = [f"{r[k]:.{d}f}" if r[k] is not None else "n/a" for k, d in (("ttft_p50", 2), ("ttft_p99", 2),
                                                                                  ("itl_p50_ms", 1))]
            print(f"| {n} | {name} | {r['p50']:.2f} | {r['p99']:.2f} | {' | '.join(timed)} | {r['tokens_per_s']:.1f} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
