"""Greedy speculation must reproduce target.generate token for token."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import tiny_model, truncated_draft

ARCHS = ["llama", "qwen2", "mistral", "qwen3", "gemma"]


def prompts(n, vocab=98, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 5, 7, 13, 31, 64][:n]
    return [torch.randint(3, vocab, (1, L), generator=g) for L in lengths]


def assert_same_as_target(model, prompt, **kwargs):
    expected = model.target.generate(prompt, do_sample=False, **kwargs)
    actual = model.generate(prompt, do_sample=False, swiftspec=True, **kwargs)
    assert actual.tolist() == expected.tolist(), f"first difference in {prompt.shape[1]}-token prompt"
    return model.swiftspec_stats


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_kind", ["agreeing", "random"])
def test_greedy_equals_target(arch, draft_kind):
    target = tiny_model(arch, seed=0)
    draft = truncated_draft(target, 2) if draft_kind == "agreeing" else tiny_model(arch, seed=7, layers=1)
    model = SwiftSpecForCausalLM.from_models(target, draft)
    for p in prompts(6, seed=len(arch)):
        assert_same_as_target(model, p, max_new_tokens=40)
    if draft_kind == "agreeing":  # the draft really is accepted, not just rejected: on fixed trees, whatever the
        fixed = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=8, draft_depth=4)  # policy would pick here
        taus = [assert_same_as_target(fixed, p, max_new_tokens=40).tau for p in prompts(3, seed=len(arch))]
        assert sum(taus) / len(taus) > 1.5, taus


@pytest.mark.parametrize(
    "settings",
    [
        dict(tree_budget=2, draft_width=1, draft_depth=1),
        dict(tree_budget=8, draft_width=8, draft_depth=None),
        dict(tree_budget=16, draft_width=4, draft_depth=3),
        dict(tree_budget=5, draft_width=2, draft_depth=6, tree_capacity=64),
    ],
)
def test_tree_settings_stay_lossless(llama_pair, settings):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, **settings)
    for p in prompts(5, seed=3):
        assert_same_as_target(model, p, max_new_tokens=48)


def test_eager_attention_target(llama_pair):
    target = tiny_model("llama", seed=0, attn="eager")
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1))
    for p in prompts(4, seed=5):
        assert_same_as_target(model, p, max_new_tokens=30)


def test_repetition_penalty_and_no_repeat_ngram(llama_pair):
    target, draft, random_draft = llama_pair
    for d in (draft, random_draft):
        model = SwiftSpecForCausalLM.from_models(target, d)
        for p in prompts(4, seed=11):
            assert_same_as_target(model, p, max_new_tokens=40, repetition_penalty=1.3)
            assert_same_as_target(model, p, max_new_tokens=40, no_repeat_ngram_size=2)


def test_multiple_eos_ids_stop_inside_a_verified_path(llama_pair):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft)
    stopped = 0
    for p in prompts(6, seed=13):
        free = target.generate(p, do_sample=False, max_new_tokens=30)[0, p.shape[1] :].tolist()
        eos = [free[min(9, len(free) - 1)], free[min(4, len(free) - 1)]]  # tokens the target emits
        assert_same_as_target(model, p, max_new_tokens=30, eos_token_id=eos)
        out = model.generate(p, do_sample=False, max_new_tokens=30, eos_token_id=eos)
        stopped += out.shape[1] < p.shape[1] + 30
    assert stopped == 6


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criterion(llama_pair):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft)
    for p in prompts(5, seed=17):
        free = target.generate(p, do_sample=False, max_new_tokens=25)[0, p.shape[1] :].tolist()
        criteria = StoppingCriteriaList([StopAfterToken(free[min(7, len(free) - 1)])])
        out = model.generate(p, do_sample=False, max_new_tokens=25, stopping_criteria=criteria)
        expected = target.generate(p, do_sample=False, max_new_tokens=25, stopping_criteria=criteria)
        assert out.tolist() == expected.tolist()
        assert out.shape[1] <= p.shape[1] + 8


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 17])
def test_max_new_tokens_is_exact(llama_pair, max_new_tokens):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft)
    for p in prompts(5, seed=19):
        assert_same_as_target(model, p, max_new_tokens=max_new_tokens)
        assert model.swiftspec_stats.new_tokens == max_new_tokens


def test_max_length_and_generation_config(llama_pair):
    from transformers import GenerationConfig

    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft)
    p = prompts(4, seed=23)[3]
    assert_same_as_target(model, p, max_length=p.shape[1] + 12)
    config = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected = target.generate(p, generation_config=config)
    assert model.generate(p, generation_config=config, swiftspec=True).tolist() == expected.tolist()


def test_left_padded_attention_mask_matches_unpadded(llama_pair):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft)
    p = prompts(5, seed=29)[4]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), p], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(p)], dim=1)
    out = model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=20, swiftspec=True)
    expected = target.generate(p, do_sample=False, max_new_tokens=20)
    assert out[:, :3].tolist() == [[0, 0, 0]]
    assert out[:, 3:].tolist() == expected.tolist()


def test_swiftspec_false_is_target_generate(llama_pair):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft)
    p = prompts(4, seed=31)[3]
    torch.manual_seed(5)
    expected = target.generate(p, do_sample=True, max_new_tokens=15)
    torch.manual_seed(5)
    assert model.generate(p, do_sample=True, max_new_tokens=15, swiftspec=False).tolist() == expected.tolist()
