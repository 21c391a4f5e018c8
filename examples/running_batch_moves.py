"""Warm running batch on the demo pair: 42 greedy requests (HumanEval and Spec-Bench prompts, 64 tokens), 16 clients,
after one untimed pass, twice: tokens/s and the time DeviceSides.move_rows took (rows joining a larger bucket, leaving,
moving into holes), and a hash of every answer (equal before and after a change to the moves).

    OMP_NUM_THREADS=1 python examples/running_batch_moves.py LABEL
"""

from __future__ import annotations

import hashlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoTokenizer

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts
from hf_swiftspec.engine.device_sides import DeviceSides
from hf_swiftspec.pair import bundled_pair


def main(label: str) -> None:
    torch.set_num_threads(1)
    folder = bundled_pair("swiftspec-demo-pystdlib")
    pair = SwiftSpecForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder / "target")
    texts = [p.text[-400:] for source in ("humaneval", "spec_bench") for p in load_prompts(source)][:42]
    spent = {"move": 0.0, "n": 0}
    move_rows = DeviceSides.move_rows

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        move_rows(self, *args, **kwargs)
        spent["move"] += time.perf_counter() - start
        spent["n"] += 1

    DeviceSides.move_rows = timed
    engine = pair.continuous_engine()
    answers = {}

    def call(i: int) -> int:
        ids = tokenizer(texts[i % len(texts)], return_tensors="pt").input_ids
        out = pair.generate(ids, max_new_tokens=64, do_sample=False, swiftspec_engine=(engine, i))
        answers[i] = out[0, ids.shape[1]:].tolist()
        return out.shape[1] - ids.shape[1]

    with ThreadPoolExecutor(16) as pool:  # warm-up: the pool's slot sets made
        list(pool.map(call, range(len(texts))))
    for rep in range(2):
        spent.update(move=0.0, n=0)
        first = 1000 * (rep + 1)
        start = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            tokens = sum(pool.map(call, range(first, first + len(texts))))
        seconds = time.perf_counter() - start
        print(f"{label} warm {rep}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s; "
              f"move_rows {spent['n']} calls {spent['move'] * 1000:.0f} ms")
    engine.close()
    print("outputs", hashlib.md5(str(sorted((k % 1000, v) for k, v in answers.items())).encode()).hexdigest())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
