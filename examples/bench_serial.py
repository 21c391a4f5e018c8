"""Side-by-side wall time: target.generate, transformers assisted generation, swiftspec serial.

    python examples/bench_serial.py [--prompts 6] [--max-new-tokens 128]

Builds a pair in memory (no download, `hf_swiftspec.testing.agreeing_pair`): a random Llama
target whose layers after the first are damped (`--damp`), and a draft made of the target's
first layer and head, so the draft agrees with the target often, as a small model of the same
family does. All three methods run greedy
on the same prompts, interleaved, after a warm-up; outputs must be identical or the run fails.
This is a CPU-scale stand-in until the benchmark harness and the demo pair exist.
"""

import argparse
import statistics
import time

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.testing import agreeing_pair


def build_pair(args):
    target, draft = agreeing_pair(args.layers, args.hidden, args.vocab, args.damp, args.sharpness)
    target.generation_config.eos_token_id = None  # every run generates exactly max_new_tokens
    return target, draft


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def best_assistant_tokens(target, draft, prompt, max_new_tokens):
    """transformers' assisted generation, tuned fairly: the best num_assistant_tokens on a warm-up prompt."""
    best = None
    for n in (2, 4, 6, 8, 12):
        draft.generation_config.num_assistant_tokens = n
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        _, seconds = timed(lambda: target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=max_new_tokens))
        if best is None or seconds < best[1]:
            best = (n, seconds)
    draft.generation_config.num_assistant_tokens = best[0]
    return best[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--damp", type=float, default=0.02, help="scale of layers 2.. (0.02: ~78%% greedy agreement)")
    parser.add_argument("--sharpness", type=float, default=20.0, help="head scale (20: top token ~0.7 probable)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, draft = build_pair(args)
    model = SwiftSpecForCausalLM.from_models(target, draft)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab, (1, args.prompt_len), generator=gen) for _ in range(args.prompts + 1)]
    warm, prompts = prompts[0], prompts[1:]
    n_assist = best_assistant_tokens(target, draft, warm, args.max_new_tokens)
    model.generate(warm, do_sample=False, max_new_tokens=args.max_new_tokens)  # warm-up

    methods = {
        "target.generate": lambda p: target.generate(p, do_sample=False, max_new_tokens=args.max_new_tokens),
        f"assisted (n={n_assist})": lambda p: target.generate(
            p, assistant_model=draft, do_sample=False, max_new_tokens=args.max_new_tokens
        ),
        "swiftspec serial": lambda p: model.generate(p, do_sample=False, max_new_tokens=args.max_new_tokens),
    }
    times = {name: [] for name in methods}
    taus = []
    for p in prompts:
        outputs = {}
        for name, fn in methods.items():
            outputs[name], seconds = timed(lambda: fn(p))
            times[name].append(seconds)
        taus.append(model.swiftspec_stats.tau)
        reference = outputs["target.generate"].tolist()
        for name, out in outputs.items():
            if out.tolist() != reference:
                raise SystemExit(f"{name} output differs from target.generate: the run is invalid")

    base = statistics.mean(times["target.generate"])
    print(f"target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, draft "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M; {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, greedy, {args.threads} thread(s); outputs identical")
    print(f"| method | s/prompt (mean ± sd) | tok/s | speed-up vs target |")
    print(f"|---|---|---|---|")
    for name, ts in times.items():
        mean = statistics.mean(ts)
        sd = statistics.stdev(ts) if len(ts) > 1 else 0.0
        print(f"| {name} | {mean:.3f} ± {sd:.3f} | {args.max_new_tokens / mean:.1f} | {base / mean:.2f}x |")
    print(f"swiftspec tau (tokens per target verification): {statistics.mean(taus):.2f}; last call: "
          f"{model.swiftspec_stats.summary()}")


if __name__ == "__main__":
    main()
