"""Every attention choice inside the device round's phases (round="device"): attention="kernel" routes the slot caches'
forwards (prefill and catch-ups, the draft's growth, the verification) through the tree kernel, fed each row's prefix
length and tree bits on the device over the live length (steps/attention.slot_step_kwargs); compile=True runs the
phases' decoder layers through torch.compile, eager or replayed. Under TRITON_INTERPRET=1 (tests/conftest.py) the
kernel is the Triton kernel itself in the interpreter (slow: small shapes); the torch reference is what a CPU without
Triton runs. References: target.generate token for token (greedy, float32, fixed shapes: no clock decides), the
dense-mask verification and plain per-branch causal forwards."""

import copy

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.drafters.device_growth import grow
from hf_swiftspec.models.architectures import describe_model
from hf_swiftspec.steps import attention
from hf_swiftspec.steps.attention import resolve_attention, routed_attention
from hf_swiftspec.steps.slot_cache import SlotCache, catch_up, verify_forward
from hf_swiftspec.tools.models import left_padded, random_prompts, tiny_model, truncated_draft
from hf_swiftspec.tools.sweep import perturbed_copy, tiny_of_type
from test_device_growth import check_growth
from test_device_sides import reads_per_round
from test_device_windows import branch_logits, subtree_of, varied_model

FIXED = dict(draft_depth=3, draft_width=2, tree_budget=6)  # one shape: what a round accepts follows no clock
TRITON = resolve_attention("kernel", tiny_model()) == "triton"
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton cannot run here")
BACKENDS = [pytest.param("triton", marks=needs_triton), "torch-reference"]


@pytest.fixture
def backend_of(monkeypatch):
    """Make attention="kernel" resolve to `backend`: the Triton kernel where Triton runs, else (as on a CPU without
    Triton) its torch reference."""

    def use(backend: str) -> str:
        if backend == "torch-reference":
            monkeypatch.setattr(attention, "triton_available", lambda device=None: False)
        assert resolve_attention("kernel", tiny_model()) == backend
        return backend

    return use


@pytest.fixture
def reference_calls(monkeypatch) -> list:
    """The queries' shapes of every attention call the kernel's torch reference served (steps/attention.py's)."""
    calls, reference = [], attention.tree_attention_reference

    def counted(query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return reference(query, *args, **kwargs)

    monkeypatch.setattr(attention, "tree_attention_reference", counted)
    return calls


def gqa_model(arch: str, seed: int = 0):
    """A tiny target: llama (4 query heads on 2 KV heads), qwen3 with 4 query heads on 1 (the kernel reads each KV
    block once for its group)."""
    model = tiny_model(arch, seed=seed, **({"num_key_value_heads": 1} if arch == "qwen3" else {}))
    model.generation_config.eos_token_id = None
    return model


def greedy(model, ids, mask=None, new: int = 10, **kwargs):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                          eos_token_id=None, pad_token_id=0, **kwargs)


PROMPTS = [[5, 17, 33, 8, 61, 9, 40], *random_prompts((17, 9, 1), 0, 98)]


def inputs(rows: int, prompts=PROMPTS):
    if rows == 1:
        return torch.tensor(prompts[:1]), None
    return left_padded(prompts[1 : 1 + rows])


def repeating(target, rows: int, new: int = 10):
    """inputs(rows) whose prompts end where the target's text repeats: each prompt p as p, the target's greedy text
    after p, p again (what draft-free mode's suffix proposals find)."""
    prompts = [p + greedy(target, torch.tensor([p]), new=new)[0, len(p):].tolist() + p for p in PROMPTS]
    return inputs(rows, prompts)


def prefilled(model, prompts: list[list[int]], backend: str, capacity: int = 64) -> SlotCache:
    """A SlotCache attending as `backend` says, holding each row's prompt (catch_up: through the kernel too)."""
    width = max(len(p) for p in prompts)
    cache = SlotCache(model.config.num_hidden_layers, capacity, describe_model(model), attention=backend)
    cache.span = width + 1
    with torch.no_grad():
        catch_up(model, cache, torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
                 torch.tensor([len(p) for p in prompts]))
    return cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "chunked"])
def test_kernel_routed_verification_equals_the_dense_one_and_per_branch_forwards(backend, kind, backend_of):
    """verify_forward's logits over kernel-routed slot caches (their prompts prefilled through the kernel too) equal
    the dense-mask verification's to float32 tolerance, and each node's one plain causal forward of its whole branch:
    two rows of other prefix lengths (one padded with nodes that see themselves), a GQA model and windowed ones (a
    chain past a 6-token window: the window's term in the bits and each query's first prefix slot)."""
    backend_of(backend)
    model = gqa_model("qwen3", seed=1) if kind == "qwen3" else varied_model(kind, window=6)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 4)]
    trees = [(torch.randint(3, V, (14,), generator=g).tolist(), [-1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 1, 12]),
             (torch.randint(3, V, (10,), generator=g).tolist(), [-1, 0, 1, 2, 3, 4, 5, 6, 0, 8])]
    prefix_lens = torch.tensor([len(p) for p in prefixes])
    dense = prefilled(model, prefixes, "sdpa")
    dense.span = 40
    with torch.no_grad():
        expected = verify_forward(model, dense, prefix_lens, subtree_of(trees, 14))
    routed = copy.deepcopy(model)
    with routed_attention(routed, backend):
        kernel = prefilled(routed, prefixes, backend)
        kernel.span = 40
        with torch.no_grad():
            got = verify_forward(routed, kernel, prefix_lens, subtree_of(trees, 14))
    assert routed.config._attn_implementation == "sdpa" and kernel.fallbacks == set()
    for b, (prefix, (tokens, parents)) in enumerate(zip(prefixes, trees)):
        n = len(tokens)
        torch.testing.assert_close(got[b, :n], expected[b, :n], atol=5e-5, rtol=1e-5)
        for i in range(n):
            path, node = [], i
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            want = branch_logits(model, prefix + path[::-1])
            torch.testing.assert_close(got[b, i], want, atol=1e-4, rtol=0, msg=lambda m: f"row {b} node {i}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_routed_growth_equals_fresh_causal_forwards(backend, backend_of):
    """The draft's growth through the kernel (each level's frontier: its prefix and its ancestors' bits), 4 levels
    below roots behind prefixes past a 6-token window, equals the tree grown from fresh causal forwards."""
    backend_of(backend)
    draft = varied_model("mistral", window=6)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (11, 3)]
    roots, depth, width = [17, 90], 4, 2
    with routed_attention(draft, backend), torch.no_grad():
        cache = prefilled(draft, prefixes, backend)
        cache.span = 32
        growth = grow(draft, cache, torch.tensor([len(p) for p in prefixes]), torch.tensor(roots), depth, width)
    check_growth(draft, growth, prefixes, roots, depth, width, 128)


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("drafted", [True, False])
def test_greedy_with_the_kernel_equals_target_generate(arch, rows, drafted):
    """attention="kernel" on the device round, the Triton kernel (in the interpreter): token for token
    target.generate's, a lone prompt and a left-padded batch, with a draft model growing every round and draft-free
    (suffix proposals alone); the user's attn_implementation is back after the call."""
    target = gqa_model(arch)
    draft = truncated_draft(target, 2) if drafted else None
    pair = SwiftSpecForCausalLM.from_models(target, draft, round="device", attention="kernel",
                                            ngram_size=0 if drafted else 3, **FIXED)
    ids, mask = inputs(rows) if drafted else repeating(target, rows)
    assert greedy(pair, ids, mask).tolist() == greedy(target, ids, mask).tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device"
    assert ("target=triton, draft=triton;" if drafted else "target=triton, no draft model;") in stats.attention
    assert not drafted or stats.draft_forwards > len(stats.rounds)
    assert stats.new_tokens > sum(r.rows for r in stats.rounds)  # proposals were accepted: trees verified
    assert all(m.config._attn_implementation == "sdpa" for m in (target, draft) if m is not None)


def test_kernel_phases_read_the_host_once_a_round(backend_of, reference_calls, monkeypatch):
    """The kernel-routed phases (torch reference: what a CPU without Triton runs) read nothing but the round's one
    read: per-row lengths and bits stay on the device; a left-padded batch, target.generate's tokens."""
    backend_of("torch-reference")
    target = gqa_model("qwen3")
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), round="device", attention="kernel",
                                            ngram_size=0, **FIXED)
    counts = reads_per_round(monkeypatch)
    ids, mask = inputs(3)
    assert greedy(pair, ids, mask, new=16).tolist() == greedy(target, ids, mask, new=16).tolist()
    assert "target=torch-reference, draft=torch-reference" in pair.swiftspec_stats.attention
    assert max(counts) <= 1 and len(counts) == len(pair.swiftspec_stats.rounds)
    stats = pair.swiftspec_stats  # every forward of both models went through the kernel, a call per layer
    assert len(reference_calls) == 3 * stats.target_forwards + 2 * stats.draft_forwards


@needs_triton
def test_replayed_phases_with_the_kernel_equal_target_generate():
    """capture=True (the CPU stand-in for CUDA graphs, whose replay runs over the capture's static inputs: a length or
    a bit baked in from the first round would give wrong tokens) with the Triton kernel, a lone prompt and a batch."""
    target = gqa_model("qwen3")
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), round="device", attention="kernel",
                                            capture=True, ngram_size=0, **FIXED)
    for rows in (1, 3):
        ids, mask = inputs(rows)
        assert greedy(pair, ids, mask, new=12).tolist() == greedy(target, ids, mask, new=12).tolist()
        attended = pair.swiftspec_stats.attention
        assert "target=triton, draft=triton; replayed phases, emulate" in attended and "eager:" not in attended


@pytest.mark.parametrize("choice", ["model", "kernel"])
def test_compiled_phases_equal_target_generate(choice):
    """compile=True on a CPU: the phases' forwards with their decoder layers compiled by inductor (with the tree
    kernel, as on CUDA, one custom operator inside them), a draft whose layers are the target's class; the user's
    layers are left as they were, and the compiled calls are kept for the pair's next call."""
    target = tiny_model("llama", seed=0, layers=2)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 1)
    pair = SwiftSpecForCausalLM.from_models(target, draft, round="device", attention=choice, compile=True,
                                            ngram_size=0, **FIXED)
    ids, _ = inputs(1)
    assert greedy(pair, ids, new=8).tolist() == greedy(target, ids, new=8).tolist()
    backend = "sdpa" if choice == "model" else resolve_attention("kernel", target)
    assert f"target={backend}, draft={backend}; eager phases, compiled layers" in pair.swiftspec_stats.attention
    assert all(layer._compiled_call_impl is None for m in (target, draft) for layer in m.model.layers)
    assert len(pair.captures.device.compiled) == 3  # one compiled call per decoder layer of both models
    assert pair.swiftspec_stats.capture_s > 0  # the rounds that compiled are setup, priced by nothing


@pytest.mark.parametrize("model_type, fallback", [("gpt_oss", "attention sinks"), ("gemma2", None)])
def test_layers_the_kernel_cannot_serve_run_their_own_attention_and_say_so(model_type, fallback, backend_of):
    """Attention sinks (gpt_oss) the kernel cannot serve: those layers take the dense mask through the model's own
    attention, and the call's stats name why; a softcap (gemma2) it serves. Both with windows, target.generate's
    tokens, a batch."""
    backend = backend_of("torch-reference")
    overrides = dict(gemma2=dict(attn_logit_softcapping=5.0)).get(model_type, {})
    target = tiny_of_type(model_type, seed=0, initializer_range=0.3, sliding_window=8, **overrides)
    pair = SwiftSpecForCausalLM.from_models(target, perturbed_copy(target), round="device", attention="kernel",
                                            ngram_size=0, draft_depth=4, draft_width=2, tree_budget=8)
    ids, mask = left_padded(random_prompts((5, 23, 12), seed=1, vocab_size=128))
    assert greedy(pair, ids, mask, new=30).tolist() == greedy(target, ids, mask, new=30).tolist()
    own = f" (own attention for {fallback})" if fallback else ""
    assert f"target={backend}{own}, draft={backend}{own};" in pair.swiftspec_stats.attention


def test_a_draft_head_beside_a_kernel_routed_target(backend_of, reference_calls):
    """An EAGLE-3 head attends with its own sdpa (as in the host round) while the target verifies through the
    kernel; target.generate's tokens."""
    from test_eagle3 import random_head

    backend = backend_of("torch-reference")
    target = gqa_model("llama")
    pair = SwiftSpecForCausalLM.from_models(target, random_head(target), round="device", attention="kernel",
                                            ngram_size=0, **FIXED)
    ids, _ = inputs(1)
    assert greedy(pair, ids, new=16).tolist() == greedy(target, ids, new=16).tolist()
    assert f"target={backend}, draft=sdpa (a draft head);" in pair.swiftspec_stats.attention
    layers = target.config.num_hidden_layers
    assert len(reference_calls) == layers * (1 + len(pair.swiftspec_stats.rounds))  # the prefill, each verification


def test_the_running_batch_attends_through_the_kernel(backend_of, reference_calls, monkeypatch):
    """The server's running batch on the device round with attention="kernel": requests prefilled alone in pieces
    (catch-ups behind committed slots, through the kernel) join and leave; each answer is target.generate's, and
    the target's attn_implementation is its own again once the batch ends."""
    from hf_swiftspec.engine import continuous
    from test_continuous import relay_calls

    backend_of("torch-reference")
    monkeypatch.setattr(continuous, "PREFILL_PIECE", 8)
    target = gqa_model("qwen3")
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), round="device", attention="kernel",
                                            ngram_size=0, **FIXED)
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
             for p, n in zip(random_prompts((5, 19, 11), seed=4, vocab_size=98), (30, 16, 24))]
    engine = pair.continuous_engine()
    try:
        out = relay_calls(pair, engine, calls, at=(3, 2, 1))
    finally:
        engine.close()
    for i, call in enumerate(calls):
        assert out[i].tolist() == target.generate(**call).tolist(), f"request {i}"
    assert target.config._attn_implementation == "sdpa"
    assert {q[0] for q in reference_calls} >= {1, 2, 4}  # prefills alone, then batches of 2 and 3 (4 rows)
