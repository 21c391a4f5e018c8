"""Where a serial round's time goes (stats.RoundPhases): every phase timed, none twice, the rest said as "other" (the
host round's phases, round="host", which these clocks tick through; the device round's: tests/test_device_*.py).

The rounds run on a clock that ticks once a reading (EngineChoice.clock, which the round's PhaseClock reads), so
each phase's time counts the clock readings it spans: what these tests assert follows from the code that ran,
never from how fast this machine ran it.
"""

import json

import pytest
import torch
from fixed_costs import given_costs

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import BenchConfig, BenchModels, run_bench
from hf_swiftspec.cli import main
from hf_swiftspec.engine import rounds
from hf_swiftspec.stats import PHASES, PhaseClock
from hf_swiftspec.tools.models import tiny_model, truncated_draft


class Ticks:
    """A clock that moves one second each time it is read."""

    def __init__(self):
        self.value = 0.0

    def __call__(self) -> float:
        self.value += 1.0
        return self.value


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=0)
    model.generation_config.eos_token_id = None  # random text: run to max_new_tokens
    return model


def ticking(model, monkeypatch) -> list[float]:
    """Put the pair's rounds on a Ticks clock; returns the list each round's own length on it is appended to,
    measured around one_round from outside (the reading one_round starts with is the round's start)."""
    clock = model.policy().engines.clock = Ticks()
    lengths = []
    inner = rounds.one_round

    def timed_round(sides, rows):
        before = clock.value
        keep = inner(sides, rows)
        lengths.append(clock.value - (before + 1))
        return keep

    monkeypatch.setattr(rounds, "one_round", timed_round)
    return lengths


def check_sums(stats, lengths: list[float]) -> None:
    """The breakdown covers every round, and its phases plus other are the rounds' time, measured from outside."""
    phases = stats.phases
    assert phases.clock == "host" and phases.rounds == len(lengths) == stats.verify_steps
    assert phases.round_s == sum(lengths)
    assert sum(phases.seconds().values()) == phases.round_s  # integer seconds: exact
    assert all(seconds >= 0 for seconds in phases.seconds().values()), phases
    assert stats.device_phases is None  # a CPU: no CUDA events


def test_a_draft_model_round_times_every_phase(target, monkeypatch):
    """tree_budget=8, draft_depth=3: the draft grows every round, so every phase runs, and the summary says so."""
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), tree_budget=8, draft_depth=3, round="host")
    lengths = ticking(model, monkeypatch)
    prompt = torch.randint(3, 98, (1, 9), generator=torch.Generator().manual_seed(1))
    model.generate(prompt, do_sample=False, max_new_tokens=24)
    stats = model.swiftspec_stats
    check_sums(stats, lengths)
    assert stats.draft_forwards > 0
    assert all(getattr(stats.phases, phase) > 0 for phase in PHASES), stats.phases
    assert stats.phases.line() in stats.summary() and "expand" in stats.phases.line()


def test_a_suffix_round_runs_no_draft_phase(target, monkeypatch):
    """Draft-free: the suffix index proposes, nothing expands or catches up (those phases are zero), the rest run."""
    model = SwiftSpecForCausalLM.from_models(target, round="host")
    lengths = ticking(model, monkeypatch)
    repeated = torch.randint(3, 98, (1, 12), generator=torch.Generator().manual_seed(3)).repeat(1, 3)
    model.generate(repeated, do_sample=False, max_new_tokens=24)
    stats = model.swiftspec_stats
    check_sums(stats, lengths)
    assert sum(r.ngram_accepted for r in stats.rounds) > 0  # the suffix proposals were verified and accepted
    assert stats.phases.expand == 0 and stats.phases.catch_up == 0
    assert all(getattr(stats.phases, p) > 0 for p in PHASES if p not in ("expand", "catch_up")), stats.phases


def test_plain_rounds_run_no_draft_phase(target, monkeypatch):
    """A draft model the policy never runs (expansions priced far above what they could earn): every round plain,
    no expansion, no catch-up timed; the draft still follows the verdicts (commit)."""
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), round="host")
    given_costs(model, expand_s=1.0, verify_s={1: 0.01, **{t: 1.0 for t in range(2, 33)}})
    lengths = ticking(model, monkeypatch)
    prompt = torch.randint(3, 98, (1, 9), generator=torch.Generator().manual_seed(1))
    model.generate(prompt, do_sample=False, max_new_tokens=12)  # fewer rounds than the first probe's (probe_every)
    stats = model.swiftspec_stats
    check_sums(stats, lengths)
    assert stats.plain_rounds == len(stats.rounds) and stats.draft_forwards == 0
    assert stats.phases.expand == 0 and stats.phases.catch_up == 0
    assert stats.phases.verify > 0 and stats.phases.walk > 0 and stats.phases.commit > 0


class FakeEvent:
    """A CUDA event's interface on a counter: recording reads the counter (ms); `complete` says whether query() is
    True (the device has run it)."""

    now = 0.0
    complete = True

    def record(self):
        FakeEvent.now += 1.0
        self.at = FakeEvent.now

    def query(self) -> bool:
        return FakeEvent.complete

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return end.at - self.at


def recorder(made: list):
    """An event factory that keeps every event it made in `made`."""

    def make() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    return make


def run_phases(clock: PhaseClock, rounds_run: int) -> None:
    """Rounds of nested phases, as the sides time them (verify's walk inside it: its own time, not verify's)."""
    for _ in range(rounds_run):
        clock.begin_round()
        with clock.phase("select"):
            pass
        with clock.phase("verify"):
            with clock.phase("walk"):
                pass
        clock.timed("commit", lambda: None)()
        clock.end_round()


def test_nested_phases_and_device_events_sum_to_the_round(monkeypatch):
    """Inner phases are not counted in their outer ones; with events (CUDA's), each phase change records one, and
    they are read only when the breakdown is asked for, or once many complete rounds' have piled up (a running batch
    never asks): the same breakdown either way, the events reused."""
    FakeEvent.now, FakeEvent.complete = 0.0, False
    made = []
    clock = PhaseClock(Ticks(), events=recorder(made))
    run_phases(clock, 3)
    host = clock.host_phases()
    # a tick a round for each phase (the reading that closes it); verify twice (before and after its walk)
    assert (host.select, host.verify, host.walk, host.commit, host.expand) == (3, 6, 3, 3, 0)
    assert host.rounds == 3 and sum(host.seconds().values()) == host.round_s
    assert clock.marks and clock.device_rounds == 0  # nothing read during the rounds
    device = clock.device_phases()
    assert device.clock == "cuda events" and device.rounds == 3
    # the events 1 ms apart: each phase 1 ms a round, verify 2
    assert (device.select, device.verify, device.walk, device.commit) == pytest.approx((3e-3, 6e-3, 3e-3, 3e-3))
    assert sum(device.seconds().values()) == pytest.approx(device.round_s, abs=1e-15) and device.other >= 0

    monkeypatch.setattr("hf_swiftspec.stats.MAX_MARKS", 10)
    FakeEvent.now, FakeEvent.complete, made.clear()
    piled = PhaseClock(Ticks(), events=recorder(made))
    run_phases(piled, 2)
    assert len(piled.marks) > 10 and piled.device_rounds == 0  # not run yet on the device: left to read later
    FakeEvent.complete = True
    run_phases(piled, 1)
    assert piled.marks == [] and piled.device_rounds == 3  # read at a round's end, without waiting
    run_phases(piled, 1)
    assert len(made) == len(piled.marks) + len(piled.pool)  # the read events recorded again
    again = piled.device_phases()
    assert again.rounds == 4 and again.verify == pytest.approx(4 * 2e-3)


def test_the_bench_keeps_the_breakdown_per_call(target, tmp_path):
    """results.json: each serial swiftspec call's phases (ms per round, the phases and other summing to the round);
    none for target.generate; results.md shows them."""
    models = BenchModels(target, truncated_draft(target, 2), settings={"tree_budget": 8, "draft_depth": 3})
    run_bench(BenchConfig(
        models=models, output_dir=str(tmp_path), methods=("target", "swiftspec_serial"), prompts=("humaneval",),
        num_prompts=1, max_new_tokens=8, growth_check_tokens=0, progress=False, peak_gbps=10.0,
    ))
    data = json.loads((tmp_path / "results.json").read_text())
    by_name = {m["name"]: m for m in data["sets"][0]["batches"][0]["methods"]}
    for run in by_name["swiftspec_serial"]["runs"]:
        phases = run["phases"]
        assert phases["clock"] == "host" and phases["rounds"] > 0 and run["device_phases"] is None
        assert set(phases) == {"clock", "rounds", "round", *PHASES, "other"}
        assert sum(phases[p] for p in (*PHASES, "other")) == pytest.approx(phases["round"], abs=1e-5)
        assert phases["verify"] > 0 and phases["expand"] > 0
    assert all(run["phases"] is None for run in by_name["target"]["runs"])
    assert "| swiftspec serial | host |" in (tmp_path / "results.md").read_text()


def test_generate_prints_the_breakdown_when_asked(capsys):
    """swiftspec generate --phases: the statistics line, then the serial round's phases; without it, no such line."""
    assert main(["generate", "--phases", "--max-new-tokens", "12", "--threads", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert last[0].startswith("[swiftspec] 12 tokens in ")
    assert last[1].startswith("[swiftspec] per round (host, ms, ") and "+ other " in last[1]
    assert main(["generate", "--max-new-tokens", "12", "--threads", "1"]) == 0
    assert "per round" not in capsys.readouterr().out
