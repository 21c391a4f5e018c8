"""The static round (compile=True): capturable steps, one host sync per round, exact output.

References: plain causal forwards of each branch (the step), target.generate (greedy), the adaptive
round with the same seed (sampling: both draw each position's token with the same noise).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine.request import DecodeRequest
from hf_swiftspec.engine.static_round import ShapeChooser, StaticShape, run_static
from hf_swiftspec.policy import GoodputPolicy
from hf_swiftspec.static import SlotCache, StaticModel, bucket_capacity, forward_slots, step_mask, warm_steps
from hf_swiftspec.tools.models import random_prompts, tiny_gpt2, tiny_model, truncated_draft
from hf_swiftspec.verify import Sampler

# What makes the host wait for the device: reading a value, or an op whose output shape depends on values.
SYNCING = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "equal",
                     "unique", "masked_select"})


class SyncCounter(TorchFunctionMode):
    """Counts tensor calls that read device values on the host (boolean-mask indexing included)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        tensor_repeats = name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
        if name in SYNCING or tensor_repeats or (name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _indices(args[1])
        )):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _indices(index):
    return index if isinstance(index, tuple) else (index,)


def pair(model_type: str = "llama", seed: int = 0):
    if model_type == "gpt2":
        target = tiny_gpt2(seed=seed)
        draft = copy_first_layers(target)
    else:
        target = tiny_model(model_type, seed=seed)
        draft = truncated_draft(target, 2)
    target.generation_config.eos_token_id = None  # long runs; EOS has a test of its own
    return target, draft


def copy_first_layers(gpt2):
    import copy

    draft = copy.deepcopy(gpt2)
    draft.transformer.h = draft.transformer.h[:2]
    draft.config.n_layer = 2
    return draft


def request_for(prompt: list[int], max_new: int, sampler: Sampler | None = None, eos: int | None = None) -> DecodeRequest:
    ids = torch.tensor([prompt])
    criteria = StoppingCriteriaList([MaxLengthCriteria(len(prompt) + max_new)])
    if eos is not None:
        criteria.append(EosTokenCriteria(eos))
    return DecodeRequest(
        prompt=ids, samplers=[sampler or Sampler(LogitsProcessorList(), False)], stopping_criteria=criteria,
        max_new_tokens=max_new, policy=GoodputPolicy(), contexts=[ids],
    )


@pytest.fixture
def always_trees(monkeypatch):
    """Every round a tree round (the chooser's pick depends on timings)."""
    import hf_swiftspec.engine.static_round as static_round

    monkeypatch.setattr(static_round.ShapeChooser, "plan_round", lambda self, kinds: "tree")


def static_models(target, draft, shape: StaticShape, length: int, compiled: bool = False):
    return (StaticModel.build(target, shape.target_slots(length), compiled),
            StaticModel.build(draft, shape.draft_slots(length), compiled))


# ---- the capturable step -----------------------------------------------------------------------

def random_tree(T: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
def test_step_over_scattered_slots_equals_each_branch_causal_forward(model_type):
    """A tree step writing its nodes to scattered slots after a prefill, each node seeing the prefix and its
    ancestors, gives every node the logits a plain causal forward of its branch gives its last token."""
    target, _ = pair(model_type)
    prompt = random_prompts([13], seed=2)[0]
    parents = random_tree(7, seed=3)
    tokens = torch.randint(3, 98, (7,), generator=torch.Generator().manual_seed(4))
    model = StaticModel.build(target, 64)
    model.prefill(prompt)
    depths, branches = [], []
    for i, p in enumerate(parents):
        branch = [i] if p < 0 else branches[p] + [i]
        branches.append(branch)
        depths.append(len(branch) - 1)
    slots = torch.tensor([40, 17, 33, 20, 55, 18, 30])  # anywhere after the prefix, in any order
    region = torch.zeros(7, model.capacity, dtype=torch.bool)
    region[:, : len(prompt)] = True  # (step_mask's region here spans every slot)
    for i, branch in enumerate(branches):
        region[i, slots[branch]] = True
    mask = step_mask(len(prompt), region, 0, model.capacity, target.dtype)
    positions = torch.tensor([len(prompt) + d for d in depths])
    logits = model.run(tokens[None], positions[None], slots, mask)
    for i, branch in enumerate(branches):
        ids = torch.tensor([prompt + tokens[branch].tolist()])
        with torch.no_grad():
            reference = target(input_ids=ids).logits[0, -1]
        torch.testing.assert_close(logits[i], reference, atol=2e-5, rtol=1e-4)


def test_compiled_steps_have_no_graph_break_and_equal_eager():
    """The draft's and the target's steps compile whole (fullgraph=True: a graph break raises), once per
    shape: another prefix, other slots and another tree reuse the graph, and every output equals the
    eager step's."""
    torch._dynamo.reset()
    target, draft = pair()
    compiled = torch.compile(forward_slots, fullgraph=True, dynamic=False, backend="eager")
    counts = torch._dynamo.utils.counters
    counts.clear()
    for model, Q in ((target, 8), (draft, 4)):
        for prefix in (11, 19):
            cache_a, cache_b = SlotCache.for_model(model, 64), SlotCache.for_model(model, 64)
            for cache in (cache_a, cache_b):
                StaticModel(model, cache).prefill(list(range(3, 3 + prefix)))
            slots = torch.randperm(64 - prefix, generator=torch.Generator().manual_seed(prefix))[:Q] + prefix
            region = torch.rand(Q, Q, generator=torch.Generator().manual_seed(Q)) < 0.5
            region |= torch.eye(Q, dtype=torch.bool)
            full = torch.zeros(Q, 64, dtype=torch.bool)
            full[:, :prefix] = True
            full[:, slots] = region
            mask = step_mask(prefix, full, 0, 64, model.dtype)
            ids = torch.randint(3, 98, (1, Q))
            positions = (prefix + torch.arange(Q))[None]
            with torch.no_grad():
                eager = forward_slots(model, cache_a, ids, positions, slots, mask)
                graph = compiled(model, cache_b, ids, positions, slots, mask)
            torch.testing.assert_close(graph, eager)
            for layer_a, layer_b in zip(cache_a.layers, cache_b.layers):
                torch.testing.assert_close(layer_b.keys, layer_a.keys)
    assert counts["stats"]["unique_graphs"] == 2  # one per (model, Q): prefixes, slots, masks, caches reuse it


def test_capacity_is_bucketed():
    assert bucket_capacity(10) == 512 and bucket_capacity(512) == 512 and bucket_capacity(513) == 1024


# ---- the round ---------------------------------------------------------------------------------

SHAPES = [StaticShape(8, 4, 4), StaticShape(4, 1, 3), StaticShape(16, 3, 2), StaticShape(6, 5, 1), StaticShape(8, 3, 4, 4),
          StaticShape(12, 2, 2, 6)]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s.budget}-d{s.depth}-w{s.width}-s{s.suffix}")
def test_greedy_equals_target_generate(model_type, shape):
    target, draft = pair(model_type)
    for prompt in random_prompts([9, 30], seed=5):
        ids = torch.tensor([prompt])
        expected = target.generate(ids, max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
        result = run_static(*static_models(target, draft, shape, len(prompt) + 40), request_for(prompt, 40), shape, 98, 3)
        assert result.tokens == expected
        assert result.stats.verify_steps == len(result.rounds)


def test_ngram_branches_are_verified_beside_the_draft_tree(always_trees):
    """A prompt that repeats itself: the n-gram proposal (beside a draft that never agrees) is accepted,
    and the output stays target.generate's."""
    target, _ = pair()
    useless = tiny_model(seed=99, layers=1)  # an unrelated draft
    prompt = random_prompts([6], seed=13)[0]
    ids = torch.tensor([prompt])
    cycle = target.generate(ids, max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    prompt = prompt + cycle  # the continuation is in the context now
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    shape = StaticShape(8, 3, 2, 4)
    result = run_static(*static_models(target, useless, shape, len(prompt) + 40), request_for(prompt, 40), shape, 98, 3)
    assert result.tokens == expected
    assert sum(r.ngram_accepted for r in result.rounds) >= 10


def test_a_draft_that_is_the_target_has_every_chain_accepted(always_trees):
    """With the target as its own draft a chain of depth d is accepted whole: d + 1 tokens per round."""
    import copy

    target, _ = pair()
    prompt = random_prompts([14], seed=6)[0]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    shape = StaticShape(8, 4, 1)
    result = run_static(*static_models(target, copy.deepcopy(target), shape, len(prompt) + 40), request_for(prompt, 40),
                        shape, 98)
    assert result.tokens == expected
    assert [r.accepted for r in result.rounds] == [4] * 8


def test_a_prefill_in_chunks_decodes_the_same(monkeypatch):
    """Prompts run into the caches 7 tokens a forward (the target's prefill, the draft's catch-up)."""
    import hf_swiftspec.static as static

    monkeypatch.setattr(static, "PREFILL_CHUNK", 7)
    target, draft = pair()
    prompt = random_prompts([30], seed=15)[0]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, 30:].tolist()
    shape = StaticShape(8, 3, 3, 4)
    result = run_static(*static_models(target, draft, shape, 54), request_for(prompt, 24), shape, 98, 3)
    assert result.tokens == expected


def test_forwards_run_for_their_kv_alone_skip_the_vocabulary_head(always_trees):
    """The target's prefill and the draft's catch-up (StaticModel.extend) multiply no head row when the
    model takes an index to keep (what compile=True builds: StaticRounds asks the probes), and the output
    stays target.generate's; the round's own steps still get their logits."""
    from hf_swiftspec.engine.static_round import StaticRounds

    target, draft = pair()
    assert StaticRounds().static_model("draft", draft, 64).headless
    prompt = random_prompts([30], seed=15)[0]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, 30:].tolist()
    shape = StaticShape(8, 3, 3)
    steps = (StaticModel.build(target, shape.target_slots(54), headless=True),
             StaticModel.build(draft, shape.draft_slots(54), headless=True))
    rows = {"target": [], "draft": []}
    hooks = [model.lm_head.register_forward_hook(lambda module, args, out, role=role: rows[role].append(args[0].shape[1]))
             for role, model in (("target", target), ("draft", draft))]
    try:
        result = run_static(*steps, request_for(prompt, 24), shape, 98)
    finally:
        for hook in hooks:
            hook.remove()
    assert result.tokens == expected
    assert rows["target"][0] == 0 and rows["draft"][0] == 0  # the prefill; the draft's first catch-up (the prompt)
    assert all(n > 0 for n in rows["target"][1:])


def test_eos_stops_the_round_where_generate_stops():
    target, draft = pair()
    prompt = random_prompts([12], seed=7)[0]
    ids = torch.tensor([prompt])
    free = target.generate(ids, max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    eos = free[17]  # a token the target emits mid-way: generation must stop right after its first occurrence
    expected = free[: free.index(eos) + 1]
    shape = StaticShape(8, 4, 4)
    result = run_static(*static_models(target, draft, shape, len(prompt) + 30), request_for(prompt, 30, eos=eos), shape, 98)
    assert result.tokens == expected


@pytest.mark.parametrize("kwargs", [dict(temperature=0.7), dict(top_k=8, top_p=0.9), dict(min_p=0.05)])
def test_sampling_draws_what_the_adaptive_round_draws(kwargs):
    """With one seed both rounds draw each position's token from the target's distribution with the same
    noise, so their outputs are the same sequence whatever trees each verified."""
    target, draft = pair()
    prompt = random_prompts([15], seed=8)[0]
    ids = torch.tensor([prompt])
    static = SwiftSpecForCausalLM.from_models(target, draft, compile=True, tree_budget=8, draft_depth=3, draft_width=4)
    adaptive = SwiftSpecForCausalLM.from_models(target, draft)
    runs = []
    for model in (static, adaptive):
        runs.append(model.generate(ids, max_new_tokens=40, do_sample=True, swiftspec=True,
                                   generator=torch.Generator().manual_seed(11), **kwargs))
    assert static.swiftspec_stats.engine == "static (compiled)"
    assert torch.equal(runs[0], runs[1])


def test_one_host_sync_per_round():
    """Growing the tree, verifying it, walking it and committing read nothing from the device but the
    round's result: syncs = rounds, plus the prompt and the EOS ids read once."""
    target, draft = pair()
    prompt = random_prompts([20], seed=1)[0]
    shape = StaticShape(8, 3, 4)
    models = static_models(target, draft, shape, len(prompt) + 40)
    with SyncCounter() as counter:
        result = run_static(*models, request_for(prompt, 40, eos=2), shape, 98)
    rounds = len(result.rounds)
    assert rounds >= 5
    assert counter.calls == {"tolist": rounds + 2}, counter.calls


def test_generate_compile_true_equals_target_generate_with_scores():
    """compile=True end to end: inductor-compiled steps, generate()'s output dict, scores and logits."""
    torch._dynamo.reset()
    target, draft = pair()
    model = SwiftSpecForCausalLM.from_models(target, draft, compile=True, tree_budget=8, draft_depth=3, draft_width=4)
    for prompt in random_prompts([10, 21], seed=9):
        ids = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=32, do_sample=False, return_dict_in_generate=True, output_scores=True,
                      output_logits=True)
        expected = target.generate(ids, **kwargs)
        out = model.generate(ids, swiftspec=True, **kwargs)
        assert torch.equal(out.sequences, expected.sequences)
        for mine, theirs in zip(out.scores + out.logits, expected.scores + expected.logits):
            torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)
    assert model.swiftspec_stats.engine == "static (compiled)"
    kept = model.policy()  # what the calls measured stays with the model, for the next call, and so do the caches
    assert set(kept.chooser.rates) >= {"tree", "plain"}
    assert [m.model for m in kept.models.values()] == [target, draft]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
        (dict(stop_strings=["ab"], tokenizer="char"), "StopStringCriteria"),
        (dict(batch=True), "one sequence"),
    ],
)
def test_compile_true_refuses_what_it_cannot_walk_on_the_device(kwargs, named):
    from hf_swiftspec.tools.models import char_tokenizer

    target, draft = pair()
    model = SwiftSpecForCausalLM.from_models(target, draft, compile=True)
    ids = torch.tensor(random_prompts([10, 10], seed=1)) if kwargs.pop("batch", False) else torch.tensor(
        random_prompts([10], seed=1))
    if kwargs.get("tokenizer") == "char":
        kwargs["tokenizer"] = char_tokenizer()
    with pytest.raises(ValueError, match=named) as error:
        model.generate(ids, max_new_tokens=8, swiftspec=True, **kwargs)
    assert "Drop compile=True" in str(error.value)


def test_a_generation_to_the_last_position_of_learned_embeddings():
    """gpt2 with 64 positions, decoded to its last one: tree nodes past it are clamped, never used."""
    target = tiny_gpt2(n_positions=64)
    target.generation_config.eos_token_id = None
    draft = copy_first_layers(target)
    prompt = random_prompts([30], seed=4)[0]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=34, do_sample=False)[0, 30:].tolist()
    shape = StaticShape(8, 4, 4)
    result = run_static(*static_models(target, draft, shape, 64), request_for(prompt, 34), shape, 98)
    assert result.tokens == expected


def test_no_compiled_step_allocates_the_kv_buffers():
    """A CUDA graph owns what its capture allocates and overwrites it at its next replay (seen on an H200: a
    draft whose first forward was compiled crashed, or read its KV overwritten). So the buffers exist, at
    fixed addresses, before the first compiled step, also for a draft that has run no prefill."""
    target, _ = pair("llama")
    static = StaticModel.build(target, 64, compiled=False)
    static.compiled = True  # run()'s compiled path, with a step that only records what it finds
    found = []
    static.step = lambda model, cache, *args: found.append(cache.allocated) or forward_slots(model, cache, *args)
    warm_steps(static, {1, 4}, 0)
    assert found == [True, True]
    assert all(hasattr(buffer, "_dynamo_static_input_type") for buffer in static.cache.buffers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (examples/gpu_session.py --phase tests)")
def test_cuda_graph_round_equals_eager_and_target_generate():
    """On a GPU, compile=True captures each step as a CUDA graph: token for token what the eager static
    round and target.generate emit, on a pair of llama and a gpt2 (float32)."""
    for model_type in ("llama", "gpt2"):
        target, draft = (m.to("cuda") for m in pair(model_type))
        model = SwiftSpecForCausalLM.from_models(target, draft, compile=True, tree_budget=8, draft_depth=4, draft_width=4)
        shape = StaticShape(8, 4, 4)
        for prompt in random_prompts([11, 40], seed=12):
            ids = torch.tensor([prompt], device="cuda")
            expected = target.generate(ids, max_new_tokens=48, do_sample=False)
            assert torch.equal(model.generate(ids, max_new_tokens=48, do_sample=False, swiftspec=True), expected)
            assert model.swiftspec_stats.engine == "static (compiled)"
            eager = run_static(*static_models(target, draft, shape, len(prompt) + 48), request_for(prompt, 48), shape, 98)
            assert eager.tokens == expected[0, len(prompt):].tolist()


def test_switching_between_kinds_of_round_stays_exact(monkeypatch):
    """Plain and n-gram rounds leave the draft behind (its chain grows past its fixed size): the tree round
    after them catches it up first. A fixed pattern of every kind, against target.generate."""
    import hf_swiftspec.engine.static_round as static_round

    pattern = iter(["tree", "plain", "ngram", "plain", "ngram", "ngram", "plain", "tree", "tree", "ngram"] * 20)
    monkeypatch.setattr(static_round.ShapeChooser, "plan_round", lambda self, kinds: next(k for k in pattern if k in kinds))
    target, draft = pair()
    prompt = random_prompts([7], seed=14)[0]
    prompt += target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, 7:].tolist()  # repeats
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    shape = StaticShape(8, 2, 3, 4)
    result = run_static(*static_models(target, draft, shape, len(prompt) + 40), request_for(prompt, 40), shape, 98, 3)
    assert result.tokens == expected
    budgets = [r.budget for r in result.rounds]
    assert 1 in budgets and 8 in budgets and any(1 < b < 8 for b in budgets)  # plain, tree and n-gram rounds


def test_shape_chooser_keeps_the_fastest_kind_and_probes_the_next():
    chooser = ShapeChooser()
    speed = {"tree": (2, 0.03), "plain": (1, 0.01)}  # trees make 2 tokens per 30 ms, plain rounds 1 per 10 ms
    kinds = []
    for _ in range(60):
        kind = chooser.plan_round(["tree", "plain"])
        kinds.append(kind)
        chooser.observe_round(kind, *speed[kind])
    assert kinds[:2] == ["tree", "plain"]  # each kind is tried first
    # a losing probe costs 10 ms over plain rounds of 10 ms: the next comes 10 / (0.03 * 10) = 34 rounds later
    probes = [i for i, kind in enumerate(kinds) if kind == "tree"]
    assert probes == [0, 6, 41], probes
    chooser = ShapeChooser()
    speed = {"tree": (3, 0.02), "ngram": (2, 0.015), "plain": (1, 0.01)}  # 150, 133, 100 tokens/s
    kinds = []
    for _ in range(60):
        kind = chooser.plan_round(["tree", "ngram", "plain"])
        kinds.append(kind)
        chooser.observe_round(kind, *speed[kind])
    assert kinds[:3] == ["tree", "ngram", "plain"] and kinds[3:].count("tree") >= 45  # cheap probes: every 4 rounds
    assert "ngram" in kinds[3:] and "plain" in kinds[3:]  # probes take turns among the others


def test_the_walk_never_accepts_padding():
    """Root 0 with children 1 (token 7, proposed) and 2 (token 5, padding); the target chooses 5 after the
    root: padding would match, so only the root is accepted and the target's 5 is emitted."""
    from hf_swiftspec.verify import children_of, walk_path

    tokens, parents, choice = [3, 7, 5], [-1, 0, 0], [5, 9, 9]
    out = walk_path(choice, children_of(parents, tokens, [True, True, False]), max_tokens=10)
    assert (out.path, out.tokens) == ([0], [5])
    out = walk_path(choice, children_of(parents, tokens, [True, True, True]), max_tokens=10)
    assert (out.path, out.tokens) == ([0, 2], [5, 9])


def test_compile_true_serves_prompts_across_capacity_buckets():
    """Each capacity bucket (512, 1024, 2048 slots) compiles its own graphs: three buckets of three step
    shapes passed dynamo's default limit of 8 graphs per function, which fullgraph turns into an error."""
    torch._dynamo.reset()
    target = tiny_model(max_position_embeddings=4096)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 2)
    model = SwiftSpecForCausalLM.from_models(target, draft, compile=True, tree_budget=2, draft_depth=1, draft_width=1,
                                             ngram_size=0)
    for length in (10, 600, 1100):
        ids = torch.tensor(random_prompts([length], seed=length))
        expected = target.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, swiftspec=True), expected)
    assert {m.capacity for m in model.policy().models.values()} == {2048}
