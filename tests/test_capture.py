"""Replayed forwards (capture.py): the one adaptive round with its steps padded to buckets, planned over the
whole fixed-capacity cache and replayed from static buffers.

On this CPU the replay is capture.py's "emulate" backend: a "replay" runs the forward again with the
cache's host bookkeeping put back as it was at capture, and reads only the static buffers, so an input the
runner forgot to make static, or a host value the forward depends on, changes tokens here (mutations
checked: skipping the copy of the masks, or of the positions, into the buffers makes every greedy case
below fail). CUDA graphs themselves run in the CUDA test at the end (GPU machines only).

Every pair here runs the host round (round="host", HOST), whose steps these are, while the asynchronous engine drives
it; the device round's replayed phases are tests/test_device_*.py's.
"""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.models.architectures import Architecture
from hf_swiftspec.steps.attention import fixed_step_inputs, resolve_attention
from hf_swiftspec.steps.capture import MAX_QUERIES, StepRunner, capacity_bucket, capture_backend, capture_gap, forward, query_bucket
from hf_swiftspec.steps.probes import describe
from hf_swiftspec.steps.recurrent import new_cache
from hf_swiftspec.steps.step import RowQueries, model_step, run_step, step_layout
from hf_swiftspec.tools import sweep
from hf_swiftspec.tools.models import left_padded, random_prompts, sharpen, tiny_model, truncated_draft

VOCAB = 98
HOST = dict(round="host")  # the round whose steps this file replays
FIXED = dict(HOST, tree_budget=8, draft_depth=4)  # the draft runs every round (the policy drafts little on tiny models)
# The kernel runs in Triton's interpreter, at a cost that goes with the positions a replayed cache holds: the draft's
# tree region of tree_capacity (1024) slots made each call ~1 s; 64 slots (draft_width 4 leaves room for a round's
# growth) cut the test 3-5x with the same rounds.
KERNEL_FIXED = dict(FIXED, draft_width=4, tree_capacity=64)


def build(family: str):
    if family == "llama":
        target = tiny_model("llama", seed=0)
        return target, truncated_draft(target, 2)
    target = sweep.tiny_of_type("gemma3_text", seed=0, vocab_size=VOCAB)  # sliding-window layers: a mask per type
    sharpen(target, 4.0)
    return target, sweep.perturbed_copy(target)


@pytest.fixture(scope="module")
def pairs():
    return {family: build(family) for family in ("llama", "gemma3")}


def replays(model) -> dict[str, int]:
    return {role: sum(b.replays for b in g.buckets.values()) for role, g in model.captures.runners.items()}


@pytest.mark.parametrize("family,attention", [
    ("llama", "auto"), ("gemma3", "auto"), ("gemma3", "kernel"), pytest.param("llama", "kernel", marks=pytest.mark.slow),
])
def test_replayed_round_equals_target_generate(pairs, family, attention):
    """attention="kernel": the Triton tree kernel (its interpreter here, so fewer calls) reads each row's lengths
    from the device, over a padded batch and gemma3's sliding windows."""
    target, draft = pairs[family]
    settings = KERNEL_FIXED if attention == "kernel" else FIXED
    model = SwiftSpecForCausalLM.from_models(target, draft, capture=True, attention=attention, **settings)
    calls = [(7,), (30,), (3, 23, 9)] if attention == "auto" else [(3, 23, 9)]
    for seed, lengths in enumerate(calls):  # 23 tokens reach past gemma3's 16-token window
        ids, mask = left_padded(random_prompts(lengths, seed, VOCAB))
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        actual = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        assert actual.tolist() == expected.tolist(), (family, lengths)
    done = replays(model)
    assert min(done.values()) > 3 * len(calls), done  # the steps were replayed, not run eagerly
    stats = model.swiftspec_stats
    assert "replayed, emulate" in stats.attention and stats.tau > 1.2
    assert stats.attention.startswith("target=triton" if attention == "kernel" else "target=sdpa"), stats.attention


def test_sampling_draws_as_the_eager_round(pairs):
    """Same generator, same noise: the replayed round samples the eager round's tokens (whose distribution
    test_sampling checks against the target's)."""
    target, draft = pairs["llama"]
    ids, mask = left_padded(random_prompts((5, 12), 3, VOCAB))
    outs = []
    for capture in (False, True):
        model = SwiftSpecForCausalLM.from_models(target, draft, capture=capture, **FIXED)
        generator = torch.Generator().manual_seed(7)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=True, top_k=20,
                                   generator=generator).tolist())
    assert outs[0] == outs[1]
    assert sum(replays(model).values()) > 0


def test_buffers_and_graphs_serve_later_calls(pairs):
    """Every buffer a replay reads is allocated before its capture and keeps its address: later calls reuse
    the pool's buffers and the graphs captured over them (a shape already captured is never captured again),
    and a call that repeats an earlier one captures nothing new."""
    target, draft = pairs["llama"]
    model = SwiftSpecForCausalLM.from_models(target, draft, capture=True, **FIXED)
    first = torch.tensor([random_prompts((9,), 0, VOCAB)[0]])
    model.generate(first, max_new_tokens=48, do_sample=False)
    graphs = model.captures.runners
    pointers = {role: [t.data_ptr() for t in g.pool.buffers.values()] for role, g in graphs.items()}
    for seed in (1, 2):
        prompt = torch.tensor([random_prompts((11,), seed, VOCAB)[0]])
        out = model.generate(prompt, max_new_tokens=40, do_sample=False)
        assert out.tolist() == target.generate(prompt, max_new_tokens=40, do_sample=False).tolist()
    assert {role: [t.data_ptr() for t in g.pool.buffers.values()] for role, g in graphs.items()} == pointers
    for g in graphs.values():  # one graph per step shape: the buffers under them never changed
        assert len(g.buckets) == len({key[:3] for key in g.buckets}), list(g.buckets)
    # every tree the policy may verify (up to tree_budget=8), the draft's expansions (up to draft_width=8) and catch-ups
    assert {role: len(g.buckets) for role, g in graphs.items()} == {"target": 4, "draft": 11}
    captured, before = {role: g.captures for role, g in graphs.items()}, replays(model)
    model.output_history.clear()  # the same call again: the same rounds
    model.generate(first, max_new_tokens=48, do_sample=False)
    model.output_history.clear()
    model.generate(first, max_new_tokens=48, do_sample=False)
    assert {role: g.captures for role, g in graphs.items()} == captured
    assert model.swiftspec_stats.capture_s == 0.0  # nothing captured: nothing to say
    assert all(replays(model)[role] > before[role] for role in before)


def test_calls_of_other_lengths_share_the_captured_capacity(pairs):
    """A call that needs fewer positions than a captured capacity (up to 4 times fewer) packs into its buffers
    and replays its graphs; a model whose whole context fits 1024 positions gets one capacity for every call."""
    target, draft = pairs["llama"]
    graphs = StepRunner("emulate")
    assert graphs.capacity_for(300) == 512 and graphs.capacity_for(130) == 512 and graphs.capacity_for(127) == 256
    assert graphs.capacity_for(20) == 256 and graphs.capacity_for(600) == 1024 and graphs.capacities == {256, 512, 1024}
    small = StepRunner("emulate")
    assert small.capacity_for(40, whole=300) == 512 and small.capacity_for(10, whole=300) == 512
    assert StepRunner("emulate").capacity_for(40, whole=5000) == 256
    model = SwiftSpecForCausalLM.from_models(target, draft, capture=True, **FIXED)
    prompts = [torch.tensor([random_prompts((n,), n, VOCAB)[0]]) for n in (240, 9)]  # alone: 512 and 256 positions
    for prompt in prompts:
        out = model.generate(prompt, max_new_tokens=20, do_sample=False)
        assert out.tolist() == target.generate(prompt, max_new_tokens=20, do_sample=False).tolist()
    assert all(len(g.capacities) == 1 for g in model.captures.runners.values()), model.captures.runners


def test_custom_generate_keeps_graphs_in_the_captures_it_is_given(pairs):
    """A plain model's generate(custom_generate=...) replays too, and swiftspec_captures keeps its graphs for
    the next call, as the pair keeps its own."""
    from hf_swiftspec import custom_generate
    from hf_swiftspec.steps.capture import Captures

    target, draft = pairs["llama"]
    captures = Captures()
    prompt = torch.tensor([random_prompts((9,), 4, VOCAB)[0]])
    kwargs = dict(max_new_tokens=24, do_sample=False, custom_generate=custom_generate, swiftspec_draft=draft,
                  swiftspec_settings={"capture": True, **FIXED}, swiftspec_captures=captures)
    seen = []
    for _ in range(2):  # the same call twice: the second captures nothing and replays what the first captured
        out = target.generate(prompt, **kwargs)
        assert out.tolist() == target.generate(prompt, max_new_tokens=24, do_sample=False).tolist()
        graphs = captures.runners["target"]
        seen.append((graphs.captures, sum(b.replays for b in graphs.buckets.values())))
    assert seen[1][0] == seen[0][0] > 0 and seen[1][1] > seen[0][1], seen


def test_buckets_and_backends():
    assert [query_bucket(n) for n in (1, 2, 3, 8, 9, 64)] == [1, 2, 4, 8, 16, 64]
    assert query_bucket(MAX_QUERIES + 1) is None
    assert capacity_bucket(10) == 256 and capacity_bucket(257) == 512
    cpu = torch.device("cpu")
    assert capture_backend("auto", cpu) is None and capture_backend(True, cpu) == "emulate"
    assert capture_backend("auto", torch.device("cuda", 0)) == "cuda" and capture_backend(False, torch.device("cuda")) is None
    with pytest.raises(ValueError, match="capture='yes'"):
        capture_backend("yes", cpu)
    with pytest.raises(ValueError, match="SwiftSpecConfig.capture"):
        SwiftSpecForCausalLM.from_models(tiny_model("llama"), capture="always")


def test_steps_that_cannot_replay_run_eagerly_and_say_why(pairs):
    """Chain-shaped and recurrent models never get graphs; a step larger than every bucket (a long catch-up)
    runs eagerly and the stats say so."""
    llama = describe(pairs["llama"][0], "target")
    assert capture_gap(llama) is None
    assert "chains" in capture_gap(Architecture("x", ("full_attention",), llama.layer_masks[:1], chain_reason="slots"))
    assert "recurrent" in capture_gap(Architecture("x", ("mamba",), llama.layer_masks[:1], layer_states=(2,)))
    model = tiny_model("llama", seed=0, layers=1)
    chain = [int(t) for t in torch.randint(3, VOCAB, (80,), generator=torch.Generator().manual_seed(0))]
    outs = []
    for graphs in (None, StepRunner("emulate")):
        cache = new_cache(llama, 128, pool=graphs and graphs.pool)
        with torch.no_grad():
            model_step(model, cache, torch.tensor([chain[:4]]), torch.arange(4)[None], keep=1)
            rows = [RowQueries.chain(chain[4:], 4, "cpu")]  # 76 queries: past every bucket
            outs.append(run_step(model, cache, rows, "sdpa", llama, runner=graphs)[0])
    assert f"more than {MAX_QUERIES} queries" in next(iter(graphs.fallbacks)) and not graphs.buckets
    torch.testing.assert_close(outs[1], outs[0])


def head_pairs():
    """(target, EAGLE-3 head) and, where transformers has an MTP type, (target, MTP layer): heads that read
    the target's hidden states through hooks on its layers or its final norm."""
    from test_eagle3 import random_head
    from test_mtp import MTP_TYPES, train_to_agree, with_mtp

    target = tiny_model("llama", seed=1, layers=3)
    yield "eagle3", target, random_head(target)
    if MTP_TYPES:
        target, head = with_mtp(MTP_TYPES[0])
        train_to_agree(target, head)  # a random layer's proposals are accepted alike from stale states
        yield "mtp", target, head


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_head_and_the_target_it_taps_replay_as_eager_steps(kind, monkeypatch):
    """A replay runs no hooks: the captured step takes the tap's states into its bucket, and each replay hands
    the tap a copy; the head's own steps replay with its hidden output as a second output. Greedy tokens equal
    target.generate's, both models replay, every verification hands the head the same states as eager steps do,
    and every head forward gives the same logits and hidden outputs (mutations checked: handing nothing fails at
    the tap's take(); not copying a replay's second output into the bucket fails the states)."""
    from hf_swiftspec.drafters.heads import HeadDrafter
    from hf_swiftspec.engine.workers import TargetWorker

    pairs = {name: (target, head) for name, target, head in head_pairs() if name == kind}
    if kind not in pairs:
        pytest.skip("no MTP model type in this transformers")
    target, head = pairs[kind]
    handed: list[torch.Tensor] = []  # every row's states each verification took from the tap
    drafted: list[torch.Tensor] = []  # every head forward's logits and hidden outputs, row by row
    features_of, run = TargetWorker.features_of, HeadDrafter.run

    def recording(self, *args):
        out = features_of(self, *args)
        handed.extend(f.clone() for f in out if f is not None)
        return out

    def recording_run(self, queries, logits=True):
        out = run(self, queries, logits)
        drafted.extend(t.clone() for t in [*out, *self.last_hidden])
        return out

    monkeypatch.setattr(TargetWorker, "features_of", recording)
    monkeypatch.setattr(HeadDrafter, "run", recording_run)
    prompt = torch.tensor([[5, 17, 33, 8, 5, 17, 40]])
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    rounds, states = {}, {}
    for capture in (False, True):
        handed.clear(), drafted.clear()
        model = SwiftSpecForCausalLM.from_models(target, head, capture=capture, tree_budget=6, draft_depth=3, **HOST)
        for _ in range(2):  # the second call replays the first call's buckets
            assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False), expected)
        rounds[capture], states[capture] = model.swiftspec_stats.rounds, (list(handed), list(drafted))
        if capture:
            attention = model.swiftspec_stats.attention
            own = resolve_attention("auto", target)  # sdpa-grouped where its query heads share key / value heads
            assert f"target={own} (replayed, emulate" in attention and "draft=sdpa (replayed, emulate" in attention
            assert min(replays(model).values()) > 10, replays(model)
    assert rounds[True] == rounds[False]
    for replayed, eager in zip(states[True], states[False], strict=True):  # the tap's states, then the head's outputs
        assert len(replayed) == len(eager) > 10
        for got, want in zip(replayed, eager):
            torch.testing.assert_close(got, want)
    assert sum(r.accepted for r in rounds[True]) > 0  # the head's nodes were accepted


def test_a_fixed_step_compiles_whole():
    """A replayed step has no graph break and no host read: torch.compile(fullgraph=True) takes it whole, and
    gives the eager step's logits."""
    model = tiny_model("llama", seed=0, layers=1)
    arch = describe(model, "target")
    results = []
    for compiled in (False, True):
        cache = new_cache(arch, 64)
        with torch.no_grad():
            model_step(model, cache, torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None], keep=1)
            row = RowQueries(torch.tensor([9, 10, 11]), torch.tensor([4, 5, 5]),
                             torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
            _, ids, positions, layout = step_layout(model, cache, [row], bucket=4)
            tensors, build = fixed_step_inputs("sdpa", arch, layout, model.dtype, set())
            step = torch.compile(forward, fullgraph=True, dynamic=False) if compiled else forward
            kwargs = {"input_ids": ids, "position_ids": positions, **build(tensors)}
            results.append(step(model, cache, kwargs, 0)[0][0, :3])  # (logits, no hidden)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_compile_true_compiles_the_layers_for_the_call_only():
    """compile=True on a CPU: the round's fixed steps with the decoder layers compiled; generate()'s output dict
    (scores, logits) as target.generate's, and the user's layers left as they were."""
    target, draft = tiny_model("llama", seed=0, layers=2), None
    draft = truncated_draft(target, 1)
    model = SwiftSpecForCausalLM.from_models(target, draft, compile=True, **FIXED)
    prompt = torch.tensor([random_prompts((10,), 9, VOCAB)[0]])
    kwargs = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    expected, actual = target.generate(prompt, **kwargs), model.generate(prompt, **kwargs)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    for ours, theirs in ((actual.scores, expected.scores), (actual.logits, expected.logits)):
        torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), rtol=1e-4, atol=1e-4)
    assert "fixed steps, compiled layers" in model.swiftspec_stats.attention
    assert all(layer._compiled_call_impl is None for m in (target, draft) for layer in m.model.layers)
    assert len(model.captures.runners["target"].compiled) == 2  # one compiled call per layer, kept for later calls


def test_compiled_layers_with_the_kernel_for_two_models():
    """compile=True with the tree kernel (as on CUDA) and a draft whose layers are of the target's class: each
    model's steps give target.generate's tokens. (With shapes marked dynamic the target reused a graph compiled
    for the draft and took another token at its first verification, on this CPU and on an H200.)"""
    target = tiny_model("llama", seed=0, layers=2)
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), compile=True, attention="kernel",
                                             **KERNEL_FIXED)
    prompt = torch.tensor([random_prompts((7,), 0, VOCAB)[0]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert model.generate(prompt, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()
    assert model.swiftspec_stats.attention.startswith("target=triton (fixed steps, compiled layers)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("attention,compiled", [("auto", False), ("model", False), ("auto", True)])
def test_cuda_graph_round_equals_target_generate(pairs, attention, compiled):
    """capture="auto" (the default): CUDA graphs, with the tree kernel ("auto") or sdpa and a dense mask."""
    device = torch.device("cuda")
    target, draft = (m.to(device) for m in pairs["llama"])
    model = SwiftSpecForCausalLM.from_models(target, draft, compile=compiled, attention=attention, **FIXED)
    for seed, lengths in enumerate([(7,), (30,), (3, 23, 9)]):
        ids, mask = (t.to(device) for t in left_padded(random_prompts(lengths, seed, VOCAB)))
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        actual = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        assert actual.tolist() == expected.tolist(), lengths
    stats = model.swiftspec_stats
    assert "replayed, cuda" in stats.attention and "eager:" not in stats.attention, stats.attention
    assert stats.attention.startswith("target=triton" if attention == "auto" else "target=sdpa"), stats.attention
    assert min(replays(model).values()) > 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_cuda_graph_round_with_a_tapped_target_equals_target_generate(kind):
    """An EAGLE-3 head or MTP layer and its target under CUDA graphs: the states each replay wrote reach the head."""
    pairs = {name: (target, head) for name, target, head in head_pairs() if name == kind}
    if kind not in pairs:
        pytest.skip("no MTP model type in this transformers")
    target, head = (m.to("cuda") for m in pairs[kind])
    if kind == "mtp" and hasattr(head.mtp, "set_experts_implementation"):
        # the MTP layer is a mixture of experts; under the default "grouped_mm" its float32 step did not capture on
        # an H200 ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"), and ran eagerly, saying so
        head.mtp.set_experts_implementation("batched_mm")
    prompt = torch.tensor([[5, 17, 33, 8, 5, 17, 40]], device="cuda")
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    model = SwiftSpecForCausalLM.from_models(target, head, tree_budget=6, draft_depth=3, **HOST)
    for _ in range(2):
        assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False), expected)
    stats = model.swiftspec_stats
    assert "target=triton (replayed, cuda" in stats.attention and "draft=sdpa (replayed, cuda" in stats.attention
    assert "eager:" not in stats.attention, stats.attention
    assert min(replays(model).values()) > 10 and sum(r.accepted for r in stats.rounds) > 0
