"""Writing a run down: results.json, results.md (the Markdown the command prints) and results.png,
with a speed-up by batch size table and plot where the run measured batches."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path

from ..stats import PHASES
from ..tools.options import TREE_OPTIONS
from .schema import BatchResult, BenchReport, LimitReport, MemoryBudget, MethodResult, PromptRun, SetResult, Spread


def fmt(value: Spread | None, digits: int = 2, suffix: str = "") -> str:
    """"mean ± sd" of a Spread, "–" when the metric does not apply."""
    if value is None:
        return "–"
    return f"{value.mean:.{digits}f} ± {value.sd:.{digits}f}{suffix}"


def settings_text(method: MethodResult) -> str:
    if method.status != "ok":
        return method.note
    shown = {k: v for k, v in method.settings.items() if k not in ("num_assistant_tokens_schedule", "note")}
    text = ", ".join(f"{k}={v}" for k, v in shown.items())
    return f"{text} (fastest of {', '.join(method.tuning)})" if method.tuning else text


def memory_text(weights: dict[str, float], run: dict[str, float]) -> str:
    """MiB per device: the weights of the models a method holds + the most one of its calls allocated."""
    devices = list(dict.fromkeys([*weights, *(d for d, mib in run.items() if mib)]))
    return "; ".join(f"{d} {weights.get(d, 0.0):.1f} + {run.get(d, 0.0):.1f}" for d in devices) or "–"


def policy_cells(m: MethodResult) -> str:
    """The goodput policy's mean choices for a swiftspec method, a cell each: tree size T, draft forwards
    per round, share of plain rounds, n-gram share of accepted tokens ("–" for the other methods)."""
    if m.tree_budget is None:
        return " | ".join("–" * 4)
    return (
        f"{m.tree_budget.mean:.1f} | {m.draft_expansions.mean:.1f} | {100 * m.plain_fraction.mean:.0f}% | "
        f"{100 * m.ngram_share.mean:.0f}%"
    )


def method_table(methods: list[MethodResult]) -> list[str]:
    lines = [
        "| method | settings | tokens/s | speed-up | τ | target fwd / token | target idle | tree T | draft fwd / round "
        "| plain rounds | n-gram share | memory MiB (weights + call) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        idle = None if m.target_idle_fraction is None else Spread(
            *(100 * getattr(m.target_idle_fraction, k) for k in ("mean", "sd", "min", "max"))
        )
        lines.append(
            f"| {m.label} | {settings_text(m)} | {fmt(m.tokens_per_s, 1)} | {fmt(m.speedup, 2, '×')} | {fmt(m.tau)} | "
            f"{fmt(m.target_forwards_per_token)} | {fmt(idle, 0, '%')} | {policy_cells(m)} | "
            f"{memory_text(m.weights_mib, m.run_memory_mib)} |"
        )
    return lines


def mean_phases(runs: list[PromptRun], key: str) -> dict[str, float] | None:
    """A method's round breakdown over its calls (`key`: "phases" or "device_phases"), in ms per round, each call
    weighted by its rounds; None where no call has one."""
    found = [getattr(run, key) for run in runs if getattr(run, key) is not None]
    rounds = sum(p["rounds"] for p in found)
    if not rounds:
        return None
    return {name: sum(p[name] * p["rounds"] for p in found) / rounds for name in ("round", *PHASES, "other")}


def phase_table(methods: list[MethodResult]) -> list[str]:
    """Where the serial round's time went, a row per method and clock (host; on CUDA also the device's stream)."""
    rows = []
    for m in methods:
        for key, clock in (("phases", "host"), ("device_phases", "CUDA events")):
            ms = mean_phases(m.runs, key)
            if ms is not None:
                cells = " | ".join(f"{ms[name]:.2f}" for name in ("round", *PHASES, "other"))
                rows.append(f"| {m.label} | {clock} | {cells} |")
    if not rows:
        return []
    names = " | ".join(name.replace("_", "-") for name in (*PHASES, "other"))
    return [
        "Where a serial round's time went, in ms per round (the phases and other sum to the round):",
        "",
        f"| method | clock | round | {names} |",
        "|---|---|---|" + "---|" * (len(PHASES) + 1),
        *rows,
        "",
    ]


def limit_lines(limit: LimitReport) -> list[str]:
    return [
        f"**Limit** ({limit.method}, {limit.device}; peak bandwidth {limit.peak_gbps:.1f} GB/s, {limit.peak_source}): "
        f"one verification step reads {limit.weight_mb:.1f} MB of weights + {limit.kv_mb:.1f} MB of KV (mean context "
        f"{limit.context_tokens:.0f} tokens), so its floor is {limit.floor_ms:.2f} ms. Measured: {limit.verify_step_ms:.2f} ms "
        f"per verification ({limit.verify_over_floor:.2f}× the floor); target.generate {limit.target_step_ms:.2f} ms per "
        f"token ({limit.target_step_over_floor:.2f}×). Ceiling τ / floor = {limit.tau:.2f} / {limit.floor_ms:.2f} ms = "
        f"{limit.ceiling_tokens_per_s:.0f} tokens/s; measured {limit.tokens_per_s:.1f} tokens/s.",
        "",
    ]


def memory_lines(memory: MemoryBudget) -> list[str]:
    verdict = "no reallocation, one cache per model" if memory.no_growth else "**GREW: a kv buffer was reallocated**"
    lines = [
        f"## Memory budget ({memory.context_tokens} tokens of context)",
        "",
        "| item | MiB |",
        "|---|---|",
        f"| draft weights | {memory.draft_weights_mib:.1f} |",
        f"| draft cache (context + {memory.draft_extra_slots} tree slots) | {memory.draft_tree_cache_mib:.1f} |",
        f"| token tree ({memory.tree_capacity} nodes) | {memory.token_tree_mib:.1f} |",
        f"| target cache (context + {memory.target_extra_slots} slots) − its own KV ({memory.target_kv_mib:.1f}) | "
        f"{memory.target_tree_cache_mib - memory.target_kv_mib:.1f} |",
        f"| **extra over target alone** (target weights {memory.target_weights_mib:.1f}) | **{memory.extra_mib:.1f}** |",
        "",
    ]
    for t in memory.traces:
        lines.append(
            f"- {t.role}: {t.forwards} forwards, {t.caches} cache, {t.buffers} kv buffer {tuple(t.shape)}; at most "
            f"{t.max_length} of {t.capacity} positions and {t.max_tree_slots} tree slots in use."
        )
    lines += [
        f"- Within the tree region (the device round: target ≤ its slot bucket for the context and the largest round "
        f"of tree_budget={memory.tree_budget}; the host round: ≤ tree_budget extra slots, or a capacity shared "
        f"between calls where steps are replayed; draft tree ≤ tree_capacity="
        f"{memory.tree_capacity}): {'yes' if memory.within_tree_region else '**no**'}; growth: {verdict}.",
        "",
    ]
    return lines


def batch_heading(batch: BatchResult) -> list[str]:
    """"### batch size B: how many calls of how many rows", saying where a short group repeated its prompts."""
    base = next(m for m in batch.methods if m.name == "target")
    repeats = sum(len(run.prompts) - len(set(run.prompts)) for run in base.runs)
    filled = f"; {repeats} row{'s' * (repeats > 1)} repeat a prompt of their own batch to fill it" if repeats else ""
    size, count = batch.batch_size, len(base.runs)
    rows = f"of {size} prompts, left-padded" if size > 1 else "of one prompt"
    return [f"### Batch size {size}: {count} call{'s' * (count != 1)} {rows}{filled}", ""]


def batch_cell(m: MethodResult) -> str:
    """One method at one batch size: target.generate's tokens/s, the others' speed-up over it, and
    the goodput policy's mean T per row and share of plain rounds for swiftspec."""
    if m.status != "ok":
        return m.status
    if m.name == "target":
        return f"{m.tokens_per_s.mean:.1f} tok/s"
    cell = f"{m.speedup.mean:.2f}×"
    if m.tree_budget is not None:
        cell += f" (T {m.tree_budget.mean:.1f}, {100 * m.plain_fraction.mean:.0f}% plain)"
    if any(engine.startswith("target") for engine in m.engines):
        cell += " (target's own loop)"
    return cell


def batch_table(sets: list[SetResult]) -> list[str]:
    """Rows: set x method; columns: batch sizes."""
    sizes = [b.batch_size for b in sets[0].batches]
    lines = [
        "## Speed-up by batch size",
        "",
        "Total tokens/s of all rows for target.generate; for the others, speed-up over it on the same padded batches "
        "(mean over calls), and for swiftspec the policy's mean tree size T per row and share of plain rounds (T = 1).",
        "",
        "| set | method | " + " | ".join(f"B = {b}" for b in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    for result in sets:
        for k, m in enumerate(result.batches[0].methods):
            cells = [batch_cell(batch.methods[k]) for batch in result.batches]
            lines.append(f"| {result.name} | {m.label} | " + " | ".join(cells) + " |")
    return lines + [""]


def batch_memory_lines(sets: list[SetResult]) -> list[str]:
    """Memory per method at the largest batch size: its models' weights + the most one of its calls allocated."""
    lines = []
    for result in sets:
        batch = result.batches[-1]
        ok = [m for m in batch.methods if m.status == "ok"]
        shown = "; ".join(f"{m.label} {memory_text(m.weights_mib, m.run_memory_mib)}" for m in ok)
        lines.append(f"- {result.name}: {shown}")
    return [f"Memory at batch size {sets[0].batches[-1].batch_size}, MiB: the weights a method holds + the most one "
            "call allocated:", ""] + lines + [""]


def markdown_report(report: BenchReport) -> str:
    """results.md: a header saying what ran where, one table per prompt set and batch size (and where the serial
    round's time went), the speed-up by batch size, the limit and the memory budget."""
    pair, env, config = report.pair, report.environment, report.config
    tree = ", ".join(f"{k}={'auto' if v is None else v}" for k, v in pair.settings.items() if k in TREE_OPTIONS)
    cut = (
        f"prompts cut to at most {config['max_prompt_tokens']} tokens and to fit the context"
        if config["max_prompt_tokens"]
        else "prompts cut only to fit the context"
    )
    sizes = [b.batch_size for b in report.sets[0].batches] if report.sets else [1]
    batched = sizes != [1]
    calls = (
        f"batch sizes {', '.join(map(str, sizes))} (prompts left-padded, one generate() call per batch); mean ± sd over "
        "calls" if batched else "mean ± sd over prompts"
    )
    lines = [
        "# SwiftSpec benchmark",
        "",
        f"Pair **{pair.name}**: target {pair.target} ({pair.target_params_m:g}M parameters), draft {pair.draft} "
        f"({pair.draft_params_m:g}M), {pair.dtype}; {env.device}, {env.threads} torch thread(s) per worker. Greedy, "
        f"{config['max_new_tokens']} new tokens at most, {cut}; {calls}; warm-up and tuning untimed; "
        f"every method's tokens identical to target.generate's on every prompt{', row by row' if batched else ''}. "
        f"swiftspec: {tree}.",
        "",
        f"hf_swiftspec {env.hf_swiftspec}, transformers {env.transformers}, torch {env.torch}, Python {env.python}; "
        f"{env.created}. Peak memory: {env.memory_source}.",
        "",
    ]
    for result in report.sets:
        lines += [f"## {result.name}: {len(result.prompts)} prompts", ""]
        lines += [f"From `{result.source}`; warm-up prompt {result.warmup_prompt}.", ""]
        for batch in result.batches:
            lines += (batch_heading(batch) if batched else []) + method_table(batch.methods) + [""]
            lines += phase_table(batch.methods)
            if batch.batch_size == 1 and result.limit is not None:
                lines += limit_lines(result.limit)
    if batched and report.sets:
        lines += batch_table(report.sets) + batch_memory_lines(report.sets)
    if report.memory is not None:
        lines += memory_lines(report.memory)
    if report.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in report.notes] + [""]
    return "\n".join(lines)


def error_bar(value: Spread | None) -> tuple[float, float, float]:
    """(bar height, whisker below, whisker above) for one metric: the bar at the mean, the whisker
    spanning the prompts' min to max. Mean ± sd went below zero for skewed speed-ups; a range never
    does (the metrics plotted are never negative), and the lower end is clamped at 0 all the same."""
    if value is None:
        return 0.0, 0.0, 0.0
    low = max(value.min, 0.0)
    return value.mean, max(value.mean - low, 0.0), max(value.max - value.mean, 0.0)


def plot_batch_sizes(ax, sets: list[SetResult]) -> None:
    """Speed-up over target.generate against batch size: a line per set and method measured at more
    than one batch size (the batch-1-only methods are in the bars), min-max whiskers."""
    sizes = [b.batch_size for b in sets[0].batches]
    for result in sets:
        for k, m in enumerate(result.batches[0].methods):
            if m.name == "target":
                continue
            points = [(b.batch_size, error_bar(b.methods[k].speedup)) for b in result.batches if b.methods[k].status == "ok"]
            if len(points) > 1:
                xs, bars = zip(*points)
                heights, below, above = zip(*bars)
                ax.errorbar(xs, heights, yerr=[below, above], marker="o", capsize=3, label=f"{result.name}: {m.label}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size (prompts per call)")
    ax.set_title("speed-up over target.generate by batch size (min-max)")
    if ax.get_legend_handles_labels()[0]:  # none where only target.generate decoded batches
        ax.legend(fontsize="small")


def write_plot(report: BenchReport, path: Path) -> None:
    """Speed-up and tokens/s per method at the smallest batch size (batch 1 unless the run skipped
    it), one bar per prompt set: the mean, with the min-max range over calls; with several batch
    sizes, a third panel of speed-up against batch size."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display backend

    first = [s.batches[0].methods for s in report.sets]
    names = list(dict.fromkeys(m.name for methods in first for m in methods if m.status == "ok"))
    labels = {m.name: m.label for methods in first for m in methods}
    several = len(report.sets[0].batches) > 1
    fig = Figure(figsize=(4 + 1.6 * len(names) + 5 * several, 4.5), layout="constrained")
    axes = fig.subplots(1, 2 + several)
    width = 0.8 / len(report.sets)
    for k, methods in enumerate(first):
        by_name = {m.name: m for m in methods if m.status == "ok"}
        xs = [i + (k - (len(report.sets) - 1) / 2) * width for i in range(len(names))]
        for ax, metric in zip(axes, ("speedup", "tokens_per_s")):
            heights, below, above = zip(*(error_bar(getattr(by_name.get(n), metric, None)) for n in names))
            ax.bar(xs, heights, width, yerr=[below, above], capsize=3, label=report.sets[k].name)
    at = f" at batch size {report.sets[0].batches[0].batch_size}" if several else ""
    for ax, title in zip(axes, (f"speed-up over target.generate{at} (min-max)", f"tokens/s{at} (min-max)")):
        ax.set_title(title)
        ax.set_xticks(range(len(names)), [labels[n] for n in names], rotation=20, ha="right")
        ax.legend(fontsize="small")
    axes[0].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    if several:
        plot_batch_sizes(axes[2], report.sets)
    fig.suptitle(f"{report.pair.name} on {report.environment.device}", fontsize="medium")
    fig.savefig(path, dpi=120)


def write_outputs(report: BenchReport, directory: str | Path) -> list[Path]:
    """results.json, results.md and (with matplotlib) results.png in `directory`; returns their paths."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    plot = find_spec("matplotlib") is not None
    if not plot:
        report.notes.append("No results.png: matplotlib is not installed (pip install 'hf_swiftspec[bench]').")
    paths = [folder / "results.json", folder / "results.md"]
    paths[0].write_text(json.dumps(asdict(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    paths[1].write_text(markdown_report(report), encoding="utf-8")
    if plot:
        paths.append(folder / "results.png")
        write_plot(report, paths[-1])
    return paths
