"""transformers integration: pipeline, streamers, outputs, stop strings, pair folders, Auto classes."""

import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, TextIteratorStreamer, TextStreamer, pipeline

from hf_swiftspec import SwiftSpecConfig, SwiftSpecForCausalLM
from hf_swiftspec.tools.models import char_tokenizer, tiny_model, truncated_draft


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    return SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2)), char_tokenizer()


def test_pipeline_greedy_matches_target_pipeline(pair):
    model, tok = pair
    ours = pipeline("text-generation", model=model, tokenizer=tok)
    theirs = pipeline("text-generation", model=model.target, tokenizer=tok)
    for prompt in ["def f(x):", "Hello", "a"]:
        got = ours(prompt, max_new_tokens=24, do_sample=False)[0]["generated_text"]
        assert got == theirs(prompt, max_new_tokens=24, do_sample=False)[0]["generated_text"]
    assert model.swiftspec_stats is not None and model.swiftspec_stats.new_tokens > 0


def test_pipeline_default_sampling_runs_speculatively(pair):
    model, tok = pair
    model.swiftspec_stats = None
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    out = pipe("import os", max_new_tokens=16)  # the pipeline's defaults: do_sample=True, temperature=0.7
    assert out[0]["generated_text"].startswith("import os")
    assert model.swiftspec_stats.new_tokens >= 1


def test_text_streamer_prints_the_returned_text(pair, capsys):
    model, tok = pair
    ids = tok("print(", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=20, do_sample=False, streamer=TextStreamer(tok), swiftspec=True)
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == tok.decode(out[0])


def test_text_iterator_streamer_ends(pair):
    model, tok = pair
    ids = tok("for i in", return_tensors="pt").input_ids
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=30)
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(out=model.generate(ids, max_new_tokens=25, do_sample=False, streamer=streamer))
    )
    thread.start()
    text = "".join(streamer)  # would hang forever if end() were never called
    thread.join(timeout=30)
    assert text == tok.decode(result["out"][0, ids.shape[1] :])


@pytest.mark.parametrize("bad", [dict(input_ids=torch.ones(2, 3, dtype=torch.long)), dict(num_beams=2)])
def test_streamer_ends_when_generation_fails(pair, bad):
    model, tok = pair
    streamer = TextIteratorStreamer(tok, timeout=10)
    kwargs = dict(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=5, streamer=streamer)
    with pytest.raises(ValueError):
        model.generate(**{**kwargs, **bad})
    assert "".join(streamer) == ""  # ended, not hanging


def test_return_dict_in_generate_with_scores_and_logits(pair):
    model, _ = pair
    ids = torch.tensor([[5, 9, 11, 4]])
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ours = model.generate(ids, swiftspec=True, repetition_penalty=1.2, **kwargs)
    ref = model.target.generate(ids, repetition_penalty=1.2, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert len(ours.scores) == len(ref.scores) == 12 and ours.scores[0].shape == (1, 98)
    for a, b in zip(ours.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    for a, b in zip(ours.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_stop_strings_with_tokenizer(pair):
    model, tok = pair
    ids = tok("x = ", return_tensors="pt").input_ids
    free = tok.decode(model.target.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :])
    stop = free[5:7]
    kwargs = dict(max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    ours = model.generate(ids, swiftspec=True, **kwargs)
    assert ours.tolist() == model.target.generate(ids, **kwargs).tolist()
    assert tok.decode(ours[0, ids.shape[1] :]).endswith(stop)
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids, swiftspec=True, max_new_tokens=5, stop_strings=["a"])


def test_sampling_is_reproducible_with_manual_seed(pair):
    model, _ = pair
    ids = torch.tensor([[5, 9, 11]])
    torch.manual_seed(3)
    a = model.generate(ids, do_sample=True, max_new_tokens=20)
    torch.manual_seed(3)
    b = model.generate(ids, do_sample=True, max_new_tokens=20)
    assert a.tolist() == b.tolist()


def write_pair_folder(tmp_path, target, draft, **settings):
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    SwiftSpecConfig(target="target", draft="draft", **settings).save_pretrained(tmp_path)
    return tmp_path


def test_pair_folder_loads_with_from_pretrained_and_auto(tmp_path, pair):
    model, tok = pair
    folder = write_pair_folder(tmp_path, model.target, model.draft, tree_budget=6)
    loaded = SwiftSpecForCausalLM.from_pretrained(folder)
    assert loaded.config.tree_budget == 6
    auto = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(auto, SwiftSpecForCausalLM)
    ids = torch.tensor([[7, 8, 9, 10]])
    expected = model.target.generate(ids, max_new_tokens=20, do_sample=False)
    for m in (loaded, auto):
        assert m.generate(ids, max_new_tokens=20, do_sample=False).tolist() == expected.tolist()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "swiftspec"


def test_pair_folder_settings_override_and_missing_member(tmp_path, pair):
    model, _ = pair
    folder = write_pair_folder(tmp_path, model.target, model.draft)
    assert SwiftSpecForCausalLM.from_pretrained(folder, tree_budget=4).config.tree_budget == 4
    SwiftSpecConfig(target="target").save_pretrained(tmp_path / "broken")
    with pytest.raises(ValueError, match="'draft'"):
        SwiftSpecForCausalLM.from_pretrained(tmp_path / "broken")


def test_a_seed_gives_the_same_sample_whatever_tree_is_verified():
    """Noise is drawn per position, so the policy's choices (timing-dependent) never change a sample."""
    target = tiny_model("llama", seed=0)
    ids = torch.tensor([[5, 9, 11, 5, 9]])
    outputs = set()
    for settings in (dict(tree_budget=2, draft_depth=1), dict(tree_budget=12, draft_depth=4), dict(), dict(ngram_size=0)):
        model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), **settings)
        out = model.generate(ids, do_sample=True, temperature=1.5, max_new_tokens=30, generator=torch.Generator().manual_seed(7))
        outputs.add(tuple(out[0].tolist()))
    assert len(outputs) == 1
