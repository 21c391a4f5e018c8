"""Quickstart: build a tiny target/draft pair in memory and decode with tree speculation.

    python examples/quickstart.py

No download: the target is a small random Llama (its later layers damped so that, like a real
model family, a draft cut from its first layer agrees with it often). Prints the speculative
output, checks it equals target.generate token for token, and prints the statistics.
"""

import time

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import char_tokenizer, damp_late_layers, tiny_model, truncated_draft


def main() -> None:
    torch.set_num_threads(1)  # tiny matmuls: one thread avoids OpenMP spin-wait overhead
    tokenizer = char_tokenizer()
    target = tiny_model("llama", seed=0, layers=8, hidden=512, vocab_size=98, sharpness=20.0)
    damp_late_layers(target, keep=1, scale=0.02)
    draft = truncated_draft(target, keep_layers=1)
    model = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=8, draft_width=4)

    prompt = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    target.generate(prompt, max_new_tokens=8, do_sample=False)  # warm-up, so the timings compare
    model.generate(prompt, max_new_tokens=8, do_sample=False)
    start = time.perf_counter()
    expected = target.generate(prompt, max_new_tokens=64, do_sample=False)
    target_s = time.perf_counter() - start
    out = model.generate(prompt, max_new_tokens=64, do_sample=False, swiftspec=True)
    stats = model.swiftspec_stats

    print("completion :", repr(tokenizer.decode(out[0, prompt.shape[1] :])))
    print("identical to target.generate:", out.tolist() == expected.tolist())
    print("swiftspec  :", stats.summary())
    print(f"target alone: {expected.shape[1] - prompt.shape[1]} tokens in {target_s:.2f}s "
          f"(speed-up {target_s / stats.wall_time_s:.2f}x on this machine)")
    if out.tolist() != expected.tolist():
        raise SystemExit("speculative output differs from the target's own greedy output")


if __name__ == "__main__":
    main()
