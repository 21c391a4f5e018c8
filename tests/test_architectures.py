"""Every causal-LM type of the installed transformers: tree, chain, plain, refused with a reason, or skipped.

The sweep (hf_swiftspec.tools.sweep) builds each type tiny, with windows, chunks, slot rules and indexers of
16 (8) positions that the prompts and trees reach past, and compares generate(swiftspec=True) with the
type's own generate token for token in four shapes (sweep.SHAPES): a fixed deep chain or tree with 2
key/value heads and a prompt past the window, a fixed wide tree with as many key/value heads as query
heads, the default settings, and a left-padded batch of three prompts.

Each type must get the verdict (status and reason class, sweep.verdict) pinned for it: REPRESENTATIVE's in
this file, which CI sweeps on every run (`-m "not slow"`), every other type's in the committed whole sweep
(hf_swiftspec/data/architecture_verdicts.json), which the `slow` cases compare against when a transformers
release is adopted (`pytest -m slow tests/test_architectures.py`). A type whose own generate stops running
fails with the reason; nothing is skipped. After a change the sweep explains, rewrite the committed file with
`python -m hf_swiftspec.tools.sweep --save hf_swiftspec/data/architecture_verdicts.json` (7-13 minutes on
this 2-core machine); its table is `python -m hf_swiftspec.tools.sweep --results hf_swiftspec/data/architecture_verdicts.json
--page docs/source/en/architectures.md`. SWIFTSPEC_COVERAGE_JSON=path keeps a pytest run's results, when it swept
every type (`-m "slow or not slow"`).
"""

import os
from pathlib import Path

import pytest
import torch
import transformers

from hf_swiftspec.models.compat import NEWEST
from hf_swiftspec.tools import sweep
from hf_swiftspec.tools.sweep import Outcome, causal_lm_types, check_type, coverage_line, save, verdict

RESULTS: dict[str, Outcome] = {}
COMMITTED = {o.model_type: o for o in sweep.load(sweep.VERDICTS)}
SWEPT_RELEASE = sweep.swept_release(sweep.VERDICTS)
# One type for each mechanism the decode path handles differently, with the verdict it must get; CI sweeps these
# on every run. The whole sweep (every causal-LM type, ~190) is marked slow: it runs when a transformers release is
# adopted (moving compat.NEWEST and pyproject's cap), and its results rewrite the committed file and the table.
REPRESENTATIVE = {
    "llama": "tree",  # rotary, GQA
    "gpt2": "tree",  # learned positions, fused QKV
    "gemma3_text": "tree",  # sliding and full layers, one mask per layer type, softcapping
    "mistral": "tree",  # every layer sliding
    "qwen2": "tree",  # sliding from max_window_layers
    "llama4_text": "chain: slot rule",  # chunked layers; NoPE temperature stepped by cache slot (SlotLimit)
    "gpt_oss": "tree",  # attention sinks, MoE
    "deepseek_v3": "tree",  # latent attention (MLA)
    "deepseek_v32": "plain: slot rule",  # sparse-attention indexer (SlotLimit)
    "gpt_neo": "chain: slot rule",  # local window applied by cache slot (SlotLimit)
    "doge": "plain: slot rule",  # dynamic top-k keys by slot count (SlotLimit)
    "bloom": "chain: no position_ids",  # ALiBi, no position_ids
    "trocr": "chain: no position_ids",  # no logits_to_keep
    "mamba2": "chain: recurrent state",  # recurrent state: chains with rollback
    "qwen3_next": "chain: recurrent state",  # hybrid: Gated DeltaNet beside attention
    "lfm2": "chain: recurrent state",  # short convolutions beside attention
    "mamba": "refused: recurrent state",  # its multi-token scan restarts from zero
    "bert": "tree",  # causal only as a decoder
    "openai-gpt": "refused: no cache",
    "musicgen": "refused: own generate",
}
# The layer types a representative's tiny model must have to stand for its mechanism (a default config may lack
# them: lfm2's and qwen2's defaults are full attention only).
REPRESENTATIVE_LAYERS = {
    "gemma3_text": {"sliding_attention", "full_attention"},
    "qwen2": {"sliding_attention", "full_attention"},
    "llama4_text": {"chunked_attention", "full_attention"},
    "gpt_oss": {"sliding_attention", "full_attention"},
    "qwen3_next": {"linear_attention", "full_attention"},
    "lfm2": {"conv", "full_attention"},
}


def sweep_param(model_type: str):
    return pytest.param(model_type, marks=() if model_type in REPRESENTATIVE else (pytest.mark.slow,))
# Of the types whose own generate runs, those not refused for a recurrent state. 90%: the sweep now runs
# formerly skipped types of which a dozen cannot speculate whatever swiftspec does (no cache at all:
# openai-gpt, xlm, xlnet, reformer; a generate() of their own: musicgen; no multi-token steps: prophetnet).
MIN_COVERAGE = 0.90


@pytest.fixture(scope="module", autouse=True)
def keep_results():
    """With SWIFTSPEC_COVERAGE_JSON=path, a run that swept every type saves its results there."""
    yield
    if os.environ.get("SWIFTSPEC_COVERAGE_JSON") and len(RESULTS) == len(causal_lm_types()):
        save([RESULTS[t] for t in causal_lm_types()], Path(os.environ["SWIFTSPEC_COVERAGE_JSON"]))


@pytest.mark.parametrize("model_type", [sweep_param(t) for t in causal_lm_types()])
def test_type_gets_its_pinned_verdict(model_type):
    """Tree, chain or plain decodes token for token like its own generate (tau > 1 where it speculates); the
    verdict is the one pinned for it."""
    if model_type in REPRESENTATIVE:
        expected = REPRESENTATIVE[model_type]
    elif model_type in COMMITTED:
        expected = verdict(COMMITTED[model_type])
    else:
        pytest.fail(f"{model_type} is not in {sweep.VERDICTS.name}: rerun the whole sweep (this file's docstring says how)")
    outcome = check_type(model_type)
    RESULTS[model_type] = outcome
    assert outcome.status != "wrong", f"{model_type}: {outcome.reason}"
    assert verdict(outcome) == expected, f"{model_type}: {outcome.reason or outcome.status} ({outcome.notes})"
    if outcome.status in ("tree", "chain"):
        assert outcome.tau > 1.0
    elif outcome.status == "refused":
        assert outcome.reason.startswith("The target ("), outcome.reason  # says which model and why
    elif outcome.status == "plain":  # past a slot rule: its own loop, exactly; the reason names the rule
        assert outcome.reason.startswith("the target "), outcome.reason


@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVE_LAYERS))
def test_representatives_have_the_layers_they_stand_for(model_type):
    model = sweep.tiny_of_type(model_type, **sweep.head_overrides(model_type, "gqa"))
    assert set(model.config.get_text_config(decoder=True).layer_types) == REPRESENTATIVE_LAYERS[model_type]


def test_committed_verdicts_are_the_pinned_ones_and_name_every_type():
    """The committed sweep ran on the release CI tests (compat.NEWEST), names every causal-LM type of it with a
    classified reason, and agrees with REPRESENTATIVE (both are what the sweep finds)."""
    assert SWEPT_RELEASE is not None and SWEPT_RELEASE.startswith(NEWEST + "."), (SWEPT_RELEASE, NEWEST)
    if SWEPT_RELEASE == transformers.__version__:
        assert sorted(COMMITTED) == causal_lm_types(), "rerun the whole sweep (this file's docstring says how)"
    assert not [t for t, o in COMMITTED.items() if "unclassified" in verdict(o) or o.status == "wrong"]
    assert {t: verdict(COMMITTED[t]) for t in REPRESENTATIVE} == REPRESENTATIVE


def test_coverage():
    """At least 90% of the types that run their own generate, recurrent refusals aside, speculate (the committed
    sweep; the slow cases above hold every type to its committed verdict)."""
    outcomes = list(COMMITTED.values())
    print(coverage_line(outcomes))
    ran = [o for o in outcomes if o.status != "skipped" and not o.recurrent]
    speculating = [o for o in ran if o.status in ("tree", "chain")]
    assert len(speculating) >= MIN_COVERAGE * len(ran), [o.model_type for o in ran if o not in speculating]


def test_model_without_logits_to_keep_grows_a_chain():
    """trocr's forward takes no logits_to_keep: the draft's first expansion (prompt + root in one
    forward) returned a row per prompt token, each became a child of the root, and the "chain" the
    target verified with causal attention was a tree (it differed at the second generated token)."""
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.tools.sweep import own_generate, perturbed_copy, tiny_of_type

    target = tiny_of_type("trocr", use_learned_position_embeddings=False)  # as trocr-small checkpoints
    pair = SwiftSpecForCausalLM.from_models(target, perturbed_copy(target), tree_budget=8, draft_depth=4)
    generator = torch.Generator().manual_seed(5)
    for length in (10, 12, 3):
        prompt = torch.randint(3, 128, (1, length), generator=generator)
        assert own_generate(pair, prompt, 20, swiftspec=True).tolist() == own_generate(target, prompt, 20).tolist()
        assert pair.swiftspec_stats.tau > 1.0


def test_left_padding_is_refused_where_positions_follow_cache_slots():
    """trocr takes no position_ids: target.generate gives a left-padded prompt the positions after
    the padding, and swiftspec ran the prompt alone, at other positions (a silent difference once
    position embeddings matter; scaled up here so the tiny model shows it)."""
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.tools.sweep import perturbed_copy, tiny_of_type

    target = tiny_of_type("trocr", use_learned_position_embeddings=True)
    with torch.no_grad():
        target.model.decoder.embed_positions.weight.mul_(50)
    pair = SwiftSpecForCausalLM.from_models(target, perturbed_copy(target))
    prompt = torch.tensor([[0, 0, 0, 17, 35, 99, 4, 60]])
    mask = (prompt != 0).long()
    kwargs = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)
    padded = target.generate(prompt, attention_mask=mask, **kwargs)
    assert padded[:, 3:].tolist() != target.generate(prompt[:, 3:], **kwargs).tolist()
    with pytest.raises(ValueError, match=r"The target \(trocr\) takes no position_ids, so 3 left padding"):
        pair.generate(prompt, attention_mask=mask, **kwargs)
    assert pair.generate(prompt[:, 3:], **kwargs).tolist() == target.generate(prompt[:, 3:], **kwargs).tolist()


def test_held_out_failures_are_refusals_that_name_the_fix():
    """Found by a held-out sweep: glm4_moe_lite with 2 key/value heads (its own generate runs) failed
    inside sdpa mid-generation, and prophetnet with an AssertionError from its forward; both are now
    refused up front by a check of the step speculation runs, saying what fails and what to do."""
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.tools.sweep import head_overrides, own_generate, perturbed_copy, prompts, tiny_of_type

    glm = tiny_of_type("glm4_moe_lite", **head_overrides("glm4_moe_lite", "gqa"))
    own_generate(glm, prompts()[1], 3)
    with pytest.raises(ValueError, match=r"The target \(glm4_moe_lite\) fails on a forward of several tokens after a "
                       r"cached prefix.*set num_key_value_heads=4 in its config"):
        SwiftSpecForCausalLM.from_models(glm, perturbed_copy(glm))
    prophetnet = tiny_of_type("prophetnet")
    own_generate(prophetnet, prompts()[1], 3)
    with pytest.raises(ValueError, match=r"The target \(prophetnet\) fails on a forward of several tokens after a "
                       r"cached prefix.*use_cache. is only supported for .decoder_input_ids. of length 1"):
        SwiftSpecForCausalLM.from_models(prophetnet, perturbed_copy(prophetnet))


def test_a_catch_up_runs_no_vocabulary_head():
    """A forward the draft runs for its KV alone (its catch-up of the prompt) passes an empty logits_to_keep
    index: its head multiplies no row (on a 262k vocabulary the head is half a small draft's forward), and
    the output is still target.generate's."""
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.steps.probes import describe
    from hf_swiftspec.tools.models import tiny_model, truncated_draft

    target = tiny_model("llama", seed=3)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 1)
    assert describe(draft, "draft").headless
    rows = []
    hook = draft.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    try:
        pair = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=4, draft_depth=2)
        prompt = torch.randint(3, 98, (1, 24), generator=torch.Generator().manual_seed(2))
        out = pair.generate(prompt, do_sample=False, max_new_tokens=16)
    finally:
        hook.remove()
    assert out.tolist() == target.generate(prompt, do_sample=False, max_new_tokens=16).tolist()
    assert 0 in rows and pair.swiftspec_stats.draft_forwards > 2  # the catch-up, headless; expansions with rows


def test_a_forward_that_takes_no_index_to_keep_runs_its_head():
    """A model whose forward takes logits_to_keep as a count only (an empty index raises) is not refused:
    its catch-ups keep one row, as before, and it decodes exactly."""
    import functools

    from transformers import LlamaForCausalLM

    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.steps.probes import describe
    from hf_swiftspec.tools.models import tiny_model, truncated_draft

    class CountOnly(LlamaForCausalLM):
        @functools.wraps(LlamaForCausalLM.forward)  # (its signature: the cache argument's name is read from it)
        def forward(self, *args, **kwargs):
            if not isinstance(kwargs.get("logits_to_keep", 0), int):
                raise TypeError("logits_to_keep must be an int")
            return super().forward(*args, **kwargs)

    target = tiny_model("llama", seed=3)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 1)
    draft.__class__ = CountOnly
    assert not describe(draft, "draft").headless
    pair = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=4, draft_depth=2)
    prompt = torch.randint(3, 98, (1, 24), generator=torch.Generator().manual_seed(2))
    out = pair.generate(prompt, do_sample=False, max_new_tokens=16)
    assert out.tolist() == target.generate(prompt, do_sample=False, max_new_tokens=16).tolist()
