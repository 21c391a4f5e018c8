"""Warm running batch on the demo pair: 42 greedy requests (HumanEval and Spec-Bench prompts, 64 tokens), 16 clients, after one untimed pass, twice; tokens/s and the time DeviceSides.move_rows took (rows joining a larger bucket, leaving, moving into holes).

    OMP_NUM_THREADS=1 python examples/running_batch_moves.py LABEL
"""
import sys
import time

import torch
from concurrent.futures import ThreadPoolExecutor
from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts
from hf_swiftspec.engine.device_sides import DeviceSides
from hf_swiftspec.pair import bundled_pair
from transformers import AutoTokenizer
torch.set_num_threads(1)
folder = bundled_pair("swiftspec-demo-pystdlib")
pair = SwiftSpecForCausalLM.from_pretrained(folder)
tok = AutoTokenizer.from_pretrained(folder / "target")
texts = [p.text[-400:] for s in ("humaneval", "spec_bench") for p in load_prompts(s)][:42]
spent = {"move": 0.0, "n": 0}
orig = DeviceSides.move_rows
def timed(self, *a, **k):
    t = time.perf_counter(); orig(self, *a, **k); spent["move"] += time.perf_counter() - t; spent["n"] += 1
DeviceSides.move_rows = timed
engine = pair.continuous_engine()
outs = {}
def call(i):
    ids = tok(texts[i % 42], return_tensors="pt").input_ids
    out = pair.generate(ids, max_new_tokens=64, do_sample=False, swiftspec_engine=(engine, i))
    outs[i] = out[0, ids.shape[1]:].tolist()
    return out.shape[1] - ids.shape[1]
with ThreadPoolExecutor(16) as pool: list(pool.map(call, range(42)))
for rep in range(2):
    spent.update(move=0.0, n=0)
    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool: tokens = sum(pool.map(call, range(1000 * (rep + 1), 1000 * (rep + 1) + 42)))
    s = time.perf_counter() - start
    print(f"{sys.argv[1]} warm {rep}: {tokens} tokens in {s:.2f} s, {tokens/s:.1f} tok/s; move_rows {spent['n']} calls {spent['move']*1000:.0f} ms")
engine.close()
import hashlib; print("outputs", hashlib.md5(str(sorted((k % 1000, v) for k, v in outs.items())).encode()).hexdigest())
