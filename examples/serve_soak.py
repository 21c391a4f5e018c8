"""A long mixed load on `swiftspec serve --continuous-batching` (loopback only, bounded in requests and time).

Clients send a mix: greedy and sampled (seeded) requests, streaming and not, some with stop strings,
clients that leave mid-stream, prompts near the target's context, requests for n=2 answers and for
logprobs. Every greedy answer is checked against `target.generate` on the same tokens (cut at its stop
string where it has one), every seeded one against the pair's lone call with that seed; none may be lost
or mixed (with --max-queue, a 429 is a refusal, counted, not a loss). A monitor samples the process's RSS,
the running batch's cache capacity and rows, and the pair's output history (the earlier answers suffix
proposals copy from, which grows until it holds `--suffix-cache-tokens`) over time; RSS is called flat when
its median over the run's last quarter is within 2% of the quarter before (its spread over the last half,
single rounds' spikes included, is printed beside it). The server runs in this process (one torch thread), so RSS
is the server's and the clients' together. At the end it prints the server's /metrics figures.

    python examples/serve_soak.py --requests 100 --clients 16           # a short run
    python examples/serve_soak.py --requests 1200 --clients 64 --max-seconds 1800 --suffix-cache-tokens 4096
    python examples/serve_soak.py --requests 400 --clients 32 --max-queue 8 --cache-positions 1400 --retries 50
"""

from __future__ import annotations

import argparse
import gc
import random
import socket
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.serving.server import ServeOptions, serve
from hf_swiftspec.pair import bundled_pair

PROMPTS = [
    "def read_config(path):\n", "import os\n\ndef list_files(root):\n", "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n", "for i in range(10):\n", "def __repr__(self):\n", "try:\n    import json\n",
]
NEAR_CONTEXT = "x = 1\n" * 58  # 232 of the demo target's 256 positions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def job(i: int, rng: random.Random) -> dict:
    """Request i of the mix."""
    kind = rng.choice(["greedy", "greedy", "sampled", "stop", "leaves", "near", "n2", "logprobs"])
    return {
        "i": i, "kind": kind, "prompt": NEAR_CONTEXT if kind == "near" else rng.choice(PROMPTS),
        "max_tokens": 20 if kind == "near" else rng.choice([8, 16, 32]),
        "stream": kind == "leaves" or (kind not in ("n2", "logprobs") and rng.random() < 0.5), "seed": i,
    }


def flatness(samples: list[tuple]) -> tuple[float, float, float, float]:
    """Over the run's last half: (lowest, highest RSS in MB, their spread in %, drift in %). The drift is the
    median RSS of the last quarter over that of the quarter before: growth, without the spikes of single rounds
    (a round of 70 rows holds its logits and trees for a moment, and the allocator hands some back)."""
    if not samples:
        return 0.0, 0.0, 0.0, 0.0
    end = samples[-1][0]
    half = [s[1] for s in samples if s[0] >= end / 2]
    third = [s[1] for s in samples if end / 2 <= s[0] < 3 * end / 4] or half
    last = [s[1] for s in samples if s[0] >= 3 * end / 4] or half
    drift = 100 * (statistics.median(last) - statistics.median(third)) / statistics.median(third)
    return min(half), max(half), 100 * (max(half) - min(half)) / min(half), drift


def metrics_of(port: int) -> dict[str, float]:
    """The server's /metrics samples (prometheus_client's parser), by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://localhost:{port}/metrics") as response:
        text = response.read().decode()
    return {f"{s.name}{s.labels or ''}": s.value for family in text_string_to_metric_families(text) for s in family.samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=600, help="stop sending new requests after this long")
    parser.add_argument("--max-queue", type=int, default=None, help="the server's --max-queue (429s are refusals)")
    parser.add_argument("--cache-positions", type=int, default=None, help="the server's --cache-positions")
    parser.add_argument("--request-timeout", type=float, default=None, help="the server's --request-timeout")
    parser.add_argument("--retries", type=int, default=0,
                        help="times a client refused with 429 tries again after the Retry-After it was given")
    parser.add_argument("--suffix-cache-tokens", type=int, default=None,
                        help="the pair's output history (earlier answers suffix proposals copy from), in tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = bundled_pair("swiftspec-demo-pystdlib")
    pair = SwiftSpecForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the references, in this process
    tokenizer, target = pair.tokenizer, pair.target
    port = free_port()
    settings = {} if args.suffix_cache_tokens is None else {"suffix_cache_tokens": args.suffix_cache_tokens}
    running = serve(ServeOptions(pair=str(folder), port=port, log_level="error", continuous_batching=True, threads=1,
                                 settings=settings, max_queue=args.max_queue, cache_positions=args.cache_positions,
                                 request_timeout=args.request_timeout),
                    blocking=False)
    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            time.sleep(0.1)
    samples, stop_monitor = [], threading.Event()

    def monitor() -> None:
        started = time.monotonic()
        while not stop_monitor.wait(1.0):
            state = running._generation_state._cb_manager
            manager = getattr(state, "_cb", None)
            engine = getattr(manager, "engine", None)
            sides = engine and engine.sides
            history = manager.pair.output_history.tokens if manager is not None else 0
            samples.append((time.monotonic() - started, rss_mb(), sides.target.cache.capacity if sides else 0,
                            len(engine.rows.live) if engine else 0, history))

    threading.Thread(target=monitor, daemon=True).start()
    deadline = time.monotonic() + args.max_seconds
    rng = random.Random(0)
    jobs = [job(i, rng) for i in range(args.requests)]

    def run(spec: dict) -> dict:
        if time.monotonic() > deadline:
            return {**spec, "skipped": True}
        sampled = spec["kind"] == "sampled"
        stop = None
        if spec["kind"] == "stop":
            stop = ["\n    return", ":\n"]
        kwargs = dict(model=str(folder), prompt=spec["prompt"], max_tokens=spec["max_tokens"], stop=stop,
                      temperature=0.9 if sampled else 0, seed=spec["seed"] if sampled else None,
                      n=2 if spec["kind"] == "n2" else None, logprobs=1 if spec["kind"] == "logprobs" else None)
        began = time.perf_counter()
        for attempt in range(args.retries + 1):
            try:
                return {**spec, **ask(kwargs, spec), "latency": time.perf_counter() - began, "stop": stop,
                        "retried": attempt}
            except openai.RateLimitError as busy:  # the server said when to come back
                if attempt == args.retries:
                    return {**spec, "refused": True}
                time.sleep(float(busy.response.headers.get("retry-after", 1)))
            except Exception as error:  # noqa: BLE001 (a lost request: reported)
                return {**spec, "lost": f"{type(error).__name__}: {error}"}

    def ask(kwargs: dict, spec: dict) -> dict:
        if spec["stream"]:
            chunks = client.completions.create(stream=True, **kwargs)
            text = ""
            for n, chunk in enumerate(chunks):
                text += chunk.choices[0].text if chunk.choices else ""
                if spec["kind"] == "leaves" and n == 2:
                    chunks.close()  # the client leaves mid-stream
                    break
            return {"text": text, "tokens": None}
        reply = client.completions.create(**kwargs)
        texts = [c.text for c in reply.choices]
        if spec["kind"] == "logprobs" and "".join(reply.choices[0].logprobs.tokens) != texts[0]:
            return {"lost": "its logprobs' tokens are not its text"}
        return {"text": texts[0], "texts": texts, "tokens": reply.usage.completion_tokens}

    began = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(run, jobs))
    wall = time.perf_counter() - began
    stop_monitor.set()
    refused = [r for r in results if r.get("refused")]
    lost = [r for r in results if r.get("lost")]
    done = [r for r in results if not (r.get("skipped") or r.get("refused") or r.get("lost"))]
    wrong = []
    for r in done:
        if r["kind"] == "leaves":
            continue
        ids = tokenizer(r["prompt"], return_tensors="pt").input_ids
        if r["kind"] == "sampled":
            out = pair.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r["max_tokens"], do_sample=True,
                                temperature=0.9, generator=torch.Generator().manual_seed(r["seed"]))
        else:
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r["max_tokens"], do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if r["stop"]:
            cuts = [expected.index(s) for s in r["stop"] if s in expected]
            expected = expected[: min(cuts)] if cuts else expected
        if any(text != expected for text in r.get("texts", [r["text"]])):
            wrong.append((r["i"], r["kind"], r["text"][:40], expected[:40]))
    latencies = sorted(r["latency"] for r in done if r["kind"] != "leaves")
    new_tokens = sum(r["tokens"] or 0 for r in done)
    gc.collect()
    print(f"requests: {len(done)} answered of {len(jobs)} ({sum(r['kind'] == 'leaves' for r in done)} clients left "
          f"mid-stream), {len(refused)} refused (429, after {args.retries} retries), {len(lost)} lost, "
          f"{sum(r.get('retried', 0) for r in done)} retries after a 429, {args.clients} clients, {wall:.1f} s")
    for item in lost[:5]:
        print("  lost:", item["i"], item["kind"], item["lost"][:200])
    print(f"answers checked: {len(done) - sum(r['kind'] == 'leaves' for r in done)}, wrong or mixed: {len(wrong)}")
    for item in wrong[:5]:
        print("  wrong:", item)
    print(f"latency p50 {statistics.median(latencies):.2f} s, p99 {latencies[int(0.99 * (len(latencies) - 1))]:.2f} s; "
          f"{new_tokens / wall:.1f} tokens/s (non-streamed answers' tokens)")
    print("t (s)  RSS (MB)  cache capacity  rows  history tokens")
    for t, rss, capacity, rows, history in samples[:: max(1, len(samples) // 16)]:
        print(f"{t:5.0f}  {rss:8.0f}  {capacity:14d}  {rows:4d}  {history:14d}")
    low, high, spread, drift = flatness(samples)
    print(f"RSS over the last half: {low:.0f}-{high:.0f} MB (spread {spread:.1f}%), drift {drift:+.1f}% (median of its "
          f"last quarter over the quarter before: {'flat' if abs(drift) <= 2 else 'NOT flat'}, within 2%)")
    figures = metrics_of(port)
    print("metrics: " + ", ".join(f"{name} {figures[name]:g}" for name in (
        "swiftspec_requests_total{'outcome': 'finished'}", "swiftspec_requests_total{'outcome': 'busy'}",
        "swiftspec_requests_total{'outcome': 'cancelled'}", "swiftspec_generation_tokens_total",
        "swiftspec_accepted_tokens_total", "swiftspec_verifications_total", "swiftspec_plain_round_share",
    ) if name in figures))
    running.kill_server()


if __name__ == "__main__":
    main()
