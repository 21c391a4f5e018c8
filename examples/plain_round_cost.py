"""What a plain round costs next to transformers' own decode step, on a real-shaped random pair.

    python examples/plain_round_cost.py [--shape smollm2-135m] [--prompt-tokens 256] [--new-tokens 64] [--repeats 5]

With random weights neither the draft nor the n-gram chain predicts anything, so after its first
call the goodput policy decodes plainly. Interleaved with `target.generate` on one torch thread,
this prints per call: target.generate's time per new token after its prefill, swiftspec's time per
verification (target forward + walk + commit), the rest of swiftspec's round, and the two totals.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import REAL_SHAPES, real_shaped_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(REAL_SHAPES))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = real_shaped_pair(args.shape)
    model = SwiftSpecForCausalLM.from_models(target, draft)
    ids = torch.randint(3, 98, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    model.generate(ids, **kwargs)  # the policy's first call measures; the later ones decode plainly
    target.generate(ids, **kwargs)
    ratios = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        reference = target.generate(ids, **kwargs)
        target_s = time.perf_counter() - start
        start = time.perf_counter()
        target(ids, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        model.output_history.clear()  # else the suffix proposals copy the earlier calls' identical output
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        swiftspec_s = time.perf_counter() - start
        stats = model.swiftspec_stats
        assert torch.equal(out, reference), "swiftspec's output differs from target.generate's"
        step = 1000 * (target_s - prefill_s) / args.new_tokens
        verify = 1000 * stats.target_time_s / stats.verify_steps
        rest = 1000 * (swiftspec_s - prefill_s - stats.target_time_s) / stats.verify_steps
        ratios.append(target_s / swiftspec_s)
        print(
            f"target.generate {step:.2f} ms/token after a {1000 * prefill_s:.0f} ms prefill | swiftspec "
            f"{verify:.2f} ms per verification + {rest:.2f} ms rest of the round ({stats.plain_rounds} of "
            f"{stats.verify_steps} rounds plain, {stats.draft_forwards} draft forwards) | speed-up {ratios[-1]:.3f}x"
        )
    print(f"median speed-up {statistics.median(ratios):.3f}x over {args.repeats} interleaved calls")


if __name__ == "__main__":
    main()
