"""A distilled draft against the pair's own draft, on the same target, side by side in one `swiftspec bench` run.

`swiftspec distill` writes a pair folder whose target is the one it was given; this times that pair's draft as one
more method of a bench run on the original pair (the same target weights, prompts and settings), interleaved call
by call with target.generate and the pair's own draft, every output checked against target.generate's.

    python examples/distill_bench.py --distilled /tmp/demo-distilled [swiftspec bench options, e.g. --threads 1
        --methods target,swiftspec_serial --out examples/results/cpu-distill-bench]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from transformers import AutoModelForCausalLM

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import bench_config, build_parser, run_bench
from hf_swiftspec.bench.methods import load_models, swiftspec_method, swiftspec_settings
from hf_swiftspec.bench.report import markdown_report


def distilled_draft(folder: Path, target):
    """The draft model of a pair folder `swiftspec distill` wrote, beside `target` in its dtype."""
    draft = folder / "draft"
    if not (draft / "config.json").is_file():
        raise SystemExit(f"--distilled {folder}: no draft/config.json there; give the folder swiftspec distill wrote.")
    return AutoModelForCausalLM.from_pretrained(draft, dtype=target.dtype).to(target.device).eval()


def main() -> None:
    outer = argparse.ArgumentParser(add_help=False)
    outer.add_argument("--distilled", required=True, type=Path, help="the pair folder swiftspec distill wrote")
    known, rest = outer.parse_known_args()
    config = bench_config(build_parser().parse_args(rest))
    models = load_models(config, [])
    settings = swiftspec_settings(models, config)
    model = SwiftSpecForCausalLM.from_models(models.target, distilled_draft(known.distilled, models.target), **settings)
    method = swiftspec_method("swiftspec_serial", model, config.seed)
    method = dataclasses.replace(method, name="swiftspec_distilled", label=f"swiftspec serial, {known.distilled.name}'s draft",
                                 settings={**method.settings, "draft": str(known.distilled / "draft")})
    report = run_bench(dataclasses.replace(config, models=models, extra_methods=(method,)))
    print(markdown_report(report))


if __name__ == "__main__":
    main()
