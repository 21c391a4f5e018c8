"""The fused tree attention wired into both models' tree steps (Triton interpreter on CPU)."""

import copy

import pytest
import torch

from hf_swiftspec import SwiftSpecConfig, SwiftSpecForCausalLM
from hf_swiftspec.attention import resolve_attention, routed_attention
from hf_swiftspec.cache import TreeCache
from hf_swiftspec.engine.workers import model_step, tree_step_forward
from hf_swiftspec.testing import tiny_model, truncated_draft
from hf_swiftspec.tree import subtree_mask

needs_triton = pytest.mark.skipif(resolve_attention("kernel", tiny_model()) != "triton", reason="Triton cannot run here")


def tree_logits(model, backend, prefix, tokens, parents):
    cache = TreeCache(model.config.num_hidden_layers, 128)
    model_step(model, cache, torch.tensor([prefix]), torch.arange(len(prefix))[None], keep=1)
    cache.seal_prefix()
    mask, depths = subtree_mask(parents, "cpu")
    return tree_step_forward(model, cache, torch.tensor([tokens]), (len(prefix) + depths)[None], mask, backend)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch-reference"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_with_tree_kernel_equals_sdpa_with_dense_mask(backend, arch):
    dense_model = tiny_model(arch, seed=1)
    kernel_model = copy.deepcopy(dense_model)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 98, (37,), generator=g).tolist()
    tokens = torch.randint(3, 98, (11,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 5, 6, 3, 0, 9]
    expected = tree_logits(dense_model, "sdpa", prefix, tokens, parents)
    with routed_attention(kernel_model, backend):
        got = tree_logits(kernel_model, backend, prefix, tokens, parents)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert kernel_model.config._attn_implementation == "sdpa"  # the user's setting is back


@needs_triton
def test_generate_with_the_kernel_is_lossless():
    target = tiny_model("llama", seed=0)
    model = SwiftSpecForCausalLM.from_models(
        copy.deepcopy(target), truncated_draft(target, 2), attention="kernel", tree_budget=6, draft_width=4
    )
    for length in (1, 6, 19):
        prompt = torch.randint(3, 98, (1, length), generator=torch.Generator().manual_seed(length))
        expected = target.generate(prompt, do_sample=False, max_new_tokens=12)
        assert model.generate(prompt, do_sample=False, max_new_tokens=12).tolist() == expected.tolist()
        assert model.swiftspec_stats.attention == "target=triton, draft=triton"
        assert model.swiftspec_stats.draft_forwards > 3  # the draft's tree steps ran through the kernel too
        assert model.target.config._attn_implementation == model.draft.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("own", ["sdpa", "eager"])
def test_generate_restores_the_users_attention_implementation(own):
    """Routing through the tree kernel lasts for one generate() call, also when it fails."""
    target = tiny_model("llama", seed=0, attn=own)
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), attention="kernel")
    prompt = torch.randint(3, 98, (1, 5), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, do_sample=False, max_new_tokens=4)
    assert target.config._attn_implementation == model.draft.config._attn_implementation == own
    hook = target.register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model.generate(prompt, do_sample=False, max_new_tokens=4)
    finally:
        hook.remove()
    assert target.config._attn_implementation == own


def test_attention_choice_resolution():
    model = tiny_model("llama")
    assert resolve_attention("auto", model) == "sdpa"  # CPU: the model's own attention with a dense mask
    assert resolve_attention("model", model) == "sdpa"
    assert resolve_attention("kernel", model) in ("triton", "torch-reference")
    with pytest.raises(ValueError, match="attention='flash'"):
        SwiftSpecConfig(attention="flash")
