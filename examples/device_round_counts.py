"""What a device round (round="device") costs a GPU, counted per round on a CPU: host reads, host data made into
tensors (each a pageable copy that waits for the stream on CUDA, but one pinned non-blocking copy), operators
dispatched (each a kernel on a GPU, replayed or not) in all and inside the two models' forwards, and the keys each
verification's attention reads against the prefix it has.

    python examples/device_round_counts.py [--pair swiftspec-demo-pystdlib] [--rows 1] [--max-new-tokens 48]
           [--round device] [--settings tree_budget=8,draft_depth=3,draft_width=2] [--capture] [--out FILE.json]

Greedy, float32, eager phases (capture=False: the operators are the same in a replay; --capture: the replayed phases'
stand-in on a CPU, whose slot caches are pooled, as on CUDA). Prints the mean per round (after the first round) and
writes every round's counts with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import rounds
from hf_swiftspec.tools.counters import KeysRead, OperatorCounter, SyncCounter

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Config:\n    def __init__(self, path):\n",
           "def read_lines(path):\n    with open(path) as f:\n", "import json\n\n\ndef load(path):\n"]


def parse_settings(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        out[name] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else value
    return out


def load(pair: str, settings: dict) -> SwiftSpecForCausalLM:
    if pair.startswith("shape:"):
        from hf_swiftspec.tools.models import char_tokenizer, real_shaped_pair

        model = SwiftSpecForCausalLM.from_models(*real_shaped_pair(pair.removeprefix("shape:")),
                                                 tokenizer=char_tokenizer(), **settings)
        model.generation_config.eos_token_id = None
        return model
    return SwiftSpecForCausalLM.from_pretrained(pair, dtype=torch.float32, **settings)


def counted_rounds(model, ids, mask, max_new_tokens: int) -> list[dict]:
    """One greedy call; per round its counts (rounds.one_round, the round's whole body)."""
    body, out = rounds.one_round, []

    def counted(sides, rows):
        models = (model.target, model.draft)
        with SyncCounter() as sync, OperatorCounter(models) as ops, KeysRead() as keys:
            keep = body(sides, rows)
        prefix = [h.prefix for h in getattr(sides, "host", [])[: getattr(sides, "live", 0)]]
        out.append(dict(reads=sync.total, host_tensors=sync.host_tensors, operators=ops.total, forwards=ops.forwards,
                        outside=ops.outside, keys=[k for _, k in keys.calls], queries=[q for q, _ in keys.calls],
                        longest=max(prefix) if prefix else None, top=ops.operators.most_common(12)))
        return keep

    rounds.one_round = counted
    try:
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    finally:
        rounds.one_round = body
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--round", default="device")
    parser.add_argument("--settings", default="tree_budget=8,draft_depth=3,draft_width=2")
    parser.add_argument("--capture", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = dict(parse_settings(args.settings), round=args.round, capture=args.capture)
    model = load(args.pair, settings)
    tok = model.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    batch = tok(PROMPTS[: args.rows], return_tensors="pt", padding=True)
    per_round = counted_rounds(model, batch.input_ids, batch.attention_mask if args.rows > 1 else None,
                               args.max_new_tokens)
    later = per_round[1:] or per_round
    mean = {k: statistics.fmean(r[k] for r in later) for k in ("reads", "host_tensors", "operators", "forwards", "outside")}
    print(f"{args.pair}, {args.rows} row(s), round={args.round}, {args.settings}: {len(per_round)} rounds")
    print("per round (mean after the first): " + ", ".join(f"{k} {v:.1f}" for k, v in mean.items()))
    last = per_round[-1]
    print(f"last round: attention calls read {sorted(set(last['keys']))} keys, the longest row's prefix "
          f"{last['longest']} slots")
    print("most frequent operators outside the forwards (last round):", last["top"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(pair=args.pair, rows=args.rows, settings=settings, mean=mean, rounds=per_round), f, indent=1)


if __name__ == "__main__":
    main()
