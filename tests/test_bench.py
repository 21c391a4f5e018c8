"""The benchmark harness: end to end on a tiny pair, its documented JSON schema, the identical-output
check, prompt loading, and the memory budget (no cache growth). No timing assertions."""

import json
from dataclasses import fields
from importlib.util import find_spec

import pytest
import torch

from hf_swiftspec import bench
from hf_swiftspec.bench import methods, prompts
from hf_swiftspec.bench.command import default_methods
from hf_swiftspec.steps.cache import TreeCache
from hf_swiftspec.engine.device_sides import tree_region_slots
from hf_swiftspec.steps.capture import WHOLE_CONTEXT, capacity_bucket
from hf_swiftspec.bench import (
    BenchConfig,
    BenchModels,
    Method,
    OutputMismatchError,
    bench_config,
    build_parser,
    load_prompts,
    memory_budget,
    run_bench,
)
from hf_swiftspec.tools.models import tiny_model, truncated_draft

FAST = dict(num_prompts=2, max_new_tokens=8, assistant_tokens=(2, 4), growth_check_tokens=24, progress=False, peak_gbps=10.0)

# The results.json keys, as documented in docs/source/en/bench.md's schema section. Changing any of them is a
# schema change: bump bench.SCHEMA_VERSION and that page with it.
REPORT_KEYS = {"schema_version", "environment", "pair", "config", "sets", "memory", "notes"}
ENVIRONMENT_KEYS = {
    "created", "hf_swiftspec", "transformers", "torch", "python", "platform", "device", "threads", "cpu_count",
    "memory_source",
}
PAIR_KEYS = {
    "name", "target", "draft", "target_params_m", "draft_params_m", "dtype", "target_device", "draft_device",
    "tokenizer", "settings",
}
CONFIG_KEYS = {
    "pair", "model", "eagle3", "prompts", "num_prompts", "max_new_tokens", "max_prompt_tokens", "methods", "batch_sizes", "seed",
    "warmup", "output_dir",
    "assistant_tokens", "prompt_lookup_tokens", "swiftspec", "device", "dtype", "threads", "chat_template",
    "ignore_eos", "peak_gbps", "growth_check_tokens", "progress",
}
SET_KEYS = {"name", "source", "warmup_prompt", "prompts", "batches", "limit"}
BATCH_KEYS = {"batch_size", "methods"}
PROMPT_KEYS = {"index", "id", "category", "prompt_tokens", "truncated"}
METHOD_KEYS = {
    "name", "label", "status", "note", "settings", "tuning", "tokens_per_s", "speedup", "tau",
    "target_forwards_per_token", "target_idle_fraction", "verify_step_ms", "peak_memory_mib", "run_memory_mib", "runs", "weights_mib",
    "tree_budget", "draft_expansions", "plain_fraction", "ngram_share", "engines",
}
SPREAD_KEYS = {"mean", "sd", "min", "max"}
RUN_KEYS = {
    "prompts", "seconds", "row_tokens", "new_tokens", "tokens_per_s", "speedup", "tau", "target_forwards",
    "target_forwards_per_token", "target_idle_fraction", "overlap", "verify_step_ms", "engine", "peak_memory_mib",
    "run_memory_mib", "tree_budget", "draft_expansions", "plain_fraction", "ngram_share", "capture_s", "phases",
    "device_phases",
}
LIMIT_KEYS = {
    "method", "device", "peak_gbps", "peak_source", "weight_mb", "kv_mb", "context_tokens", "floor_ms",
    "verify_step_ms", "verify_over_floor", "target_step_ms", "target_step_over_floor", "tau", "ceiling_tokens_per_s",
    "tokens_per_s",
}
MEMORY_KEYS = {
    "context_tokens", "target_weights_mib", "draft_weights_mib", "target_kv_mib", "target_tree_cache_mib",
    "draft_tree_cache_mib", "token_tree_mib", "extra_mib", "target_extra_slots", "tree_budget", "draft_extra_slots",
    "tree_capacity", "within_tree_region", "no_growth", "traces",
}
TRACE_KEYS = {"role", "forwards", "caches", "buffers", "shape", "capacity", "max_length", "max_tree_slots", "mib"}


@pytest.fixture(scope="module")
def tiny_models():
    target = tiny_model("llama", seed=0)
    return BenchModels(target, truncated_draft(target, 2), settings={"tree_budget": 6, "draft_width": 4})


@pytest.fixture(scope="module")
def finished(tiny_models, tmp_path_factory):
    """(report, output folder) of one full run: every method, both bundled sets."""
    out = tmp_path_factory.mktemp("bench")
    report = run_bench(BenchConfig(models=tiny_models, output_dir=str(out), methods=bench.DEFAULT_METHODS, **FAST))
    return report, out


def test_memory_shows_the_draft_a_method_holds(finished, tiny_models):
    """Every method runs in one process that holds both models, so a process peak is the same for all: the
    report counts the weights each method holds (swiftspec and assisted also hold the draft) beside what its
    calls allocate."""
    report, _ = finished
    by_name = {m.name: m for m in report.sets[0].at(1)}
    mib = lambda model: sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20  # noqa: E731
    target, draft = mib(tiny_models.target), mib(tiny_models.draft)
    assert by_name["target"].weights_mib["cpu"] == pytest.approx(target, abs=0.1)
    assert by_name["prompt_lookup"].weights_mib == by_name["target"].weights_mib
    for name in ("assisted", "swiftspec_serial"):
        assert by_name[name].weights_mib["cpu"] == pytest.approx(target + draft, abs=0.1)  # no shared tensors here
    assert all(m.weights_mib["cpu"] <= by_name["swiftspec_serial"].weights_mib["cpu"] for m in by_name.values())


def test_runs_every_method_on_every_set_and_writes_the_results(finished):
    report, out = finished
    assert [s.name for s in report.sets] == ["humaneval", "spec_bench"]
    for result in report.sets:
        assert [b.batch_size for b in result.batches] == [1]  # the default: batch 1 alone, as before batches
        assert [m.name for m in result.at(1)] == list(bench.DEFAULT_METHODS)
        assert all(m.status == "ok" and len(m.runs) == 2 for m in result.at(1))
        by_name = {m.name: m for m in result.at(1)}
        assert by_name["target"].tau.mean == 1.0 and by_name["target"].target_forwards_per_token.mean == 1.0
        assert by_name["target"].speedup.mean == 1.0
        assert by_name["swiftspec_async"].target_idle_fraction is not None
        assert by_name["swiftspec_serial"].target_idle_fraction is None
        overlaps = [run.overlap for run in by_name["swiftspec_async"].runs]  # where each async round's time went
        assert all(o["rounds"] > 0 and o["verify"] > 0 for o in overlaps), overlaps
        assert all(run.overlap is None for run in by_name["swiftspec_serial"].runs)
        assert by_name["swiftspec_serial"].tree_budget.min >= 1 and by_name["target"].tree_budget is None  # the policy's choices
        assert by_name["swiftspec_serial"].engines == ["device"] and by_name["target"].engines == []
        assert by_name["assisted"].settings["num_assistant_tokens"] in (2, 4)
        assert set(by_name["assisted"].tuning) == {"2", "4"}
        assert result.limit is not None and result.limit.peak_source == "given"
    markdown = (out / "results.md").read_text()
    assert markdown.count("| swiftspec serial |") == 4 and "**Limit**" in markdown and "## Memory budget" in markdown
    # a row per set in the method table and in the serial round's breakdown (the asynchronous engine has its own)
    assert markdown.count("| swiftspec serial | host |") == 2 and "| swiftspec async | host |" not in markdown
    # The policy's choices, a column each (they were four numbers packed in one cell).
    assert "| tree T | draft fwd / round | plain rounds | n-gram share |" in markdown
    # The character tokenizer has no chat template: the prompts went in as plain text, and results.json says so.
    assert report.config["chat_template"] is False and any("no chat template" in note for note in report.notes)
    assert "### Batch size" not in markdown and "## Speed-up by batch size" not in markdown
    assert (out / "results.png").exists() == (find_spec("matplotlib") is not None)
    if find_spec("matplotlib") is None:
        assert any("matplotlib" in note for note in report.notes)


def test_results_json_has_exactly_the_documented_keys(finished):
    _, out = finished
    data = json.loads((out / "results.json").read_text())
    assert set(data) == REPORT_KEYS and data["schema_version"] == bench.SCHEMA_VERSION == 8
    assert set(data["environment"]) == ENVIRONMENT_KEYS
    assert set(data["pair"]) == PAIR_KEYS
    assert set(data["config"]) == CONFIG_KEYS
    assert set(data["memory"]) == MEMORY_KEYS
    assert all(set(trace) == TRACE_KEYS for trace in data["memory"]["traces"])
    for result in data["sets"]:
        assert set(result) == SET_KEYS and set(result["limit"]) == LIMIT_KEYS
        assert all(set(p) == PROMPT_KEYS for p in result["prompts"])
        for batch in result["batches"]:
            assert set(batch) == BATCH_KEYS
            for method in batch["methods"]:
                assert set(method) == METHOD_KEYS
                assert set(method["tokens_per_s"]) == SPREAD_KEYS
                assert all(set(run) == RUN_KEYS for run in method["runs"])


def test_the_documented_keys_are_the_dataclass_fields():
    """The schema lives in bench's dataclasses; this keeps the test's (and docs/source/en/bench.md's) lists in step."""
    for cls, keys in [
        (bench.BenchReport, REPORT_KEYS), (bench.Environment, ENVIRONMENT_KEYS), (bench.PairInfo, PAIR_KEYS),
        (bench.SetResult, SET_KEYS), (bench.BatchResult, BATCH_KEYS), (bench.PromptInfo, PROMPT_KEYS),
        (bench.MethodResult, METHOD_KEYS),
        (bench.Spread, SPREAD_KEYS), (bench.PromptRun, RUN_KEYS), (bench.LimitReport, LIMIT_KEYS),
        (bench.MemoryBudget, MEMORY_KEYS), (bench.CacheTrace, TRACE_KEYS),
    ]:
        assert {f.name for f in fields(cls)} == keys, cls.__name__
    assert {f.name for f in fields(BenchConfig)} - {"models", "extra_methods"} == CONFIG_KEYS


def test_the_bench_page_documents_every_key_at_this_schema_version():
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "source" / "en" / "bench.md"
    schema = page.read_text().split("## The results schema (`results.json`)")[1]
    assert f"schema_version {bench.SCHEMA_VERSION}" in schema, "bump the schema_version docs/source/en/bench.md names"
    keys = (REPORT_KEYS | ENVIRONMENT_KEYS | PAIR_KEYS | SET_KEYS | BATCH_KEYS | PROMPT_KEYS | METHOD_KEYS | SPREAD_KEYS
            | RUN_KEYS | LIMIT_KEYS | MEMORY_KEYS | TRACE_KEYS)  # fmt: skip
    missing = keys - set(re.findall(r"\w+", schema))
    assert not missing, f"docs/source/en/bench.md's schema lacks {sorted(missing)}"


def flipped_method(target) -> Method:
    """target.generate with its last new token changed: what a lossy method looks like."""

    def generate(ids, **kwargs):
        out = target.generate(ids, **kwargs).clone()
        out[0, -1] = (out[0, -1] + 1) % target.config.vocab_size
        return out

    return Method("flipped", "flipped last token", generate)


def test_a_method_with_different_tokens_fails_the_run_loudly(tiny_models, tmp_path):
    config = BenchConfig(
        models=tiny_models, methods=("target", "swiftspec_serial"), extra_methods=(flipped_method(tiny_models.target),),
        prompts=("humaneval",), output_dir=str(tmp_path / "out"), ignore_eos=True, **FAST,
    )
    with pytest.raises(OutputMismatchError, match=r"method 'flipped' .* prompt 0 of set 'humaneval' .*new token 7"):
        run_bench(config)
    assert not (tmp_path / "out").exists()  # an invalid run leaves no results behind


# The warm-up prompt, then two of different lengths (the batches are left-padded): the tiny target ends
# "class Point:" at EOS after 4 tokens, so at every batch size one row is padded after its end.
BATCH_PROMPTS = "warm up with this\nimport os\nclass Point:\n"


@pytest.fixture(scope="module")
def batched(tiny_models, tmp_path_factory):
    """(report, output folder) of `--batch-sizes 1,2,3` on two prompts: every method, one set."""
    folder = tmp_path_factory.mktemp("batched")
    (folder / "prompts.txt").write_text(BATCH_PROMPTS)
    config = BenchConfig(
        models=tiny_models, prompts=(str(folder / "prompts.txt"),), batch_sizes=(1, 2, 3), output_dir=str(folder / "out"),
        methods=bench.DEFAULT_METHODS,
        **{**FAST, "growth_check_tokens": 0},
    )
    return run_bench(config), folder / "out"


def test_every_batch_size_has_every_method_and_counts_each_rows_own_tokens(batched):
    report, _ = batched
    result = report.sets[0]
    assert [b.batch_size for b in result.batches] == [1, 2, 3]
    for batch in result.batches:
        assert [m.name for m in batch.methods] == list(bench.DEFAULT_METHODS)
    assert all(m.status == "ok" for m in result.at(1))
    rows = {1: [[0], [1]], 2: [[0, 1]], 3: [[0, 1, 0]]}  # a short group repeats its own prompts, never another call's
    tokens = {1: [[8], [4]], 2: [[8, 4]], 3: [[8, 4, 8]]}  # the EOS row's padding is not its output
    for size in (1, 2, 3):
        by_name = {m.name: m for m in result.at(size)}
        target, serial = by_name["target"], by_name["swiftspec_serial"]
        for m in (target, serial):
            assert m.status == "ok" and [run.prompts for run in m.runs] == rows[size]
            assert [run.row_tokens for run in m.runs] == tokens[size]
            assert all(run.new_tokens == sum(run.row_tokens) for run in m.runs)
        assert target.speedup.mean == 1.0 and target.engines == [] and serial.engines == ["device"]  # speculated
        assert serial.tree_budget.min >= 1 and 0 <= serial.plain_fraction.mean <= 1
        if size > 1:
            for name, why in [("assisted", "batch size 1 only"), ("prompt_lookup", "batch size 1 only"),
                              ("swiftspec_async", "serial engine")]:
                cell = by_name[name]
                assert (cell.status, cell.runs, cell.tokens_per_s) == ("unsupported", [], None) and why in cell.note
    assert result.limit is not None  # from the batch-1 calls


def test_batched_results_json_markdown_and_plot(batched):
    report, out = batched
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["batch_sizes"] == [1, 2, 3]
    for batch in data["sets"][0]["batches"]:
        assert set(batch) == BATCH_KEYS
        for method in batch["methods"]:
            assert set(method) == METHOD_KEYS and all(set(run) == RUN_KEYS for run in method["runs"])
    statuses = [[m["status"] for m in b["methods"]] for b in data["sets"][0]["batches"]]
    assert statuses[1] == statuses[2] == ["ok", "unsupported", "unsupported", "ok", "unsupported"]
    markdown = (out / "results.md").read_text()
    assert "## Speed-up by batch size" in markdown and "| set | method | B = 1 | B = 2 | B = 3 |" in markdown
    serial = next(line for line in markdown.splitlines() if line.startswith("| prompts | swiftspec serial |"))
    assert serial.count("× (T ") == 3 and "% plain)" in serial
    assisted = next(line for line in markdown.splitlines() if line.startswith("| prompts | assisted generation |"))
    assert assisted.endswith("| unsupported | unsupported |")
    assert "### Batch size 3: 1 call of 3 prompts, left-padded; 1 row repeat" in markdown
    assert "Memory at batch size 3" in markdown and "**Limit**" in markdown
    assert (out / "results.png").exists() == (find_spec("matplotlib") is not None)


def row_flipped_method(target) -> Method:
    """target.generate with the last token of a batch's second row changed: lossy in batches only."""

    def generate(ids, **kwargs):
        out = target.generate(ids, **kwargs).clone()
        if out.shape[0] > 1:
            out[1, -1] = (out[1, -1] + 1) % target.config.vocab_size
        return out

    return Method("row_flipped", "row flipped", generate, batched=True)


def test_a_mismatching_row_of_a_batch_fails_the_run(tiny_models, tmp_path):
    (tmp_path / "prompts.txt").write_text(BATCH_PROMPTS)
    config = BenchConfig(
        models=tiny_models, methods=("target",), extra_methods=(row_flipped_method(tiny_models.target),),
        prompts=(str(tmp_path / "prompts.txt"),), batch_sizes=(1, 2), output_dir=str(tmp_path / "out"),
        **{**FAST, "growth_check_tokens": 0},
    )
    with pytest.raises(OutputMismatchError, match=r"'row_flipped' .* prompt 1 of set 'prompts' .*row 1 of a batch of 2\)"
                       r": first difference at new token 7 .*--batch-sizes 2"):  # in the row's padding: compared too
        run_bench(config)
    assert not (tmp_path / "out").exists()


def test_a_batch_swiftspec_cannot_speculate_is_reported_as_the_targets_loop(tiny_models, tmp_path, monkeypatch):
    import hf_swiftspec.generation

    monkeypatch.setattr(hf_swiftspec.generation, "batch_exactness_gaps", lambda *args: ["a processor reads other rows"])
    (tmp_path / "prompts.txt").write_text(BATCH_PROMPTS)
    with pytest.warns(UserWarning, match="target's own decoding loop"):
        report = run_bench(BenchConfig(
            models=tiny_models, methods=("target", "swiftspec_serial"), prompts=(str(tmp_path / "prompts.txt"),),
            batch_sizes=(2,), output_dir=None, **{**FAST, "growth_check_tokens": 0},
        ))
    serial = report.sets[0].at(2)[1]
    assert serial.engines == ["target (batch: a processor reads other rows)"] and serial.tree_budget is None
    assert report.sets[0].limit is None and report.sets[0].at(1) == []  # no batch-1 calls, no floor
    assert any("prompts, batch size 2: swiftspec serial ran as target (batch" in note for note in report.notes)
    assert "(target's own loop)" in bench.markdown_report(report)


def test_prompt_batches_are_left_padded_and_short_groups_repeat_their_own_prompts():
    from hf_swiftspec.bench.prompts import PromptSet, prompt_batches

    ids = [torch.full((1, n), 10 + n) for n in (1, 2, 3, 4, 5)]
    infos = [bench.PromptInfo(i, str(i), "", n, False) for i, n in enumerate((1, 2, 3, 4, 5))]
    prompt_set = PromptSet("s", prompts.PROMPTS_DIR, None, ids[0], infos, ids)
    assert [b.prompts for b in prompt_batches(prompt_set, 2, pad_id=0)] == [[0, 1], [2, 3], [4, 4]]
    assert [b.prompts for b in prompt_batches(prompt_set, 8, pad_id=0)] == [[0, 1, 2, 3, 4, 0, 1, 2]]
    first = prompt_batches(prompt_set, 2, pad_id=0)[0]
    assert first.ids.tolist() == [[0, 11], [12, 12]] and first.attention_mask.tolist() == [[0, 1], [1, 1]]
    alone = prompt_batches(prompt_set, 1, pad_id=0)
    assert [b.ids.tolist() for b in alone] == [t.tolist() for t in ids] and all(b.attention_mask.all() for b in alone)


@pytest.mark.parametrize("row, eos, expected", [
    ([5, 6, 7], (), 3), ([5, 2, 0, 0], (2,), 2), ([5, 2, 2, 2], (2,), 2), ([2], (2, 9), 1), ([5, 9, 2], (2, 9), 2),
])
def test_a_rows_own_tokens_end_at_its_first_eos(row, eos, expected):
    """generate pads a finished row with pad_token_id, often an EOS id itself: none of it is the row's."""
    from hf_swiftspec.bench.measure import own_length

    assert own_length(row, eos) == expected


def test_padding_token_falls_back_like_generate(tiny_models):
    from transformers import GenerationConfig

    from hf_swiftspec.bench.prompts import padding_token
    from hf_swiftspec.tools.models import char_tokenizer

    assert padding_token(char_tokenizer(), GenerationConfig(pad_token_id=5)) == char_tokenizer().pad_token_id
    assert padding_token(None, GenerationConfig(pad_token_id=5, eos_token_id=2)) == 5
    assert padding_token(None, GenerationConfig(eos_token_id=[7, 2])) == 7
    with pytest.raises(ValueError, match="no pad token .*--batch-sizes 1"):
        padding_token(None, GenerationConfig())


def test_each_batch_size_starts_from_the_outputs_swiftspec_kept_before_it(tiny_models):
    """A later batch size must not copy the answers an earlier one gave the same prompts."""
    from hf_swiftspec import SwiftSpecForCausalLM

    model = SwiftSpecForCausalLM.from_models(tiny_models.target, tiny_models.draft, tree_budget=6)
    method = methods.swiftspec_method("swiftspec_serial", model, seed=0)
    ids = torch.tensor([[5, 6, 7, 8]])
    method.generate(ids, max_new_tokens=6, do_sample=False)
    kept = list(model.output_history.docs.values())
    restore = method.checkpoint()
    method.generate(ids + 1, max_new_tokens=6, do_sample=False)
    assert len(model.output_history) == 2
    restore()
    assert list(model.output_history.docs.values()) == kept and method.batched


def test_async_is_skipped_with_a_note_when_the_placement_does_not_allow_it(tiny_models, monkeypatch):
    monkeypatch.setattr(methods, "async_placement", lambda target: (None, "skipped: no second GPU for the draft"))
    report = run_bench(BenchConfig(
        models=tiny_models, methods=("target", "swiftspec_async"), prompts=("spec_bench",), output_dir=None,
        **{**FAST, "growth_check_tokens": 0},
    ))
    skipped = report.sets[0].at(1)[1]
    assert (skipped.name, skipped.status, skipped.runs, skipped.tokens_per_s) == ("swiftspec_async", "skipped", [], None)
    assert "no second GPU" in skipped.note and any("no second GPU" in note for note in report.notes)
    assert report.memory is None and report.sets[0].limit is None
    assert "no second GPU" in bench.markdown_report(report)


@pytest.mark.parametrize("threads, expected", [(None, 1), (2, 2)])
def test_the_bench_runs_one_torch_thread_per_worker_on_cpu_unless_told(tiny_models, threads, expected):
    torch.set_num_threads(2)
    try:
        report = run_bench(BenchConfig(
            models=tiny_models, methods=("target",), prompts=("humaneval",), output_dir=None, threads=threads,
            **{**FAST, "num_prompts": 1, "growth_check_tokens": 0},
        ))
        assert report.environment.threads == torch.get_num_threads() == expected
        assert f"{expected} torch thread(s) per worker" in bench.markdown_report(report)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("values", [[0.2, 0.25, 3.0], [0.0, 0.0, 5.0], [1.0], [58.1, 61.9, 60.0]])
def test_plot_error_bars_span_min_to_max_and_never_go_below_zero(values):
    """mean ± sd drew whiskers below zero for skewed speed-ups such as the first case."""
    from hf_swiftspec.bench.measure import spread
    from hf_swiftspec.bench.report import error_bar

    value = spread(values)
    height, below, above = error_bar(value)
    assert below >= 0 and above >= 0 and height - below >= 0
    assert height - below == pytest.approx(min(values)) and height + above == pytest.approx(max(values))
    assert error_bar(None) == (0.0, 0.0, 0.0)  # a method missing from a set draws nothing


def test_caches_keep_one_buffer_over_a_long_generation(tiny_models):
    """No per-step reallocation: each model's cache (the device round's SlotCache, round="auto") keeps its buffers'
    address and shape, at the call's slot bucket: its context and its largest round's tree region."""
    ids = torch.randint(3, 98, (1, 9), generator=torch.Generator().manual_seed(0))
    budget = memory_budget(tiny_models, {"tree_budget": 6, "draft_width": 4, "draft_depth": 2}, ids, 300)
    assert budget.no_growth and budget.within_tree_region
    target, draft = budget.traces
    assert target.forwards > 20 and draft.forwards > 20  # many rounds were watched
    assert (target.caches, target.buffers, draft.caches, draft.buffers) == (1, 1, 1, 1)
    region = tree_region_slots(2, 4, 6 - 1)  # two levels of 4, the suffix index's 5 offered nodes
    assert target.capacity == capacity_bucket(9 + 300 + region) and target.max_length <= target.capacity
    assert budget.target_extra_slots == target.capacity - 1 - 309
    assert 0 < draft.max_tree_slots <= budget.tree_capacity
    assert budget.extra_mib > budget.draft_weights_mib > 0


def test_host_round_caches_exceed_the_context_by_the_tree_budget_alone(tiny_models):
    """round="host": each TreeCache holds the context, the tree budget and a scratch slot, one buffer throughout."""
    ids = torch.randint(3, 98, (1, 9), generator=torch.Generator().manual_seed(0))
    budget = memory_budget(tiny_models, {"tree_budget": 6, "draft_width": 4, "draft_depth": 2, "round": "host"},
                           ids, 300)
    target, draft = budget.traces
    assert budget.no_growth and budget.within_tree_region and target.forwards > 20
    assert budget.target_extra_slots == budget.tree_budget == 6
    assert target.capacity == 9 + 300 + 6 + 1 and target.max_length <= target.capacity  # + the scratch slot
    assert 0 < draft.max_tree_slots <= budget.tree_capacity


def test_memory_check_allows_a_replayed_cache_its_shared_capacity(tiny_models):
    """Replayed steps of the host round (capture.py; "emulate" on a CPU) give the target's cache a capacity shared
    between calls (StepRunner.capacity_for: the whole context's bucket for a small model), not the call's own bucket;
    the check counts that as within the tree region, and still catches a cache past it."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    budget = memory_budget(tiny_models, {"tree_budget": 6, "draft_width": 4, "capture": True, "round": "host"}, ids, 40)
    whole = tiny_models.target.config.max_position_embeddings + 6
    assert whole <= WHOLE_CONTEXT and budget.traces[0].capacity == capacity_bucket(whole) + 1  # + the scratch slot
    assert budget.target_extra_slots > capacity_bucket(9 + 40 + 6) - 49  # past the call's own bucket
    assert budget.no_growth and budget.within_tree_region


def reallocate_after(commit):
    """commit, then every buffer moved to a new one, as a regression that reallocates would."""

    def reallocating_commit(cache, *args, **kwargs):
        commit(cache, *args, **kwargs)
        if cache.buffers:
            if hasattr(cache, "kv_buffers"):  # a slot cache: its keys' and values' buffers
                cache.kv_buffers = []
            else:
                cache.buffers = []
            cache.pack()

    return reallocating_commit


def test_memory_check_notices_a_reallocated_buffer(tiny_models, monkeypatch):
    """The check itself works: a cache that reallocates every commit is caught, in either round."""
    from hf_swiftspec.engine import device_phases

    ids = torch.tensor([[5, 6, 7]])
    monkeypatch.setattr(device_phases, "commit_cache", reallocate_after(device_phases.commit_cache))
    budget = memory_budget(tiny_models, {"tree_budget": 6, "draft_width": 4}, ids, 40)
    assert not budget.no_growth and budget.traces[0].buffers > 1
    monkeypatch.setattr(TreeCache, "commit_rows", reallocate_after(TreeCache.commit_rows))
    budget = memory_budget(tiny_models, {"tree_budget": 6, "draft_width": 4, "round": "host"}, ids, 40)
    assert not budget.no_growth and budget.traces[0].buffers > 1


def test_prompt_loading_reads_the_bundled_sets_and_user_files(tmp_path):
    humaneval = load_prompts("humaneval")
    assert len(humaneval) == 20 and humaneval[0].text.startswith("Complete the code") and humaneval[0].category == "code"
    spec = load_prompts("spec_bench", limit=13)
    assert len({p.category for p in spec}) == 13  # the copy is ordered round-robin over categories
    assert (prompts.PROMPTS_DIR / "LICENSE-EAGLE").is_file() and (prompts.PROMPTS_DIR / "LICENSE-Spec-Bench").is_file()

    mixed = tmp_path / "mine.jsonl"
    mixed.write_text(
        '{"turns": ["first turn", "second turn"], "question_id": 7, "category": "x"}\n\n'
        '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}\n'
        '{"prompt": "def f():"}\n'
    )
    assert [(p.text, p.id) for p in load_prompts(str(mixed))] == [("first turn", "7"), ("hello", "3"), ("def f():", "4")]
    text = tmp_path / "mine.txt"
    text.write_text("one\n\ntwo\n")
    assert [p.text for p in load_prompts(str(text))] == ["one", "two"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": "no prompt here"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no prompt .*'turns'"):
        load_prompts(str(bad))
    with pytest.raises(ValueError, match="neither a file nor a bundled set"):
        load_prompts("mt_bench_typo")


def test_long_prompts_are_cut_before_the_template(tiny_models):
    from hf_swiftspec.tools.models import char_tokenizer

    ids, truncated = bench.encode_prompt(char_tokenizer(), "x" * 50, max_tokens=16, chat_template=True)
    assert truncated and ids.shape == (1, 16)
    ids, truncated = bench.encode_prompt(char_tokenizer(), "short", max_tokens=16, chat_template=True)
    assert not truncated and ids.shape == (1, 5)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(methods=("assisted",)), "must include 'target'"),
        (dict(methods=("target", "beam_search")), "Unknown methods \\['beam_search'\\]"),
        (dict(num_prompts=0), "num_prompts must be at least 1"),
        (dict(assistant_tokens=()), "assistant_tokens must be positive"),
        (dict(swiftspec={"tree_budget": 1}), "tree_budget"),
        (dict(batch_sizes=(1, 0)), r"batch_sizes must be distinct positive ints.*got \(1, 0\)"),
        (dict(batch_sizes=(2, 2)), "batch_sizes must be distinct positive ints"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(tiny_models, change, message):
    with pytest.raises(ValueError, match=message):
        run_bench(BenchConfig(models=tiny_models, output_dir=None, **{**FAST, **change}))


def test_command_line_defaults_are_bench_config_defaults():
    assert bench_config(build_parser().parse_args([])) == BenchConfig()
    args = build_parser().parse_args(
        ["--prompts", "humaneval", "--prompts", "x.jsonl", "--methods", "target,swiftspec_serial", "--tree-budget", "6",
         "--assistant-tokens", "3,5", "--max-prompt-tokens", "0", "--quiet", "--no-chat-template", "--batch-sizes", "1,2,4"]
    )
    config = bench_config(args)
    assert config.batch_sizes == (1, 2, 4) and BenchConfig().batch_sizes == (1,)  # batch 1 alone unless asked
    assert config.prompts == ("humaneval", "x.jsonl") and config.methods == ("target", "swiftspec_serial")
    assert config.swiftspec == {"tree_budget": 6} and config.assistant_tokens == (3, 5)
    assert config.max_prompt_tokens is None and not config.progress and not config.chat_template


def test_the_default_run_is_the_quick_one_and_full_the_long_one():
    """The defaults finish in minutes on 2 CPU cores; --full restores the long run, and explicit options win."""
    quick, full = bench_config(build_parser().parse_args([])), bench_config(build_parser().parse_args(["--full"]))
    assert quick == BenchConfig() and full == BenchConfig.full()
    assert (full.num_prompts, full.max_new_tokens, full.assistant_tokens) == (8, 128, (2, 4, 6, 8, 12))
    assert 2 * quick.num_prompts * quick.max_new_tokens <= full.num_prompts * full.max_new_tokens
    assert len(quick.assistant_tokens) < len(full.assistant_tokens)
    assert quick.methods is full.methods is None  # every method that pays where the models run, side by side
    mixed = bench_config(build_parser().parse_args(["--full", "--num-prompts", "2", "--assistant-tokens", "3"]))
    assert (mixed.num_prompts, mixed.max_new_tokens, mixed.assistant_tokens) == (2, 128, (3,))


def test_bench_main_reports_bad_input_with_exit_status_1(capsys):
    assert bench.bench_main(build_parser().parse_args(["--methods", "assisted"])) == 1
    assert "must include 'target'" in capsys.readouterr().err


def test_command_runs_a_pair_folder_end_to_end(tmp_path, capsys):
    from pair_helpers import local_pair

    pair = local_pair(tmp_path, tree_budget=6, draft_width=4)
    out = tmp_path / "results"
    argv = [
        "--pair", str(pair), "--prompts", "humaneval", "--num-prompts", "1", "--max-new-tokens", "6",
        "--assistant-tokens", "2", "--growth-check-tokens", "16", "--peak-gbps", "10", "--out", str(out), "--quiet",
    ]
    assert bench.bench_main(build_parser().parse_args(argv)) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# SwiftSpec benchmark") and "| swiftspec serial |" in printed
    assert "| swiftspec async |" not in printed and "swiftspec_async was not run" in printed  # both on this CPU
    data = json.loads((out / "results.json").read_text())
    assert data["pair"]["settings"]["tree_budget"] == 6 and data["pair"]["name"] == str(pair)
    assert printed == (out / "results.md").read_text() + "\n"  # the table printed is the table saved


def test_without_the_demo_pair_an_in_memory_pair_runs_with_a_note(tiny_models, monkeypatch):
    import hf_swiftspec.tools.models

    monkeypatch.setattr(methods, "bundled_pair", lambda name: None)
    monkeypatch.setattr(hf_swiftspec.tools.models, "agreeing_pair", lambda: (tiny_models.target, tiny_models.draft))
    report = run_bench(BenchConfig(methods=("target",), prompts=("humaneval",), output_dir=None, **FAST))
    assert report.pair.name.startswith("agreeing_pair") and any("demo pair" in note for note in report.notes)


def test_default_methods_follow_where_the_models_run(tiny_models):
    """On the CPU both models would share the cores, where the asynchronous engine has run at 0.5-0.6x: it runs
    only when asked for, and the report says so; with a GPU (the draft may get another) it is in the default, and so
    is transformers' compiled static-cache decoding (on a CPU it would compile for minutes)."""
    report = run_bench(BenchConfig(models=tiny_models, prompts=("spec_bench",), output_dir=None, **{**FAST, "num_prompts": 1}))
    assert [m.name for m in report.sets[0].at(1)] == [m for m in bench.DEFAULT_METHODS if m != "swiftspec_async"]
    assert any("swiftspec_async was not run" in note and "--methods" in note for note in report.notes)
    assert "target_static" not in [m.name for m in report.sets[0].at(1)]
    assert "assisted_static" not in [m.name for m in report.sets[0].at(1)]
    methods, note = default_methods(torch.device("cuda", 0))
    assert note is None and set(methods) == set(bench.DEFAULT_METHODS) | {"target_static", "assisted_static"}


def test_assisted_generation_with_a_static_cache_is_timed_beside_the_others(tiny_models, monkeypatch):
    """The peer transformers >= 5.24 offers a GPU user: assisted generation over a static cache. Its outputs are
    checked against target.generate's as every method's are (the run fails otherwise); a batch is unsupported, as
    for assisted generation. Compiling is left out here (on a CPU it takes minutes): the wiring is what is tested."""
    monkeypatch.setattr(methods, "static_cache_settings", lambda target: {"cache_implementation": "static",
                                                                           "max_cache_len": 128})
    calls = []
    draft_forward = tiny_models.draft.forward
    monkeypatch.setattr(tiny_models.draft, "forward", lambda *a, **k: calls.append(1) or draft_forward(*a, **k))
    report = run_bench(BenchConfig(models=tiny_models, prompts=("humaneval",), methods=("target", "assisted_static"),
                                   output_dir=None, batch_sizes=(1, 2), **{**FAST, "num_prompts": 1}))
    at_one = {m.name: m for m in report.sets[0].at(1)}
    assert at_one["assisted_static"].status == "ok" and at_one["assisted_static"].settings["max_cache_len"] == 128
    assert calls, "the draft never ran: this was not assisted generation"
    at_two = {m.name: m for m in report.sets[0].at(2)}
    assert at_two["assisted_static"].status == "unsupported"


def test_the_device_and_host_rounds_are_timed_by_name_or_skipped_with_the_reason(tiny_models):
    """swiftspec_device runs the pair's own settings on round="device": its outputs are checked against
    target.generate's as every method's are (batch 1 and 2), and its stats say the device round ran; a pair the device
    round refuses is skipped with the refusal's own words, not timed on the host round under the device round's
    name."""
    models = BenchModels(tiny_models.target, tiny_models.draft, settings={**tiny_models.settings, "ngram_size": 0})
    report = run_bench(BenchConfig(models=models, prompts=("humaneval",), output_dir=None, batch_sizes=(1, 2),
                                   methods=("target", "swiftspec_device", "swiftspec_host"), **{**FAST, "num_prompts": 1}))
    for size in (1, 2):
        by_name = {m.name: m for m in report.sets[0].at(size)}
        device, host = by_name["swiftspec_device"], by_name["swiftspec_host"]
        assert device.status == host.status == "ok"
        assert all(run.engine == "device" for run in device.runs), [run.engine for run in device.runs]
        assert all(run.engine == "serial" for run in host.runs), [run.engine for run in host.runs]  # round="host"
    from hf_swiftspec.tools import sweep

    budgeted = sweep.tiny_of_type("doge", seed=0, vocab_size=tiny_models.target.config.vocab_size, keep_window_size=4)
    report = run_bench(BenchConfig(models=BenchModels(budgeted, sweep.perturbed_copy(budgeted), settings={"ngram_size": 0}),
                                   prompts=("humaneval",), methods=("target", "swiftspec_device"), output_dir=None,
                                   **{**FAST, "num_prompts": 1, "growth_check_tokens": 0}))  # (no swiftspec call to size)
    skipped = {m.name: m for m in report.sets[0].at(1)}["swiftspec_device"]
    assert skipped.status == "skipped" and "round='device'" in skipped.note
    assert "slot-limited layers" in skipped.note  # (a target that keeps its best-scored keys past a slot budget)


def test_the_async_methods_run_exactly_on_the_engine_each_names(tiny_models):
    """The threads placement: swiftspec_async under round='auto' and swiftspec_async_device on the device round's
    asynchronous engine, with the pair's suffix proposals on and off, swiftspec_async_host on the host round's; their
    tokens target.generate's (run_bench fails a method whose tokens differ)."""
    engines = {"swiftspec_async": "async-threads-device", "swiftspec_async_device": "async-threads-device",
               "swiftspec_async_host": "async-threads"}
    for swiftspec in ({}, {"ngram_size": 0}):
        report = run_bench(BenchConfig(models=tiny_models, methods=("target", *engines), prompts=("spec_bench",),
                                       output_dir=None, swiftspec=swiftspec, **{**FAST, "growth_check_tokens": 0}))
        for result in report.sets[0].at(1)[1:]:
            assert result.status == "ok" and result.runs, (swiftspec, result.name, result.note)
            assert result.engines == [engines[result.name]], (swiftspec, result.name, result.engines)


def test_the_agreeing_pair_takes_its_draft_s_layers_and_refuses_a_bad_count():
    notes = []
    models = methods.load_models(BenchConfig(pair="agreeing:3"), notes)
    assert models.draft.config.num_hidden_layers == 3 and models.target.config.num_hidden_layers == 12
    assert "first 3 layer(s)" in notes[0]
    assert methods.load_models(BenchConfig(pair="agreeing"), []).draft.config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="agreeing:LAYERS takes 1 to 11"):
        methods.load_models(BenchConfig(pair="agreeing:x"), [])
    args = build_parser().parse_args(["--ngram-size", "0", "--tree-budget", "6"])
    assert bench_config(args).swiftspec == {"tree_budget": 6, "ngram_size": 0}
