"""Rules that attention modules apply by cache slot (architectures.SLOT_RULES): trees below them, past them
chains (slot = position again) or the target's own loop, and never a silent difference.

GPT-Neo bands its local layers' causal mask by key slot inside its attention (`self.bias[key_len - q_len :
key_len]`), declared by `window_size` and `attention_types`, neither of which transformers' layer types
report; a tree node sits at a slot past its position, so a 7-token window made the tree differ from
target.generate at generated token 17 (issue 26). Doge keeps its best `keep_window_size` keys once a
forward holds more slots than that; llama4's NoPE layers scale queries by a temperature stepped every
`floor_scale` cache slots.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GPTNeoConfig, GPTNeoForCausalLM

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools import sweep
from hf_swiftspec.steps.probes import describe
from hf_swiftspec.steps.slot_cache import SlotLayer
from hf_swiftspec.tools.models import left_padded, random_prompts

PROMPT = torch.randint(3, 98, (1, 7), generator=torch.Generator().manual_seed(0))  # 7 tokens, as the issue's
GREEDY = dict(do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=98)
SETTINGS = {"fixed": dict(tree_budget=8, draft_depth=4), "default": {}}


def gpt_neo(window: int):
    """The issue's GPT-Neo (a global and a local layer), with weights 5x the default scale so that its tokens
    depend on what attention sees (at 0.02 a tiny random model repeats one token whatever the window), and a
    copy with noise as the draft."""
    torch.manual_seed(0)
    config = GPTNeoConfig(vocab_size=99, hidden_size=32, num_layers=2, num_heads=4, window_size=window,
                          attention_types=[[["global", "local"], 1]], pad_token_id=98, bos_token_id=1, eos_token_id=None,
                          initializer_range=0.1)  # fmt: skip
    target = GPTNeoForCausalLM(config).eval()
    return target, sweep.perturbed_copy(target, scale=0.05)


@pytest.mark.parametrize("setting", SETTINGS)
def test_gpt_neo_past_its_local_window_decodes_chains_exactly(setting):
    target, draft = gpt_neo(window=7)
    pair = SwiftSpecForCausalLM.from_models(target, draft, **SETTINGS[setting])
    out = pair.generate(PROMPT, **GREEDY)
    assert out.tolist() == target.generate(PROMPT, **GREEDY).tolist()
    assert describe(target).slot_limits[0].length == 7
    assert sweep.call_chain_reason(pair.swiftspec_stats.attention).startswith(
        "the target applies its local layers' 7-token window inside its attention, by cache slot")


@pytest.mark.parametrize("setting", SETTINGS)
def test_gpt_neo_within_its_window_speculates_trees_exactly(setting):
    target, draft = gpt_neo(window=256)
    pair = SwiftSpecForCausalLM.from_models(target, draft, **SETTINGS[setting])
    out = pair.generate(PROMPT, **GREEDY)
    assert out.tolist() == target.generate(PROMPT, **GREEDY).tolist()
    assert "chains" not in pair.swiftspec_stats.attention
    if setting == "fixed":
        assert pair.swiftspec_stats.tau > 1.0


def test_a_padded_batch_past_the_window_decodes_with_the_targets_loop():
    """Chains are one sequence at a time: a batch whose steps reach the window takes transformers' loop, saying why."""
    target, draft = gpt_neo(window=7)
    ids, mask = left_padded(random_prompts((3, 9, 5), 0, 98), pad=98)
    pair = SwiftSpecForCausalLM.from_models(target, draft)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pair.generate(ids, attention_mask=mask, **GREEDY)
    assert out.tolist() == target.generate(ids, attention_mask=mask, **GREEDY).tolist()
    assert any("decoded this batch of 3 with the target's own decoding loop" in str(w.message) and "7-token window"
               in str(w.message) for w in caught)
    assert pair.swiftspec_stats.engine.startswith("target (batch: ")


def test_doge_past_its_key_budget_decodes_with_the_targets_loop():
    target = sweep.tiny_of_type("doge", keep_window_size=4)
    pair = SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target), tree_budget=8, draft_depth=4)
    prompt = sweep.prompts()[1]  # 23 tokens: past the 4 keys it keeps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sweep.own_generate(pair, prompt, 12, swiftspec=True)
    assert out.tolist() == sweep.own_generate(target, prompt, 12).tolist()
    assert any("decoded this call with the target's own decoding loop" in str(w.message) and "keeps only its 4 "
               "best-scored keys" in str(w.message) for w in caught)


def test_llama4_temperature_steps_make_calls_past_them_chains():
    # attn_scale 0.1 -> 20: the temperature's steps then change tokens of a tiny model, not only logits
    target = sweep.tiny_of_type("llama4_text", floor_scale=8, attn_scale=20.0, no_rope_layers=[0, 1])
    pair = SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target), tree_budget=8, draft_depth=4)
    prompt = sweep.prompts()[0][:, :9]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a chain is exact: no fallback, no warning
        out = sweep.own_generate(pair, prompt, 16, swiftspec=True)
    assert out.tolist() == sweep.own_generate(target, prompt, 16).tolist()
    (limit,) = describe(target).slot_limits
    assert limit.length == 7 and limit.beyond == "chain"
    assert sweep.call_chain_reason(pair.swiftspec_stats.attention) is not None


def test_compile_decodes_a_slot_rule_as_the_eager_round():
    """compile=True refuses nothing the round serves: a model with slot rules runs its steps uncompiled (capture.py's
    capture_gap), as the eager round does, and gives target.generate's tokens."""
    target, draft = gpt_neo(window=256)
    pair = SwiftSpecForCausalLM.from_models(target, draft, compile=True)
    assert pair.generate(PROMPT, **GREEDY).tolist() == target.generate(PROMPT, **GREEDY).tolist()
    assert "replayed" not in pair.swiftspec_stats.attention


GREEDY_40 = dict(do_sample=False, max_new_tokens=40, min_new_tokens=40, eos_token_id=None, pad_token_id=0)


def indexer_model(model_type: str):
    """A tiny sparse-attention model with an 8-key indexer (the sweep's; latent attention wants as many
    key/value heads as query heads when it is given a mask). Its pad token's embedding row is zero, so a
    query at token 0 scores every key 0: exact ties, which torch.topk breaks by the row's layout."""
    model = sweep.tiny_of_type(model_type, index_topk=8, **sweep.head_overrides(model_type, "mha"))
    return model, sweep.perturbed_copy(model)


@pytest.mark.parametrize("setting", SETTINGS)
def test_an_indexer_past_its_top_k_decodes_with_the_targets_loop(setting):
    """Issue 26: axk2 with index_topk=8 differed from target.generate (any multi-token step, chains too: its
    indexer's topk keeps other keys among exactly tied ones when the row holds more slots)."""
    target, draft = indexer_model("deepseek_v32")
    pair = SwiftSpecForCausalLM.from_models(target, draft, **SETTINGS[setting])
    prompt = torch.tensor([random_prompts((3, 23, 9, 1, 7, 12), 4, 128)[0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pair.generate(prompt, **GREEDY_40)
    assert out.tolist() == target.generate(prompt, **GREEDY_40).tolist()
    assert any("keeps the top 8 keys its indexer scores" in str(w.message) for w in caught)
    ids, mask = left_padded(random_prompts((3, 23, 9, 1, 7, 12), 0, 128))
    target, draft = indexer_model("axk2")
    pair = SwiftSpecForCausalLM.from_models(target, draft, **SETTINGS[setting])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = pair.generate(ids, attention_mask=mask, **GREEDY_40)
    assert out.tolist() == target.generate(ids, attention_mask=mask, **GREEDY_40).tolist()


def counting_indexer_writes(monkeypatch) -> list[int]:
    """The queries of each indexer-key write into a slot cache (the device round's caches hold them)."""
    seen, update = [], SlotLayer.update_indexer

    def counted(self, states):
        seen.append(states.shape[1])
        return update(self, states)

    monkeypatch.setattr(SlotLayer, "update_indexer", counted)
    return seen


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_an_indexer_within_its_top_k_speculates_trees_on_the_device_round(model_type, setting, monkeypatch):
    """Below index_topk every visible key is kept, ties or not: trees are exact there, on the round CUDA takes too
    (round='auto'), its slot caches holding the indexer's keys beside keys and values (written at the tree's slots,
    committed and moved with them); a lone prompt, and a left-padded batch whose rows stop at their own EOS (rows
    leave: the kept rows move down, their indexer keys too)."""
    writes = counting_indexer_writes(monkeypatch)
    model = sweep.tiny_of_type(model_type, index_topk=128, **sweep.head_overrides(model_type, "mha"))
    pair = SwiftSpecForCausalLM.from_models(model, sweep.perturbed_copy(model), **SETTINGS[setting])
    prompt = torch.tensor([random_prompts((9,), 4, 128)[0]])
    out = pair.generate(prompt, **GREEDY_40)
    assert out.tolist() == model.generate(prompt, **GREEDY_40).tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and stats.round_choice == "round='auto': the device round" and stats.tau > 1.0
    assert writes and max(writes) > 1  # the tree's queries wrote indexer keys into the slot caches
    ids, mask = left_padded(random_prompts((3, 23, 9, 1, 7, 12), 0, 128))
    free = model.generate(ids, attention_mask=mask, **GREEDY_40)
    call = dict(GREEDY_40, min_new_tokens=0, eos_token_id=int(free[1, ids.shape[1] + 5]))  # row 1 stops early
    out = pair.generate(ids, attention_mask=mask, **call)
    assert out.tolist() == model.generate(ids, attention_mask=mask, **call).tolist()
    assert pair.swiftspec_stats.engine == "device"


@pytest.mark.parametrize("capture", [False, True])
def test_doge_within_its_key_budget_runs_the_device_round(capture):
    """Within keep_window_size a forward keeps every key: the device round decodes it (eagerly: rules by slot are
    never replayed), and a call that reaches the budget on round='device' is refused by name (on 'auto': the target's
    loop, test_doge_past_its_key_budget_decodes_with_the_targets_loop)."""
    target = sweep.tiny_of_type("doge", keep_window_size=128)
    pair = SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target), round="device", capture=capture)
    prompt = torch.tensor([random_prompts((9,), 4, 128)[0]])
    out = pair.generate(prompt, **GREEDY_40)
    assert out.tolist() == target.generate(prompt, **GREEDY_40).tolist()
    assert pair.swiftspec_stats.engine == "device" and "replayed" not in pair.swiftspec_stats.attention
    long = dict(GREEDY_40, max_new_tokens=100, min_new_tokens=100)  # 9 + 100 + the largest tree: past 128
    with pytest.raises(ValueError, match=r"round='device'.*keeps only its 128 best-scored keys.*reach 141 slots"):
        pair.generate(prompt, **long)


def test_doge_within_its_key_budget_shares_the_device_rounds_running_batch():
    """The server's running batch on the device round takes such a target too: each request is checked at its join
    (one whose own slots reach the budget is refused by name), so a round's forwards, which hold the longest row's
    slots over the live length (eagerly, whatever capture says), keep every key; requests joining and leaving it decode
    as target.generate does."""
    from hf_swiftspec.engine.continuous_device import DeviceContinuousEngine
    from test_continuous import relay_calls

    target = sweep.tiny_of_type("doge", keep_window_size=128)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target), round="device", capture=True)
    engine = pair.continuous_engine()
    assert isinstance(engine, DeviceContinuousEngine) and engine.runner is None
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
             for p, n in zip(random_prompts((9, 30, 4), 5, 128), (40, 20, 30))]
    try:
        out = relay_calls(pair, engine, calls, at=(2, 1, 1), wait_s=300)
        with pytest.raises(ValueError, match=r"cannot join the server's speculating batch.*keeps only its 128 best"):
            pair.generate(swiftspec_engine=(engine, "long"), **dict(calls[1], max_new_tokens=90))
    finally:
        engine.close()
    for i, call in enumerate(calls):
        assert out[i].tolist() == target.generate(**call).tolist(), i
