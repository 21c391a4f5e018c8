"""`swiftspec distill`, the run around the training: any corpus (a text file, a folder, jsonl, a `datasets`
dataset) split into the same records; the pair it writes runs as `swiftspec pair create`'s does and still loads
when moved; every phase shows its progress; --minutes sizes the schedule to the time; a Ctrl-C inside a step
resumes to exactly the uninterrupted run's weights."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import processors
from torch.optim.optimizer import register_optimizer_step_post_hook

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.pair import PairConfigError, create_pair_repo
from hf_swiftspec.tools.distill import distill
from hf_swiftspec.tools.distill_corpus import DataOptions, DistillError, read_records, split_records
from hf_swiftspec.tools.distill_data import tokenise_all, token_stream
from hf_swiftspec.tools.distill_progress import PHASES, Progress, minutes
from hf_swiftspec.tools.distill_report import Speed
from hf_swiftspec.tools.distill_train import ModelStudent, TrainSettings, train
from hf_swiftspec.tools.models import char_tokenizer, tiny_model
from distill_helpers import EVAL, config, load_target, save_target, word_texts

QUICK = dict(train=TrainSettings(steps=6, batch=2, window=32, lr=3e-3, warmup=2), save_every=100,
             eval=replace(EVAL, prompts=2, new_tokens=8, windows=2))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("distill-run") / "target")


def documents(count: int, seed: int) -> list[str]:
    """Texts of 12 lines of word soup: about 600 characters each."""
    return ["\n".join(word_texts(12, seed=seed * 100 + i, words=10)) + "\n" for i in range(count)]


@pytest.fixture(scope="module")
def text_file(target_dir) -> Path:
    path = target_dir.parent / "corpus.txt"
    path.write_text("".join(documents(12, seed=0)))
    return path


def records_of(records) -> list[tuple]:
    """What a record is, whatever its source was called."""
    return [(r.text, r.messages, r.part) for r in records]


# ---------------------------------------------------------------- any corpus


def test_a_text_file_is_cut_at_line_ends_into_records_and_some_are_held_out(text_file):
    records = read_records([text_file], DataOptions(record_chars=1000))
    text = text_file.read_text()
    assert len(records) >= len(text) // 1000 >= 4 and "".join(r.text for r in records) == text  # nothing lost or repeated
    assert all(len(r.text) <= 1000 and r.text.endswith("\n") for r in records)
    assert [r.part for r in records] == list(range(len(records))) and {r.document for r in records} == {str(text_file)}
    train, heldout = split_records(records, 30)
    assert train and heldout and len(train) + len(heldout) == len(records)


def test_pieces_of_one_document_are_packed_without_an_end_of_sequence_between_them(text_file):
    tokenizer = char_tokenizer()
    bos = tokenizer.bos_token_id  # a tokenizer that opens each text with BOS, as Llama's does
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    records = read_records([text_file], DataOptions(record_chars=1000))
    stream = token_stream(tokenise_all(records, tokenizer, Progress(False)), tokenizer.eos_token_id)
    whole = tokenizer(text_file.read_text()).input_ids
    assert whole[0] == bos and stream.tolist() == whole + [tokenizer.eos_token_id]  # one BOS, one EOS: one document


def test_a_folder_jsonl_and_a_saved_dataset_give_the_same_records_and_held_out_ones(tmp_path):
    texts = documents(8, seed=1)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"doc{i}.py").write_text(text)
    (folder / ".hidden").write_text("not data")
    (folder / "blob.bin").write_bytes(b"\0\1\2binary")
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    options = DataOptions(record_chars=300)
    from_folder, from_jsonl = read_records([folder], options), read_records([jsonl], options)
    assert records_of(from_folder) == records_of(from_jsonl) and len(from_folder) > len(texts)
    assert [records_of(part) for part in split_records(from_folder, 20)] == [records_of(part) for part in split_records(from_jsonl, 20)]
    datasets = pytest.importorskip("datasets", reason="the `datasets` library (pip install 'hf_swiftspec[distill]') is not installed")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts}),
                          "test": datasets.Dataset.from_dict({"body": ["other"]})}).save_to_disk(saved)
    from_dataset = read_records([saved], replace(options, column="body"))
    assert records_of(from_dataset) == records_of(from_jsonl)
    with pytest.raises(DistillError, match="no split 'validation'.*test.*train"):
        read_records([saved], replace(options, column="body", split="validation"))
    chats = tmp_path / "chats"
    turns = [[{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}] for i in range(3)]
    datasets.Dataset.from_dict({"conversations": turns}).save_to_disk(chats)
    conversations = read_records([chats])
    assert conversations[1].messages == ({"role": "user", "content": "question 1"}, {"role": "assistant", "content": "answer 1"})


def test_a_dataset_without_the_datasets_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: its import raises ImportError
    with pytest.raises(DistillError, match=r"pip install 'hf_swiftspec\[distill\]'"):
        read_records(["hf:someone/chats"])


def test_transformers_length_warning_is_not_shown_for_records_longer_than_the_context(text_file, capfd, caplog):
    tokenizer = char_tokenizer()
    tokenizer.model_max_length = 16  # every record is longer: training reads windows of them, so it does not apply
    tokenise_all(read_records([text_file]), tokenizer, Progress(False))
    shown = capfd.readouterr().err + "".join(record.getMessage() for record in caplog.records)
    assert "sequence length is longer" not in shown


# ---------------------------------------------------------------- the pair it writes


@pytest.fixture(scope="module")
def from_text(target_dir, text_file):
    """The default draft (a new small model) distilled from one text file."""
    out = target_dir.parent / "from-text"
    result = distill(config(target_dir, text_file, out, draft="small", data_options=DataOptions(record_chars=400),
                            train=TrainSettings(steps=40, batch=4, window=48, lr=3e-3, warmup=5)))
    return out, result


def test_one_text_file_distills_into_a_pair_that_decodes_as_the_target(from_text, target_dir):
    out, result = from_text
    assert result.after.agreement > result.before.agreement + 0.1 and result.after.identical
    pair, target, tokenizer = SwiftSpecForCausalLM.from_pretrained(out), load_target(target_dir), char_tokenizer()
    ids = tokenizer("def x in self", return_tensors="pt").input_ids
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    assert pair.generate(ids, max_new_tokens=30, do_sample=False).tolist() == expected.tolist()


def test_the_written_config_is_pair_creates_for_the_same_target_and_draft(from_text, target_dir, tmp_path):
    out, _ = from_text
    written = json.loads((out / "config.json").read_text())
    create_pair_repo(tmp_path / "created", target=str(target_dir), draft=str(out / "draft"))
    created = json.loads((tmp_path / "created" / "config.json").read_text())
    assert Path(written.pop("target")) == target_dir.resolve() and written.pop("draft") == "draft"
    created.pop("target"), created.pop("draft")
    assert written == created  # tree_budget null (the policy sizes the trees), the library's draft width
    assert written["tree_budget"] is None


def test_tree_settings_given_are_the_pairs(target_dir, text_file, tmp_path):
    out = tmp_path / "sized"
    distill(config(target_dir, text_file, out, pair_settings={"tree_budget": 16, "draft_width": 4}, **QUICK))
    written = json.loads((out / "config.json").read_text())
    assert (written["tree_budget"], written["draft_width"], written["draft_depth"]) == (16, 4, None)


def test_a_moved_pair_still_finds_its_local_target(from_text, target_dir, tmp_path):
    moved = tmp_path / "elsewhere" / "deeper" / "pair"
    shutil.copytree(from_text[0], moved, ignore=shutil.ignore_patterns("checkpoints"))
    pair, target, tokenizer = SwiftSpecForCausalLM.from_pretrained(moved), load_target(target_dir), char_tokenizer()
    ids = tokenizer("class y", return_tensors="pt").input_ids
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert pair.generate(ids, max_new_tokens=20, do_sample=False).tolist() == expected.tolist()
    # A pair naming its target by a relative path it lost: the error says where it looked, relative to what
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "target": "../target"}))
    with pytest.raises(PairConfigError, match=r"relative to the pair folder \(.*elsewhere/deeper/target\)"):
        SwiftSpecForCausalLM.from_pretrained(moved)


# ---------------------------------------------------------------- progress


class Ticks:
    """A clock that moves a quarter of a second each time it is read: the run's lines depend on its work alone."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


def speed_stub(pair, prompts_file, folder, config) -> Speed:
    """Stands in for `swiftspec bench` (tests/test_distill.py runs the real one through the command line)."""
    assert prompts_file.is_file() and pair.config.tree_budget is None
    return Speed(2, 8, 1.5, 1.2, 2.0, 1, "bench")


def test_every_phase_shows_progress_and_the_plan_comes_first(target_dir, tmp_path):
    data = tmp_path / "mixed.jsonl"
    texts = word_texts(16, seed=4)
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:10])
                    + "".join(json.dumps({"turns": [t[:20]]}) + "\n" for t in texts[10:]))  # conversations: answered
    stream = io.StringIO()
    result = distill(config(target_dir, data, tmp_path / "out", draft="small", verbose=True, **QUICK), speed=speed_stub,
                     clock=Ticks(), stream=stream)
    train, _ = split_records(read_records([data]), 10)
    assert result.self_distilled == sum(r.messages is not None for r in train) > 0  # by default: the conversations alone
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("distill: reading the data")
    loading = next(i for i, line in enumerate(lines) if "loading the target" in line)  # said before it loads, and after
    assert lines[loading + 1].startswith("distill: target loaded in")
    plan = next(i for i, line in enumerate(lines) if line.startswith("distill: the run:"))
    assert "About" in lines[plan] and all(PHASES[name] in lines[plan] for name in PHASES)
    for name, words in PHASES.items():
        shown = [i for i, line in enumerate(lines) if line.startswith(f"distill: {words}: ")]
        assert shown and min(shown) > plan, name
        counts = [lines[i].split(": ")[2].split()[0] for i in shown[:-1]]  # "3/10" of each line before the last
        assert counts[0].startswith("0/") and all("ETA" in lines[i] for i in shown[:-1]), lines[shown[0]]
        assert any(int(count.split("/")[0]) > 0 for count in counts), (name, counts)  # it moved while it ran
        assert f"distill: {words}: done" in lines[shown[-1]], name
    quiet = io.StringIO()
    distill(config(target_dir, data, tmp_path / "quiet", draft="small", verbose=False, **QUICK), speed=speed_stub,
            clock=Ticks(), stream=quiet)
    assert quiet.getvalue() == ""


def test_the_plan_line_estimates_the_whole_run():
    clock = Ticks()
    stream = io.StringIO()
    progress = Progress(True, clock, stream)
    progress.plan({"tokenise": 30.0, "train": 600.0}, {})
    assert "About 10m" in stream.getvalue() and "(ETA 10m30s)" in stream.getvalue()
    progress.start("tokenise", 10, "records")
    progress.advance(5)  # half done after 1.25 s by the clock: 1.25 s to go for it, then training
    assert stream.getvalue().splitlines()[-1].endswith("ETA 1s, run 10m01s")


# ---------------------------------------------------------------- --minutes


class StepClock:
    """A clock that only the student's steps move, by `seconds[i]` for step i (the last value after that)."""

    def __init__(self, seconds: list[float]):
        self.seconds, self.now, self.steps = seconds, 0.0, 0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.seconds[min(self.steps, len(self.seconds) - 1)]
        self.steps += 1


def timed_student(clock: StepClock):
    target, draft = tiny_model("llama", layers=2, hidden=32, seed=0), tiny_model("llama", layers=1, hidden=32, seed=1)
    student = ModelStudent(draft.train(), target.eval(), top_k=8)
    taken = student.step

    def step(ids, autocast):
        clock.step()
        return taken(ids, autocast)

    student.step = step
    return student


@pytest.mark.parametrize("seconds, steps", [([2.0], 30), ([2.0] * 10 + [4.0], 20)])
def test_minutes_train_until_the_time_is_spent_with_the_schedule_sized_to_it(seconds, steps, tmp_path):
    """60 s of training: 30 steps of 2 s; or 10 of 2 s, then the machine slows to 4 s a step and the plan shrinks to
    20. Either way the cosine reaches its floor at the last step the time allows."""
    clock = StepClock(seconds)
    settings = TrainSettings(minutes=1.0, batch=2, window=16, lr=1e-2, warmup=3)
    stream = torch.randint(0, 98, (400,), generator=torch.Generator().manual_seed(0))
    shown = io.StringIO()
    history = train(timed_student(clock), stream, settings, tmp_path / "checkpoints", {}, Progress(True, clock, shown),
                    save_every=1000, clock=clock, step_s=seconds[0])
    assert history.step == steps and history.seconds == pytest.approx(60.0)
    # The training line's ETA is the time left, whatever the steps' rate so far has been
    spent = [sum(seconds[min(i, len(seconds) - 1)] for i in range(k)) for k in range(steps + 1)]
    lines = [line for line in shown.getvalue().splitlines() if line.startswith("distill: train: ") and "done" not in line]
    assert len(lines) > 5
    for line in lines:
        done = int(line.split(": ")[2].split("/")[0])
        assert line.endswith(f"ETA {minutes(60 - spent[done])}, run {minutes(60 - spent[done])}"), line
    assert history.learning_rates[-1] == pytest.approx(settings.learning_rate(steps - 1, steps))
    assert history.learning_rates[-1] < settings.lr * (settings.min_lr_ratio + 0.02)
    decaying = history.learning_rates[settings.warmup :]
    assert all(a > b for a, b in zip(decaying, decaying[1:]))


class WorkClock:
    """A clock that only the models' work moves: each decoder layer's forward advances it by `per_token` seconds a
    token it reads (three times that under autograd: its backward too). A run's phases then take as long as their
    work says, the same on any machine, and its recorded times can be held to its budget."""

    def __init__(self, per_token: float):
        self.per_token, self.now = per_token, 0.0

    def __call__(self) -> float:
        return self.now

    def layer(self, module, args, output) -> None:
        if type(module).__name__.endswith("DecoderLayer") and isinstance(output, torch.Tensor):
            self.now += output.shape[0] * output.shape[1] * self.per_token * (3 if output.requires_grad else 1)

    def __enter__(self) -> "WorkClock":
        self.handle = torch.nn.modules.module.register_module_forward_hook(self.layer)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def timed_speed(pair, prompts_file, folder, config) -> Speed:
    """Stands in for `swiftspec bench`: one target.generate per method and prompt on the work clock."""
    prompts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()]
    for prompt in prompts[1:] * 4:
        ids = pair.tokenizer(prompt, return_tensors="pt").input_ids
        pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=config.eval.new_tokens)
    return Speed(len(prompts) - 1, config.eval.new_tokens, 1.5, 1.2, 2.0, 1, "bench", 1.4, 0.0, 1.0)


def minutes_run(target_dir, text_file, out, minutes: float, per_token: float, **changes):
    stream = io.StringIO()
    with WorkClock(per_token) as clock:
        result = distill(config(target_dir, text_file, out, verbose=True, draft="small", save_every=1000,
                                data_options=DataOptions(record_chars=400), heldout_percent=25,
                                train=TrainSettings(minutes=minutes, batch=4, window=48, lr=3e-3, warmup=5), **changes),
                         speed=timed_speed, clock=clock, stream=stream)
    return result, stream.getvalue(), json.loads((out / "distill.json").read_text())


def plan_of(shown: str) -> str:
    return next(line for line in shown.splitlines() if line.startswith("distill: the run:"))


@pytest.fixture(scope="module")
def one_minute(target_dir, text_file):
    """--minutes 1 on the work clock (a millisecond a layer-token), measuring 3 held-out prompts x 16 tokens."""
    return minutes_run(target_dir, text_file, target_dir.parent / "one-minute", 1.0, 1e-3,
                       eval=replace(EVAL, prompts=3, new_tokens=16, windows=4))


def test_minutes_go_to_training_and_the_run_ends_within_them(one_minute):
    """The run's own recorded phases add up to its time, training takes at least 70% of it, the measurements at
    most their 15%, and it ends within the minute; the plan line said what training would get."""
    result, shown, report = one_minute
    phases, total = report["phases"], report["seconds"]
    assert set(phases) == {"prepare", "tokenise", "evaluate-start", "train", "evaluate-end", "speed"}
    assert sum(phases.values()) == pytest.approx(total, abs=0.5)  # (writing the pair moves no model)
    assert phases["train"] >= 0.7 * total and total <= 60.0, phases
    assert phases["evaluate-start"] + phases["evaluate-end"] + phases["speed"] <= 0.15 * 60
    assert "train until the minutes are spent, 8" in plan_of(shown) and "warning" not in shown  # 8x% of them
    assert (result.after.prompts, result.after.new_tokens / result.after.prompts) == (3, 16)  # as asked: it fits


def test_a_slow_target_gets_fewer_held_out_prompts_and_tokens_not_less_training(target_dir, text_file, tmp_path):
    """The target's work four times dearer (and four minutes, for as many steps): measuring the 5 prompts x 24 tokens
    asked for would pass the share, so fewer are measured (the plan says so), and training still takes at least 70%
    of a run that ends within its minutes."""
    result, shown, report = minutes_run(target_dir, text_file, tmp_path / "out", 4.0, 4e-3)
    phases, total = report["phases"], report["seconds"]
    assert phases["train"] >= 0.7 * total and total <= 240.0, phases
    e = report["eval"]
    assert (e["prompts"], e["new_tokens"]) < (EVAL.prompts, EVAL.new_tokens) and result.after.prompts == e["prompts"]
    assert f"{e['prompts']} held-out prompts x {e['new_tokens']} tokens" in plan_of(shown)
    assert "of the minutes allows" in plan_of(shown)


def test_the_plan_warns_when_training_gets_under_half_the_minutes(target_dir, text_file, tmp_path):
    _, shown, report = minutes_run(target_dir, text_file, tmp_path / "out", 0.75, 4e-3)
    warning = next(line for line in shown.splitlines() if "warning: training gets" in line)
    assert "of the 0.75 minutes" in warning and "--no-speed" in warning
    assert report["phases"]["train"] < 0.5 * 45


def test_the_card_says_what_the_run_did(one_minute, target_dir):
    """The card's training figures are the run's: the tokens its steps read (steps x batch x window, not the corpus),
    the training's own minutes; and a speed-up that the suffix proposals made is not credited to the draft."""
    result, _, report = one_minute
    card = (target_dir.parent / "one-minute" / "README.md").read_text()
    trained = report["steps"] * 4 * 48
    assert report["train_tokens"] == result.train_tokens == trained != report["corpus_tokens"]
    assert f"**{trained:,} tokens trained on**" in card and f"{report['corpus_tokens']:,} tokens to draw from" in card
    assert f"**{report['training_time']['seconds'] / 60:.1f} minutes of training**" in card
    assert f"of a {report['seconds'] / 60:.1f}-minute run (--minutes 1)" in card
    expect = card[card.index("## What to expect"):card.index("## Measured on held-out data")]
    assert "**The draft does not pay on this machine** (the policy hardly drafted with it)" in expect
    assert "draft-free (suffix proposals alone) ran 1.40x" in expect and "100% of the accepted proposals" in expect
    assert "Draft-free mode" in expect and "larger target" in expect and "GPU" in expect


def test_minutes_too_few_for_the_other_phases_are_refused(target_dir, text_file, tmp_path):
    with pytest.raises(DistillError, match=r"--minutes 0.001: .* leaving no time to train"):
        distill(config(target_dir, text_file, tmp_path / "out", train=TrainSettings(minutes=0.001, batch=2, window=32)))
    with pytest.raises(DistillError, match="give one"):
        distill(config(target_dir, text_file, tmp_path / "out", train=TrainSettings(steps=5, minutes=1.0)))


# ---------------------------------------------------------------- Ctrl-C inside a step


@pytest.fixture(scope="module")
def uninterrupted(target_dir, text_file):
    out = target_dir.parent / "whole"
    distill(config(target_dir, text_file, out, **QUICK))
    return load_file(str(out / "draft" / "model.safetensors"))


def ctrl_c() -> None:
    """What a Ctrl-C does: SIGINT to this process (Python raises KeyboardInterrupt in the main thread)."""
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("inside, checkpoint", [("forward", "step-0000003"), ("update", "step-0000004")])
def test_a_ctrl_c_inside_a_step_resumes_to_the_uninterrupted_weights(inside, checkpoint, uninterrupted, target_dir,
                                                                     text_file, tmp_path, monkeypatch):
    """SIGINT during step 4's forward drops that step whole (its windows are drawn again on resume); during its
    update, the step ends first. Either way the resumed run's weights equal the uninterrupted run's, bit for bit."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only, and this test runs in another")
    calls = []
    if inside == "forward":
        taken = ModelStudent.step

        def step(self, ids, autocast):
            calls.append(self.module.training)  # training steps (not the trial step or a measurement)
            if sum(calls) == 4 and self.module.training:
                ctrl_c()
            return taken(self, ids, autocast)

        monkeypatch.setattr(ModelStudent, "step", step)
        handle = None
    else:
        def updated(*args):
            calls.append(1)
            if len(calls) == 4:
                ctrl_c()  # after AdamW wrote the weights, before the step's bookkeeping

        handle = register_optimizer_step_post_hook(updated)
    cut = tmp_path / "cut"
    try:
        with pytest.raises(KeyboardInterrupt):
            distill(config(target_dir, text_file, cut, **QUICK))
    finally:
        if handle is not None:
            handle.remove()
        monkeypatch.undo()
    assert [p.name for p in (cut / "checkpoints").iterdir()] == [checkpoint]
    assert distill(config(target_dir, text_file, cut, resume=True, **QUICK)).steps == 6
    resumed = load_file(str(cut / "draft" / "model.safetensors"))
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name
