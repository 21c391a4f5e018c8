"""What a device round (round="device") costs a GPU, counted on the CPU (hf_swiftspec/tools/counters.py): per round at
most one host read and one tensor made of host data (the suffix proposals' pinned copy; none without them), operators
dispatched outside the two models' forwards under a ceiling (each one a kernel on a GPU, replayed or not), and
attention that reads the live length (the rows' longest prefix and the tree), not the slot capacity.

The ceiling is what the round dispatches today on the demo pair (tree_budget=8, draft_depth=3, draft_width=2, suffix
proposals on: examples/results/cpu-device-round-counts) with a little room: a change that adds a pass per node or per
layer to the round's bookkeeping fails it."""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import rounds
from hf_swiftspec.engine.device_sides import DeviceSides
from hf_swiftspec.pair import DEMO_PAIR_NAME, bundled_pair
from hf_swiftspec.steps.slot_cache import span_bucket
from hf_swiftspec.tools.counters import KeysRead, OperatorCounter, SyncCounter
from hf_swiftspec.tools.models import left_padded

SETTINGS = dict(round="device", tree_budget=8, draft_depth=3, draft_width=2)
OUTSIDE_CEILING = 100  # operators a round outside the forwards (measured: 53-62 a round; the goal: ~100)
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Config:\n    def __init__(self, path):\n",
           "def read_lines(path):\n    with open(path) as f:\n", "import json\n\n\ndef load(path):\n"]


@pytest.fixture(scope="module")
def demo():
    folder = bundled_pair(DEMO_PAIR_NAME)
    if folder is None:
        pytest.skip("the bundled demo pair is missing")
    return folder


def counted_rounds(pair, monkeypatch) -> list[dict]:
    """Per round (rounds.one_round, the round's whole body): reads, host-data tensors, operators outside and inside the
    forwards, the keys each attention call read, and the longest live prefix (host mirror) and span before the round."""
    seen, body = [], rounds.one_round

    def counted(sides, rows):
        assert isinstance(sides, DeviceSides)  # the device round ran, not a fallback
        longest = max(h.prefix for h in sides.host[: sides.live])
        with SyncCounter() as sync, OperatorCounter((pair.target, pair.draft)) as ops, KeysRead() as keys:
            keep = body(sides, rows)
        seen.append(dict(reads=sync.total, host=sync.host_tensors, outside=ops.outside, forwards=ops.forwards,
                         keys={k for _, k in keys.calls}, longest=longest, tree=sides.tree_slots,
                         capacity=sides.capacity))
        return keep

    monkeypatch.setattr(rounds, "one_round", counted)
    return seen


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("ngram_size", [3, 0], ids=["suffix", "no-suffix"])
def test_a_round_reads_once_copies_once_and_dispatches_under_the_ceiling(demo, rows, ngram_size, monkeypatch):
    pair = SwiftSpecForCausalLM.from_pretrained(demo, dtype=torch.float32, ngram_size=ngram_size, **SETTINGS)
    tok = pair.tokenizer
    ids, mask = left_padded([tok(p).input_ids for p in PROMPTS[:rows]], pad=tok.pad_token_id or 0)
    seen = counted_rounds(pair, monkeypatch)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40)
    out = pair.generate(ids, **kwargs)
    assert out.tolist() == pair.target.generate(ids, **kwargs).tolist()
    assert pair.swiftspec_stats.engine == "device" and len(seen) == len(pair.swiftspec_stats.rounds)
    assert max(r["reads"] for r in seen) == 1
    assert max(r["host"] for r in seen) == (1 if ngram_size else 0)  # the suffix proposals' one copy
    assert max(r["outside"] for r in seen[1:]) <= OUTSIDE_CEILING, [r["outside"] for r in seen]
    assert min(r["forwards"] for r in seen) > 0


def test_attention_reads_the_live_length_not_the_capacity(demo, monkeypatch):
    """Every attention call of a round reads the rows' longest prefix plus what the phase writes (eagerly, exactly: the
    growth its tree's nodes, the verification its T nodes, each with the scratch slot; rounded up to a power of two of
    the prefix and the whole tree region where the phases replay), far below the slot capacity the pool allocates."""
    depth, width, budget = SETTINGS["draft_depth"], SETTINGS["draft_width"], SETTINGS["tree_budget"]
    for capture in (False, True):
        pair = SwiftSpecForCausalLM.from_pretrained(demo, dtype=torch.float32, capture=capture, **SETTINGS)
        ids = pair.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        seen = counted_rounds(pair, monkeypatch)
        pair.generate(ids, do_sample=False, max_new_tokens=40)
        for r in seen:
            longest = r["longest"]
            want = {span_bucket(longest + r["tree"])} if capture else {longest + 1 + depth * width + 1,
                                                                        longest + budget + 1}
            assert r["keys"] <= want, (r["keys"], want)  # emulated replays run no attention of their own
            assert max(want) < r["capacity"] or r["capacity"] == max(want)
        assert seen[-1]["capacity"] >= 256 > 2 * (seen[-1]["longest"] + seen[-1]["tree"])
