"""A draft with another tokenizer than the target's (issue 64): how much of what it proposes survives the
translation into the target's tokens, what the target accepts of it, and what translating costs a round.

The pair is made here, in memory, from two tokenizers trained on one text (hf_swiftspec.tools.models.bpe_tokenizer):
the target's byte-level ("Ġgolf"), the draft's SentencePiece-like ("▁golf", the same words, other ids and spelling)
or with spaces ending words ("golf ", word boundaries one character off the target's). Both models continue that
text (tools.models.text_model), so the draft proposes the target's text in its own tokens: the case where the
translation decides tau. Every call's tokens are checked against target.generate.

    python examples/other_tokenizer.py --out examples/results/cpu-other-tokenizer
    python examples/other_tokenizer.py --save /tmp/two-tokenizer-pair   # then, for the side-by-side bench:
    swiftspec bench --threads 1 --pair /tmp/two-tokenizer-pair --methods target,assisted,swiftspec_serial --max-new-tokens 64

(`assisted` runs transformers' universal assisted generation on that pair: generate(assistant_model=draft,
tokenizer=..., assistant_tokenizer=...).) Timings on a shared machine are noisy: read the ms as an order of size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import CYCLE_TEXT, bpe_tokenizer, text_model

WORDS = CYCLE_TEXT.split()
SETTINGS = {"adaptive": {}, "tree 8, depth 4, no suffix proposals": {"tree_budget": 8, "draft_depth": 4, "ngram_size": 0}}


def prompts(count: int) -> list[str]:
    """`count` prompts of 3-6 words from across the text."""
    return [" ".join(WORDS[(5 * i) % len(WORDS):][: 3 + i % 4]) for i in range(count)]


def measure(target, draft, tt, dt, settings: dict, texts: list[str], new_tokens: int, direct: bool) -> dict:
    model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, **settings)
    if not direct:
        model.vocabularies.direct = {}  # every branch re-tokenised from its text
    runs = []
    for text in texts:
        ids = tt(text, return_tensors="pt").input_ids
        expected = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, swiftspec=True)
        wall = time.perf_counter() - start
        if out.tolist() != expected.tolist():
            sys.exit(f"tokens differ from target.generate on {text!r}")
        stats = model.swiftspec_stats
        runs.append((stats, wall))
    translated = [s.translation for s, _ in runs]
    steps = sum(s.verify_steps for s, _ in runs)
    return {
        "tau": round(sum(s.new_tokens for s, _ in runs) / steps, 2),
        "draft_nodes_translated": sum(t.nodes for t in translated),
        "survival_percent": round(100 * sum(t.kept for t in translated) / max(sum(t.nodes for t in translated), 1), 1),
        "mapped_percent": round(100 * sum(t.mapped for t in translated) / max(sum(t.kept for t in translated), 1), 1),
        "translation_ms_per_round": round(1e3 * sum(t.seconds for t in translated) / steps, 2),
        "round_ms": round(1e3 * sum(w for _, w in runs) / steps, 2),
        "taken_back_tokens": sum(t.taken_back for t in translated),
        "tokens_per_s": round(sum(s.new_tokens for s, _ in runs) / sum(w for _, w in runs), 1),
        "tokens_per_s_median_call": round(statistics.median(s.new_tokens / w for s, w in runs), 1),
    }


def build(style: str):
    tt, dt = bpe_tokenizer(450, "bytes"), bpe_tokenizer(700 if style == "pieces" else 560, style)
    target = text_model(tt, seed=0)
    target.generation_config.eos_token_id = None
    return target, text_model(dt, seed=1, layers=1), tt, dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write results.json and results.md here")
    parser.add_argument("--save", type=Path, help="write the pieces pair (members included) here, for swiftspec bench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.save:
        target, draft, tt, dt = build("pieces")
        SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt).save_pretrained(
            args.save, save_members=True)
        print(f"wrote {args.save}: swiftspec bench --threads 1 --pair {args.save} --methods target,assisted,swiftspec_serial")
        return
    texts = prompts(args.prompts)
    rows = []
    for style in ("pieces", "trailing"):
        target, draft, tt, dt = build(style)
        for name, settings in SETTINGS.items():
            for direct in (True, False):
                row = {"draft_tokenizer": style, "tree": name, "mapping": "token to token, else text" if direct else
                       "text only", **measure(target, draft, tt, dt, settings, texts, args.max_new_tokens, direct)}
                rows.append(row)
                print(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"prompts": texts, "max_new_tokens": args.max_new_tokens,
                                                           "torch_threads": 1, "rows": rows}, indent=2) + "\n")
        keys = list(rows[0])
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
        (args.out / "command.txt").write_text(
            f"python examples/other_tokenizer.py --out {args.out} --prompts {args.prompts} "
            f"--max-new-tokens {args.max_new_tokens}\n# on the project's shared 2-core machine, loaded by other jobs\n")


if __name__ == "__main__":
    main()
