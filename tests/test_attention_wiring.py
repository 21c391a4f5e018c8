"""The fused tree attention wired into both models' tree steps (Triton interpreter on CPU)."""

import copy

import pytest
import torch

from hf_swiftspec import SwiftSpecConfig, SwiftSpecForCausalLM
from hf_swiftspec.tools import sweep
from hf_swiftspec.steps.probes import describe
from hf_swiftspec.steps.attention import resolve_attention, routed_attention
from hf_swiftspec.steps.cache import TreeCache
from hf_swiftspec.steps.step import RowQueries, model_step, run_step
from hf_swiftspec.tools.models import tiny_model, truncated_draft
from hf_swiftspec.steps.tree import subtree_mask

needs_triton = pytest.mark.skipif(resolve_attention("kernel", tiny_model()) != "triton", reason="Triton cannot run here")


def tree_logits(model, backend, prefix, tokens, parents, fallbacks=None):
    architecture = describe(model)
    cache = TreeCache(len(architecture.layer_types), 128, architecture.sliding)
    model_step(model, cache, torch.tensor([prefix]), torch.arange(len(prefix))[None], keep=1)
    cache.seal_prefix()
    mask, depths = subtree_mask(parents, "cpu")
    positions = len(prefix) + depths
    (logits,) = run_step(
        model, cache, [RowQueries(torch.tensor(tokens), positions, mask, positions)], backend, architecture, fallbacks
    )
    return logits


def tree_case() -> tuple[list[int], list[int], list[int]]:
    """A 37-token prefix and an 11-node tree over it (tokens, parents)."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 98, (37,), generator=g).tolist()
    tokens = torch.randint(3, 98, (11,), generator=g).tolist()
    return prefix, tokens, [-1, 0, 0, 1, 1, 2, 5, 6, 3, 0, 9]


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch-reference"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_with_tree_kernel_equals_sdpa_with_dense_mask(backend, arch):
    dense_model = tiny_model(arch, seed=1)
    kernel_model = copy.deepcopy(dense_model)
    prefix, tokens, parents = tree_case()
    expected = tree_logits(dense_model, "sdpa", prefix, tokens, parents)
    with routed_attention(kernel_model, backend):
        got = tree_logits(kernel_model, backend, prefix, tokens, parents)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert kernel_model.config._attn_implementation == "sdpa"  # the user's setting is back


KERNEL_CASES = {  # model type: (config overrides, why some layers run their own attention, or None)
    "gemma3_text": (dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]), None),
    "gemma2": (dict(sliding_window=8, attn_logit_softcapping=5.0), None),  # softcap in the kernel; eager outside
    "llama4_text": (dict(attention_chunk_size=8), None),
    "gpt_oss": (dict(sliding_window=8), "attention sinks"),
    "deepseek_v3": ({}, "keys and values of different widths"),
}


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch-reference"])
@pytest.mark.parametrize("model_type", list(KERNEL_CASES))
def test_kernel_serves_windows_and_softcap_and_falls_back_where_it_cannot(backend, model_type):
    overrides, fallback = KERNEL_CASES[model_type]
    dense_model = sweep.tiny_of_type(model_type, seed=1, **overrides)
    kernel_model = copy.deepcopy(dense_model)
    own = dense_model.config._attn_implementation
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 128, (21,), generator=g).tolist()
    tokens = torch.randint(3, 128, (11,), generator=g).tolist()
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0]  # a branch deeper than the window, and a sibling
    expected = tree_logits(dense_model, own, prefix, tokens, parents)
    fallbacks = set()
    with routed_attention(kernel_model, backend):
        got = tree_logits(kernel_model, backend, prefix, tokens, parents, fallbacks)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert fallbacks == ({fallback} if fallback else set())
    assert kernel_model.config._attn_implementation == own


@needs_triton
def test_generate_with_the_kernel_is_lossless():
    target = tiny_model("llama", seed=0)
    model = SwiftSpecForCausalLM.from_models(
        copy.deepcopy(target), truncated_draft(target, 2), attention="kernel", tree_budget=6, draft_depth=2,
        draft_width=4,
    )  # a fixed tree: the draft expands every round, so its tree steps run through the kernel too
    for length in (1, 6, 19):
        prompt = torch.randint(3, 98, (1, length), generator=torch.Generator().manual_seed(length))
        expected = target.generate(prompt, do_sample=False, max_new_tokens=12)
        assert model.generate(prompt, do_sample=False, max_new_tokens=12).tolist() == expected.tolist()
        assert model.swiftspec_stats.attention == (
            "device round (slot caches over the live length: target=triton, draft=triton; eager phases)")
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


class KeyHeads(torch.overrides.TorchFunctionMode):
    """The (query heads, key heads) of every scaled_dot_product_attention call of more than one query."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].shape[2] > 1:
            self.calls.append((args[0].shape[1], args[1].shape[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_grouped_heads_attend_in_place_and_bitwise_as_repeated(arch):
    """sdpa-grouped (a CPU model whose query heads share key / value heads): a tree forward's logits are bitwise those of
    transformers' sdpa, which repeats each shared head per query head first, while its attention reads the 2 shared
    heads themselves; the user's attn_implementation is back afterwards. One model runs both (a copy of its weights at
    other addresses may round its matrix products differently)."""
    model = tiny_model(arch, seed=1)
    prefix, tokens, parents = tree_case()
    with KeyHeads() as dense:
        expected = tree_logits(model, "sdpa", prefix, tokens, parents)
    with routed_attention(model, "sdpa-grouped"), KeyHeads() as grouped:
        got = tree_logits(model, "sdpa-grouped", prefix, tokens, parents)
    assert torch.equal(got, expected)
    layers = model.config.num_hidden_layers
    assert dense.calls[-layers:] == [(4, 4)] * layers  # the tree's: repeat_kv, every query head a copy of its own
    assert grouped.calls[-layers:] == [(4, 2)] * layers and set(grouped.calls) == {(4, 2)}  # heads in place
    assert model.config._attn_implementation == "sdpa"


def test_attention_choice_resolution():
    model = tiny_model("llama")  # 4 query heads sharing 2 key / value heads
    assert resolve_attention("auto", model) == "sdpa-grouped"  # CPU: its own sdpa with a dense mask, heads in place
    assert resolve_attention("auto", tiny_model("llama", num_key_value_heads=4)) == "sdpa"  # no heads shared
    assert resolve_attention("auto", tiny_model("llama", attn="eager")) == "eager"
    assert resolve_attention("model", model) == "sdpa"
    assert resolve_attention("kernel", model) in ("triton", "torch-reference")
    with pytest.raises(ValueError, match="attention='flash'"):
        SwiftSpecConfig(attention="flash")


def test_stats_say_which_layers_ran_their_own_attention():
    target = sweep.tiny_of_type("gpt_oss", sliding_window=8)
    model = SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target), attention="kernel")
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = sweep.own_generate(target, prompt, 6)
    assert sweep.own_generate(model, prompt, 6, swiftspec=True).tolist() == expected.tolist()
    backend = resolve_attention("kernel", target)
    assert model.swiftspec_stats.attention == (
        f"device round (slot caches over the live length: target={backend} (own attention for attention sinks), "
        f"draft={backend} (own attention for attention sinks); eager phases)"
    )


@pytest.mark.parametrize("starts, width", [((0,), 6), ((0,), 8), ((2,), 6)])
def test_a_plain_steps_mask_lets_its_root_see_exactly_its_row(starts, width):
    """A plain step's mask (one row, one query: the root, over a prefix of 5 committed slots) against one
    written out by hand: every committed slot from the row's start, its own slot; nothing before the start
    (left padding) or past its own slot (stale slots of a wider step)."""
    from hf_swiftspec.models.architectures import FULL
    from hf_swiftspec.steps.attention import StepLayout, dense_tree_mask

    prefix = 5
    layout = StepLayout(list(starts), [prefix], [torch.ones(1, 1, dtype=torch.bool)], torch.tensor([[prefix]]),
                        [None], width)
    expected = torch.full((1, 1, 1, width), torch.finfo(torch.float32).min)
    expected[..., starts[0] : prefix + 1] = 0.0
    assert torch.equal(dense_tree_mask(layout, torch.float32, FULL), expected)
