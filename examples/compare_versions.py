"""Speed of this checkout's swiftspec against an earlier revision's, side by side in one bench run.

A refactor of the decode path must not cost speed. Timing two checkouts one after the other measures
the machine's drift as much as the change; here the earlier revision's package is copied out of git
under another name (hf_swiftspec_before: every import inside the package is relative) and timed as one
more method of the same `swiftspec bench` run, interleaved call by call with target.generate and this
checkout's swiftspec, on the same models and prompts. Its tokens are checked against target.generate's
like every method's.

    python examples/compare_versions.py --before HEAD~3 [swiftspec bench options, e.g. --pair shape:smollm2-135m
        --batch-sizes 1,4 --threads 1 --methods target,swiftspec_serial]
    python examples/compare_versions.py --before HEAD~3 --before-compile --methods target,swiftspec_compiled
    python examples/compare_versions.py --before HEAD~3 --before-rounds host,device \
        --methods target,prompt_lookup,swiftspec_serial,swiftspec_device   # each round against its earlier self
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from hf_swiftspec.bench import bench_config, build_parser, run_bench
from hf_swiftspec.bench.methods import Method, load_models, swiftspec_settings
from hf_swiftspec.bench.report import markdown_report

ROOT = Path(__file__).resolve().parents[1]


def archive_revision(revision: str) -> Path:
    """A temporary folder holding `revision`'s hf_swiftspec package (as `git archive` gives it)."""
    folder = Path(tempfile.mkdtemp(prefix="swiftspec-before-"))
    archive = subprocess.run(["git", "archive", revision, "hf_swiftspec"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def import_revision(revision: str, name: str = "hf_swiftspec_before"):
    """The hf_swiftspec package of `revision`, imported as `name` from a temporary folder."""
    folder = archive_revision(revision)
    (folder / "hf_swiftspec").rename(folder / name)
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def before_method(package, models, settings: dict, seed: int, label: str, name: str = "swiftspec_before") -> Method:
    """The earlier revision's swiftspec on the same models, as a bench method."""
    model = package.SwiftSpecForCausalLM.from_models(models.target, models.draft, **settings)

    def generate(ids, **kwargs):
        model.swiftspec_stats = None
        generator = torch.Generator(device=model.target.device).manual_seed(seed)
        return model.generate(ids, swiftspec=True, generator=generator, **kwargs)

    def checkpoint():
        saved = [list(doc) for doc in model.output_history.docs.values()]

        def restore():
            model.output_history.clear()
            for doc in saved:
                model.output_history.add(doc)

        return restore

    return Method(name, label, generate, stats=lambda: model.swiftspec_stats,
                  settings={"revision": label}, batched=not settings.get("compile"), checkpoint=checkpoint)


def main() -> None:
    outer = argparse.ArgumentParser(add_help=False)
    outer.add_argument("--before", required=True, help="the git revision to compare with (e.g. HEAD~3, a commit)")
    outer.add_argument("--before-rounds", default=None,
                       help="comma-separated SwiftSpecConfig rounds to time the earlier revision with, each a method of "
                       "its own (swiftspec_before_host, swiftspec_before_device); default: its default round")
    outer.add_argument("--before-compile", action="store_true",
                       help="time the earlier revision with compile=True (compare with --methods ...,swiftspec_compiled)")
    known, rest = outer.parse_known_args()
    args = build_parser().parse_args(rest)
    config = bench_config(args)
    package = import_revision(known.before)
    models = load_models(config, [])
    settings = swiftspec_settings(models, config) | ({"compile": True} if known.before_compile else {})
    if known.before_rounds:
        extra = tuple(before_method(package, models, settings | {"round": name}, config.seed,
                                    f"swiftspec at {known.before}, round={name}", f"swiftspec_before_{name}")
                      for name in known.before_rounds.split(","))
    else:
        extra = (before_method(package, models, settings, config.seed, f"swiftspec at {known.before}"),)
    config = dataclasses.replace(config, models=models, extra_methods=extra)
    report = run_bench(config)
    print(markdown_report(report))


if __name__ == "__main__":
    main()
