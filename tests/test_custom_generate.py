"""A plain model speculates through transformers' custom_generate, in both forms: the callable
(hf_swiftspec.custom_generate) and the Hub-repo folder (model_cards/swiftspec-custom-generate), each checked
token for token against the model's own generate (the contract's greedy rows run through the callable in
test_generate_contract.py)."""

import pytest
import torch
from transformers import StoppingCriteriaList

from hf_swiftspec import custom_generate, load_eagle3_head
from hf_swiftspec.drafters.eagle3 import save_eagle3_head
from hf_swiftspec.pair import bundled_pairs_dir
from hf_swiftspec.tools.models import char_tokenizer, left_padded, tiny_model, truncated_draft

REPO = str(bundled_pairs_dir() / "swiftspec-custom-generate")
PROMPT = torch.tensor([[5, 17, 33, 8, 5, 17, 40, 9, 5, 17]])


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.mark.floor  # transformers' custom_generate hand-off: also on the floor release
@pytest.mark.parametrize("draft", ["model", "none", "head"])
def test_the_callable_speculates_losslessly_with_any_drafter(target, draft, tmp_path):
    if draft == "head":
        from test_eagle3 import random_head
        save_eagle3_head(random_head(target, draft_vocab=48), tmp_path / "head")
        drafter = load_eagle3_head(tmp_path / "head")
    else:
        drafter = truncated_draft(target, 2) if draft == "model" else None
    stats = []
    expected = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    out = target.generate(PROMPT, max_new_tokens=20, do_sample=False, custom_generate=custom_generate,
                          swiftspec_draft=drafter, swiftspec_settings={"tree_budget": 6, "draft_depth": 2},
                          swiftspec_on_stats=stats.append)
    assert torch.equal(out, expected)
    assert stats[0].new_tokens == 20 and stats[0].draft_model == (drafter is not None)
    assert (stats[0].draft_forwards > 0) == (drafter is not None)


def test_the_callable_decodes_a_left_padded_batch(target):
    ids, mask = left_padded([[5, 17, 33, 8, 5, 17], [40, 9, 12], [7, 7, 7, 7, 30]])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          custom_generate=custom_generate, swiftspec_draft=truncated_draft(target, 2))
    assert torch.equal(out, expected)


def test_the_callable_refuses_bad_settings_by_name(target):
    with pytest.raises(ValueError, match="tree_budgt.*did you mean 'tree_budget'"):
        target.generate(PROMPT, max_new_tokens=4, custom_generate=custom_generate, swiftspec_settings={"tree_budgt": 4})
    with pytest.raises(ValueError, match="serial engine"):
        target.generate(PROMPT, max_new_tokens=4, custom_generate=custom_generate,
                        swiftspec_settings={"placement": {"target": ["cpu"], "draft": ["cpu"]}})


def test_a_vocabulary_mismatch_names_the_callables_own_tokenizer_arguments(target):
    """A draft of another vocabulary size and no tokenizers: the error says to pass swiftspec_tokenizer= and
    swiftspec_draft_tokenizer= (what this entry point takes), not from_models' tokenizer= / draft_tokenizer=."""
    other = tiny_model("llama", vocab_size=120, layers=1, seed=3)
    with pytest.raises(ValueError, match="Vocabulary mismatch") as refused:
        target.generate(PROMPT, max_new_tokens=4, custom_generate=custom_generate, swiftspec_draft=other)
    message = str(refused.value)
    assert "as swiftspec_tokenizer=" in message and "as swiftspec_draft_tokenizer=" in message
    assert " tokenizer=" not in message.replace("swiftspec_tokenizer=", "").replace("swiftspec_draft_tokenizer=", "")


def test_the_repo_form_runs_from_a_local_path_with_its_streamer_and_stop_strings(target):
    """custom_generate=<the folder>, trust_remote_code=True: generate.py hands generate()'s arguments to the
    loop, the streamer and stop_strings (with tokenizer=) included, which a custom loop does not receive."""
    draft = truncated_draft(target, 2)
    expected = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    out = target.generate(PROMPT, max_new_tokens=16, do_sample=False, custom_generate=REPO, trust_remote_code=True,
                          swiftspec_draft=draft)
    assert torch.equal(out, expected)

    class Collect:
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            self.ended = True

    streamer = Collect()
    target.generate(PROMPT, max_new_tokens=16, do_sample=False, custom_generate=REPO, trust_remote_code=True,
                    swiftspec_draft=draft, streamer=streamer)
    assert streamer.ended and streamer.tokens[-16:] == expected[0, -16:].tolist()

    tokenizer = char_tokenizer()
    text = tokenizer.decode(expected[0, PROMPT.shape[1]:])
    stop = text[5:7]
    plain = target.generate(PROMPT, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert plain.shape[1] < expected.shape[1]  # the stop string ends it early
    out = target.generate(PROMPT, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer,
                          custom_generate=REPO, trust_remote_code=True, swiftspec_draft=draft)
    assert torch.equal(out, plain)


def test_the_repo_form_needs_trust_remote_code(target):
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(PROMPT, max_new_tokens=4, custom_generate=REPO)


def test_a_stopping_criteria_list_passes_through(target):
    class AfterFive:
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT.shape[1] + 5, dtype=torch.bool)

    criteria = StoppingCriteriaList([AfterFive()])
    expected = target.generate(PROMPT, max_new_tokens=16, do_sample=False, stopping_criteria=criteria)
    out = target.generate(PROMPT, max_new_tokens=16, do_sample=False, stopping_criteria=criteria,
                          custom_generate=custom_generate, swiftspec_draft=truncated_draft(target, 2))
    assert torch.equal(out, expected) and out.shape[1] == PROMPT.shape[1] + 5
