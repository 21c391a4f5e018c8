"""examples/gpu_session.py --smoke: every phase runs on the CPU in seconds and writes its results, so the
GPU session that runs the full sizes finds a script that works and only has to run it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """One smoke run of every phase (a single process: torch is imported once)."""
    out = tmp_path_factory.mktemp("gpu_session")
    env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, also on a GPU machine
    command = [sys.executable, str(REPO / "examples" / "gpu_session.py"), "--smoke", "--phase", "all"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "failed: none" in result.stdout
    return out


def read_json(path: Path) -> dict:
    record = json.loads(path.read_text())
    assert record["environment"]["smoke"] is True and record["environment"]["torch"]
    assert "error" not in record
    return record


# The smoke run of every phase (~45 s on a 2-core CPU) only matters before a GPU session: run it then with
# `pytest -m slow tests/test_gpu_session.py`.
pytestmark = pytest.mark.slow


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_tests_phase_keeps_pytest_output(out):
    text = (out / "tests.txt").read_text()
    assert "-m pytest" in text and " passed" in text and text.rstrip().endswith("exit status: 0")


def test_kernel_phase_writes_a_row_per_case(out):
    record = read_json(out / "kernel.json")
    rows = record["rows"]
    assert len(rows) == 4 and not record["errors"] and positive(record["peak_gbps"])
    assert {(r["dtype"], r["kv_heads"], r["T"]) for r in rows} == {("bf16", 2, 1), ("bf16", 2, 8), ("fp16", 4, 1), ("fp16", 4, 8)}
    for row in rows:
        assert all(positive(row[k]) for k in ("tree_ms", "dense_ms", "gbps", "pct_peak", "speedup_vs_dense"))
    markdown = (out / "kernel.md").read_text()
    assert markdown.count("| prefix | T | tree ms |") == 2 and "GQA group 2" in markdown


def test_steps_phase_times_expansions_and_verifications_beside_their_floor(out):
    record = read_json(out / "steps.json")
    assert not record["errors"] and "RANDOM weights" in record["notes"][0]
    rows = record["rows"]
    steps = {(r["context"], r["attention"], r["step"], r["nodes"]) for r in rows}
    for context in (32, 96):
        for attention in ("sdpa", "triton"):  # the model's own attention, and the kernel (interpreted here)
            assert (context, attention, "draft_expand", 8) in steps
            assert {(context, attention, "verify", t) for t in (1, 4, 8)} <= steps
    for row in rows:
        assert all(positive(row[k]) for k in ("ms", "floor_ms", "over_floor", "weight_mb", "kv_mb"))
        assert row["over_floor"] == pytest.approx(row["ms"] / row["floor_ms"])
    assert "| context | step | nodes |" in (out / "steps.md").read_text()


def test_e2e_phase_trains_a_pair_and_benches_it(out):
    record = read_json(out / "e2e.json")
    assert record["training"]["target"]["steps"] == 2 and record["training"]["draft"]["steps"] == 2
    assert all(positive(loss) for loss in record["heldout_loss"].values())
    assert record["tau"]["identical"] is True and record["tau"]["tau"] >= 1
    assert record["bench"]["exit_status"] == 0
    bench = json.loads((out / "bench_results" / "results.json").read_text())
    methods = {m["name"]: m for m in bench["sets"][0]["batches"][0]["methods"]}
    assert {"target", "assisted", "prompt_lookup", "swiftspec_serial"} <= set(methods)
    assert positive(methods["swiftspec_serial"]["tokens_per_s"]["mean"])
    assert (out / "bench_results" / "results.md").exists()


def test_each_phase_writes_at_most_four_files(out):
    """A device call brings back at most eight files: one phase per call must stay well inside that."""
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    by_phase = {"tests": ["tests.txt"], "kernel": ["kernel.json", "kernel.md"], "steps": ["steps.json", "steps.md"],
                "e2e": ["e2e.json", "bench_results/results.json", "bench_results/results.md", "bench_results/results.png"]}
    expected = {Path(name) for names in by_phase.values() for name in names}
    assert set(files) <= expected and set(files) >= expected - {Path("bench_results/results.png")}  # png: matplotlib
