"""Everything a GPU session measures, as phases that each write their results under $OUT the moment they end.

    python examples/gpu_session.py --phase tests    # ~3 min  the tests that run CUDA code  -> tests.txt
    python examples/gpu_session.py --phase kernel   # ~6 min  tree kernel vs sdpa           -> kernel.json, kernel.md
    python examples/gpu_session.py --phase steps    # ~2 min  8B / 1B-shaped step latencies -> steps.json, steps.md
    python examples/gpu_session.py --phase e2e      # ~6 min  train a pair, bench it        -> e2e.json, bench_results/
    python examples/gpu_session.py --phase all      # the four in order (longer than one 10-minute device call)
    python examples/gpu_session.py --smoke --phase all --out /tmp/smoke   # tiny shapes: well under a minute

tests   pytest on the test files that run CUDA code on a GPU machine: the tree-attention kernel (all of it, the
        slow sweep included), the attention wiring, and the CLI and bench tests (their default device is cuda:0).
kernel  kernels/benchmarks/bench_tree_attention.py for fp16 and bf16, 32 query heads over 32/8/4 KV heads
        (GQA groups 1/4/8), head dims 64/128/256, prefixes of 512 to 32k tokens, trees of 1 to 64 nodes.
steps   step latencies of a Llama-3-8B-shaped target and a Llama-3.2-1B-shaped draft with RANDOM weights in
        bf16, at 1k and 8k tokens of context: one draft expansion (DraftModelDrafter.expand over 8 leaves) and target
        verifications of T = 1, 8, 16, 32 nodes (TargetWorker.forward_subtrees), eager, through the model's own
        sdpa and through the Triton tree kernel; then replayed as CUDA graphs (capture.py), eager layers and compiled
        and as CUDA graphs; each beside its HBM floor: (weight bytes + KV bytes read) / the measured bandwidth.
e2e     trains a ~158M target and a ~15M draft on the standard library as examples/train_demo_pair.py trains the
        demo pair (bf16 autocast, 150 s + 60 s), then runs `swiftspec bench` (`python -m hf_swiftspec.bench`)
        on it in float32 with every method it offers, swiftspec_compiled included; the pair itself stays in a
        temporary folder.

The device's bandwidth is measured once per run (a 4 GiB device-to-device copy, bytes read + written) and
passed to kernel, steps and the bench as the peak. A phase that fails writes its traceback into
$OUT/<phase>.json and the run goes on; the exit status is 0 only if every phase passed. Without CUDA every
phase runs as --smoke on the CPU (one torch thread, the kernel in Triton's interpreter).

$OUT (or --out) receives per phase at most four files, so one phase per device call stays within the eight
files such a call brings back. The code runs from this checkout: nothing needs to be installed.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_PATHS = [str(REPO), str(REPO / "kernels" / "torch-ext")]  # this checkout, also where nothing is installed
sys.path[:0] = SOURCE_PATHS + [str(REPO / "kernels" / "benchmarks"), str(REPO / "examples")]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: the kernel runs interpreted

import bench_tree_attention  # noqa: E402  (kernels/benchmarks)
import train_demo_pair  # noqa: E402  (examples)
from train_demo_pair import DemoSettings, ModelShape  # noqa: E402

from hf_swiftspec.steps.attention import routed_attention  # noqa: E402
from hf_swiftspec.bench.command import device_description  # noqa: E402
from hf_swiftspec.steps.capture import Captures  # noqa: E402
from hf_swiftspec.bench.limits import kv_bytes_per_token, measure_bandwidth_gbps, weight_bytes_read  # noqa: E402
from hf_swiftspec.config import SwiftSpecConfig  # noqa: E402
from hf_swiftspec.engine.launch import build_workers  # noqa: E402
from hf_swiftspec.tools.models import shaped_model  # noqa: E402
from hf_swiftspec.steps.tree import Subtree, subtree_mask  # noqa: E402

# Shapes in hf_swiftspec.tools.models.REAL_SHAPES' format. Context 131072 as in Llama 3.1, so the draft's tree
# may grow past 8k positions; rope scaling left out (it costs nothing per step).
LLAMA_3_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, max_position_embeddings=131072,
)
LLAMA_3_2_1B = dict(
    model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, max_position_embeddings=131072,
)
TINY_LLAMA = dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: GPU (the issue's shapes, each phase a few minutes) or SMOKE (tiny, seconds)."""

    tests: tuple[str, ...]  # pytest arguments
    # kernel: every (dtype, q heads, kv heads, head dim) over every prefix x tree size
    kernel_configs: tuple[tuple[str, int, int, int], ...]
    kernel_prefixes: tuple[int, ...]
    kernel_trees: tuple[int, ...]
    kernel_iters: tuple[int, int]  # (warm-up, timed) calls per case
    kernel_budget_s: float  # no new configuration starts after this long (the device kills a call at 10 min)
    # steps
    step_target: dict
    step_draft: dict
    step_dtype: torch.dtype
    step_contexts: tuple[int, ...]
    step_trees: tuple[int, ...]
    step_iters: tuple[int, int]
    # e2e
    demo: DemoSettings
    bench_args: tuple[str, ...]
    bandwidth_mib: int  # size of the copy that measures the peak
    bench_pair: str | None = None  # bench this pair (None: the demo pair) instead of training one
    train: bool = True
    # how the steps run: "model" / "kernel" (SwiftSpecConfig.attention, eager), "captured" (replayed, capture.py,
    # attention "auto": the kernel on CUDA), "captured-model" (replayed, sdpa with a dense mask), "compiled"
    # (replayed, the decoder layers compiled: compile=True)
    step_attentions: tuple[str, ...] = ("model", "kernel", "captured", "captured-model", "compiled")


GPU = Plan(
    tests=("tests/test_cuda.py", "tests/test_tree_attention_kernel.py", "tests/test_attention_wiring.py", "tests/test_cli.py",
           "tests/test_bench.py", "tests/test_capture.py"),
    # bf16, GQA 4, head dim 128 (Llama-3-8B's attention) first: the configuration that matters most
    kernel_configs=tuple(itertools.product(("bf16", "fp16"), (32,), (8, 4, 32), (128, 64, 256))),
    kernel_prefixes=(512, 2048, 8192, 32768),
    kernel_trees=(1, 8, 16, 32, 64),
    kernel_iters=(10, 50),
    kernel_budget_s=360.0,
    step_target=LLAMA_3_8B,
    step_draft=LLAMA_3_2_1B,
    step_dtype=torch.bfloat16,
    step_contexts=(1024, 8192),
    step_trees=(1, 8, 16, 32),
    step_iters=(5, 20),
    # ~158M and ~15M parameters (heads of 64), 16k tokens a step; at a few steps a second the target sees
    # several passes over the ~3.4M-token corpus in 150 s.
    demo=DemoSettings(
        context=512, target_shape=ModelShape(hidden=1024, layers=12, intermediate=2816, heads=16),
        draft_shape=ModelShape(hidden=512, layers=4, intermediate=1408, heads=8), batch_size=32,
        target_steps=100_000, draft_steps=100_000, target_seconds=150.0, draft_seconds=60.0,
        target_lr=1e-3, draft_lr=2e-3, eval_windows=32, tau_prompts=8, tau_new_tokens=64,
    ),
    # float32: the bench fails the run on any token that differs from target.generate's, and 16-bit
    # rounding differs between the tree kernel's T-node step and sdpa's 1-token step
    bench_args=("--dtype", "float32", "--prompts", "humaneval", "--prompts", "spec_bench", "--prompts", "editing",
                "--methods", "target,assisted,prompt_lookup,swiftspec_serial,swiftspec_async,swiftspec_compiled"),
    bandwidth_mib=4096,
)

SMOKE = Plan(
    tests=("tests/test_tree_attention_kernel.py", "-k", "pack"),
    kernel_configs=(("bf16", 4, 2, 32), ("fp16", 4, 4, 64)),
    kernel_prefixes=(64,),
    kernel_trees=(1, 8),
    kernel_iters=(1, 2),
    kernel_budget_s=60.0,
    step_target=TINY_LLAMA,
    step_draft={**TINY_LLAMA, "num_hidden_layers": 1},
    step_dtype=torch.float32,
    step_contexts=(32, 96),
    step_trees=(1, 4, 8),
    step_iters=(1, 3),
    demo=DemoSettings(
        context=64, vocab_size=300, corpus_files=8, batch_size=2, target_steps=2, draft_steps=2, eval_windows=2,
        target_shape=ModelShape(hidden=64, layers=1, intermediate=128, heads=1),
        draft_shape=ModelShape(hidden=64, layers=1, intermediate=64, heads=1), tau_prompts=1, tau_new_tokens=4,
    ),
    bench_args=("--dtype", "float32", "--prompts", "humaneval", "--num-prompts", "1", "--max-new-tokens", "8",
                "--assistant-tokens", "4", "--growth-check-tokens", "16", "--warmup", "0"),
    bandwidth_mib=64,
)


# One 15-minute lease (a machine's start included): each phase a minute or two. The tests on CUDA, the kernel
# at Llama-3-8B's heads (bf16, GQA 4, head dim 128), the 8B/1B steps, and the bundled demo pair benched as it
# ships, not retrained.
LEASE = replace(
    GPU,
    tests=("-rfE", "--tb=short", "tests/test_cuda.py",
           "tests/test_capture.py",
           "tests/test_tree_attention_kernel.py"),
    kernel_configs=(("bf16", 32, 8, 128),),
    kernel_prefixes=(1024, 4096, 8192),
    kernel_trees=(1, 8, 16, 32),
    kernel_iters=(5, 30),
    kernel_budget_s=60.0,
    step_iters=(3, 10),
    bench_args=("--dtype", "float32", "--prompts", "humaneval", "--prompts", "spec_bench", "--num-prompts", "4",
                "--max-new-tokens", "64", "--methods", "target,assisted,prompt_lookup,swiftspec_serial,swiftspec_async"),
    train=False,
)
# The captured round (capture.py): its CUDA test and the device round's fused kernels against their references
# (compiled, on the GPU: tests/test_fused_*.py), the 8B/1B steps eager and replayed, and the demo pair against
# transformers' compiled static-cache decoding, eager swiftspec and the other peers, with the bundled EAGLE-3 head
# (its steps and its target's replayed).
CAPTURE = replace(
    LEASE,
    tests=("-rfE", "--tb=short", "tests/test_capture.py", "tests/test_fused_kernels.py", "tests/test_fused_merge.py",
           "tests/test_fused_select.py", "-k", "cuda or kernel or fused or equals"),
    step_contexts=(1024, 8192),
    step_attentions=("model", "captured", "captured-model", "compiled"),
    bench_args=("--dtype", "float32", "--prompts", "humaneval", "--prompts", "spec_bench", "--num-prompts", "4",
                "--max-new-tokens", "64", "--eagle3", "swiftspec-demo-pystdlib-eagle3", "--methods",
                "target,target_static,assisted_static,prompt_lookup,swiftspec_serial,swiftspec_eager,swiftspec_compiled,"
                "swiftspec_eagle3,swiftspec_device"),
)
# The captured round on a pair whose draft model pays, the device round (swiftspec_device) beside it (on the demo
# pair the suffix index carries the draft, which runs no forwards on a GPU): the 158M/15M pair trained for less
# time than GPU's, so that it and its bench fit one lease beside the CUDA capture tests.
TRAINED = replace(
    CAPTURE,
    demo=replace(GPU.demo, target_seconds=120.0, draft_seconds=45.0),
    bench_args=("--dtype", "float32", "--prompts", "humaneval", "--prompts", "spec_bench", "--num-prompts", "4",
                "--max-new-tokens", "64", "--methods",
                "target,target_static,assisted_static,prompt_lookup,swiftspec_serial,swiftspec_eager,swiftspec_compiled,"
                "swiftspec_device"),
    train=True,
)
PLANS = {"gpu": GPU, "lease": LEASE, "capture": CAPTURE, "trained": TRAINED, "smoke": SMOKE}


@dataclass
class Session:
    out: Path
    device: torch.device
    plan: Plan
    failed: list[str] = field(default_factory=list)

    @cached_property
    def peak_gbps(self) -> float:
        """Copy bandwidth of the device (bytes read + written), measured once."""
        return measure_bandwidth_gbps(self.device, self.plan.bandwidth_mib)

    def environment(self) -> dict:
        import transformers

        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        return {
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": device_description(self.device), "smoke": self.plan is SMOKE, "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton_version, "python": platform.python_version(),
        }  # fmt: skip

    def write(self, name: str, text: str) -> Path:
        path = self.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def write_json(self, name: str, record: dict) -> Path:
        return self.write(name, json.dumps({"environment": self.environment(), **record}, indent=1, default=str))


def child_env() -> dict:
    """The environment of a subprocess: this checkout's packages importable without an install."""
    paths = SOURCE_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def median_ms(run, reset, device: torch.device, warmup: int, iters: int) -> float:
    """Median time of run() in ms over `iters` calls after `warmup`, reset() before each, outside the timing.
    CUDA: events recorded around the call after a synchronize (launch gaps count); CPU: the wall clock."""
    times = []
    for i in range(warmup + iters):
        reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(device)
            ms = start.elapsed_time(end)
        else:
            begin = time.perf_counter()
            run()
            ms = 1000 * (time.perf_counter() - begin)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


# ---------------------------------------------------------------- tests


SUMMARY = re.compile(r"^(=+ )?(\d+ (passed|failed|skipped|errors?|deselected)[^\n]*) in [\d.]+s", re.MULTILINE)


def run_tests(session: Session) -> None:
    """pytest in a subprocess, its output streamed into tests.txt as it comes. A pytest that has printed its
    summary but does not exit within 15 s is stopped and judged by the summary: on an H200 the capture tests'
    pytest printed it (96 s) and then outlived the phase's limit, losing the result (the cause is not known)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.plan.tests]
    path = session.out / "tests.txt"
    with path.open("w") as log:
        log.write(f"{' '.join(command)}\n{json.dumps(session.environment())}\n\n")
        log.flush()
        process = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        code, summarised = None, None
        while code is None:
            time.sleep(1.0)
            code = process.poll()
            summary = SUMMARY.search(path.read_text())
            summarised = summarised or (summary and time.perf_counter())
            if code is None and summarised and time.perf_counter() - summarised > 15.0:
                process.kill()
                process.wait()
                code = int(bool(re.search(r"failed|error", summary.group(2))))
                log.write(f"\n(pytest had not exited 15 s after its summary: stopped; status taken from the summary)")
        log.write(f"\nexit status: {code}\n")
    print(path.read_text()[-2000:])
    if code:
        session.failed.append(f"tests (pytest exit status {code})")


# ---------------------------------------------------------------- kernel


def kernel_args(session: Session, dtype: str, q_heads: int, kv_heads: int, head_dim: int) -> argparse.Namespace:
    plan = session.plan
    warmup, iters = plan.kernel_iters
    return argparse.Namespace(
        prefix=list(plan.kernel_prefixes), tree=list(plan.kernel_trees), batch=1, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype, peak_gbps=session.peak_gbps, warmup=warmup, iters=iters,
    )


def kernel_markdown(session: Session, record: dict) -> str:
    """One table per head configuration, the bench's own columns."""
    columns = bench_tree_attention.COLUMNS
    parts = [f"# Tree attention kernel vs sdpa\n\n{session.environment()['device']}, peak {session.peak_gbps:.0f} GB/s "
             "(measured copy). Medians in ms, L2 flushed before each call (on CUDA). tree: the Triton kernel; dense: sdpa "
             "with a boolean mask; effic.: sdpa's memory-efficient backend, K/V repeated to every query head; flash: sdpa's "
             "flash backend WITHOUT a mask (not the same computation: a floor for reading the same K/V); vs dense = "
             "dense / tree; GB/s: (Q + K + V bytes) / tree time. nan: the backend refused the case."]
    configs = itertools.groupby(record["rows"], key=lambda r: (r["dtype"], r["q_heads"], r["kv_heads"], r["head_dim"]))
    for (dtype, hq, hkv, d), rows in configs:
        table = [[bench_tree_attention.format_cell(row[key], fmt) for key, _, _, fmt in columns] for row in rows]
        parts.append(f"## {dtype}, {hq} query / {hkv} KV heads (GQA group {hq // hkv}), head dim {d}\n\n"
                     + markdown_table([header for _, header, _, _ in columns], table))
    parts += [f"Failed: {error}" for error in record["errors"]]
    parts += [f"Not run, out of time: {config}" for config in record["skipped_for_time"]]
    return "\n\n".join(parts) + "\n"


def run_kernel(session: Session) -> None:
    """Every configuration in turn, both files rewritten after each (a kill loses only the one running)."""
    sk = bench_tree_attention.import_kernels()
    device = session.device.type
    rows, errors, skipped = [], [], []
    start = time.perf_counter()
    for config in session.plan.kernel_configs:
        if time.perf_counter() - start > session.plan.kernel_budget_s:
            skipped.append(config)
            continue
        try:
            rows += bench_tree_attention.bench(kernel_args(session, *config), sk, device)
        except Exception as error:  # a configuration the kernel or sdpa fails: the others still count
            errors.append(f"{config}: {type(error).__name__}: {error}")
            traceback.print_exc()
        record = {"peak_gbps": session.peak_gbps, "seconds": time.perf_counter() - start, "rows": rows,
                  "errors": errors, "skipped_for_time": skipped}
        session.write_json("kernel.json", record)
        session.write("kernel.md", kernel_markdown(session, record))
    if errors:
        session.failed.append(f"kernel ({len(errors)} configurations failed)")


# ---------------------------------------------------------------- steps


def random_subtree(nodes: int, vocab: int, seed: int) -> Subtree:
    """A tree of `nodes` nodes, each node's parent drawn uniformly among the earlier ones."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
    tokens = torch.randint(3, vocab, (nodes,), generator=gen).tolist()
    return Subtree(list(range(nodes)), tokens, parents)


def verification_ms(worker, subtree: Subtree, session: Session) -> float:
    """A target verification forward of `subtree` over the committed prefix, the cache rolled back each time."""
    prefix = worker.cache.prefix_lens[0]
    return median_ms(lambda: worker.forward_subtrees([subtree]), lambda: worker.cache.truncate(prefix),
                     session.device, *session.plan.step_iters)


def expansion_ms(worker, session: Session) -> float:
    """One draft expansion (the best `width` leaves: the root's children), the tree and cache put back each time."""
    tree, lengths = copy.deepcopy(worker.trees[0]), list(worker.cache.lengths)

    def reset():
        worker.trees[0] = copy.deepcopy(tree)
        worker.cache.lengths = list(lengths)

    return median_ms(worker.expand, reset, session.device, *session.plan.step_iters)


def step_row(session: Session, step: str, model, context: int, nodes: int, attention: str, ms: float) -> dict:
    """A measured step beside its floor: every weight and the KV of the context read once at peak bandwidth."""
    weights, kv = weight_bytes_read(model), kv_bytes_per_token(model) * (context + nodes)
    floor_ms = 1000 * (weights + kv) / (session.peak_gbps * 1e9)
    return {"step": step, "context": context, "nodes": nodes, "attention": attention, "ms": ms,
            "weight_mb": weights / 1e6, "kv_mb": kv / 1e6, "floor_ms": floor_ms, "over_floor": ms / floor_ms}


def steps_at(session: Session, target, draft, context: int, attention: str) -> list[dict]:
    """Prefill both models on a random prompt of `context` tokens as generate() does, then time a draft
    expansion and each verification size with `attention` ("model" or "kernel", SwiftSpecConfig's)."""
    trees = session.plan.step_trees
    vocab = target.config.vocab_size
    prompt = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(context))
    captured = attention in ("captured", "captured-model", "compiled")
    config = SwiftSpecConfig(attention={"captured": "auto", "compiled": "auto"}.get(attention, attention.removeprefix(
        "captured-")), capture=captured, compile=attention == "compiled")
    target_worker, drafters = build_workers(target, draft, config, context + max(trees), None,
                                            captures=Captures() if captured else None)
    drafter = drafters.model  # the draft model's drafter (the suffix drafter runs no model)
    rows = []
    with routed_attention(target, target_worker.attention), routed_attention(draft, drafter.attention):
        target_worker.prefill(prompt)
        drafter.start([prompt[0].tolist()])
        drafter.catch_up()  # the prompt into the draft's prefix
        drafter.expand()  # the root: its children are the leaves every timed expansion runs
        ms = expansion_ms(drafter, session)
        label = lambda worker: worker.attention if worker.runner is None else (  # noqa: E731
            f"{worker.attention} replayed" + (", compiled" if worker.runner.compile_layers else ""))
        rows.append(step_row(session, "draft_expand", draft, context, drafter.width, label(drafter), ms))
        target_worker.forward_subtrees([random_subtree(1, vocab, 0)])  # takes the prefill's root logits
        for T in trees:
            ms = verification_ms(target_worker, random_subtree(T, vocab, T), session)
            rows.append(step_row(session, "verify", target, context, T, label(target_worker), ms))
    return rows


def step_models(session: Session, notes: list[str]):
    """(target, draft) with random weights (transformers' usual initialisation: only their speed counts) on the
    device; a target too large for the device beside the draft loses half its layers until it fits."""
    plan, shape = session.plan, dict(session.plan.step_target)
    build = dict(initializer_range=0.02, device=session.device, dtype=plan.step_dtype)
    draft = shaped_model(plan.step_draft, seed=1, **build)
    while True:
        try:
            return shaped_model(shape, **build), draft
        except torch.OutOfMemoryError:
            shape["num_hidden_layers"] //= 2
            notes.append(f"the target did not fit beside the draft: shrunk to {shape['num_hidden_layers']} layers")
            torch.cuda.empty_cache()


def steps_markdown(session: Session, record: dict) -> str:
    header = ["context", "step", "nodes", "attention", "ms", "floor ms", "x floor", "weights MB", "KV MB"]
    table = [[r["context"], r["step"], r["nodes"], r["attention"], f"{r['ms']:.3f}", f"{r['floor_ms']:.3f}",
              f"{r['over_floor']:.2f}", f"{r['weight_mb']:.0f}", f"{r['kv_mb']:.1f}"] for r in record["rows"]]
    lines = [f"# Step latencies, eager ({session.environment()['device']})", "", *record["notes"],
             f"Peak {session.peak_gbps:.0f} GB/s (measured copy). Medians of {session.plan.step_iters[1]} calls after "
             f"{session.plan.step_iters[0]} warm-ups.", "", markdown_table(header, table)]
    lines += [f"\nFailed: {error}" for error in record["errors"]]
    return "\n".join(lines) + "\n"


def run_steps(session: Session) -> None:
    plan = session.plan
    dtype = str(plan.step_dtype).removeprefix("torch.")
    notes = [f"RANDOM weights in {dtype}: target shaped like {plan.step_target}, draft like {plan.step_draft}; "
             f"draft_expand runs DraftModelDrafter.expand (the draft's {SwiftSpecConfig().draft_width} best leaves), verify runs "
             "TargetWorker.forward_subtrees "
             "(T nodes of a random tree); attention: sdpa = the model's own with a dense mask, triton = the tree kernel."]
    target, draft = step_models(session, notes)
    record = {"notes": notes, "peak_gbps": session.peak_gbps, "rows": [], "errors": [],
              "target_params": sum(p.numel() for p in target.parameters()),
              "draft_params": sum(p.numel() for p in draft.parameters())}
    for context, attention in itertools.product(plan.step_contexts, plan.step_attentions):
        try:
            with torch.no_grad():  # as generate() runs them
                record["rows"] += steps_at(session, target, draft, context, attention)
        except Exception as error:
            record["errors"].append(f"context {context}, attention {attention}: {type(error).__name__}: {error}")
            traceback.print_exc()
        if session.device.type == "cuda":
            torch.cuda.empty_cache()
        session.write_json("steps.json", record)
        session.write("steps.md", steps_markdown(session, record))
    print(steps_markdown(session, record))
    if record["errors"]:
        session.failed.append(f"steps ({len(record['errors'])} failed)")


# ---------------------------------------------------------------- e2e


def run_bench(session: Session, pair: Path | str | None, log: Path) -> int:
    """`swiftspec bench` on the pair (None: the demo pair) in a subprocess, results into $OUT/bench_results/."""
    command = [sys.executable, "-m", "hf_swiftspec.bench", *(["--pair", str(pair)] if pair else []),
               "--out", str(session.out / "bench_results"), "--peak-gbps", f"{session.peak_gbps:.1f}", "--quiet",
               *session.plan.bench_args]
    with log.open("w") as out:
        code = subprocess.run(command, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT).returncode
    print(log.read_text()[-6000:])
    return code


def run_e2e(session: Session) -> None:
    """Train the pair (e2e.json as soon as it is trained), measure it, bench it; or bench a ready pair."""
    if not session.plan.train:
        with tempfile.TemporaryDirectory(prefix="gpu_session_") as work:
            code = run_bench(session, session.plan.bench_pair, Path(work) / "bench.log")
            session.write_json("e2e.json", {"pair": session.plan.bench_pair or "the demo pair", "bench": {
                "exit_status": code, "output_tail": (Path(work) / "bench.log").read_text()[-4000:]}})
        if code:
            session.failed.append(f"e2e (bench exit status {code})")
        return
    settings = replace(session.plan.demo, device=str(session.device))
    record: dict = {"settings": asdict(settings)}
    with tempfile.TemporaryDirectory(prefix="gpu_session_") as work:
        pair = Path(work) / "pair"
        corpus = train_demo_pair.prepare_corpus(settings)
        training = train_demo_pair.train_members(settings, corpus, pair)
        record["training"] = {role: asdict(t) for role, t in training.items()}
        session.write_json("e2e.json", record)
        facts = train_demo_pair.write_pair(settings, corpus, pair, training)
        tau = facts.tau
        record.update(sizes=facts.sizes, heldout_loss=facts.losses,
                      tau={**asdict(tau), "tau": tau.tau, "speedup": tau.speedup})
        session.write_json("e2e.json", record)
        if session.device.type == "cuda":
            torch.cuda.empty_cache()  # the bench is another process: leave it the memory this one cached
        code = run_bench(session, pair, Path(work) / "bench.log")
        record["bench"] = {"exit_status": code, "output_tail": (Path(work) / "bench.log").read_text()[-4000:]}
        session.write_json("e2e.json", record)
    if code:
        session.failed.append(f"e2e (bench exit status {code})")


# ---------------------------------------------------------------- the run

PHASES = {"tests": run_tests, "kernel": run_kernel, "steps": run_steps, "e2e": run_e2e}


def run_phase(name: str, session: Session) -> None:
    """One phase; an exception is written into the phase's JSON (the run goes on to the next phase)."""
    print(f"== {name} ==", flush=True)
    start = time.perf_counter()
    try:
        PHASES[name](session)
    except Exception:
        traceback.print_exc()
        session.failed.append(name)
        path = session.out / f"{name}.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        session.write_json(f"{name}.json", {**record, "error": traceback.format_exc()})
    print(f"== {name}: {time.perf_counter() - start:.0f} s ==", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", default="all", help=f"one of {', '.join(PHASES)}, comma-separated, or all")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="results folder (default: $OUT)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, seconds (the default without CUDA)")
    parser.add_argument("--plan", choices=PLANS, default=None,
                        help="gpu (the default on CUDA: every size, ~17 min), lease (one 15-minute lease: each phase "
                        "a minute or two) or smoke (tiny shapes, the default without CUDA)")
    args = parser.parse_args(argv)
    args.phases = list(PHASES) if args.phase == "all" else args.phase.split(",")
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        parser.error(f"--phase {args.phase}: unknown {unknown}; choose from {', '.join(PHASES)} or all")
    if args.out is None:
        parser.error("no results folder: set $OUT or pass --out DIR")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
        if not args.smoke:
            print("No CUDA device: running the --smoke sizes on the CPU.", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    plan = SMOKE if args.smoke or not cuda else PLANS[args.plan or "gpu"]
    session = Session(args.out, torch.device("cuda:0" if cuda else "cpu"), plan)
    for name in args.phases:
        run_phase(name, session)
    files = sorted(str(p.relative_to(args.out)) for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {', '.join(files)} in {args.out}; failed: {', '.join(session.failed) or 'none'}")
    return 1 if session.failed else 0


if __name__ == "__main__":
    sys.exit(main())
