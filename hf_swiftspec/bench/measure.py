"""Measuring one call (one prompt, or a padded batch of them): wall time, each row's new tokens,
target forwards, peak memory per device (/proc probes on Linux), and the row-by-row identical-output
check; then the per-method spreads over calls."""

from __future__ import annotations

import contextlib
import copy
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from .schema import Method, MethodResult, OutputMismatchError, PromptInfo, PromptRun, Spread

if TYPE_CHECKING:
    from .prompts import PromptBatch


MIB = 2**20


def generation_kwargs(ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None) -> dict:
    """The same greedy settings for every method; ids (B, L), attention_mask (B, L) (None: no padding)."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    return dict(do_sample=False, max_new_tokens=max_new_tokens, attention_mask=mask)


def synchronize() -> None:
    """Wait for queued kernels on every GPU, so a timing covers the work it started."""
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def timed_call(generate: Callable[..., torch.Tensor], ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, float]:
    synchronize()
    start = time.perf_counter()
    out = generate(ids, **kwargs)
    synchronize()
    return out, time.perf_counter() - start


def tokens_per_second(generate: Callable[..., torch.Tensor], ids: torch.Tensor, kwargs: dict) -> float:
    out, seconds = timed_call(generate, ids, kwargs)
    return (out.shape[1] - ids.shape[1]) / seconds


class ForwardCounter:
    """Counts forward calls of the module it hooks (the target: one per prefill or verification)."""

    def __init__(self):
        self.count = 0

    def __call__(self, module, args) -> None:
        self.count += 1


@contextlib.contextmanager
def counting_forwards(model):
    counter = ForwardCounter()
    handle = model.register_forward_pre_hook(counter)
    try:
        yield counter
    finally:
        handle.remove()


PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def proc_status_mib(key: str) -> float | None:
    """A "VmRSS:   1234 kB" line of /proc/self/status in MiB, or None off Linux."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_resident_mib() -> float:
    resident = proc_status_mib("VmRSS")
    if resident is not None:
        return resident
    import psutil  # accelerate depends on it

    return psutil.Process().memory_info().rss / MIB


def cpu_peak_mib() -> float:
    """The process's RSS high-water mark (since start, or since the last reset_cpu_peak)."""
    peak = proc_status_mib("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB on Linux


def reset_cpu_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: "5" > /proc/self/clear_refs); False where impossible."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


@dataclass
class MemoryProbe:
    """Peak memory of one call per device: "cpu" is the process RSS high-water mark, "cuda:i" what
    torch.cuda.max_memory_allocated reports. per_call: the CPU peak is reset before each call
    (else it is the process's peak since start, and run_memory_mib["cpu"] means little)."""

    cuda_devices: tuple[int, ...]
    per_call: bool

    @classmethod
    def create(cls, device: torch.device) -> "MemoryProbe":
        """With the target on a GPU, every visible GPU is watched (the async draft may sit on another)."""
        cuda = tuple(range(torch.cuda.device_count())) if device.type == "cuda" else ()
        return cls(cuda, reset_cpu_peak())

    @property
    def source(self) -> str:
        cpu = "process RSS high-water mark, reset before each call" if self.per_call else (
            "process RSS high-water mark since start (ru_maxrss; cannot be reset here)"
        )
        return cpu + ("; torch.cuda.max_memory_allocated per device" if self.cuda_devices else "")

    def start(self) -> dict[str, float]:
        """Reset the peaks; return what is resident now, per device (MiB)."""
        if self.per_call:
            reset_cpu_peak()
        for index in self.cuda_devices:
            torch.cuda.reset_peak_memory_stats(index)
        return {"cpu": cpu_resident_mib(), **{f"cuda:{i}": torch.cuda.memory_allocated(i) / MIB for i in self.cuda_devices}}

    def stop(self, before: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """(peak per device, peak minus what was resident at start) in MiB."""
        peak = {"cpu": cpu_peak_mib(), **{f"cuda:{i}": torch.cuda.max_memory_allocated(i) / MIB for i in self.cuda_devices}}
        return {k: round(v, 1) for k, v in peak.items()}, {k: round(max(peak[k] - before[k], 0.0), 1) for k in peak}


@dataclass
class Harness:
    """What every timed call of a run shares."""

    probe: MemoryProbe
    forwards: ForwardCounter
    seed: int
    warmup: int
    max_new_tokens: int
    batch_sizes: tuple[int, ...] = (1,)  # ascending
    pad_token_id: int = 0  # left-pads the batches (prompts.padding_token)
    eos_token_ids: tuple[int, ...] = ()  # where a row ends (empty: rows run to max_new_tokens)


def eos_token_ids(generation_config) -> tuple[int, ...]:
    """The ids generate() ends a row at: generation_config.eos_token_id as a tuple (empty for None)."""
    eos = generation_config.eos_token_id
    return () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def own_length(row: list[int], eos_token_ids: tuple[int, ...]) -> int:
    """A row's own new tokens: up to and including its first EOS. generate() pads a row that ended
    early up to the batch's length, with pad_token_id (often an EOS id itself), and that padding is
    not the row's output."""
    return next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))


def timed_run(method: Method, batch: PromptBatch, harness: Harness) -> tuple[list[list[int]], PromptRun]:
    """One timed call on a batch (one row per prompt): every row's new tokens and the measurements."""
    torch.manual_seed(harness.seed)
    before = harness.probe.start()
    harness.forwards.count = 0
    kwargs = generation_kwargs(batch.ids, harness.max_new_tokens, batch.attention_mask)
    out, seconds = timed_call(method.generate, batch.ids, kwargs)
    peak, extra = harness.probe.stop(before)
    rows = out[:, batch.ids.shape[1] :].tolist()
    lengths = [own_length(row, harness.eos_token_ids) for row in rows]
    stats, n = method.stats(), sum(lengths)
    # swiftspec counts its own target forwards (a compiled step runs no module hooks); the others: the hook's count
    forwards = stats.target_forwards if stats is not None else harness.forwards.count
    return rows, PromptRun(
        prompts=list(batch.prompts),
        seconds=seconds,
        row_tokens=lengths,
        new_tokens=n,
        tokens_per_s=n / seconds,
        speedup=0.0,  # known once target.generate has run on this batch
        tau=stats.tau if stats is not None else (n / (forwards * len(rows)) if forwards else 0.0),
        target_forwards=forwards,
        target_forwards_per_token=forwards / n if n else 0.0,
        target_idle_fraction=stats.target_idle_fraction if stats is not None and stats.overlap is not None else None,
        overlap=asdict(stats.overlap) if stats is not None and stats.overlap is not None else None,
        verify_step_ms=1000 * stats.target_time_s / stats.verify_steps if stats is not None and stats.verify_steps else None,
        engine=stats.engine if stats is not None else None,
        **policy_choices(stats),
        peak_memory_mib=peak,
        run_memory_mib=extra,
        capture_s=getattr(stats, "capture_s", None),  # (None also for an earlier revision's stats: compare_versions.py)
        phases=per_round_ms(getattr(stats, "phases", None)),
        device_phases=per_round_ms(getattr(stats, "device_phases", None)),
    )


def per_round_ms(phases) -> dict | None:
    """A round breakdown (stats.RoundPhases) as results.json keeps it; None where the call had none (the other
    methods, the asynchronous engine, an earlier revision's stats)."""
    return None if phases is None else phases.ms_per_round()


def policy_choices(stats) -> dict:
    """What the goodput policy chose in one swiftspec call (all None for the other methods). A round
    verifies one tree size for every row still decoding, so the mean T per row weighs it by its rows."""
    rounds = stats.rounds if stats is not None else []
    if not rounds:
        return dict(tree_budget=None, draft_expansions=None, plain_fraction=None, ngram_share=None)
    return dict(
        tree_budget=sum(r.budget * r.rows for r in rounds) / sum(r.rows for r in rounds),
        draft_expansions=sum(r.expansions for r in rounds) / len(rounds),
        plain_fraction=stats.plain_rounds / len(rounds),
        ngram_share=stats.ngram_share,
    )


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_identical(outputs: dict[str, list[list[int]]], set_name: str, rows: list[PromptInfo]) -> None:
    """Raise OutputMismatchError when any method's greedy tokens differ from target.generate's, in
    any row of the batch (outputs: method -> each row's new tokens, padding included; rows: the
    prompt of each row)."""
    expected = outputs["target"]
    size = len(rows)
    again = f"--prompts {set_name} --methods target,{{name}}" + (f" --batch-sizes {size}" if size > 1 else "")
    for name, got in outputs.items():
        if got == expected:
            continue
        if len(got) != len(expected):
            raise OutputMismatchError(
                f"method {name!r} returned {len(got)} rows for a batch of {len(expected)} prompts of set {set_name!r} "
                f"(prompts {[info.index for info in rows]}); it must return one row per prompt, as target.generate "
                f"does. Nothing was written. Reproduce it with {again.format(name=name)}."
            )
        row = next(r for r, (a, b) in enumerate(zip(expected, got)) if a != b)
        want_row, tokens, info = expected[row], got[row], rows[row]
        at = first_difference(want_row, tokens)
        got_token = tokens[at] if at < len(tokens) else "end"
        want = want_row[at] if at < len(want_row) else "end"
        where = f", row {row} of a batch of {size}" if size > 1 else ""
        raise OutputMismatchError(
            f"method {name!r} generated different tokens from target.generate on prompt {info.index} of set {set_name!r} "
            f"(id {info.id}{where}): first difference at new token {at} (target.generate: {want}, {name}: {got_token}; "
            f"{len(want_row)} vs {len(tokens)} new tokens). Greedy decoding must reproduce target.generate exactly, "
            f"row by row, so this run is invalid and nothing was written. Reproduce it with {again.format(name=name)}."
        )


def spread(values) -> Spread | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return Spread(*(round(v, 6) for v in (statistics.mean(values), sd, min(values), max(values))))


def largest_per_device(maps: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for entry in maps:
        for device, value in entry.items():
            out[device] = max(out.get(device, 0.0), value)
    return out


def method_result(method: Method, runs: list[PromptRun]) -> MethodResult:
    def metric(name):
        return spread(getattr(run, name) for run in runs)

    return MethodResult(
        name=method.name,
        label=method.label,
        status="ok",
        note="",
        settings=copy.deepcopy(method.settings),
        tuning=dict(method.tuning),
        tokens_per_s=metric("tokens_per_s"),
        speedup=metric("speedup"),
        tau=metric("tau"),
        target_forwards_per_token=metric("target_forwards_per_token"),
        target_idle_fraction=metric("target_idle_fraction"),
        verify_step_ms=metric("verify_step_ms"),
        tree_budget=metric("tree_budget"),
        draft_expansions=metric("draft_expansions"),
        plain_fraction=metric("plain_fraction"),
        ngram_share=metric("ngram_share"),
        engines=list(dict.fromkeys(run.engine for run in runs if run.engine is not None)),
        peak_memory_mib=largest_per_device([run.peak_memory_mib for run in runs]),
        run_memory_mib=largest_per_device([run.run_memory_mib for run in runs]),
        runs=runs,
        weights_mib=weights_mib(method.models),
    )


def weights_mib(models) -> dict[str, float]:
    """MiB of parameters and buffers per device over `models`, each tensor counted once (a draft cut from
    the target shares its embedding)."""
    seen, total = set(), {}
    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            device = str(tensor.device)
            total[device] = total.get(device, 0.0) + tensor.numel() * tensor.element_size() / MIB
    return {device: round(mib, 1) for device, mib in total.items()}
