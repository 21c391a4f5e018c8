"""Windowed attention beyond the window: trees and requests longer than a sliding window or chunk.

A node at position p sees the committed positions within its layer's window of p and those of
its tree ancestors that are inside it too; models mixing full and sliding layers get one mask per
layer type. References: the model's own generate, and plain causal forwards per branch.
"""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.steps.probes import describe
from hf_swiftspec.steps.cache import TreeCache
from hf_swiftspec.tools.sweep import perturbed_copy, tiny_of_type
from hf_swiftspec.steps.step import RowQueries, model_step, run_step
from hf_swiftspec.steps.tree import subtree_mask

WINDOW = 16
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def windowed_model(kind: str, window: int = WINDOW, seed: int = 0):
    if kind == "gemma3":  # Gemma 3: sliding and full layers, one mask per layer type
        return tiny_of_type("gemma3_text", layers=4, seed=seed, sliding_window=window, layer_types=GEMMA3_LAYERS)
    if kind == "mistral":  # Mistral: every layer sliding, one mask
        return tiny_of_type("mistral", layers=2, seed=seed, sliding_window=window)
    # chunked (its NoPE temperature, stepped by cache slot, kept off this test's tokens: SLOT_RULES covers it)
    return tiny_of_type("llama4_text", layers=2, seed=seed, attention_chunk_size=window, floor_scale=8192)


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_200_tokens_past_a_16_token_window_equal_own_generate(kind):
    target = windowed_model(kind)
    # fixed trees: the policy would size them by this machine's step times, and tau below would follow them
    model = SwiftSpecForCausalLM.from_models(target, perturbed_copy(target), tree_budget=8, draft_depth=4, draft_width=4)
    for length in (3, 40):
        prompt = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))
        expected = target.generate(prompt, do_sample=False, max_new_tokens=200, min_new_tokens=200, eos_token_id=None)
        actual = model.generate(
            prompt, do_sample=False, max_new_tokens=200, min_new_tokens=200, eos_token_id=None, swiftspec=True
        )
        assert actual.tolist() == expected.tolist()
        assert model.swiftspec_stats.tau > 1.5


def branch_logits(model, ids):
    return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("kind", ["gemma3", "mistral", "chunked"])
def test_tree_deeper_than_the_window_equals_per_branch_causal_forwards(kind):
    model = windowed_model(kind, window=6)
    architecture = describe(model)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 128, (9,), generator=g).tolist()
    tokens = torch.randint(3, 128, (14,), generator=g).tolist()
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 1, 12]  # a chain of 9 (past the window) and two branches
    cache = TreeCache(len(architecture.layer_types), 64, architecture.sliding)
    model_step(model, cache, torch.tensor([prefix]), torch.arange(len(prefix))[None], keep=1)
    cache.seal_prefix()
    mask, depths = subtree_mask(parents, "cpu")
    positions = len(prefix) + depths
    (logits,) = run_step(model, cache, [RowQueries(torch.tensor(tokens), positions, mask, positions)], "sdpa", architecture)
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        torch.testing.assert_close(logits[i], branch_logits(model, prefix + path[::-1]), atol=2e-5, rtol=0)


def test_window_per_layer_type_reaches_the_model_as_a_dict():
    architecture = describe(windowed_model("gemma3"))
    assert architecture.masks["sliding_attention"].size == WINDOW
    assert architecture.masks["full_attention"].kind == "full"
    assert architecture.mask_by_type
