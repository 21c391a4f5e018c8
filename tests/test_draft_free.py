"""Draft-free mode: a target alone speculates from the text's own repetition, losslessly."""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools import sweep
from hf_swiftspec.tools.models import char_tokenizer, tiny_model


def cycling_prompt():
    return torch.randint(3, 98, (1, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "build", [lambda: tiny_model("llama", seed=7), lambda: sweep.tiny_of_type("gpt2", seed=7, vocab_size=98)],
    ids=["llama", "gpt2"],
)
def test_draft_free_greedy_equals_target(build):
    """Random prompts and a prompt whose greedy continuation repeats: target.generate's tokens, and
    on repetitive text the n-gram branch is accepted."""
    target = build()
    target.generation_config.eos_token_id = None
    model = SwiftSpecForCausalLM.from_models(target)
    assert model.draft is None
    g = torch.Generator().manual_seed(3)
    repeated = torch.randint(3, 98, (1, 12), generator=g).repeat(1, 3)  # a prompt that repeats itself
    accepted = 0
    for prompt in (cycling_prompt(), torch.randint(3, 98, (1, 5), generator=g), repeated):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=48)
        assert model.generate(prompt, do_sample=False, max_new_tokens=48).tolist() == expected.tolist()
        stats = model.swiftspec_stats
        assert stats.draft_forwards == 0
        accepted += sum(r.ngram_accepted for r in stats.rounds)
    assert accepted > 10


def test_draft_free_from_a_plain_model_folder(tmp_path):
    target = tiny_model("llama", seed=7)
    target.save_pretrained(tmp_path / "plain")
    char_tokenizer().save_pretrained(tmp_path / "plain")
    model = SwiftSpecForCausalLM.from_pretrained(tmp_path / "plain", tree_budget=6)
    assert model.draft is None and model.tokenizer is not None and model.config.tree_budget == 6
    prompt = cycling_prompt()
    expected = target.generate(prompt, do_sample=False, max_new_tokens=30)
    assert model.generate(prompt, do_sample=False, max_new_tokens=30).tolist() == expected.tolist()


def test_draft_free_refuses_asynchronous_placements_and_saving():
    target = tiny_model("llama", seed=7)
    with pytest.raises(ValueError, match="has no draft"):
        SwiftSpecForCausalLM.from_models(target, placement={"target": ["cpu"], "draft": ["cpu"]})
    with pytest.raises(ValueError, match="no draft"):
        SwiftSpecForCausalLM.from_models(target).save_pretrained("/nonexistent/never-written")


def test_bench_and_cli_take_a_plain_model(tmp_path, capsys):
    from hf_swiftspec.bench import BenchConfig, run_bench
    from hf_swiftspec.cli import main

    target = tiny_model("llama", seed=7)
    target.save_pretrained(tmp_path / "plain")
    char_tokenizer().save_pretrained(tmp_path / "plain")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x): return x\ndef f(x): return x + 1\n")
    report = run_bench(BenchConfig(
        model=str(tmp_path / "plain"), prompts=(str(prompts),), num_prompts=1, max_new_tokens=8, output_dir=None,
        progress=False, growth_check_tokens=0, warmup=0, methods=("target", "assisted", "swiftspec_serial", "swiftspec_async"),
    ))
    status = {m.name: m.status for m in report.sets[0].at(1)}
    assert status["assisted"] == "skipped" and status["swiftspec_async"] == "skipped"
    assert status["swiftspec_serial"] != "skipped" and report.pair.draft == "none (draft-free)"
    assert main(["generate", "--model", str(tmp_path / "plain"), "--max-new-tokens", "6", "def f("]) == 0
    assert "no draft model" in capsys.readouterr().out


def test_editing_prompt_set_is_bundled():
    from hf_swiftspec.bench import load_prompts

    prompts = load_prompts("editing")
    assert len(prompts) == 18 and [p.category for p in prompts[:3]] == ["rename", "copy", "multiturn"]
    assert all(len(p.text) < 600 for p in prompts)  # they fit small contexts beside the output


def test_a_round_reads_the_device_once():
    """A draft-free round (its proposals built on the host) reads one thing from the device: the target's
    choices after its nodes, for the walk. The stopping criteria are split once per call (reading the EOS ids
    is a host sync). Two calls that differ only in length: their reads differ by their rounds."""
    from sync_counter import SyncCounter

    target = tiny_model("llama", seed=7)
    target.generation_config.eos_token_id = 2  # a stopping criterion with ids to read
    model = SwiftSpecForCausalLM.from_models(target)
    prompt = cycling_prompt()
    counted = []
    for new_tokens in (12, 40):
        model.output_history.clear()
        model.generate(prompt, do_sample=False, max_new_tokens=new_tokens)
        with SyncCounter() as counter:
            model.output_history.clear()
            model.generate(prompt, do_sample=False, max_new_tokens=new_tokens)
        counted.append((sum(counter.calls.values()), model.swiftspec_stats.verify_steps))
    (short_reads, short_rounds), (long_reads, long_rounds) = counted
    assert long_rounds > short_rounds
    assert long_reads - short_reads == long_rounds - short_rounds, counted
