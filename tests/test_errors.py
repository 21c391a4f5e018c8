"""Bad input gets a clear error that names the value and the fix."""

import pytest
import torch

from hf_swiftspec import SwiftSpecConfig, SwiftSpecForCausalLM
from hf_swiftspec.tools import sweep
from hf_swiftspec.tools.models import tiny_model, truncated_draft


@pytest.fixture(scope="module")
def model():
    target = tiny_model("llama", seed=0)
    return SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1))


def test_vocabulary_mismatch_names_both_sizes():
    with pytest.raises(ValueError, match=r"target vocab_size=98, draft vocab_size=50"):
        SwiftSpecForCausalLM.from_models(tiny_model("llama"), tiny_model("llama", vocab_size=50))


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(tree_budget=1), r"tree_budget=1: use None \(the default: .*\) or an int >= 2"),
        (dict(tree_budget=0), r"tree_budget=0: use None \(the default: .*\) or an int >= 2"),
        # A huge value names a usable bound, not a capacity of a million nodes (issue 26 item 7).
        (dict(tree_budget=10**6), r"tree_budget=1000000 is more nodes than .* use tree_budget <= 896 \(8 is the paper's\)"),
        (dict(draft_width=10**6), r"draft_width=1000000: .* use draft_width <= 64"),
        (dict(ngram_size=-1), "ngram_size must be an int >= 0"),
        (dict(draft_width="8"), "draft_width must be a positive int, got '8'"),
        (dict(draft_depth=0), "draft_depth must be None"),
        (dict(draft_depth=True), "draft_depth must be None"),
        (dict(tree_capacity=20), "tree_capacity=20 is too small for draft_width=8: use tree_capacity >= 160"),
    ],
)
def test_invalid_tree_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        SwiftSpecConfig(**settings)


def test_settings_changed_after_loading_are_validated(model):
    model.config.tree_budget = -3
    try:
        with pytest.raises(ValueError, match=r"tree_budget=-3: use None .* or an int >= 2"):
            model.generate(torch.tensor([[4, 5]]), max_new_tokens=3)
    finally:
        model.config.tree_budget = None


def test_batches_refuse_a_streamer_and_an_asynchronous_placement(model):
    """A streamer is batch-1 only in transformers too; the asynchronous engines speculate for one sequence."""
    from transformers.generation.streamers import BaseStreamer

    class Silent(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    batch = torch.ones(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="A streamer works with one sequence at a time .* decodes 3"):
        model.generate(batch, max_new_tokens=3, streamer=Silent())
    threads = SwiftSpecForCausalLM.from_models(model.target, model.draft, placement={"target": ["cpu"], "draft": ["cpu"]})
    with pytest.raises(ValueError, match=r"Batches of prompts \(3 here\) decode on the serial engine only"):
        threads.generate(batch, max_new_tokens=3)
    assert model.generate(batch, max_new_tokens=3, do_sample=False).tolist() == model.target.generate(
        batch, max_new_tokens=3, do_sample=False
    ).tolist()


def test_beam_search_is_refused(model):
    with pytest.raises(ValueError, match="num_beams=2 is not supported with swiftspec=True"):
        model.generate(torch.tensor([[4, 5]]), max_new_tokens=3, num_beams=2)


def test_assistant_model_is_refused(model):
    with pytest.raises(ValueError, match="brings its own draft"):
        model.generate(torch.tensor([[4, 5]]), max_new_tokens=3, assistant_model=model.draft)


def test_refusal_names_the_capability_that_is_missing():
    # Mamba-1 layers, alone or in a hybrid: their multi-token scan starts from a zero state (checked on the model)
    mamba = sweep.tiny_of_type("mamba")
    with pytest.raises(ValueError, match=r"The target \(mamba\) keeps a recurrent state, and a forward of several"):
        SwiftSpecForCausalLM.from_models(mamba, mamba)
    jamba = sweep.tiny_of_type("jamba", attn_layer_period=2, attn_layer_offset=1)
    with pytest.raises(ValueError, match=r"The draft \(jamba\) keeps a recurrent state, and a forward of several tokens "
                       r"does not continue its recurrent state, so a chain of draft tokens cannot be verified in one forward "
                       r"\(state layer 0: .*\)\. Use swiftspec=False"):
        SwiftSpecForCausalLM.from_models(sweep.tiny_of_type("llama"), jamba)
    bert = sweep.tiny_of_type("bert", is_decoder=False)
    with pytest.raises(ValueError, match=r"The draft \(bert\) attends bidirectionally .*is_decoder=True"):
        SwiftSpecForCausalLM.from_models(sweep.tiny_of_type("llama"), bert)


def test_attention_that_cannot_take_a_tree_mask():
    target = tiny_model("llama")
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        SwiftSpecForCausalLM.from_models(target, tiny_model("llama"))


def test_right_padding_is_refused(model):
    ids = torch.tensor([[4, 5, 6, 0]])
    with pytest.raises(ValueError, match="only masks left padding"):
        model.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 0]]), max_new_tokens=3)


def test_wrapper_without_models():
    with pytest.raises(ValueError, match="from_models"):
        SwiftSpecForCausalLM(SwiftSpecConfig())


def test_empty_prompt_is_refused_before_any_worker_runs(model):
    with pytest.raises(ValueError, match=r"at least one prompt token; got an empty input"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)
    # fully masked prompt: nothing left after stripping the padding
    with pytest.raises(ValueError, match="only masks left padding"):
        model.generate(torch.tensor([[0, 0]]), attention_mask=torch.tensor([[0, 0]]), max_new_tokens=3)


@pytest.mark.parametrize(
    "ids, kwargs, error, match",
    [
        (torch.tensor([[4, 5, 6]]), dict(max_new_tokens="5"), TypeError, r"max_new_tokens='5' must be an int .* Pass max_new_tokens=5\."),
        (torch.tensor([[4, 5, 6]]), dict(max_new_tokens=2.5), TypeError, r"max_new_tokens=2.5 must be an int"),
        (torch.tensor([[4, 5, 6]]), dict(min_new_tokens="2", max_new_tokens=4), TypeError, r"min_new_tokens='2' must be an int"),
        (torch.tensor([4, 5, 6]), dict(max_new_tokens=3), ValueError,
         r"input_ids must have shape \(batch, length\); got a 1-D tensor of shape \(3,\)\. Pass input_ids\[None\]"),
        ([[4, 5, 6]], dict(max_new_tokens=3), TypeError, r"input_ids must be a torch.Tensor .*got a list"),
    ],
    ids=["max_new_tokens-str", "max_new_tokens-float", "min_new_tokens-str", "1-D input_ids", "list input_ids"],
)
def test_bad_generate_arguments_are_named_before_transformers_runs(model, monkeypatch, ids, kwargs, error, match):
    """generate(max_new_tokens="5") and a 1-D prompt failed inside transformers (TypeError, IndexError) naming neither."""
    from transformers import GenerationMixin

    def reached(*args, **kwargs):
        raise AssertionError("transformers' generate was reached")

    monkeypatch.setattr(GenerationMixin, "generate", reached)
    with pytest.raises(error, match=match):
        model.generate(ids, **kwargs)


def test_a_misspelt_bundled_pair_name_is_a_suggestion_not_a_hub_request(monkeypatch):
    """A bundled pair's name with a typo ended in a garbled sentence and a connection error; it is now refused before
    any Hub request, with the closest bundled names."""
    from hf_swiftspec.pair import PairConfigError, locate

    def hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(locate, "snapshot_download", hub)
    with pytest.raises(PairConfigError, match=r"'swiftspec-demo-pystdlb' is neither a local folder nor a pair bundled "
                                              r"with hf_swiftspec: did you mean 'swiftspec-demo-pystdlib'"):
        SwiftSpecForCausalLM.from_pretrained("swiftspec-demo-pystdlb")
    with pytest.raises(AssertionError, match="the Hub was asked"):  # a name close to none is still looked up
        SwiftSpecForCausalLM.from_pretrained("someone/their-pair")


def test_misspelt_setting_is_named_with_the_closest_field():
    target = tiny_model("llama")
    with pytest.raises(ValueError, match=r"unknown setting 'tree_budgt'; did you mean 'tree_budget'\?"):
        SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), tree_budgt=4)
    with pytest.raises(ValueError, match=r"unknown setting 'colour'; SwiftSpecConfig's settings are: target, draft"):
        SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), colour="red")


def saved_target(folder):
    """A tiny llama target saved with its tokenizer, loaded back from the folder (name_or_path = folder)."""
    from transformers import AutoModelForCausalLM

    from hf_swiftspec.tools.models import char_tokenizer

    tiny_model("llama", seed=0).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder), char_tokenizer()


def test_a_draft_built_in_memory_is_never_saved_as_another_models_folder(tmp_path):
    """Issue 26 item 4: a draft built from the target's config (its name_or_path is the target's folder) was
    saved as "draft": <the target's folder>, so from_pretrained of the pair loaded the target as its draft."""
    from transformers import AutoModelForCausalLM

    from hf_swiftspec.pair import PairConfigError

    target, tok = saved_target(tmp_path / "target")
    config = type(target.config).from_dict({**target.config.to_dict(), "num_hidden_layers": 1})
    draft = AutoModelForCausalLM.from_config(config)
    draft.load_state_dict(target.state_dict(), strict=False)
    assert draft.name_or_path == target.name_or_path  # what misled the save
    pair = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tok)
    assert pair.config.target == target.name_or_path and pair.config.draft is None
    with pytest.raises(PairConfigError, match="config.draft is not set .* save_members=True"):
        pair.save_pretrained(tmp_path / "pair")
    pair.save_pretrained(tmp_path / "pair", save_members=True)
    assert SwiftSpecForCausalLM.from_pretrained(tmp_path / "pair").draft.config.num_hidden_layers == 1


def test_a_member_whose_folder_now_holds_another_model_is_not_named(tmp_path):
    """A model changed in memory after loading (layers cut) no longer is what its folder holds."""
    target, tok = saved_target(tmp_path / "target")
    from transformers import AutoModelForCausalLM

    draft = truncated_draft(AutoModelForCausalLM.from_pretrained(tmp_path / "target"), 1)
    draft.name_or_path = draft.config._name_or_path = str(tmp_path / "target-copy")
    target.save_pretrained(tmp_path / "target-copy")  # the folder the draft names holds a 2-layer model
    pair = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tok)
    assert pair.config.draft is None and pair.config.target == str(tmp_path / "target")


def test_a_draft_of_another_vocabulary_is_refused_with_the_targets_tokenizer_alone(tmp_path):
    """Issue 26 item 6: a draft of another vocabulary, loaded from its folder (Gemma-3's 262k under SmolLM2's
    49k), was accepted when only tokenizer= was given (exact, but it could never be right); two tokenizers and
    `pair create` refused it. Its own tokenizer is now read from its folder and its mapping checked."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hf_swiftspec.pair import PairConfigError

    target, tok = saved_target(tmp_path / "target")
    draft_folder = tmp_path / "draft"
    tiny_model("llama", seed=1, vocab_size=300).save_pretrained(draft_folder)
    vocab = {f"w{i}": i for i in range(300)}  # another vocabulary: no id means what the target's does
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0"))).save_pretrained(draft_folder)
    draft = AutoModelForCausalLM.from_pretrained(draft_folder)
    # issue 64: another vocabulary is translated through text, so a tokenizer that cannot spell it is what is refused
    with pytest.raises(PairConfigError, match=r"cannot spell the target's text"):
        SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tok)


def test_a_tokenizer_passed_as_a_model_is_named():
    """Issue 26 item 7: from_models(tokenizer) raised AttributeError: ... has no attribute 'config'."""
    from hf_swiftspec.tools.models import char_tokenizer

    with pytest.raises(TypeError, match=r"the target must be a model .*got TokenizersBackend\. Pass it as tokenizer="):
        SwiftSpecForCausalLM.from_models(char_tokenizer())
    with pytest.raises(TypeError, match=r"the draft must be a model .*got str\. Load it first"):
        SwiftSpecForCausalLM.from_models(tiny_model("llama"), "org/draft")


@pytest.mark.parametrize("method", ["generate_batch", "init_continuous_batching", "continuous_batching_context_manager"])
def test_continuous_batching_is_refused_not_run_without_speculation(model, method):
    """transformers' continuous batching would decode the target alone through the pair's forward."""
    with pytest.raises(NotImplementedError, match="model.target.generate_batch"):
        getattr(model, method)([[1, 2, 3]])


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"target": [0, 1], "draft": [1]}, r"placement puts rank\(s\) \[1\] in both the target and the draft group; make them disjoint"),
        ({"target": [0, 1], "draft": [5]}, r"placement names ranks \[5\], but the torchrun world has ranks 0\.\.4"),
        # the query heads divide, the key/value heads do not
        ({"target": [0, 1, 2, 3], "draft": [4]}, r"The target group has 4 ranks, which does not divide the target's 4 attention "
                                                 r"heads and 2 key/value heads; use a group size that divides both"),
        ({"target": [0, 1], "draft": [2, 3, 4]}, r"The draft group has 3 ranks, which does not divide the draft's 4 attention "
                                                 r"heads and 2 key/value heads; use a group size that divides both"),
    ],
    ids=["overlap", "missing-rank", "target-heads", "draft-heads"],
)
def test_torchrun_placements_that_overlap_or_do_not_divide_the_heads(monkeypatch, spec, match):
    """Under torchrun (a world of 5 ranks here) each group shards its model's heads over its ranks; refused before any
    process group is made."""
    monkeypatch.setattr("hf_swiftspec.engine.placement.distributed_world", lambda: 5)
    target = tiny_model("llama", seed=0)  # 4 attention heads, 2 key/value heads; its draft the same
    with pytest.raises(ValueError, match=match):
        SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), placement=spec)
