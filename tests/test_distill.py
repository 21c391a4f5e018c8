"""`swiftspec distill` (hf_swiftspec/tools/distill.py): a tiny target, built here, distilled into a draft
that agrees with it more than its starting draft did, a run that resumes exactly, a pair folder that
loads and decodes as the target, an EAGLE-3 head the --eagle3 path loads, and bad input refused early."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_swiftspec import Eagle3Head, SwiftSpecForCausalLM
from hf_swiftspec.bench.methods import eagle3_head
from hf_swiftspec.cli import main
from hf_swiftspec.tools import distill as distill_module
from hf_swiftspec.tools.distill import distill
from hf_swiftspec.tools.distill_corpus import DistillError, Record
from hf_swiftspec.tools.distill_data import self_distilled, tokenise
from hf_swiftspec.tools.distill_progress import Progress
from hf_swiftspec.tools.distill_train import TopK, TrainSettings, teacher_topk, topk_kl
from hf_swiftspec.tools.eagle3_training import new_head_for
from hf_swiftspec.tools.models import char_tokenizer, tiny_model, truncated_draft
from distill_helpers import EVAL, TREE, config, load_target, save_target, word_texts


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("distill") / "target")


@pytest.fixture(scope="module")
def data_file(target_dir) -> Path:
    path = target_dir.parent / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in word_texts(40, seed=0)))
    return path


@torch.no_grad()
def heldout_agreement(target, draft, tokenizer, texts: list[str]) -> float:
    """Share of positions of `texts` where the draft's argmax is the target's."""
    hits = total = 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        same = target(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)
        hits, total = hits + int(same.sum()), total + same.numel()
    return hits / total


def heldout_tau(pair, tokenizer, texts: list[str]) -> float:
    """Greedy tokens per verification over the first 16 characters of each text, 24 new tokens each."""
    tokens = steps = 0
    for text in texts:
        ids = tokenizer(text[:16], return_tensors="pt").input_ids
        pair.generate(ids, max_new_tokens=24, do_sample=False)
        tokens, steps = tokens + pair.swiftspec_stats.new_tokens, steps + pair.swiftspec_stats.verify_steps
    return tokens / steps


@pytest.fixture(scope="module")
def distilled(target_dir, data_file):
    out = target_dir.parent / "pair"
    return out, distill(config(target_dir, data_file, out))


# ---------------------------------------------------------------- the result


def test_distilling_raises_agreement_and_tau_over_the_starting_draft(distilled, target_dir):
    out, result = distilled
    target, tokenizer = load_target(target_dir), char_tokenizer()
    start = truncated_draft(target, 1)  # the starting draft, rebuilt independently
    trained = AutoModelForCausalLM.from_pretrained(out / "draft", dtype=torch.float32).eval()
    texts = word_texts(6, seed=99)  # text neither the training nor the held-out records contain
    before, after = heldout_agreement(target, start, tokenizer, texts), heldout_agreement(target, trained, tokenizer, texts)
    assert after > before + 0.15, (before, after)
    tau_before = heldout_tau(SwiftSpecForCausalLM.from_models(target, start, tokenizer=tokenizer, **TREE), tokenizer, texts)
    tau_after = heldout_tau(SwiftSpecForCausalLM.from_models(target, trained, tokenizer=tokenizer, **TREE), tokenizer, texts)
    assert tau_after > tau_before + 0.5, (tau_before, tau_after)
    # The early exit's embeddings and head stayed the target's (frozen); its layer and norm trained
    for name, weight in trained.state_dict().items():
        same = torch.equal(weight, target.state_dict()[name])
        assert same == (name.startswith("model.embed_tokens") or name.startswith("lm_head")), name
    # What distill measured and reported says the same
    assert result.after.agreement > result.before.agreement and result.after.tau > result.before.tau
    assert result.after.identical and result.before.identical
    card = (out / "README.md").read_text()
    assert f"{result.after.tau:.2f}" in card and f"{result.after.agreement:.1%}" in card and "60 steps" in card


def test_the_written_pair_loads_and_decodes_exactly_as_the_target(distilled, target_dir):
    out, _ = distilled
    pair = SwiftSpecForCausalLM.from_pretrained(out)
    target, tokenizer = load_target(target_dir), char_tokenizer()
    assert json.loads((out / "config.json").read_text())["draft"] == "draft"
    for text in word_texts(4, seed=7):
        ids = tokenizer(text[:20], return_tensors="pt").input_ids
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        assert pair.generate(ids, max_new_tokens=40, do_sample=False).tolist() == expected.tolist()
        assert pair.swiftspec_stats.verify_steps < 40  # it speculated, not decoded token by token


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(target_dir, data_file, tmp_path):
    steps = dict(train=TrainSettings(steps=8, batch=2, window=32, lr=3e-3, warmup=2), save_every=100,
                 eval=replace(EVAL, prompts=1, new_tokens=4, windows=2))
    distill(config(target_dir, data_file, tmp_path / "whole", **steps))

    def interrupt(history):
        if history.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(config(target_dir, data_file, tmp_path / "cut", **steps), on_step=interrupt)
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["step-0000003"]  # Ctrl-C's checkpoint
    resumed = distill(config(target_dir, data_file, tmp_path / "cut", resume=True, **steps))
    assert resumed.steps == 8
    whole = load_file(str(tmp_path / "whole" / "draft" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "draft" / "model.safetensors"))
    assert whole.keys() == cut.keys()
    for name in whole:
        assert torch.equal(whole[name], cut[name]), name
    with pytest.raises(DistillError, match="other settings.*lr"):
        distill(config(target_dir, data_file, tmp_path / "cut", resume=True, train=replace(steps["train"], lr=1e-3)))


def test_a_smaller_model_learns_the_targets_own_continuations_of_prompts(target_dir, tmp_path):
    """--draft a separate model sharing the tokenizer, trained by self-distillation on prompt records."""
    small = tmp_path / "small"
    tiny_model("llama", layers=1, hidden=32, seed=3).save_pretrained(small)
    char_tokenizer().save_pretrained(small)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:24]}) + "\n" for t in word_texts(30, seed=1)))
    out = tmp_path / "self"
    result = distill(config(target_dir, prompts, out, draft=str(small), self_distill_tokens=40,
                            train=TrainSettings(steps=60, batch=4, window=32, lr=3e-3, warmup=5)))
    assert result.after.agreement > result.before.agreement + 0.1 and result.after.tau > result.before.tau
    assert result.after.identical
    assert "continued by the target itself (its greedy continuations, 40 tokens at most)" in (out / "README.md").read_text()
    assert result.corpus_tokens >= (30 - result.heldout_sequences) * 41  # prompts of 25 tokens did not train alone


def test_an_eagle3_head_loads_through_the_eagle3_path(target_dir, data_file, tmp_path):
    out = tmp_path / "head-pair"
    result = distill(config(target_dir, data_file, out, draft="eagle3",
                            train=TrainSettings(steps=40, batch=4, window=32, lr=3e-3, warmup=5)))
    target, tokenizer = load_target(target_dir), char_tokenizer()
    head = eagle3_head(str(out), target)  # what `swiftspec bench --eagle3 OUT` loads
    assert isinstance(head, Eagle3Head) and head.layer_ids
    saved = load_file(str(out / "draft" / "model.safetensors"))
    assert torch.equal(head.fc.weight, saved["fc.weight"])
    assert result.after.agreement > result.before.agreement
    pair = SwiftSpecForCausalLM.from_pretrained(out)
    assert isinstance(pair.draft, Eagle3Head)
    ids = tokenizer(word_texts(1, seed=5)[0][:20], return_tensors="pt").input_ids
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    assert pair.generate(ids, max_new_tokens=30, do_sample=False).tolist() == expected.tolist()
    # The trained head was written: it drafts for the target better than an untrained one
    texts = word_texts(4, seed=99)
    fresh = new_head_for(target, seed=0)
    tau_fresh = heldout_tau(SwiftSpecForCausalLM.from_models(target, fresh, tokenizer=tokenizer, **TREE), tokenizer, texts)
    tau_head = heldout_tau(SwiftSpecForCausalLM.from_models(target, head, tokenizer=tokenizer, **TREE), tokenizer, texts)
    assert tau_head > tau_fresh + 0.5, (tau_fresh, tau_head)


def test_a_bfloat16_run_writes_a_bfloat16_draft_that_decodes_as_the_target(target_dir, data_file, tmp_path):
    """--dtype bfloat16 (the GPU default): the target runs in bf16, the draft trains in float32 under autocast
    and is written in bf16; the pair still decodes exactly as the target (loaded in float32 on a CPU)."""
    out = tmp_path / "bf16"
    result = distill(config(target_dir, data_file, out, dtype="bfloat16",
                            train=TrainSettings(steps=30, batch=4, window=32, lr=3e-3, warmup=5)))
    assert result.after.agreement > result.before.agreement
    assert json.loads((out / "draft" / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(out / "draft" / "model.safetensors")).values())
    pair, target, tokenizer = SwiftSpecForCausalLM.from_pretrained(out), load_target(target_dir), char_tokenizer()
    ids = tokenizer(word_texts(1, seed=3)[0][:20], return_tensors="pt").input_ids
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    assert pair.generate(ids, max_new_tokens=30, do_sample=False).tolist() == expected.tolist()


def test_auto_starts_a_large_target_from_its_early_exit_and_a_small_one_from_a_new_draft(target_dir, data_file, tmp_path):
    """--draft auto (the default), by the target's size: a SmolLM2-135M-shaped config (its parameters counted on the
    meta device, no weights) gets its first 2 of 30 layers, the tiny target a new small draft; the run says which
    and why, and the early exit's recipe is its own (4 x 192-token windows)."""
    from transformers import AutoConfig

    from hf_swiftspec.tools.distill_drafts import auto_draft
    from hf_swiftspec.tools.distill_train import with_recipe
    from hf_swiftspec.tools.models import REAL_SHAPES

    shape = dict(REAL_SHAPES["smollm2-135m"])
    spec, why = auto_draft(AutoConfig.for_model(shape.pop("model_type"), **shape))
    assert spec == "early-exit:2" and "135M-parameter target of 30 layers" in why
    assert (with_recipe(TrainSettings(), spec).batch, with_recipe(TrainSettings(), spec).window) == (4, 192)
    assert auto_draft(load_target(target_dir).config)[0] == "small"
    out = tmp_path / "auto"
    result = distill(config(target_dir, data_file, out, draft="auto", train=TrainSettings(steps=2, batch=2, window=32),
                            eval=replace(EVAL, prompts=1, new_tokens=4, windows=2)))
    assert "--draft auto chose small for a 0.1M-parameter target" in result.starting_draft
    assert json.loads((out / "distill.json").read_text())["draft"] == "small"


# ---------------------------------------------------------------- the objective and the data


def test_topk_kl_is_the_full_kl_at_k_equal_v_and_folds_the_tail_below_it():
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(2, 5, 11, generator=g) * 3, torch.randn(2, 5, 11, generator=g)
    p, logq = torch.softmax(teacher, -1), torch.log_softmax(student, -1)
    full = (p * (p.log() - logq)).sum(-1).mean()
    torch.testing.assert_close(topk_kl(student, teacher_topk(teacher, 11)), full)
    top = teacher_topk(teacher, 3)
    mask = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, top.ids, True)
    p_tail, q_tail = (p * ~mask).sum(-1), (logq.exp() * ~mask).sum(-1)
    folded = ((p * (p.log() - logq)) * mask).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    torch.testing.assert_close(topk_kl(student, TopK(top.logprobs, top.ids)), folded.mean())


@pytest.mark.parametrize("k", [3, 11])
def test_topk_kl_has_the_gradient_of_the_direct_computation(k):
    """topk_kl writes its gradient out; autograd through the direct formula (float64) must give the same."""
    g = torch.Generator().manual_seed(1)
    teacher, student = torch.randn(2, 5, 11, generator=g) * 3, torch.randn(2, 5, 11, generator=g, requires_grad=True)
    top = teacher_topk(teacher, k)
    topk_kl(student, top).backward()
    wide = student.detach().double().requires_grad_(True)
    p, logq = torch.softmax(teacher.double(), -1), torch.log_softmax(wide, -1)
    mask = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, top.ids, True)
    p_tail, q_tail = (p * ~mask).sum(-1), (logq.exp() * ~mask).sum(-1)
    tail = p_tail * (p_tail.log() - q_tail.log()) if k < 11 else 0.0
    (((p * (p.log() - logq)) * mask).sum(-1) + tail).mean().backward()
    torch.testing.assert_close(student.grad, wide.grad.float(), atol=1e-6, rtol=1e-4)


def test_self_distillation_trains_on_the_targets_own_continuations(target_dir):
    target, tokenizer = load_target(target_dir), char_tokenizer()
    records = [Record("r0", "def x(self): return"), Record("r1", "class y:\n    import"),
               Record("r2", None, ({"role": "user", "content": "print x"},))]

    def check(sequences):
        for record, sequence in zip(records, sequences):
            text = record.text if record.text is not None else record.messages[0]["content"]
            ids = tokenizer(text).input_ids
            prompt = ids[: len(ids) // 2] if record.text is not None else ids
            own = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False)
            assert sequence.ids == own[0].tolist() and sequence.prompt == len(prompt)

    first = self_distilled(records, tokenizer, target, new_tokens=12, progress=Progress(False), batch=2)
    check(first)
    # A row that stops early (its 4th new token made the stop token) ends there, not padded to its batch's length
    target.generation_config.eos_token_id = first[0].ids[first[0].prompt + 3]
    stopped = self_distilled(records, tokenizer, target, new_tokens=12, progress=Progress(False), batch=2)
    assert len(stopped[0].ids) <= first[0].prompt + 4
    check(stopped)


def test_conversations_go_through_the_chat_template():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    record = Record("r", None, ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}))
    sequence = tokenise(record, tokenizer)
    assert tokenizer.decode(sequence.ids) == "<user>hi<assistant>yo"
    assert tokenizer.decode(sequence.ids[: sequence.prompt]) == "<user>hi<assistant>"


# ---------------------------------------------------------------- bad input, refused before training


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if distill gets as far as loading the target's weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("distill loaded the target before refusing its input")

    monkeypatch.setattr(distill_module, "load_target", refuse)


def other_vocabulary_draft(folder: Path) -> Path:
    """A 98-token draft whose tokenizer numbers the characters the other way round from the target's."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>"] + [chr(c) for c in range(126, 31, -1)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tiny_model("llama", layers=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case, named", [
    ("another vocabulary", "vocab"),
    ("no data", "no training data"),
    ("an empty data file", "no training data"),
    ("an unwritable output", "cannot be written"),
    ("a non-empty output", "not empty"),
    ("too many layers", "early-exit:3"),
])
def test_bad_input_is_a_clear_error_before_any_training(case, named, target_dir, data_file, tmp_path, no_loading):
    kwargs = {}
    output = tmp_path / "out"
    if case == "another vocabulary":
        kwargs["draft"] = str(other_vocabulary_draft(tmp_path / "other"))
    elif case == "no data":
        kwargs["data"] = ()
    elif case == "an empty data file":
        (tmp_path / "empty.txt").write_text("  \n")
        kwargs["data"] = (str(tmp_path / "empty.txt"),)
    elif case == "an unwritable output":
        (tmp_path / "a-file").write_text("")
        output = tmp_path / "a-file" / "out"  # under a file: no folder can be made there
    elif case == "a non-empty output":
        output.mkdir()
        (output / "notes.txt").write_text("mine")
    elif case == "too many layers":
        kwargs["draft"] = "early-exit:3"
    with pytest.raises(DistillError, match=named):
        distill(config(target_dir, data_file, output, **kwargs))
    assert not (output / "checkpoints").exists()


def test_the_command_refuses_bad_input_in_one_line(target_dir, data_file, tmp_path, capsys, no_loading):
    assert main(["distill", str(tmp_path / "out"), "--target", str(target_dir), "--data", str(tmp_path / "missing.txt")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("swiftspec: error: --data") and "missing.txt" in err[-1] and len(err) <= 2


@pytest.mark.parametrize("repo, target, named", [
    ("not a repo id!", "hub", "is not a Hub repo id"),
    ("me/pair", "local", "is a local folder"),
])
def test_push_to_hub_arguments_are_checked_before_training(repo, target, named, target_dir, data_file, tmp_path, no_loading):
    given = str(target_dir) if target == "local" else "someone/target"
    with pytest.raises(DistillError, match=named):
        distill(config(target_dir, data_file, tmp_path / "out", push_to_hub=repo, target=given))


def test_the_command_distills_and_reports(target_dir, data_file, tmp_path, capsys):
    """The command line: progress on stderr, the user's own run reported on stdout, and a card that says what to
    expect (agreement, tau with a fixed tree and under the policy, the bench's speed-ups), all from distill.json."""
    out = tmp_path / "cli-pair"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # no --threads: one torch thread on a CPU, as every swiftspec command
        code = main(["distill", str(out), "--target", str(target_dir), "--data", str(data_file), "--steps", "20",
                     "--batch", "4", "--window", "32", "--eval-prompts", "3", "--eval-new-tokens", "16"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    assert "(float32 on cpu, 1 torch thread(s))" in captured.err
    printed = captured.out
    assert code == 0, printed
    progress = [line for line in captured.err.replace("\r", "\n").splitlines() if line.startswith("distill: train: 20/20 steps")]
    assert progress and all(word in progress[-1] for word in ("loss", "top-1 agreement", "s/step", "ETA")), captured.err
    report = json.loads((out / "distill.json").read_text())
    assert report["steps"] == 20 and f"tau {report['before']['tau']:.2f} -> {report['after']['tau']:.2f}" in printed
    assert math.isfinite(report["after"]["kl"])
    after, speed = report["after"], report["speed"]
    bench = json.loads((out / "bench" / "results.json").read_text())
    timed = {m["name"]: m for m in bench["sets"][0]["batches"][0]["methods"]}
    assert speed["speedup"] == timed["swiftspec_serial"]["speedup"]["mean"]
    assert speed["prompt_lookup_speedup"] == timed["prompt_lookup"]["speedup"]["mean"]
    card = (out / "README.md").read_text()
    expect = card[card.index("## What to expect"):card.index("## Measured on held-out data")]
    for figure in (f"{after['agreement']:.1%}", f"{after['tau']:.2f}", f"{after['policy_tau']:.2f}", f"{speed['speedup']:.2f}x",
                   f"{speed['speedup'] / speed['prompt_lookup_speedup']:.2f}x prompt lookup"):
        assert figure in expect, figure
    assert f"{speed['speedup']:.2f}x target.generate" in printed
    assert f"20 steps x 4 x 32 tokens: {20 * 4 * 32:,} tokens trained on" in printed
    free = speed["speedup"] / speed["draft_free_speedup"]  # the bench's own draft-free run, beside the pair
    assert speed["draft_free_speedup"] == timed["swiftspec_suffix"]["speedup"]["mean"]
    assert f"({free:.2f}x draft-free)" in printed
    assert f"{free:.2f}x" in expect or "(the policy hardly drafted with it)" in expect
    everything = printed + captured.err + json.dumps(report) + card
    assert "shared" not in everything and "loaded machine" not in everything  # the user's own run, in the user's terms


# ---------------------------------------------------------------- several processes


def test_two_ranks_train_one_draft_and_rank_0_alone_writes(target_dir, data_file, tmp_path):
    """Two CPU ranks (gloo, as torchrun starts them) split each step's windows and average gradients: they end
    with the weights of one process training on the whole batch (up to float rounding); rank 0 alone writes."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--target", str(target_dir), "--data", str(data_file), "--steps", "6", "--batch", "4", "--window", "32",
             "--eval-prompts", "1", "--eval-new-tokens", "4", "--eval-windows", "2", "--quiet", "--threads", "1"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "hf_swiftspec.cli", "distill", str(tmp_path / "ranks"), *flags]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "wrote pair" in outputs[0] and "wrote pair" not in outputs[1]
    assert main(["distill", str(tmp_path / "alone"), *flags]) == 0
    ranks = load_file(str(tmp_path / "ranks" / "draft" / "model.safetensors"))
    alone = load_file(str(tmp_path / "alone" / "draft" / "model.safetensors"))
    start = truncated_draft(load_target(target_dir), 1).state_dict()
    for name in alone:
        torch.testing.assert_close(ranks[name], alone[name], atol=1e-4, rtol=1e-3)
    assert any(not torch.equal(alone[name], start[name]) for name in alone)  # it trained
