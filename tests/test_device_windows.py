"""Windowed layers on the device round (round="device"): a sliding window or a chunk is a term of the slot caches'
masks (steps/slot_cache.py, swiftspec_kernels.tree_mask), in the prefill and catch-ups, the draft's growth and the
target's verification. Mixed sliding and full layers (gemma3_text: one mask per layer type), every layer sliding
(mistral: one mask) and chunked attention (llama4_text), with prompts shorter and longer than a 16-token window and
150 new tokens past it: with a draft model and draft-free, a left-padded batch, replayed phases, an EAGLE-3 head, the
running batch. References: target.generate token for token, and plain causal forwards of each branch (the
verification's logits, the draft's grown tree), whose windows transformers applies itself."""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.drafters.device_growth import grow
from hf_swiftspec.engine.continuous_device import DeviceContinuousEngine
from hf_swiftspec.models.architectures import describe_model
from hf_swiftspec.steps.device_round import DeviceSubtree
from hf_swiftspec.steps.slot_cache import SlotCache, catch_up, verify_forward
from hf_swiftspec.steps.tree import subtree_mask
from hf_swiftspec.tools.models import left_padded, random_prompts
from hf_swiftspec.tools.sweep import perturbed_copy, tiny_of_type
from test_device_growth import check_growth

WINDOW = 16
KINDS = ["gemma3", "mistral", "chunked"]
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
FIXED = dict(tree_budget=8, draft_depth=4, draft_width=4)  # one shape: what a round runs follows no clock
NEW = 150


def varied_model(kind: str, window: int = WINDOW, seed: int = 0, **overrides):
    """A tiny windowed model whose greedy text keeps changing (test_sliding_window's kinds, with larger weights and
    gemma's head untied: with its defaults it repeats one token within a few steps, where a wrong mask changes no
    token). The chunked model's NoPE temperature is off: a rule by cache slot (Architecture.slot_limits), which the
    device round refuses."""
    varied = dict(seed=seed, initializer_range=0.3, **overrides)
    if kind == "gemma3":  # sliding and full layers, one mask per layer type
        return tiny_of_type("gemma3_text", layers=4, sliding_window=window, layer_types=GEMMA3_LAYERS,
                            tie_word_embeddings=False, **varied)
    if kind == "mistral":  # every layer sliding, one mask
        return tiny_of_type("mistral", layers=2, sliding_window=window, **varied)
    return tiny_of_type("llama4_text", layers=2, attention_chunk_size=window, attn_temperature_tuning=False, **varied)


@pytest.fixture(scope="module")
def models():
    """Per kind: the target and a draft that agrees with it often (a perturbed copy: windowed too)."""
    out = {}
    for kind in KINDS:
        target = varied_model(kind)
        out[kind] = target, perturbed_copy(target)
    return out


def greedy(model, ids, mask=None, **kwargs):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                          eos_token_id=None, pad_token_id=0, **kwargs)


def prompts(*lengths):
    return [torch.tensor([p]) for p in random_prompts(lengths, seed=sum(lengths), vocab_size=128)]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_past_the_window_equals_target_generate(models, kind):
    """A prompt shorter and one longer than the window, 150 tokens past it, with the draft model growing every round
    (proposals accepted: a tree verified across the window's edge) and draft-free (suffix proposals alone)."""
    target, draft = models[kind]
    assert describe_model(target).windowed
    with_draft = SwiftSpecForCausalLM.from_models(target, draft, round="device", **FIXED)
    draft_free = SwiftSpecForCausalLM.from_models(target, None, round="device", ngram_size=3, tree_budget=8)
    for ids in prompts(3, 40):
        expected = greedy(target, ids).tolist()
        assert len(set(expected[0][-NEW:])) > 10  # text that changes: a wrong mask shows
        assert greedy(with_draft, ids).tolist() == expected
        stats = with_draft.swiftspec_stats
        assert stats.engine == "device" and stats.tau > 1.5
        assert greedy(draft_free, ids).tolist() == expected
        assert draft_free.swiftspec_stats.engine == "device"


@pytest.mark.parametrize("model_type", ["cohere2", "gpt_oss", "qwen2", "phi3"])
def test_other_windowed_architectures_equal_target_generate(model_type):
    """More of transformers' windowed decoders as the architecture sweep builds them (16-token windows; sliding and
    full layers in cohere2, gpt_oss (with attention sinks) and qwen2, every layer sliding in phi3), a prompt past the
    window, with a draft model."""
    target = tiny_of_type(model_type, seed=0, initializer_range=0.3)
    assert describe_model(target).windowed
    pair = SwiftSpecForCausalLM.from_models(target, perturbed_copy(target), round="device", **FIXED)
    (ids,) = prompts(30)
    kwargs = dict(do_sample=False, max_new_tokens=60, min_new_tokens=60, eos_token_id=None, pad_token_id=0)
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    assert pair.swiftspec_stats.engine == "device"


@pytest.mark.parametrize("kind", KINDS)
def test_a_left_padded_batch_equals_target_generate(models, kind):
    """Four prompts of different lengths (one shorter than the window, three past it), left-padded, in one call."""
    target, draft = models[kind]
    ids, mask = left_padded(random_prompts((5, 23, 40, 12), seed=1, vocab_size=128))
    pair = SwiftSpecForCausalLM.from_models(target, draft, round="device", **FIXED)
    assert greedy(pair, ids, mask).tolist() == greedy(target, ids, mask).tolist()
    assert pair.swiftspec_stats.engine == "device"


@pytest.mark.parametrize("kind", KINDS)
def test_replayed_phases_equal_target_generate(models, kind):
    """capture=True (a CPU stand-in for CUDA graphs, whose replay reuses what the first round baked in: a window
    term computed from a value outside the graph's inputs would give wrong tokens), a lone prompt and a batch."""
    target, draft = models[kind]
    pair = SwiftSpecForCausalLM.from_models(target, draft, round="device", capture=True, **FIXED)
    (ids,) = prompts(30)
    assert greedy(pair, ids).tolist() == greedy(target, ids).tolist()
    assert "replayed phases" in pair.swiftspec_stats.attention
    ids, mask = left_padded(random_prompts((7, 33, 18), seed=2, vocab_size=128))
    assert greedy(pair, ids, mask).tolist() == greedy(target, ids, mask).tolist()


def test_an_eagle3_head_on_a_windowed_target_equals_target_generate():
    """A draft head's own layer attends fully (an EAGLE-3 head, here a random one), whatever the target's windows: the
    target's verification and prefill carry them; the head drafts from the target's states every round."""
    from test_eagle3 import VOCAB, random_head

    target = varied_model("gemma3", vocab_size=VOCAB)
    pair = SwiftSpecForCausalLM.from_models(target, random_head(target), round="device", ngram_size=0, **FIXED)
    kwargs = dict(do_sample=False, max_new_tokens=50, min_new_tokens=50, eos_token_id=None, pad_token_id=0)
    for ids in (torch.tensor([p]) for p in random_prompts((4, 35), seed=3, vocab_size=VOCAB)):
        assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
        assert pair.swiftspec_stats.engine == "device" and "a draft head" in pair.swiftspec_stats.attention


@pytest.mark.parametrize("kind", ["gemma3", "chunked"])
def test_requests_joining_the_running_batch_equal_target_generate(models, kind, monkeypatch):
    """The server's running batch on the device round (engine/continuous_device.py): requests prefilled alone in
    pieces of 8 tokens (a catch-up behind committed slots, across the window's edge) join and leave a batch of
    windowed rows; each answer is target.generate's."""
    from hf_swiftspec.engine import continuous
    from test_continuous import relay_calls

    monkeypatch.setattr(continuous, "PREFILL_PIECE", 8)
    target, draft = models[kind]
    pair = SwiftSpecForCausalLM.from_models(target, draft, round="device", ngram_size=0, **FIXED)
    calls = [dict(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
             for ids, n in zip(prompts(5, 37, 21), (60, 30, 50))]
    engine = pair.continuous_engine()
    assert isinstance(engine, DeviceContinuousEngine)
    try:
        out = relay_calls(pair, engine, calls, at=(3, 2, 1), wait_s=300)
    finally:
        engine.close()
    for i, call in enumerate(calls):
        assert out[i].tolist() == target.generate(**call).tolist(), f"request {i}"


def prefilled(model, prompts_: list[list[int]], capacity: int = 64) -> SlotCache:
    """A SlotCache with the model's window rules holding each row's prompt (packed: slot j is position j)."""
    width = max(len(p) for p in prompts_)
    cache = SlotCache(model.config.num_hidden_layers, capacity, describe_model(model))
    with torch.no_grad():
        catch_up(model, cache, torch.tensor([p + [0] * (width - len(p)) for p in prompts_]),
                 torch.tensor([len(p) for p in prompts_]))
    return cache


def subtree_of(trees: list[tuple[list[int], list[int]]], T: int) -> DeviceSubtree:
    """B host trees (tokens, parents) as the verifier's DeviceSubtree, each padded to T nodes (padding sees itself)."""
    fields = {name: [] for name in ("tokens", "parents", "valid", "depths", "mask")}
    for tokens, parents in trees:
        n = len(tokens)
        mask, depths = subtree_mask(parents, "cpu")
        full = torch.eye(T, dtype=torch.bool)
        full[:n, :n] = mask
        fields["tokens"].append(torch.tensor(tokens + [0] * (T - n)))
        fields["parents"].append(torch.tensor(parents + [-1] * (T - n)))
        fields["valid"].append(torch.arange(T) < n)
        fields["depths"].append(torch.cat([depths, torch.zeros(T - n, dtype=torch.long)]))
        fields["mask"].append(full)
    t = {name: torch.stack(values) for name, values in fields.items()}
    B = len(trees)
    return DeviceSubtree(torch.arange(T).repeat(B, 1), t["tokens"], t["parents"], torch.zeros(B, T), t["valid"],
                         t["depths"], t["mask"])


def branch_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("kind", KINDS)
def test_a_verification_deeper_than_the_window_equals_per_branch_causal_forwards(kind):
    """verify_forward's logits of every node of two rows' trees (a chain of 9 past a 6-token window, and branches;
    prefixes longer and shorter than the window; the second row padded) equal one plain causal forward of the
    node's whole branch."""
    model = varied_model(kind, window=6)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 4)]
    trees = [(torch.randint(3, 128, (14,), generator=g).tolist(), [-1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 1, 12]),
             (torch.randint(3, 128, (10,), generator=g).tolist(), [-1, 0, 1, 2, 3, 4, 5, 6, 0, 8])]
    cache = prefilled(model, prefixes)
    cache.span = 40  # every row's prefix and tree, and the scratch slot
    with torch.no_grad():
        logits = verify_forward(model, cache, torch.tensor([len(p) for p in prefixes]), subtree_of(trees, 14))
    for b, (prefix, (tokens, parents)) in enumerate(zip(prefixes, trees)):
        for i in range(len(tokens)):
            path, node = [], i
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            want = branch_logits(model, prefix + path[::-1])
            torch.testing.assert_close(logits[b, i], want, atol=1e-4, rtol=0, msg=lambda m: f"row {b} node {i}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_a_growth_deeper_than_the_window_equals_fresh_causal_forwards(kind):
    """The draft's growth (each level's frontier mask with the window term), 8 levels below roots behind prefixes
    longer and shorter than a 6-token window, equals the tree grown from fresh causal forwards along every branch
    (test_device_growth's reference)."""
    draft = varied_model(kind, window=6)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (11, 3)]
    roots = [17, 90]
    depth, width = 8, 2
    cache = prefilled(draft, prefixes)
    with torch.no_grad():
        growth = grow(draft, cache, torch.tensor([len(p) for p in prefixes]), torch.tensor(roots), depth, width)
    check_growth(draft, growth, prefixes, roots, depth, width, 128)
