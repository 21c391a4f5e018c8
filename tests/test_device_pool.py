"""The device round's graphs kept across a pair's calls (engine/device_pool.py): a later call of as many rows
replays the graphs an earlier call captured, over the same slots, and still decodes target.generate's tokens (the
emulating backend replays the capture's call: a prompt, a prefix or a root baked into a graph would decode the first
call's text); calls of other row buckets get their own slots, at most KEPT sets with their graphs; a call whose rows
finish at different times leaves the pool's slots whole and no graph over slots the pool dropped."""

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import device_pool
from hf_swiftspec.engine.device_pool import bucket_for
from hf_swiftspec.steps.capture import capacity_bucket
from hf_swiftspec.tools.models import left_padded, tiny_model, truncated_draft

SETTINGS = dict(round="device", ngram_size=0, draft_depth=2, draft_width=2, tree_budget=4, capture=True)
PROMPTS = [[5, 17, 33, 8, 61], [40, 9, 12, 7, 7, 3], [70, 18, 2], [11, 4, 90, 23, 6, 1, 8], [3, 3, 50, 21]]


def captured_by_the_call(pair) -> int:
    """Graphs the last call captured, as its stats say."""
    attention = pair.swiftspec_stats.attention
    return int(attention.split(" captured by this call")[0].split(", ")[-1])


def decode(pair, target, rows: list[list[int]], **kwargs):
    ids, mask = (torch.tensor(rows), None) if len(rows) == 1 else left_padded(rows)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, **kwargs)
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    assert pair.swiftspec_stats.engine == "device"


def test_a_later_call_replays_the_earlier_calls_graphs_and_decodes_its_own_text(monkeypatch):
    monkeypatch.setattr(device_pool, "KEPT", 3)  # a few row buckets reach it
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **SETTINGS)
    decode(pair, target, PROMPTS[:1])
    pool = pair.captures.device
    first = captured_by_the_call(pair)
    assert first > 0 and len(pool.runner.graphs) == first
    replays, kept = pool.runner.replays, dict(pool.runner.graphs)
    decode(pair, target, PROMPTS[1:2])  # another prompt, another length: the same graphs (and any shape it met anew)
    assert pool.runner.replays > replays and all(pool.runner.graphs[k] is g for k, g in kept.items())
    assert captured_by_the_call(pair) == len(pool.runner.graphs) - len(kept)

    # a batch whose rows finish at different times (an EOS one row reaches first): the row that stays moves into
    # the pool's one-row slots, whose graphs replay; the two-row slots stay whole for the next batch of two
    free = target.generate(left_padded(PROMPTS[:2])[0], attention_mask=left_padded(PROMPTS[:2])[1],
                           do_sample=False, max_new_tokens=16)
    eos = int(free[0, -10])
    one_row = {k for k in pool.runner.graphs if k[1] == 1}
    decode(pair, target, PROMPTS[:2], eos_token_id=eos)
    assert {k for k in pool.runner.graphs if k[1] == 1} == one_row  # the one-row phases were the earlier calls'
    assert 2 <= captured_by_the_call(pair) == sum(k[1] == 2 for k in pool.runner.graphs)
    kept = {s.addresses() for s in pool.sets.values()}
    assert all(key[-1] in kept for key in pool.runner.graphs), "graphs over slots the pool dropped were kept"
    assert all(layer.keys.shape[0] == rows for (rows, *_), slots in pool.sets.items()
               for cache in slots.caches for layer in cache.layers)
    graphs = len(pool.runner.graphs)
    decode(pair, target, PROMPTS[2:4])
    assert captured_by_the_call(pair) == len(pool.runner.graphs) - graphs  # no graph it had captured again

    for rows in (3, 4, 5):  # more row buckets (3 rows: the bucket of 4): the oldest sets and their graphs dropped
        decode(pair, target, PROMPTS[:rows])
    assert len(pool.sets) == device_pool.KEPT
    kept = {s.addresses() for s in pool.sets.values()}
    assert all(key[-1] in kept for key in pool.runner.graphs)
    dropped = min(rows for rows in range(1, 6) if bucket_for(rows) not in {key[0] for key in pool.sets})
    decode(pair, target, PROMPTS[:dropped])  # a bucket whose set was dropped: captured afresh, and still exact
    assert captured_by_the_call(pair) > 0


def test_pooled_capacities_are_powers_of_two_calls_of_nearby_lengths_share():
    assert [capacity_bucket(n) for n in (1, 200, 256, 257, 600)] == [256, 256, 256, 512, 1024]
