"""The running batch on the device round (engine/continuous_device.py): requests join and leave a batch whose cache
rows are padded to a power-of-two bucket, each decoding exactly as target.generate does (greedy, float32), with one
host read a round; replayed (the emulate backend) a bucket's graphs (one per phase and live length) serve every row
count it holds and come back when the batch does, and a joining row's values reach them as inputs (else: the capture's rows' tokens); suffix
proposals and a draft head (EAGLE-3) ride in it per row.

Joins are made deterministic as in tests/test_continuous.py (its Relay: a request's streamer, at its k-th round,
starts the next one and holds the engine's thread until that one waits in the engine's queue)."""

from __future__ import annotations


import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import continuous, device_phases, device_pool, rounds
from hf_swiftspec.steps import capture as replayed_steps
from hf_swiftspec.engine.continuous_device import DeviceContinuousEngine
from hf_swiftspec.engine.device_pool import SlotPool, bucket_for
from hf_swiftspec.engine.device_sides import DeviceSides
from hf_swiftspec.tools.models import char_tokenizer, random_prompts, tiny_model, truncated_draft
from gumbel_reference import seeded_draws
from sync_counter import SyncCounter
from test_continuous import pair_of, relay_calls

DEVICE = dict(round="device", ngram_size=0, draft_depth=3, draft_width=2, tree_budget=6)  # one shape: no clock decides
PROMPTS = random_prompts((3, 23, 9, 1, 14, 30), 0, 98)
NEW = (20, 7, 33, 12, 1, 40)  # the last needs 79 slots: the running rows move to caches of 128
AT = (2, 1, 3, 2, 1, 2)  # each request starts when the one before it is this many rounds in


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=0)
    model.generation_config.eos_token_id = None  # each request names the EOS it stops at
    return model


def relay(pair, engine, calls: list[dict], at=AT) -> dict[int, torch.Tensor]:
    """test_continuous's relay_calls, with this file's join rounds by default."""
    return relay_calls(pair, engine, calls, at, wait_s=300)


def greedy_calls(target) -> list[dict]:
    """Six requests of different prompt lengths and budgets; two stop at an EOS of their own, mid-answer."""
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False) for p, n in zip(PROMPTS, NEW)]
    for i, at in ((0, 9), (2, 15)):
        free = target.generate(calls[i]["input_ids"], max_new_tokens=NEW[i], do_sample=False)
        calls[i]["eos_token_id"] = int(free[0, len(PROMPTS[i]) + at])
    return calls


def assert_answers_are_target_generates(target, calls, out) -> None:
    for i, call in enumerate(calls):
        kwargs = {k: v for k, v in call.items() if k != "input_ids"}
        expected = target.generate(call["input_ids"], **kwargs)
        assert out[i].tolist() == expected.tolist(), f"request {i}"


def watch_rounds(monkeypatch) -> list[dict]:
    """Per round of the running batch: its host reads (SyncCounter over rounds.one_round, the round's whole body),
    its draft forwards, its live rows and its bucket."""
    seen, body = [], rounds.one_round

    def counted(sides, rows):
        if not isinstance(sides, DeviceSides):  # a reference call's own rounds (the host round's)
            return body(sides, rows)
        forwards, live, bucket = sides.counters[1].forwards, len(rows.live), sides.bucket  # before the round
        with SyncCounter() as counter:
            keep = body(sides, rows)
        seen.append(dict(reads=counter.total, draft=sides.counters[1].forwards - forwards, rows=live, bucket=bucket,
                         live=tuple(rows.live), capacity=sides.capacity))
        return keep

    monkeypatch.setattr(rounds, "one_round", counted)
    return seen


def poison(caches, rows: slice) -> None:
    for cache in caches:
        for buffer in cache.buffers if cache is not None else ():
            buffer.data[:, rows] = 1e4


def poison_unused_slots(monkeypatch) -> None:
    """Fill every dead padding row's KV, and every new slot set's caches, with large values (a tiny random model's next
    token follows its context weakly; these it cannot miss): a live row that saw a dead row's slots, or a slot of its
    own that its join or a move (to new slots, or into a hole in place) did not copy, would decode other tokens. A move
    copies only the slots its rows hold (DeviceSides.held_slots): the rest stays poisoned, which the masks must hide."""
    move_rows, slots = DeviceSides.move_rows, SlotPool.slots

    def poisoned_move(self, order, count, bucket, like=None):
        if self.slots is not None:  # the holes a move fills: whatever it does not copy stays poisoned
            for hole in [i for i, b in enumerate(order or []) if i != b]:
                poison(self.slots.caches, slice(hole, hole + 1))
        move_rows(self, order, count, bucket, like)
        poison(self.slots.caches, slice(count, None))

    def poisoned_slots(self, rows, *args, **kwargs):
        new = (rows, *args[:3]) not in self.sets
        made = slots(self, rows, *args, **kwargs)
        if new:
            poison(made.caches, slice(None))
        return made

    monkeypatch.setattr(DeviceSides, "move_rows", poisoned_move)
    monkeypatch.setattr(SlotPool, "slots", poisoned_slots)


@pytest.mark.parametrize("capture", [False, True])
def test_rows_joining_and_leaving_a_bucketed_batch_equal_target_generate(target, capture, monkeypatch):
    """Six requests join at different rounds (1, 2 and 3 rows decode together) and leave at their budgets or EOS:
    each answer is target.generate's, with the draft growing every round, at most one host read a round, and the cache
    rows padded to a power of two (the row count of 3 runs on the bucket of 4). A request needing more slots than the
    batch's caches hold grows them (a new capacity). Replayed: one graph per phase per bucket, whatever row counts
    the bucket held and however often the batch came back to it (one per live length it reached), for every bucket the
    batch ran at its last capacity (a new capacity drops the smaller one's)."""
    poison_unused_slots(monkeypatch)
    monkeypatch.setattr(replayed_steps, "SMALLEST_CAPACITY", 32)  # small capacities, so requests outgrow them
    seen = watch_rounds(monkeypatch)
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), capture=capture, **DEVICE)
    engine = pair.continuous_engine()
    assert isinstance(engine, DeviceContinuousEngine)
    calls = greedy_calls(target)
    try:
        out = relay(pair, engine, calls)
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls, out)
    assert max(r["reads"] for r in seen) <= 1 and min(r["draft"] for r in seen) >= DEVICE["draft_depth"]
    assert all(r["bucket"] == bucket_for(r["rows"]) for r in seen)
    assert {r["rows"] for r in seen} >= {1, 2, 3} and engine.served == len(calls)  # 3 rows: the bucket of 4
    buckets = [r["bucket"] for r in seen]
    switches = sum(a != b for a, b in zip(buckets, buckets[1:]))
    assert switches > len(set(buckets)) and engine.bucket_changes >= switches  # buckets were come back to
    assert engine.capacity_changes >= 2  # the slots grew twice (32, 64, 128 slots), the last time under live rows
    if capture:
        runner = engine.runner
        graphs = engine.graphs_by_slots()  # growth and verification, per bucket and live length
        last = [r["bucket"] for r in seen if r["capacity"] == seen[-1]["capacity"]]  # (a new capacity drops the rest)
        assert set(graphs.values()) == {2} and {bucket for bucket, _ in graphs} == set(last) and len(set(last)) > 1
        assert runner.replays >= len(seen) and not runner.fallbacks
    else:
        assert engine.runner is None


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
def test_rows_joining_with_wider_eos_lists(target, capture):
    """Requests with one, three and one EOS ids (none reached: they run on) and then one with five (reached mid-answer,
    the largest of them, so the last the device holds) join the running batch: the last joins a bucket of 4 with room
    for it, so the batch moves to slots of the wider EOS width for it alone (graphs of their own); every answer is
    target.generate's, the last cut at its EOS."""
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), capture=capture, **DEVICE)
    calls = []
    for prompt, width in zip((PROMPTS[0], PROMPTS[2], PROMPTS[5], PROMPTS[1]), (1, 3, 1, 5)):
        ids = torch.tensor([prompt])
        new = target.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
        if width < 5:
            eos = [t for t in range(98) if t not in new][:width]
        else:
            reached = new[next(k for k in range(10, 40) if new[k] not in new[:k])]  # its first time: mid-answer
            eos = [t for t in range(reached) if t not in new][: width - 1] + [reached]
        assert len(eos) == width
        calls.append(dict(input_ids=ids, max_new_tokens=40, do_sample=False, eos_token_id=eos))
    engine = pair.continuous_engine()
    try:
        out = relay(pair, engine, calls, at=(2, 2, 2, 2, 2))
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls, out)
    assert out[3].shape[1] < calls[3]["input_ids"].shape[1] + 40  # its EOS ended it


def test_stop_strings_and_sampled_rows_among_greedy_ones(target):
    """A request with a stop string (cut on the host after the round's read) and a sampled one (temperature, top_k:
    its noise keyed by its seed and positions) share the batch with greedy ones: the greedy and stopped answers are
    target.generate's, the sampled one is what its seed draws (gumbel_reference)."""
    tok = char_tokenizer()
    draft = truncated_draft(target, 2)
    pair = SwiftSpecForCausalLM.from_models(target, draft, capture=True, **DEVICE)
    calls = greedy_calls(target)[:4]
    free = target.generate(calls[1]["input_ids"], max_new_tokens=NEW[1], do_sample=False)[0, len(PROMPTS[1]):]
    calls[1].update(stop_strings=[tok.decode(free[3:5])], tokenizer=tok)
    sampled = dict(input_ids=calls[3]["input_ids"], max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20)
    calls[3] = dict(sampled, generator=torch.Generator().manual_seed(5))
    engine = pair.continuous_engine()
    try:
        out = relay(pair, engine, calls)
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls[:3], out)
    assert out[1].shape[1] < len(PROMPTS[1]) + NEW[1]  # the stop string cut it
    drawn = seeded_draws(target, sampled["input_ids"], torch.Generator().manual_seed(5), temperature=0.9, top_k=20,
                         max_new_tokens=16)
    assert out[3].tolist() == drawn.tolist()
    assert out[3].tolist() != target.generate(sampled["input_ids"], max_new_tokens=16, do_sample=False).tolist()


def test_what_the_device_batch_cannot_decode_is_refused_by_name(target):
    """A pair the device batch cannot decode exactly is refused when its engine is made (a recurrent target, whose
    state rolls back for one sequence at a time)."""
    from hf_swiftspec.tools import sweep

    recurrent = SwiftSpecForCausalLM.from_models(sweep.tiny_of_type("mamba2", seed=0, vocab_size=98), None,
                                                 round="device")
    with pytest.raises(ValueError, match="recurrent state rolls back per sequence"):
        recurrent.continuous_engine()


def test_requests_whose_processors_read_the_path_share_the_batch(target, monkeypatch):
    """Requests with a repetition penalty (greedy) and no_repeat_ngram_size (sampled) join greedy ones without: while
    one of them is in the batch every row is walked on the host over the read logits (engine/device_walk.py), else on
    the device; the greedy answers are target.generate's, the sampled one what its seed draws (gumbel_reference)
    with that seed."""
    from hf_swiftspec.engine import device_walk

    walked, walk = [], device_walk.walk_rows

    def uncounted(logits, subtrees, *rest):  # the host's walk, on host copies: no read of the device (uncounted)
        walked.append(len(subtrees))
        with torch._C.DisableTorchFunction():
            return walk(logits, subtrees, *rest)

    monkeypatch.setattr(device_walk, "walk_rows", uncounted)
    seen = watch_rounds(monkeypatch)
    draft = truncated_draft(target, 2)
    pair = SwiftSpecForCausalLM.from_models(target, draft, **DEVICE)
    calls = greedy_calls(target)[:4]
    calls[1]["logits_processor"] = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    sampled = dict(input_ids=calls[3]["input_ids"], max_new_tokens=16, do_sample=True, temperature=0.9,
                   no_repeat_ngram_size=2)
    calls[3] = dict(sampled, generator=torch.Generator().manual_seed(5))
    engine = pair.continuous_engine()
    try:
        out = relay(pair, engine, calls)
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls[:3], out)
    assert out[1].tolist() != target.generate(calls[1]["input_ids"], max_new_tokens=NEW[1], do_sample=False).tolist()
    assert out[3].tolist() == seeded_draws(target, sampled["input_ids"], torch.Generator().manual_seed(5),
                                           temperature=0.9, top_k=50,  # generate()'s default top_k
                                           max_new_tokens=16, no_repeat_ngram_size=2).tolist()
    assert max(walked) >= 2 and len(walked) < len(seen)  # walked on the host with others, and on the device alone
    assert max(r["reads"] for r in seen) == 1
def test_bucket_for_rounds_up_to_a_power_of_two():
    assert [bucket_for(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert device_phases.processors_signature(None) == ()


def test_serve_round_device_flag_and_one_request_through_it(monkeypatch):
    """`swiftspec serve --continuous-batching --round device --ngram-size 0` reaches the pair's settings; served so,
    a request decodes in the device batch (DeviceContinuousEngine) and answers what the target alone answers. A pair
    the device batch cannot take is refused by name, not routed to the host round's batch or the target's."""
    pytest.importorskip("openai")
    from hf_swiftspec import compat

    if not compat.serving_available():
        pytest.skip("transformers' server dependencies are not installed")
    from test_serve import batcher, started

    from hf_swiftspec.cli import main
    from hf_swiftspec.serving import server as serve_module
    from hf_swiftspec.pair.locate import bundled_pair

    options = []
    monkeypatch.setattr(serve_module, "serve", lambda o: options.append(o))
    assert main(["serve", "swiftspec-demo-pystdlib", "--continuous-batching", "--round", "device", "--ngram-size", "0"]) == 0
    assert options[0].continuous_batching and options[0].settings == {"round": "device", "ngram_size": 0}

    from hf_swiftspec.tools import sweep

    recurrent = sweep.tiny_of_type("mamba2", seed=0, vocab_size=98)  # its state rolls back for one sequence at a time
    served = serve_module.ServedPair.from_models(recurrent, None, round="device")
    served.served, served.sequential = serve_module.Served(), False
    with pytest.raises(ValueError, match="--round device with --continuous-batching: .*recurrent"):
        served.init_continuous_batching()

    folder = bundled_pair("swiftspec-demo-pystdlib")
    with started(folder, "continuous-batching", **DEVICE) as (running, client, name):
        reply = client.completions.create(model=name, prompt="def read_config(path):\n", max_tokens=12, temperature=0)
        engine = batcher(running).engine
        assert isinstance(engine, DeviceContinuousEngine) and engine.served == 1
    pair = SwiftSpecForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = pair.tokenizer("def read_config(path):\n", return_tensors="pt").input_ids
    expected = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert reply.choices[0].text == pair.tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)


def test_sampled_rows_with_the_same_settings_share_a_buckets_graphs(target, monkeypatch):
    """Three sampled requests (temperature 0.9, top_k 20, seeds of their own), replayed: the second joins the first,
    the third joins once the second has left (the bucket of 2 holds other rows' processors then). Each
    draws what its lone host-round call draws with its seed (its noise reaches the graph as an input), and requests
    with the same settings share each bucket's graphs (the processors are keyed by their settings, not the objects
    each request brings)."""
    draft = truncated_draft(target, 2)
    pair = SwiftSpecForCausalLM.from_models(target, draft, capture=True, **DEVICE)
    host = SwiftSpecForCausalLM.from_models(target, draft, ngram_size=0)
    settings = dict(do_sample=True, temperature=0.9, top_k=20)
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=n, generator=torch.Generator().manual_seed(i), **settings)
             for i, (p, n) in enumerate(zip(PROMPTS[:3], (40, 4, 8)))]
    seen = watch_rounds(monkeypatch)
    engine = pair.continuous_engine()
    try:
        out = relay(pair, engine, calls, at=(2, 99, 1))  # 99: past the second's last round, so when it is done
    finally:
        engine.close()
    for i, call in enumerate(calls):
        alone = host.generate(**dict(call, generator=torch.Generator().manual_seed(i)))
        assert out[i].tolist() == alone.tolist(), f"request {i}"
    pairs_in_bucket_2 = {r["live"] for r in seen if r["bucket"] == 2}
    assert len(pairs_in_bucket_2) == 2 and set(engine.graphs_by_slots().values()) == {2}


REPEATING = [[5, 17, 33, 8, 61, 9, 40] * 3, [12, 7, 44, 7, 12, 7, 44], [3, 90, 21] * 4 + [3], [70, 18]]


def suffix_walked_in_the_batch(target, pair, monkeypatch) -> tuple[list[dict], list[int]]:
    """Requests on prompts that repeat themselves join `pair`'s device batch at different rounds (unused slots
    poisoned): each answer is target.generate's. Returns each round's counts (watch_rounds') and the suffix nodes each
    row's walk took."""
    poison_unused_slots(monkeypatch)
    seen = watch_rounds(monkeypatch)
    walked, verify = [], DeviceSides.verify

    def counting(self, proposed, rows):
        verified = verify(self, proposed, rows)
        walked.extend(sum(p.suffix[j] >= 0 for j in v.path[1:]) for p, v in zip(proposed.proposals, verified))
        return verified

    monkeypatch.setattr(DeviceSides, "verify", counting)
    engine = pair.continuous_engine()
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False) for p, n in zip(REPEATING, (30, 12, 24, 9))]
    try:
        out = relay(pair, engine, calls, at=(2, 3, 1, 2))
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls, out)
    return seen, walked


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
def test_suffix_proposals_in_the_running_batch(target, capture, monkeypatch):
    """ngram_size 3 in the device batch: each row's suffix index (its prompt, then its verified tokens) proposes
    into its own tree, dead rows propose nothing. Requests joining at different rounds on prompts that repeat
    themselves each get target.generate's answer, suffix nodes are walked, at most one host read a round."""
    settings = {**DEVICE, "ngram_size": 3, "tree_budget": 8}
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), capture=capture, **settings)
    seen, walked = suffix_walked_in_the_batch(target, pair, monkeypatch)
    assert max(r["reads"] for r in seen) <= 1 and {r["rows"] for r in seen} >= {1, 2}
    assert sum(walked) >= 3, walked


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
def test_draft_free_rows_in_the_running_batch(target, capture, monkeypatch):
    """A pair without a draft model (the suffix proposals alone) in the device batch: requests joining at different
    rounds on prompts that repeat themselves each get target.generate's answer, no draft forward runs, suffix nodes are
    walked, at most one host read a round."""
    pair = SwiftSpecForCausalLM.from_models(target, None, capture=capture, round="device", ngram_size=3, tree_budget=8)
    seen, walked = suffix_walked_in_the_batch(target, pair, monkeypatch)
    assert max(r["reads"] for r in seen) <= 1 and {r["rows"] for r in seen} >= {1, 2}
    assert max(r["draft"] for r in seen) == 0 and sum(walked) >= 3, walked


@pytest.mark.parametrize("capture,piece", [(False, 256), (True, 256), (False, 5)], ids=["eager", "replayed", "pieces"])
def test_a_draft_head_in_the_running_batch(capture, piece, monkeypatch):
    """The bundled EAGLE-3 head in the device batch: each joining row's head is prefilled from the target's states
    at its prompt (whole, or `piece` tokens per forward between rounds: each piece's first token takes the state the
    piece before it left), its root input kept per cache row (moved when rows leave, zero for dead rows). Requests joining
    at different rounds each get target.generate's answer, the head drafting every round and its drafts accepted
    (a root input of another row, or a stale one, drafts trees the target rejects), at most one host read a round."""
    from test_device_heads import sequence_states

    from hf_swiftspec.pair import DEMO_PAIR_NAME, bundled_pair

    folder = bundled_pair(DEMO_PAIR_NAME + "-eagle3")
    if folder is None:
        pytest.skip("model_cards/swiftspec-demo-pystdlib-eagle3 is missing")
    eagle = SwiftSpecForCausalLM.from_pretrained(folder, dtype=torch.float32)
    eagle.target.generation_config.eos_token_id = None
    monkeypatch.setattr(continuous, "PREFILL_PIECE", piece)
    seen = watch_rounds(monkeypatch)
    joined, absorb = [], DeviceSides.absorb

    def recording(self, joining, row, *args):  # each joining row's root input as it enters the batch
        absorb(self, joining, row, *args)
        joined.append((list(row.sequence), self.slots.rows.drafter["root_inputs"][self.live - 1].clone()))

    monkeypatch.setattr(DeviceSides, "absorb", recording)
    pair = SwiftSpecForCausalLM.from_models(eagle.target, eagle.draft, capture=capture, **DEVICE)
    texts = ["def read_config(path):\n", "import os\nimport sys\n\n\ndef main(argv=None):\n",
             "class Stack:\n    def __init__(self):\n", "x = [i for i in range(10)]\n"]
    calls = [dict(input_ids=eagle.tokenizer(t, return_tensors="pt").input_ids, max_new_tokens=n, do_sample=False)
             for t, n in zip(texts, (24, 10, 30, 14))]
    engine = pair.continuous_engine()
    try:
        out = relay(pair, engine, calls, at=(2, 1, 2, 1))
    finally:
        engine.close()
    assert_answers_are_target_generates(eagle.target, calls, out)
    assert max(r["reads"] for r in seen) <= 1 and {r["rows"] for r in seen} >= {1, 2}
    assert min(r["draft"] for r in seen) >= DEVICE["draft_depth"]
    assert len(joined) == len(calls)
    for sequence, root_input in joined:  # the target's fused state at the token before the root, from a plain forward
        torch.testing.assert_close(root_input, sequence_states(eagle.target, eagle.draft, sequence)[-2],
                                   atol=1e-3, rtol=1e-3)  # float32 states of a prompt run in pieces, or whole
    tokens = sum(out[i].shape[1] - c["input_ids"].shape[1] for i, c in enumerate(calls))
    assert tokens > 1.5 * sum(r["rows"] for r in seen), (tokens, len(seen))  # the head's drafts were accepted


def test_the_running_batch_sizes_its_rounds_under_the_latency_guard(target, monkeypatch):
    """The running batch's rounds are the pair's goodput policy's, planned with the latency guard (policy/guard.py: no
    row's tree decodes it slower than a plain batch would), a lone call's without it; every answer is
    target.generate's. (The guard's rule itself: tests/test_latency_guard.py; its cap over suffix proposals in hand:
    test_device_sides.test_a_suffix_proposal_in_hand_sizes_the_tree.)"""
    from hf_swiftspec.policy.goodput import GoodputPolicy

    guards, plan_round = [], GoodputPolicy.plan_round

    def recorded(policy, *args, guard=False, **kwargs):
        guards.append(guard)
        return plan_round(policy, *args, guard=guard, **kwargs)

    monkeypatch.setattr(GoodputPolicy, "plan_round", recorded)
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **{**DEVICE, "draft_depth": None,
                                                                                     "tree_budget": None})
    calls = greedy_calls(target)[:3]
    engine = pair.continuous_engine()
    try:
        out = relay(pair, engine, calls, at=AT[:3])
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls, out)
    assert guards and all(guards)
    guards.clear()
    pair.generate(calls[0]["input_ids"], max_new_tokens=8, do_sample=False)
    assert guards and not any(guards)



@pytest.mark.parametrize("family", ["llama", "draft-free", "eagle3"])
@pytest.mark.parametrize("piece", [continuous.PREFILL_PIECE, 8])  # whole prompts; 8 tokens per prefill forward
def test_a_shared_prompt_prefix_is_prefilled_once(family, piece, monkeypatch):
    """Five requests whose prompts share a 45-token prefix (the fourth only its first 21 tokens, the fifth is its first
    33), each joining while the one before decodes: the target prefills the prefix once, the later requests copy its KV
    in whole blocks (32 and 16 slots) and prefill the rest, and every answer is target.generate's. Slots a copy did not fill are poisoned
    (a request reading one would decode other tokens). An EAGLE-3 head reads the target's states of every prompt
    token: its requests prefill the whole prompt."""
    from hf_swiftspec.engine import prefix_store
    from hf_swiftspec.steps.slot_cache import SlotCache

    monkeypatch.setattr(continuous, "PREFILL_PIECE", piece)
    allocate = SlotCache.allocate

    def poisoned(self, like, rows):
        allocate(self, like, rows)
        poison([self], slice(None))

    monkeypatch.setattr(SlotCache, "allocate", poisoned)
    pair = pair_of(family, **DEVICE)
    target = pair.target
    target.generation_config.eos_token_id = None
    shared = random_prompts((45,), 1, 98)[0]
    prompts = [shared + tail for tail in random_prompts((6, 13, 1), 2, 98)] + [shared[:21] + [5, 6, 7], shared[:33]]
    prefilled, prefill = [], DeviceSides.prefill

    def counted(self, slots, tokens, counts, *args, target=True, **kwargs):
        if target:
            prefilled.append(int(counts.sum()))
        return prefill(self, slots, tokens, counts, *args, target=target, **kwargs)

    monkeypatch.setattr(DeviceSides, "prefill", counted)
    engine = pair.continuous_engine()
    assert isinstance(engine, DeviceContinuousEngine)
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=12, do_sample=False) for p in prompts]
    try:
        out = relay(pair, engine, calls, at=(2, 2, 2, 2, 2))
    finally:
        engine.close()
    assert_answers_are_target_generates(target, calls, out)
    # in whole blocks of prefix_store.BLOCK; the last prompt's 32 committed tokens are all stored, but the target
    # prefills its last block itself
    reused = [0, 32, 32, 16, 16] if family != "eagle3" else [0] * 5
    assert prefix_store.BLOCK == 16 and engine.prefixes.hits == 4 * (family != "eagle3")
    assert engine.prefixes.reused_tokens == sum(reused)
    assert sum(prefilled) == sum(len(p) - 1 - r for p, r in zip(prompts, reused))  # the root is verified, not prefilled


def test_the_prefix_store_keeps_whole_blocks_of_recent_prompts_within_its_positions():
    from hf_swiftspec.engine.prefix_store import PrefixStore
    from hf_swiftspec.steps.slot_cache import SlotCache

    def cache(slots: int) -> SlotCache:
        made = SlotCache(1, slots)
        made.kv_buffers = [object()]  # it ran a forward
        return made

    store = PrefixStore(positions=100, block=16)
    a, b = list(range(40)), list(range(20)) + [99] * 20
    store.keep(a, cache(41))
    assert store.longest(b).length == 16 and store.longest(a + [1]).length == 32
    assert store.longest([7] * 40) is None and store.longest(a[:15]) is None  # less than a block in common
    store.keep(a + list(range(40)), cache(81))  # it extends a: a goes
    assert len(store.stored) == 1 and store.held == 81
    store.keep(b, cache(41))  # past 100 positions: the least recently used goes
    assert list(store.stored) == [tuple(b)] and store.held == 41
    store.keep(a[:10], cache(11))  # shorter than a block: nothing to reuse
    chain = cache(41)
    chain.length = 0
    store.keep(a, chain)  # a chain's cache (read by its length, recurrent states): not kept
    assert list(store.stored) == [tuple(b)] and store.hits == 2 and store.reused_tokens == 48
    with pytest.raises(ValueError, match="0"):
        PrefixStore(-1)
