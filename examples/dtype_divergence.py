"""How often and how far 16-bit speculation departs from the target's own 16-bit output.

In float32 swiftspec's greedy output equals target.generate's token for token. In bfloat16 / float16
it cannot be guaranteed: a verification runs T tokens through every layer at once, and a GEMM over T
rows accumulates in another order than the 1-token step target.generate runs, so the two paths see
logits that differ by rounding (bfloat16 keeps 8 bits of mantissa: near 34 its spacing is 0.25).
Where two candidates are that close, the paths may pick different ones; from there the texts differ,
each a greedy continuation of the target up to rounding. transformers' own assisted generation and
prompt lookup verify several tokens at once too, and differ the same way.

For each prompt and dtype this prints whether swiftspec's tokens equal target.generate's in that
dtype, the first new token where they differ, the gap between the target's two best logits there
(how near a tie it was) and, as the scale of what rounding alone does, how many of the first N
tokens the 16-bit target itself shares with the float32 target.

    python examples/dtype_divergence.py [--pair swiftspec-demo-pystdlib] [--prompts humaneval,spec_bench] [--num-prompts 8]
"""

from __future__ import annotations

import argparse

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def logit_gap(model, ids: torch.Tensor, new: list[int], at: int) -> float:
    """The target's top-1 minus top-2 logit before new token `at` (a 1-token-step forward over the plain text)."""
    context = torch.cat([ids, torch.tensor([new[:at]], dtype=ids.dtype)], dim=1)
    with torch.no_grad():
        logits = model.target(context).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib")
    parser.add_argument("--prompts", default="humaneval,spec_bench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = [p for source in args.prompts.split(",") for p in load_prompts(source, args.num_prompts)]
    reference = SwiftSpecForCausalLM.from_pretrained(args.pair, dtype=torch.float32)
    tok = reference.tokenizer
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    encoded = [tok(p.text, return_tensors="pt").input_ids[:, -192:] for p in prompts]
    exact32 = []
    for ids in encoded:
        plain = reference.generate(ids, swiftspec=False, **kwargs)[0, ids.shape[1]:].tolist()
        exact32.append(plain == reference.generate(ids, swiftspec=True, **kwargs)[0, ids.shape[1]:].tolist())
    print(f"float32: {sum(exact32)}/{len(exact32)} prompts identical to target.generate")
    for name in args.dtypes.split(","):
        model = SwiftSpecForCausalLM.from_pretrained(args.pair, dtype=getattr(torch, name))
        same, rows = 0, []
        for ids in encoded:
            plain = model.generate(ids, swiftspec=False, **kwargs)[0, ids.shape[1]:].tolist()
            spec = model.generate(ids, swiftspec=True, **kwargs)[0, ids.shape[1]:].tolist()
            fp32 = reference.generate(ids, swiftspec=False, **kwargs)[0, ids.shape[1]:].tolist()
            at = first_difference(plain, spec)
            vs32 = first_difference(plain, fp32)
            same += at is None
            gap = None if at is None or at >= len(plain) else logit_gap(model, ids, plain, at)
            rows.append((at, gap, vs32))
        diverged = [r for r in rows if r[0] is not None]
        print(f"{name}: {same}/{len(rows)} prompts identical to target.generate in {name}")
        for at, gap, vs32 in diverged:
            gap_text = "" if gap is None else f", top-2 logit gap there {gap:.3f}"
            print(f"  differs from new token {at}{gap_text}")
        departs = [r[2] for r in rows if r[2] is not None]
        print(f"  {name} target.generate itself departs from float32's in {len(departs)}/{len(rows)} prompts "
              f"(first at new token {min(departs) if departs else '-'})")


if __name__ == "__main__":
    main()
