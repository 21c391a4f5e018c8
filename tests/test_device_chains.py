"""round="device" runs chains (engine/device_chains.py) where trees cannot be exact: models that place tokens by cache
slot (ALiBi: bloom, mpt; forwards without position_ids: bart, whisper's decoder), a rule banded by key slot once a call
passes it (gpt_neo's local window), and recurrent or hybrid models, whose states are rolled back to the accepted path.
Each test fixes its shape (tree_budget, draft_depth, draft_width given: no clock decides what runs) and decodes greedy
float32 tokens equal to target.generate's, token for token, with a draft (a perturbed copy of the target) and
draft-free (suffix proposals: a second call copies the first's output, so chains of several tokens are accepted),
with tau > 1 and rounds whose chain was accepted only in part followed by more rounds.
"""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import device_chains
from hf_swiftspec.steps.probes import describe
from hf_swiftspec.tools import sweep
from test_slot_limits import gpt_neo

NEW = 80
FIXED = dict(round="device", draft_depth=4, draft_width=2, tree_budget=8)  # a chain call grows (4, 1, 5): width 1
FREE = dict(round="device", tree_budget=8, ngram_size=3)
PROMPT = sweep.prompts()[1]  # 23 tokens


def slot_model(model_type: str):
    """A tiny model whose tokens depend on what its attention sees (untied head, weights at 5x the default scale: at
    0.02 such a model repeats one token whatever it attends), and a copy with noise as its draft."""
    target = sweep.tiny_of_type(model_type, seed=1, initializer_range=0.1, tie_word_embeddings=False)
    return target, sweep.perturbed_copy(target, 0.05)


def greedy(model, prompt, new=NEW, **kwargs):
    return model.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                          pad_token_id=0, **kwargs)


def assert_chains_with_a_draft(target, draft, prompt=PROMPT, new=NEW, **settings):
    """The pair on the device round equals target.generate; its rounds are chains (at most depth + 1 nodes, where
    width 2 would verify 8) with a partial acceptance followed by more rounds. Returns the stats."""
    expected = greedy(target, prompt, new)
    pair = SwiftSpecForCausalLM.from_models(target, draft, **{**FIXED, **settings})
    assert greedy(pair, prompt, new).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and "chains for this call" in stats.attention, stats.attention
    assert stats.tau > 1.5 and max(r.budget for r in stats.rounds) == 5, (stats.tau, stats.rounds)
    assert any(0 < r.accepted < 4 for r in stats.rounds[:-1]), stats.rounds  # a chain rejected part-way, then on
    return stats


def verified_parents(monkeypatch) -> list[list[int]]:
    """Each round's verified nodes' parents (local indices), as the chain strategy hands them to the target."""
    seen, first = [], device_chains.Chains.first

    def spy(subtree, nodes):
        kept = first(subtree, nodes)
        seen.append(kept.parents[0].tolist())
        return kept

    monkeypatch.setattr(device_chains.Chains, "first", staticmethod(spy))
    return seen


def assert_chains_draft_free(target, prompt=PROMPT, monkeypatch=None):
    """Draft-free on the device round, twice: the first call's suffix proposals come from the prompt, the second's
    copy the first call's output (the pair keeps it), so long chains are accepted. Both equal target.generate; with
    `monkeypatch`, every verified tree is one path (the suffix proposals' most frequent continuation alone). Returns
    both calls' stats."""
    expected = greedy(target, prompt)
    pair = SwiftSpecForCausalLM.from_models(target, **FREE)
    parents = verified_parents(monkeypatch) if monkeypatch is not None else []
    out = []
    for _ in range(2):
        assert greedy(pair, prompt).tolist() == expected.tolist()
        out.append(pair.swiftspec_stats)
        assert "chains for this call" in out[-1].attention, out[-1].attention
    assert out[1].tau > 3, out[1].tau  # chains of several suffix tokens accepted
    assert all(p == list(range(-1, len(p) - 1)) for p in parents), [p for p in parents if len(p) > 2][:3]
    return out


@pytest.mark.parametrize("model_type", ["bloom", "mpt", "bart", "whisper"])
def test_models_placing_tokens_by_slot_decode_chains_exactly(model_type, monkeypatch):
    """ALiBi from the key length (bloom, mpt) and positions from the cache's length (bart, whisper: no position_ids):
    the chained slot cache reports the row's length and hands the keys up to the last query's slot, no mask."""
    target, draft = slot_model(model_type)
    assert len(set(greedy(target, PROMPT)[0, -NEW:].tolist())) > 10  # tokens that follow what attention sees
    assert_chains_with_a_draft(target, draft)
    assert_chains_draft_free(target, monkeypatch=monkeypatch)


def test_gpt_neo_past_its_local_window_decodes_chains_and_within_it_trees():
    """GPT-Neo bands its local layers by key slot: a call past its 7-token window runs chains (each node's slot its
    position), one within its 256-token window trees of width 2 (the slot caches attend no more slots than the
    window: eager phases, the span the rows' own)."""
    target, draft = gpt_neo(window=7)
    prompt = PROMPT % 98
    stats = assert_chains_with_a_draft(target, draft, prompt)
    assert "7-token window" in stats.attention
    assert_chains_draft_free(target, prompt)
    target, draft = gpt_neo(window=256)
    expected = greedy(target, prompt)
    pair = SwiftSpecForCausalLM.from_models(target, draft, **FIXED)
    assert greedy(pair, prompt).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert "chains" not in stats.attention and "eager phases" in stats.attention
    assert max(r.budget for r in stats.rounds) == 8 and stats.tau > 1.5


def test_replayed_phases_are_not_asked_of_a_chain():
    """capture=True: a chain's phases run eagerly all the same (a graph bakes in the span these models read the length
    of), the reason in the stats, the tokens target.generate's."""
    target, draft = slot_model("bloom")
    pair = SwiftSpecForCausalLM.from_models(target, draft, capture=True, **FIXED)
    assert greedy(pair, PROMPT).tolist() == greedy(target, PROMPT).tolist()
    assert "eager phases (target: its steps are chains" in pair.swiftspec_stats.attention


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba"])
def test_recurrent_states_roll_back_to_the_accepted_path(model_type):
    """Gated DeltaNet beside attention (qwen3_5_text) and Mamba-2 beside attention (bamba): a verification that ran past
    the accepted path has the target's states put back after the read and the accepted tokens run again at the head
    of the next verification (replayed_tokens); the recurrent draft's states go back to the level its chain was left
    at. Draft-free, the suffix proposals' one path."""
    target = sweep.tiny_of_type(model_type, seed=1)
    assert target.config.get_text_config().layer_types.count("full_attention") < len(target.config.layer_types)
    stats = assert_chains_with_a_draft(target, sweep.perturbed_copy(target, 0.05))
    assert stats.replayed_tokens > 0
    first, second = assert_chains_draft_free(target)
    assert first.replayed_tokens > 0 or second.replayed_tokens > 0


def test_replays_too_long_to_carry_run_as_a_forward_of_their_own(monkeypatch):
    monkeypatch.setattr(device_chains, "MAX_REPLAY", 0)  # every rollback's tokens run on their own
    target = sweep.tiny_of_type("bamba", seed=2)
    stats = assert_chains_with_a_draft(target, sweep.perturbed_copy(target, 0.05))
    assert stats.replayed_tokens > 0 and stats.target_forwards > stats.verify_steps + 1  # replays ran alone


def test_hybrid_layers_keep_their_states_beside_their_keys():
    """Falcon-H1's layers are transformers' "hybrid" cache layers, a Mamba-2 state beside attention's keys and values:
    the chained slot cache puts a state layer of its own there (slot_cache.SlotStateLayer), whose states roll back
    while its keys stay in the slots."""
    target = sweep.tiny_of_type("falcon_h1", seed=1)
    assert set(describe(target).layer_types) == {"hybrid"}
    stats = assert_chains_with_a_draft(target, sweep.perturbed_copy(target, 0.05), new=60)
    assert stats.replayed_tokens > 0


@pytest.mark.parametrize("model_type", ["bloom", "bamba"])
def test_sampled_chains_draw_what_the_host_round_draws(model_type):
    """Under one seed a chain's sampled tokens are the host round's (one Gumbel-max rule, noise keyed by seed, row and
    position: the target's distribution, test_sampling.py), through rollbacks too, and not greedy's."""
    target = slot_model(model_type)[0] if model_type == "bloom" else sweep.tiny_of_type(model_type, seed=1)
    draft = sweep.perturbed_copy(target, 0.05)
    kwargs = dict(max_new_tokens=40, eos_token_id=None, pad_token_id=0, do_sample=True, temperature=0.9, top_k=20)
    device = SwiftSpecForCausalLM.from_models(target, draft, **FIXED)
    drawn = device.generate(PROMPT, generator=torch.Generator().manual_seed(5), **kwargs)
    assert "chains for this call" in device.swiftspec_stats.attention and device.swiftspec_stats.tau > 1
    assert (device.swiftspec_stats.replayed_tokens > 0) == (model_type == "bamba")
    host = SwiftSpecForCausalLM.from_models(target, draft, **{**FIXED, "round": "host"})
    assert drawn.tolist() == host.generate(PROMPT, generator=torch.Generator().manual_seed(5), **kwargs).tolist()
    assert drawn.tolist() != greedy(target, PROMPT, 40).tolist()


def test_a_batch_of_a_chain_model_is_not_speculated():
    """Chains are one row's (the chained caches report one length): round="device" refuses a batch of such a model,
    naming why; round="auto" decodes it with transformers' own loop, exactly, as it did before."""
    from hf_swiftspec.tools.models import left_padded, random_prompts

    target, draft = slot_model("bloom")
    ids, mask = left_padded(random_prompts((5, 9), 0, 120))
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    with pytest.raises(ValueError, match="round='device' cannot decode this call exactly: the target's steps must be "
                                         "chains"):
        SwiftSpecForCausalLM.from_models(target, draft, **FIXED).generate(ids, **kwargs)
    pair = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=8, draft_depth=4)
    with pytest.warns(UserWarning, match="the target's own decoding loop"):
        assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
