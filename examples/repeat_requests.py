"""Several requests in a row on one model object: later requests copy earlier outputs.

SwiftSpecForCausalLM keeps the outputs of its generate() calls (`model.output_history`, at most
`suffix_cache_tokens` tokens, first in, first out), and its suffix proposals copy from them as
they copy from the prompt. This script runs a prompt set `--passes` times in a row, as an agent
or a user re-asking similar things would, and times each request three ways, interleaved:
target.generate, swiftspec with the history of every earlier request, and swiftspec with the
history cleared before the request. Greedy; every output is checked against target.generate's.

    python examples/repeat_requests.py                                  # demo target, draft-free
    python examples/repeat_requests.py --pair swiftspec-demo-pystdlib   # with the demo draft
    python examples/repeat_requests.py --model ID_OR_DIR --prompts editing --passes 2
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts
from hf_swiftspec.pair import bundled_pair


def timed(generate, ids, **kwargs):
    start = time.perf_counter()
    out = generate(ids, do_sample=False, attention_mask=torch.ones_like(ids), **kwargs)
    return out, (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo = bundled_pair("swiftspec-demo-pystdlib")
    parser.add_argument("--model", default=str(demo / "target") if demo else None, help="plain model: draft-free")
    parser.add_argument("--pair", default=None, help="a pair instead of --model")
    parser.add_argument("--prompts", default="editing", help="bundled set or file (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--passes", type=int, default=2, help="times the whole set is asked (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = SwiftSpecForCausalLM.from_pretrained(args.pair or args.model, dtype=torch.float32)
    tokenizer = model.tokenizer
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in load_prompts(args.prompts, args.num_prompts)]
    context = getattr(model.target.config, "max_position_embeddings", None)
    if context:
        prompts = [ids[:, -(context - args.max_new_tokens) :] for ids in prompts]
    kwargs = dict(max_new_tokens=args.max_new_tokens)
    timed(model.generate, prompts[0], swiftspec=True, **kwargs)  # warm-up: first-call costs, and the policy measures
    model.output_history.clear()
    print("pass prompt | target tok/s | swiftspec tok/s (history, tau) | swiftspec tok/s (cleared, tau) | history tokens")
    totals = {"target": [], "history": [], "cleared": []}
    for p in range(args.passes):
        for i, ids in enumerate(prompts):
            expected, target_rate = timed(model.generate, ids, swiftspec=False, **kwargs)
            saved = (model.output_history.docs.copy(), model.output_history.tokens)
            model.output_history.clear()
            out, cleared_rate = timed(model.generate, ids, swiftspec=True, **kwargs)
            cleared_tau = model.swiftspec_stats.tau
            assert torch.equal(out, expected)
            model.output_history.clear()
            for tokens in saved[0].values():  # the history as it was before this request
                model.output_history.add(tokens)
            out, history_rate = timed(model.generate, ids, swiftspec=True, **kwargs)
            assert torch.equal(out, expected)
            print(f"{p + 1:4d} {i:6d} | {target_rate:12.1f} | {history_rate:10.1f} ({model.swiftspec_stats.tau:.2f}) "
                  f"| {cleared_rate:10.1f} ({cleared_tau:.2f}) | {model.output_history.tokens}")
            totals["target"].append(target_rate)
            totals["history"].append(history_rate)
            totals["cleared"].append(cleared_rate)
    mean = {k: sum(v) / len(v) for k, v in totals.items()}
    print(f"mean tok/s: target {mean['target']:.1f}, swiftspec with history {mean['history']:.1f} "
          f"({mean['history'] / mean['target']:.2f}x), cleared {mean['cleared']:.1f} ({mean['cleared'] / mean['target']:.2f}x)")


if __name__ == "__main__":
    main()
