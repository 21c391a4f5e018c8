"""Where the server's running batch spends its time with N clients: cProfile of the engine's own thread (the host
round's ContinuousEngine, as `swiftspec serve --continuous-batching` runs it, without HTTP), greedy requests of the
bundled HumanEval and Spec-Bench prompts, N at a time.

    OMP_NUM_THREADS=1 python examples/profile_running_batch.py --clients 16 --requests 42

Prints the calls' tokens/s, the rounds and rows per round, then the engine thread's functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts
from hf_swiftspec.engine.continuous import ContinuousEngine
from hf_swiftspec.pair import bundled_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=42)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-latency-guard", action="store_true")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = bundled_pair(args.pair)
    pair = SwiftSpecForCausalLM.from_pretrained(folder)
    tokenizer = pair.tokenizer if getattr(pair, "tokenizer", None) is not None else None
    if tokenizer is None:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(folder / "target")
    texts = [p.text[-400:] for source in ("humaneval", "spec_bench") for p in load_prompts(source)][: args.requests]
    profile = cProfile.Profile()
    run = ContinuousEngine.run

    def profiled_run(self) -> None:  # the engine's thread, profiled
        profile.enable()
        try:
            run(self)
        finally:
            profile.disable()

    ContinuousEngine.run = profiled_run
    engine = pair.continuous_engine(latency_guard=not args.no_latency_guard)

    def call(i: int) -> int:
        ids = tokenizer(texts[i], return_tensors="pt").input_ids
        out = pair.generate(ids, max_new_tokens=args.max_tokens, do_sample=False, swiftspec_engine=(engine, i))
        return out.shape[1] - ids.shape[1]

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        tokens = sum(pool.map(call, range(len(texts))))
    seconds = time.perf_counter() - start
    engine.close()
    print(f"{len(texts)} requests, {args.clients} clients: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tokens/s")
    print(f"rounds by rows in the batch: {dict(sorted(engine.rounds_by_batch.items()))}")
    print(f"usage: {engine.usage}")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
