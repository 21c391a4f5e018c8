"""Time a speculative round outside the two models' forwards, on the bundled demo pair.

    python examples/round_overhead.py [--pair ID] [--max-new-tokens 128] [--repeats 3] [--keep-history]

Forward time is measured by hooks on both models (one torch thread); everything else in the
decode loop (tree bookkeeping, the walk, commits, the policy) is the round's overhead, printed
per round and as a fraction of the mean target verification forward. The round runs its steps
eagerly here (capture=False): a replayed step runs no module hooks.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_swiftspec import SwiftSpecForCausalLM


def timed_forwards(model, totals: dict, key: str):
    """Accumulate the wall time of every forward of `model` into totals[key] (seconds, count)."""
    state = {}

    def before(*args):
        state["t"] = time.perf_counter()

    def after(*args):
        seconds, count = totals.get(key, (0.0, 0))
        totals[key] = (seconds + time.perf_counter() - state["t"], count + 1)

    return [model.register_forward_pre_hook(before), model.register_forward_hook(after)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="def read_config(path):\n")
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib", help="pair id or folder, or shape:NAME")
    parser.add_argument("--keep-history", action="store_true",
                        help="let each call copy the earlier calls' outputs (by default each call starts without them: "
                        "every call decodes the same prompt, so the suffix proposals would copy the whole answer and "
                        "a call would be a handful of rounds, its fixed costs counted per round)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.pair.startswith("shape:"):  # a random-weight pair in a real model's shape (hf_swiftspec.tools.models)
        from hf_swiftspec.tools.models import char_tokenizer, real_shaped_pair

        model = SwiftSpecForCausalLM.from_models(*real_shaped_pair(args.pair.removeprefix("shape:")),
                                                 tokenizer=char_tokenizer())
        model.generation_config.eos_token_id = None  # random text: run to max_new_tokens
    else:
        model = SwiftSpecForCausalLM.from_pretrained(args.pair, dtype=torch.float32)
    model.config.capture = False  # hooks time the forwards: eager steps
    ids = model.tokenizer(args.prompt, return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)  # warm-up
    for _ in range(args.repeats):
        totals: dict = {}
        if not args.keep_history:
            model.output_history.clear()
        hooks = timed_forwards(model.target, totals, "target") + timed_forwards(model.draft, totals, "draft")
        try:
            model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        finally:
            for hook in hooks:
                hook.remove()
        stats = model.swiftspec_stats
        target_s, target_n = totals["target"]
        draft_s, draft_n = totals.get("draft", (0.0, 0))
        rounds = max(stats.verify_steps, 1)
        verify_forward = target_s / target_n  # prefill included: a slight overestimate
        overhead = (stats.wall_time_s - target_s - draft_s) / rounds
        print(
            f"{stats.new_tokens} tokens, {rounds} rounds, tau {stats.tau:.2f}: target forward {1000 * verify_forward:.2f} ms, "
            f"draft {draft_n / rounds:.1f} forwards/round, overhead {1000 * overhead:.2f} ms/round "
            f"= {100 * overhead / verify_forward:.0f}% of a verification forward"
        )


if __name__ == "__main__":
    main()
