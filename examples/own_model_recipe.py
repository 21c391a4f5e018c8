"""Your own model, no trained draft: what to expect, measured as tau (tokens per target verification).

Two drafters need nothing trained: draft-free (suffix proposals copied from the text's own repetition) and an
early exit cut from the target (`tools.models.truncated_draft`: its embedding, first layers, norm and head). This
script measures both on one target, on free-text prompts (HumanEval completions: new code) and on copy/edit
prompts (rename an argument, copy an excerpt, repeat an answer), greedy, every output checked against
target.generate's. Tau is the number to read here: with fixed tree settings it depends on the text and the drafter,
not on the machine's load; tokens per second follow it only where a verification costs about a plain step and the
draft is cheap (time them with `swiftspec bench` on your own machine). Each call starts with
`model.output_history` cleared, so no call copies an earlier call's output.

    OMP_NUM_THREADS=1 python examples/own_model_recipe.py --out examples/results/cpu-own-model-recipe
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts
from hf_swiftspec.pair import bundled_pair
from hf_swiftspec.tools.models import truncated_draft

PROMPT_SETS = {"free text": "humaneval", "copy/edit": "editing"}


def tau_over(model, tokenizer, prompts, max_new_tokens: int) -> dict:
    """Tokens per verification over the prompts (all new tokens over all verifications), per prompt too; and
    whether every output equals target.generate's."""
    tokens = verifications = 0
    per_prompt, identical = [], True
    for prompt in prompts:
        ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        model.output_history.clear()  # this call alone: no copying from earlier calls' outputs
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        expected = model.target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        identical &= out.tolist() == expected.tolist()
        stats = model.swiftspec_stats
        tokens, verifications = tokens + stats.new_tokens, verifications + stats.verify_steps
        per_prompt.append(round(stats.tau, 3))
    return dict(tau=round(tokens / verifications, 3), per_prompt=per_prompt, new_tokens=tokens,
                verifications=verifications, identical=identical)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(bundled_pair("swiftspec-demo-pystdlib") / "target"))
    parser.add_argument("--num-prompts", type=int, default=6, help="per prompt set (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree-budget", type=int, default=8, help="fixed tree size (default: %(default)s)")
    parser.add_argument("--draft-depth", type=int, default=4, help="fixed expansions a round (default: %(default)s)")
    parser.add_argument("--exit-layers", type=int, default=1, help="layers the early exit keeps (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    settings = dict(tree_budget=args.tree_budget, draft_depth=args.draft_depth)
    drafters = {
        "draft-free": SwiftSpecForCausalLM.from_models(target, tokenizer=tokenizer, **settings),
        f"early exit ({args.exit_layers} of {target.config.num_hidden_layers} layers)": SwiftSpecForCausalLM.from_models(
            target, truncated_draft(target, args.exit_layers), tokenizer=tokenizer, **settings),
    }
    context = target.config.max_position_embeddings
    rows = []
    for kind, source in PROMPT_SETS.items():
        fits = [p for p in load_prompts(source) if len(tokenizer(p.text).input_ids) + args.max_new_tokens <= context]
        prompts = fits[: args.num_prompts]  # the first that fit the target's context with their new tokens
        for name, model in drafters.items():
            row = dict(drafter=name, prompts=f"{kind} ({source}: the first {len(prompts)} that fit {context} positions)",
                       **tau_over(model, tokenizer, prompts, args.max_new_tokens))
            rows.append(row)
            print(f"{name:32s} {kind:10s} tau {row['tau']:.2f}  per prompt {row['per_prompt']}  identical {row['identical']}")
    where = Path(args.target).resolve()
    named = str(where.relative_to(Path.cwd())) if where.is_relative_to(Path.cwd()) else args.target
    results = dict(target=named, target_layers=target.config.num_hidden_layers, settings=settings,
                   max_new_tokens=args.max_new_tokens, greedy=True, rows=rows)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
