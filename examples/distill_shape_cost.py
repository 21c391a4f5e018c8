"""What `swiftspec distill`'s default draft costs beside a `shape:` target (random weights in a real model's shape).

No draft agrees with random weights, so on a `shape:` target distilling measures only the cost: this times one
decoding step (one new token over a cache of `--context` tokens) of the target, of the default recipe's draft
(`--draft small`: one layer, about 0.4 of the target's heads) and of the `shape:` pairs' own draft (an early exit of
the target's first 2 layers), median of `--repeats` steps, one thread.

    python examples/distill_shape_cost.py --out examples/results/cpu-distill-shapes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_swiftspec.tools.distill_drafts import SmallShape, small_draft
from hf_swiftspec.tools.models import REAL_SHAPES, shaped_model, truncated_draft


@torch.no_grad()
def step_ms(model, context: int, repeats: int) -> float:
    """Median milliseconds of one decoding step (1 token) over a `context`-token cache."""
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats):
        out = model(ids[:, :context], use_cache=True)
        started = time.perf_counter()
        model(ids[:, context:], past_key_values=out.past_key_values, use_cache=True)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def params_m(model) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=sorted(REAL_SHAPES))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.shapes:
        target = shaped_model(REAL_SHAPES[name])
        drafts = {"small (distill's default)": small_draft(target, SmallShape(), seed=0).eval(),
                  "early-exit:2 (the shape: pairs')": truncated_draft(target, 2)}
        target_ms = step_ms(target, args.context, args.repeats)
        row = {"shape": name, "target_params_m": round(params_m(target), 1), "target_step_ms": round(target_ms, 2)}
        for label, draft in drafts.items():
            ms = step_ms(draft, args.context, args.repeats)
            row[label] = {"params_m": round(params_m(draft), 1), "hidden": draft.config.hidden_size,
                          "layers": draft.config.num_hidden_layers, "step_ms": round(ms, 2),
                          "of_target_step": round(ms / target_ms, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del target, drafts
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"context": args.context, "repeats": args.repeats, "threads": 1,
                                                           "shapes": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
