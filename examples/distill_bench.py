"""A distilled pair against the pair's own draft, on the same target, side by side in one `swiftspec bench` run.

`swiftspec distill` writes a pair folder whose target is the one it was given; this times that pair's draft as one
more method of a bench run on the original pair (the same target weights, prompts and settings), interleaved call
by call with target.generate and the pair's own draft, every output checked against target.generate's. Each draft
runs under its own pair's settings (the distilled pair's config.json: what `swiftspec distill` wrote), and the
bench's --tree-budget / --draft-width / --draft-depth override both.

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
from hf_swiftspec.bench.methods import SWIFTSPEC_FIELDS, load_models, swiftspec_method
from hf_swiftspec.bench.report import markdown_report
from hf_swiftspec.pair import load_pair_config


def distilled_draft(folder: Path, target):
    """The draft model of a pair folder `swiftspec distill` wrote, beside `target` in its dtype."""
    draft = folder / "draft"
    if not (draft / "config.json").is_file():
        raise SystemExit(f"--distilled {folder}: no draft/config.json there; give the folder swiftspec distill wrote.")
    return AutoModelForCausalLM.from_pretrained(draft, dtype=target.dtype).to(target.device).eval()


def own_settings(folder: Path, overrides: dict) -> dict:
    """The distilled pair's SwiftSpecConfig fields the bench sets, from its config.json, under the bench's overrides."""
    config = load_pair_config(folder, str(folder))
    return {**{name: getattr(config, name) for name in SWIFTSPEC_FIELDS}, **overrides}


def main() -> None:
    outer = argparse.ArgumentParser(add_help=False)
    outer.add_argument("--distilled", required=True, type=Path, help="the pair folder swiftspec distill wrote")
    known, rest = outer.parse_known_args()
    config = bench_config(build_parser().parse_args(rest))
    models = load_models(config, [])
    settings = own_settings(known.distilled, config.swiftspec)
    model = SwiftSpecForCausalLM.from_models(models.target, distilled_draft(known.distilled, models.target), **settings)
    method = swiftspec_method("swiftspec_serial", model, config.seed)
    tree = ", ".join(f"{name}={settings[name]}" for name in ("tree_budget", "draft_width", "draft_depth"))
    method = dataclasses.replace(method, name="swiftspec_distilled", label=f"swiftspec serial, {known.distilled.name}'s pair",
                                 settings={**method.settings, "draft": str(known.distilled / "draft"), "tree": tree})
    report = run_bench(dataclasses.replace(config, models=models, extra_methods=(method,)))
    print(markdown_report(report))


if __name__ == "__main__":
    main()
