"""Writing a run down: results.json, results.md (the Markdown the command prints) and results.png."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path

from ..commandline import TREE_OPTIONS
from .schema import BenchReport, LimitReport, MemoryBudget, MethodResult, Spread


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


def memory_text(peak: dict[str, float], run: dict[str, float]) -> str:
    return "; ".join(f"{device} {peak[device]:.0f} (+{run.get(device, 0.0):.0f})" for device in peak) or "–"


def policy_text(m: MethodResult) -> str:
    """The goodput policy's mean choices for a swiftspec method ("–" for the others)."""
    if m.tree_budget is None:
        return "–"
    return (
        f"{m.tree_budget.mean:.1f} / {m.draft_expansions.mean:.1f}, {100 * m.plain_fraction.mean:.0f}%, "
        f"{100 * m.ngram_share.mean:.0f}%"
    )


def method_table(methods: list[MethodResult]) -> list[str]:
    lines = [
        "| method | settings | tokens/s | speed-up | τ | target fwd / token | target idle | policy: T / draft fwd per round, plain rounds, n-gram share | peak MiB (+ during call) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        idle = None if m.target_idle_fraction is None else Spread(
            *(100 * getattr(m.target_idle_fraction, k) for k in ("mean", "sd", "min", "max"))
        )
        lines.append(
            f"| {m.label} | {settings_text(m)} | {fmt(m.tokens_per_s, 1)} | {fmt(m.speedup, 2, '×')} | {fmt(m.tau)} | "
            f"{fmt(m.target_forwards_per_token)} | {fmt(idle, 0, '%')} | {policy_text(m)} | "
            f"{memory_text(m.peak_memory_mib, m.run_memory_mib)} |"
        )
    return lines


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
        f"| draft TreeCache (context + {memory.draft_extra_slots} tree slots) | {memory.draft_tree_cache_mib:.1f} |",
        f"| token tree ({memory.tree_capacity} nodes) | {memory.token_tree_mib:.1f} |",
        f"| target TreeCache (context + {memory.target_extra_slots} slots) − its own KV ({memory.target_kv_mib:.1f}) | "
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
        f"- Within the tree region (target ≤ tree_budget={memory.tree_budget} extra slots, draft tree ≤ tree_capacity="
        f"{memory.tree_capacity}): {'yes' if memory.within_tree_region else '**no**'}; growth: {verdict}.",
        "",
    ]
    return lines


def markdown_report(report: BenchReport) -> str:
    """results.md: a header saying what ran where, one table per prompt set, the limit and the memory budget."""
    pair, env, config = report.pair, report.environment, report.config
    tree = ", ".join(f"{k}={'auto' if v is None else v}" for k, v in pair.settings.items() if k in TREE_OPTIONS)
    cut = (
        f"prompts cut to at most {config['max_prompt_tokens']} tokens and to fit the context"
        if config["max_prompt_tokens"]
        else "prompts cut only to fit the context"
    )
    lines = [
        "# SwiftSpec benchmark",
        "",
        f"Pair **{pair.name}**: target {pair.target} ({pair.target_params_m:g}M parameters), draft {pair.draft} "
        f"({pair.draft_params_m:g}M), {pair.dtype}; {env.device}, {env.threads} torch thread(s) per worker. Greedy, "
        f"{config['max_new_tokens']} new tokens at most, {cut}; mean ± sd over prompts; warm-up and tuning untimed; "
        f"every method's tokens identical to target.generate's on every prompt. swiftspec: {tree}.",
        "",
        f"hf_swiftspec {env.hf_swiftspec}, transformers {env.transformers}, torch {env.torch}, Python {env.python}; "
        f"{env.created}. Peak memory: {env.memory_source}.",
        "",
    ]
    for result in report.sets:
        lines += [f"## {result.name}: {len(result.prompts)} prompts", ""]
        lines += [f"From `{result.source}`; warm-up prompt {result.warmup_prompt}.", ""]
        lines += method_table(result.methods) + [""]
        if result.limit is not None:
            lines += limit_lines(result.limit)
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


def write_plot(report: BenchReport, path: Path) -> None:
    """Speed-up and tokens/s per method, one bar per prompt set: the mean, with the min-max range over prompts."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display backend

    names = list(dict.fromkeys(m.name for s in report.sets for m in s.methods if m.status == "ok"))
    labels = {m.name: m.label for s in report.sets for m in s.methods}
    fig = Figure(figsize=(4 + 1.6 * len(names), 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / len(report.sets)
    for k, result in enumerate(report.sets):
        by_name = {m.name: m for m in result.methods if m.status == "ok"}
        xs = [i + (k - (len(report.sets) - 1) / 2) * width for i in range(len(names))]
        for ax, metric in zip(axes, ("speedup", "tokens_per_s")):
            heights, below, above = zip(*(error_bar(getattr(by_name.get(n), metric, None)) for n in names))
            ax.bar(xs, heights, width, yerr=[below, above], capsize=3, label=result.name)
    for ax, title in zip(axes, ("speed-up over target.generate (min-max)", "tokens/s (min-max)")):
        ax.set_title(title)
        ax.set_xticks(range(len(names)), [labels[n] for n in names], rotation=20, ha="right")
        ax.legend(fontsize="small")
    axes[0].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
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
