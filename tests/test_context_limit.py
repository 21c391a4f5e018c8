"""Generations that reach the end of a model's context: no tree node is ever placed past it.

gpt2-style learned position embeddings have `n_positions` rows and nothing beyond; target.generate
with prompt + max_new_tokens == n_positions never feeds its last token, so it succeeds. Tree nodes
deeper than the positions left used to be proposed and raised IndexError in the embedding.
"""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import sharpen

N_POSITIONS = 64


@pytest.fixture(scope="module")
def gpt2_pair():
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gpt2", vocab_size=98, n_embd=64, n_layer=3, n_head=4, n_positions=N_POSITIONS, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    target = AutoModelForCausalLM.from_config(config).eval()
    sharpen(target)
    target.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=None, pad_token_id=0)
    draft = copy.deepcopy(target)  # its first layer: agrees with the target often, so trees grow deep
    draft.transformer.h = draft.transformer.h[:1]
    draft.config.n_layer = 1
    return target, draft


SETTINGS = [dict(), dict(tree_budget=16), dict(tree_budget=8, draft_depth=4),
            dict(placement={"target": ["cpu"], "draft": ["cpu"]}), dict(round="device"),
            dict(round="device", tree_budget=8, draft_depth=4)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["default", "budget16", "fixed", "threads", "device", "device-fixed"])
@pytest.mark.parametrize("prompt_len", [4, 40])
@pytest.mark.parametrize("below_limit", [0, 1, 8])
def test_greedy_up_to_the_last_position_equals_target(gpt2_pair, settings, prompt_len, below_limit):
    target, draft = gpt2_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, **settings)
    ids = torch.randint(3, 98, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    kwargs = dict(max_new_tokens=N_POSITIONS - prompt_len - below_limit, do_sample=False)
    assert model.generate(ids, swiftspec=True, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()


def test_sampling_up_to_the_last_position(gpt2_pair):
    target, draft = gpt2_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=16)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=N_POSITIONS - 3, do_sample=True, swiftspec=True,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, N_POSITIONS)
