"""A long mixed load on `swiftspec serve --continuous-batching` (loopback only, bounded in requests and time).

Clients send a mix: greedy and sampled (seeded) requests, streaming and not, some with stop strings,
clients that leave mid-stream, prompts near the target's context. Every greedy answer is checked
against `target.generate` on the same tokens (cut at its stop string where it has one), every
seeded one against the pair's lone call with that seed; none may be lost or mixed. A monitor samples
the process's RSS, its live tensors and the running batch's cache capacity over time. The server runs
in this process (one torch thread), so RSS is the server's and the clients' together.

    python examples/serve_soak.py --requests 100 --clients 16           # a short run
    python examples/serve_soak.py --requests 1000 --clients 64 --max-seconds 1800
"""

from __future__ import annotations

import argparse
import gc
import random
import socket
import statistics
import threading
import time
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
    kind = rng.choice(["greedy", "greedy", "sampled", "stop", "leaves", "near"])
    return {
        "i": i, "kind": kind, "prompt": NEAR_CONTEXT if kind == "near" else rng.choice(PROMPTS),
        "max_tokens": 20 if kind == "near" else rng.choice([8, 16, 32]), "stream": kind == "leaves" or rng.random() < 0.5,
        "seed": i,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=600, help="stop sending new requests after this long")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = bundled_pair("swiftspec-demo-pystdlib")
    pair = SwiftSpecForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the references, in this process
    tokenizer, target = pair.tokenizer, pair.target
    port = free_port()
    running = serve(ServeOptions(pair=str(folder), port=port, log_level="error", continuous_batching=True, threads=1),
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
        while not stop_monitor.wait(2.0):
            state = running._generation_state._cb_manager
            engine = getattr(getattr(state, "_cb", None), "engine", None)
            sides = engine and engine.sides
            samples.append((time.monotonic() - started, rss_mb(), sides.target.cache.capacity if sides else 0,
                            len(engine.rows.live) if engine else 0))

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
                      temperature=0.9 if sampled else 0, seed=spec["seed"] if sampled else None)
        began = time.perf_counter()
        if spec["stream"]:
            chunks = client.completions.create(stream=True, **kwargs)
            text = ""
            for n, chunk in enumerate(chunks):
                text += chunk.choices[0].text if chunk.choices else ""
                if spec["kind"] == "leaves" and n == 2:
                    chunks.close()  # the client leaves mid-stream
                    break
            tokens = None
        else:
            reply = client.completions.create(**kwargs)
            text, tokens = reply.choices[0].text, reply.usage.completion_tokens
        return {**spec, "text": text, "tokens": tokens, "latency": time.perf_counter() - began, "stop": stop}

    began = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(run, jobs))
    wall = time.perf_counter() - began
    stop_monitor.set()
    done = [r for r in results if not r.get("skipped")]
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
        if r["text"] != expected:
            wrong.append((r["i"], r["kind"], r["text"][:40], expected[:40]))
    latencies = sorted(r["latency"] for r in done if r["kind"] != "leaves")
    new_tokens = sum(r["tokens"] or 0 for r in done)
    gc.collect()
    print(f"requests: {len(done)} of {len(jobs)} sent ({sum(r['kind'] == 'leaves' for r in done)} clients left mid-stream), "
          f"{args.clients} clients, {wall:.1f} s")
    print(f"answers checked: {len(done) - sum(r['kind'] == 'leaves' for r in done)}, wrong or mixed: {len(wrong)}")
    for item in wrong[:5]:
        print("  wrong:", item)
    print(f"latency p50 {statistics.median(latencies):.2f} s, p99 {latencies[int(0.99 * (len(latencies) - 1))]:.2f} s; "
          f"{new_tokens / wall:.1f} tokens/s (non-streamed answers' tokens)")
    print("t (s)  RSS (MB)  cache capacity  rows")
    for t, rss, capacity, rows in samples[:: max(1, len(samples) // 12)]:
        print(f"{t:5.0f}  {rss:8.0f}  {capacity:14d}  {rows:4d}")
    running.kill_server()


if __name__ == "__main__":
    main()
