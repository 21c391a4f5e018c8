"""The `swiftspec` command: generate on the demo pair, pair create / check, errors and exit codes."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.cli import DEFAULT_PROMPT, GenerateOptions, build_parser, generate_options, main
from hf_swiftspec.pair import bundled_pairs_dir
from pair_helpers import tiny_members

FAST = ["--max-new-tokens", "24", "--threads", "1"]


def statistics(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_generate_streams_then_prints_one_statistics_line(capsys):
    assert main(["generate", *FAST]) == 0
    out = capsys.readouterr().out
    assert out.startswith(DEFAULT_PROMPT) and len(out) > len(DEFAULT_PROMPT) + 10
    line = statistics(out)
    assert line.startswith("[swiftspec] 24 tokens in ") and "tokens/s" in line
    assert " tau " in line and "target forwards" in line and "speed-up" not in line


def test_compare_times_the_target_alone_and_prints_the_speed_up(capsys):
    assert main(["generate", "--compare", "--tree-budget", "6", *FAST, "import os\n"]) == 0
    line = statistics(capsys.readouterr().out)
    assert "target alone" in line and "speed-up" in line and "same output: yes" in line


def test_sampling_runs(capsys):
    assert main(["generate", "--sample", "--temperature", "0.8", "--seed", "3", *FAST]) == 0
    assert statistics(capsys.readouterr().out).startswith("[swiftspec]")


@pytest.mark.parametrize("flags, named", [(["--temperature", "0.8"], "--temperature 0.8"), (["--top-p", "0.9"], "--top-p 0.9")])
def test_sampling_settings_without_sample_are_refused(flags, named, capsys):
    """They only apply with --sample; a greedy run used to ignore them silently."""
    assert main(["generate", *flags, *FAST]) == 1
    captured = capsys.readouterr()
    assert named in captured.err and "add --sample" in captured.err and captured.out == ""


def test_an_empty_prompt_is_refused_before_loading(capsys):
    """It used to end in an IndexError deep in the engine."""
    assert main(["generate", "", *FAST]) == 1
    err = capsys.readouterr().err
    assert "swiftspec: error: the prompt is empty" in err and "loading pair" not in err


@pytest.mark.parametrize("flags, named", [
    (["--max-new-tokens", "0"], "--max-new-tokens 0: generate at least 1 token"),
    (["--sample", "--temperature", "0"], "which is greedy decoding: drop --sample and --temperature"),
])
def test_bad_generate_options_are_refused_before_the_prompt_is_echoed(flags, named, capsys):
    """Issue 26 item 7: the prompt was printed before --max-new-tokens 0 was refused; --temperature 0 with
    --sample pointed to do_sample=False, an argument of the Python API, not of the command."""
    assert main(["generate", *flags, "def f(x):"]) == 1
    captured = capsys.readouterr()
    assert named in captured.err and captured.out == "" and "loading" not in captured.err


def test_model_and_pair_say_what_they_loaded(tmp_path, capsys):
    """--model with a pair folder used the pair's draft silently; --pair with a plain model ran draft-free silently."""
    from hf_swiftspec.pair import bundled_pair

    demo = bundled_pair("swiftspec-demo-pystdlib")
    assert main(["generate", "--model", str(demo), *FAST]) == 0
    assert "is a pair repo, not a plain model: speculating with its draft" in capsys.readouterr().err
    assert main(["generate", "--pair", str(demo / "target"), *FAST]) == 0
    captured = capsys.readouterr()
    assert "is a plain causal LM, not a pair: speculating draft-free" in captured.err and "no draft model" in captured.out


def test_generate_runs_one_torch_thread_per_worker_on_cpu_unless_told(capsys):
    """torch's default (every core for each of target and draft) thrashed a 2-core machine."""
    torch.set_num_threads(2)
    try:
        assert main(["generate", "--max-new-tokens", "4"]) == 0
        assert torch.get_num_threads() == 1 and "torch threads: 1 per worker" in capsys.readouterr().err
        assert main(["generate", "--max-new-tokens", "4", "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2 and "torch threads: 2 per worker (--threads 2)" in capsys.readouterr().err
    finally:
        torch.set_num_threads(1)


def test_module_entry_point_runs_in_a_fresh_process():
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_swiftspec.cli", "generate", "--max-new-tokens", "12", "--threads", "1", "class Config:\n"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert statistics(proc.stdout).startswith("[swiftspec] 12 tokens in ")
    assert "loading pair 'swiftspec-demo-pystdlib'" in proc.stderr


def test_argparse_defaults_are_the_function_defaults():
    assert generate_options(build_parser().parse_args(["generate"])) == GenerateOptions()


@pytest.mark.parametrize(
    "argv, usage, named",
    [
        (["generate", "--bogus-flag"], "usage: swiftspec generate", "unrecognized arguments: --bogus-flag; `swiftspec generate --help`"),
        (["generate", "--max-tokens", "5"], "usage: swiftspec generate", "--max-tokens (did you mean --max-new-tokens?)"),
        (["pair", "check", ".", "--bogus"], "usage: swiftspec pair check", "unrecognized arguments: --bogus"),
    ],
)
def test_an_unknown_flag_shows_its_subcommands_usage_and_names_the_flag(argv, usage, named, capsys):
    """`swiftspec generate --bogus-flag` printed the top-level usage (swiftspec {generate,pair,...})."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(usage) and named in err, err


def test_a_misspelt_bundled_pair_is_one_sentence_with_a_suggestion(capsys):
    assert main(["generate", "--pair", "swiftspec-demo-pystdlb", *FAST]) == 1
    err = capsys.readouterr().err
    assert "did you mean 'swiftspec-demo-pystdlib'" in err and "Error" not in err.replace("swiftspec: error", ""), err


def test_errors_are_readable_with_a_nonzero_exit(tmp_path, capsys):
    assert main(["generate", "--pair", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert "swiftspec: error: No pair folder at" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--greedy", "--sample"])
    assert exit_info.value.code == 2


def test_pair_create_then_check_then_load(tmp_path, capsys):
    target, draft = tiny_members(tmp_path)
    pair = tmp_path / "pair"
    args = ["pair", "create", "--target", str(target), "--draft", str(draft), "--license", "apache-2.0"]
    assert main([*args, "--tree-budget", "6", str(pair)]) == 0
    assert main(["pair", "check", str(pair)]) == 0
    out = capsys.readouterr().out
    assert "config.json and README.md model card are valid" in out and "compatible" in out
    assert json.loads((pair / "config.json").read_text())["target"] == "../target"
    model = SwiftSpecForCausalLM.from_pretrained(pair)
    ids = torch.tensor([[30, 31, 32]])
    kwargs = dict(max_new_tokens=12, do_sample=False)
    assert model.config.tree_budget == 6 and model.tokenizer is not None
    assert model.generate(ids, **kwargs).tolist() == model.target.generate(ids, **kwargs).tolist()


def test_pair_check_names_the_bad_field(tmp_path, capsys):
    target, draft = tiny_members(tmp_path)
    pair = tmp_path / "pair"
    assert main(["pair", "create", "--target", str(target), "--draft", str(draft), str(pair)]) == 0
    config = json.loads((pair / "config.json").read_text())
    (pair / "config.json").write_text(json.dumps({**config, "draft_width": "wide"}))
    assert main(["pair", "check", str(pair)]) == 1
    assert "field 'draft_width' must be int, got str 'wide'" in capsys.readouterr().err


def test_pair_check_of_a_shipped_card_offline(capsys):
    folder = bundled_pairs_dir() / "qwen2-72b-instruct--qwen2-1.5b-instruct"
    assert main(["pair", "check", str(folder), "--config-only"]) == 0
    assert main(["pair", "check", str(folder), "--offline"]) == 1  # the 72B is not in this machine's cache
    err = capsys.readouterr().err
    assert "Qwen/Qwen2-72B-Instruct" in err and "Hugging Face cache" in err


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "mps", "npu"])
def test_a_device_this_machine_lacks_is_one_line(device, monkeypatch, capsys):
    """`--device cuda` on a CPU-only build printed a torch traceback after a line about GPU threads."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.mps, "is_available", lambda: False, raising=False)
    assert main(["generate", "--device", device, *FAST]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"swiftspec: error: --device {device}") and "this machine has: cpu." in lines[0]
    assert captured.out == "" and "Traceback" not in captured.err


def test_compare_prints_no_speed_up_for_a_completion_too_short_to_time(capsys):
    """A sample that ended after one token printed "speed-up 0.24x": the ratio of two prefills."""
    assert main(["generate", "--compare", "--sample", "--seed", "1", "--max-new-tokens", "1", "--threads", "1"]) == 0
    line = statistics(capsys.readouterr().out)
    assert "speed-up" not in line.replace("no speed-up", "") and "no speed-up: a sampled completion ended after 1 token," in line


def test_summary_omits_the_policy_where_rounds_were_not_recorded():
    """The distributed engine does not bring the rounds back; its summary said "mean tree 0.0 nodes, n-gram share 0%"."""
    from hf_swiftspec.stats import RoundRecord, SwiftSpecStats

    stats = SwiftSpecStats(engine="distributed", new_tokens=25, verify_steps=9, wall_time_s=1.0)
    line = stats.summary()
    assert "tau=2.78" in line and "mean tree" not in line and "n-gram share" not in line and "plain rounds" not in line
    stats.add_rounds([RoundRecord(budget=8, expansions=3, accepted=2, ngram_accepted=1)])
    assert "mean tree 8.0 nodes, 0 plain rounds, n-gram share 50%" in stats.summary()
