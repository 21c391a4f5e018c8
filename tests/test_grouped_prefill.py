"""Requests joining the device round's running batch together are prefilled together (engine/continuous_device.py's
PrefillGroup): one forward of each model per piece for every prompt of a group, each row its own tokens, count and
start. Checked against independent references: each row's target and draft KV equals its prompt prefilled alone, every
answer is target.generate's, and PrefillCosts' grouping is the cheapest partition a brute force finds."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hf_swiftspec.engine import continuous, continuous_device
from hf_swiftspec.engine.continuous_device import PREFILL_TOKENS, DeviceContinuousEngine, PrefillCosts
from hf_swiftspec.engine.device_sides import DeviceSides
from hf_swiftspec.steps.slot_cache import SlotCache, catch_up
from hf_swiftspec.tools.models import random_prompts
from test_continuous import pair_of
from test_continuous_device import DEVICE, assert_answers_are_target_generates, poison
from test_shared_prefill import decode_together


def solo_kv(sides: DeviceSides, model, layers: tuple, ids: list[int]) -> SlotCache:
    """`model`'s slot cache of the prompt `ids` prefilled alone (one row, from slot 0)."""
    cache = SlotCache(layers[0], len(ids) + 1, *layers[1:])
    catch_up(model, cache, torch.tensor([ids]), torch.tensor([len(ids)]))
    return cache


def checking_groups(monkeypatch) -> list[dict]:
    """Per finished PrefillGroup: its rows and, per row and model, whether the row's KV of its committed prompt equals
    that prompt prefilled alone (solo_kv), checked before the batch takes the rows in."""
    checked, piece = [], DeviceContinuousEngine.prefill_piece

    def checked_piece(self, group):
        piece(self, group)
        if not group.done:
            return
        sides = group.sides
        models = (sides.target, sides.drafter.model)
        rows = []
        for b, p in enumerate(group.prefills):
            ids = p.sequence[: p.row.prefix]
            same = []
            for cache, model, layers in zip(group.slots.caches, models, sides.layers()):
                if cache is None or model is None or not ids or model is not sides.target and sides.drafter.reads_target:
                    continue  # (a head's KV is of the target's states: the answers check it)
                alone = solo_kv(sides, model, layers, ids)
                same.append(all(torch.allclose(mine.data[:, b, :, : len(ids)], theirs.data[:, 0, :, : len(ids)],
                                               atol=1e-5, rtol=1e-5)
                                for mine, theirs in zip(cache.buffers, alone.buffers)))
            rows.append(dict(length=len(ids), reused=p.reused, same=same))
        checked.append(dict(rows=rows))

    monkeypatch.setattr(DeviceContinuousEngine, "prefill_piece", checked_piece)
    return checked


def counting_target_prefills(monkeypatch) -> list[tuple[int, int]]:
    """Each target prefill forward's (rows, tokens it prefills)."""
    seen, prefill = [], DeviceSides.prefill

    def counted(self, slots, tokens, counts, *args, target=True, **kwargs):
        if target:
            seen.append((tokens.shape[0], int(counts.sum())))
        return prefill(self, slots, tokens, counts, *args, target=target, **kwargs)

    monkeypatch.setattr(DeviceSides, "prefill", counted)
    return seen


@pytest.mark.parametrize("family", ["llama", "draft-free", "eagle3"])
@pytest.mark.parametrize("piece", [continuous.PREFILL_PIECE, 8])  # whole prompts; 8 tokens a forward, in lockstep
def test_requests_joining_together_are_prefilled_in_one_forward_each_row_as_alone(family, piece, monkeypatch):
    """A request decodes alone (its prompt's KV is then stored); then five join together, one of them sharing its
    first 32 tokens (copied from the store: the target prefills past them, a draft model from the start), one a
    one-token prompt. Where a forward's fixed cost outweighs any padding they share one forward per piece, and each
    row's target and draft KV is its prompt's prefilled alone; where padding costs more than a forward, each runs its
    own. Every answer is target.generate's; slots the copies do not fill are poisoned."""
    monkeypatch.setattr(continuous, "PREFILL_PIECE", piece)
    allocate = SlotCache.allocate

    def poisoned(self, like, rows):
        allocate(self, like, rows)
        poison([self], slice(None))

    monkeypatch.setattr(SlotCache, "allocate", poisoned)
    checked = checking_groups(monkeypatch)
    prefills = counting_target_prefills(monkeypatch)
    pair = pair_of(family, **DEVICE)
    target = pair.target
    target.generation_config.eos_token_id = None
    shared = random_prompts((40,), 3, 98)[0]
    others = random_prompts((3, 23, 1, 30), 4, 98)
    first = dict(input_ids=torch.tensor([shared + [7, 8]]), max_new_tokens=6, do_sample=False)
    calls = {"hit": dict(input_ids=torch.tensor([shared[:35] + [9, 9, 9]]), max_new_tokens=10, do_sample=False)}
    calls |= {f"other-{i}": dict(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False)
              for i, (p, n) in enumerate(zip(others, (12, 5, 9, 14)))}
    for fixed, rows in ((float(PREFILL_TOKENS), 5), (0.0, 1)):  # one group of five, then five groups of one
        monkeypatch.setattr(PrefillCosts, "fixed_tokens", lambda self, fixed=fixed: fixed)
        engine = pair.continuous_engine()
        assert isinstance(engine, DeviceContinuousEngine)
        try:
            alone = pair.generate(swiftspec_engine=(engine, "first"), **first)
            checked.clear(), prefills.clear()
            out = decode_together(pair, engine, calls)
        finally:
            engine.close()
        assert alone.tolist() == target.generate(**first).tolist()
        assert_answers_are_target_generates(target, list(calls.values()), [out[key] for key in calls])
        reuses = family != "eagle3"  # a head reads the target's states of every prompt token: nothing is reused
        assert sorted(r["reused"] for g in checked for r in g["rows"]) == [0] * 4 + [32 * reuses]
        assert [len(g["rows"]) for g in checked] == [rows] * (5 // rows)
        assert all(all(r["same"]) and len(r["same"]) == (r["length"] > 0) * (1 + (family == "llama"))
                   for g in checked for r in g["rows"])
        longest = max(len(c["input_ids"][0]) - 1 - (32 * reuses if key == "hit" else 0) for key, c in calls.items())
        forwards = -(-longest // piece)  # the longest row's pieces
        if rows == 5:
            assert [r for r, _ in prefills] == [5] * forwards
        else:
            assert all(r == 1 for r, _ in prefills) and len(prefills) >= 5
        assert sum(t for _, t in prefills) == sum(len(c["input_ids"][0]) - 1 for c in calls.values()) - 32 * reuses


def partition_cost(groups: list[list[int]], lengths: list[int], fixed: float) -> float:
    return sum(fixed + len(g) * max(max(lengths[i] for i in g), 1) for g in groups)


def all_partitions(items: list[int]):
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for partition in all_partitions(rest):
        yield [[head]] + partition
        for i in range(len(partition)):
            yield partition[:i] + [[head] + partition[i]] + partition[i + 1 :]


@pytest.mark.parametrize("seed", range(6))
def test_prefill_groups_are_the_cheapest_partition(seed, monkeypatch):
    """PrefillCosts.groups against every partition of up to 7 prompts (a brute force): its cost is the least, every
    prompt is in one group, each group in arrival order and the groups by their first arrival, none past
    PREFILL_TOKENS tokens but a lone prompt."""
    rng = random.Random(seed)
    monkeypatch.setattr(continuous_device, "PREFILL_TOKENS", 300)
    for _ in range(20):
        lengths = [rng.choice([1, 3, 17, 40, 90, 150, 256]) for _ in range(rng.randint(1, 7))]
        fixed = rng.choice([0.0, 8.0, 32.0, 120.0, 1000.0])
        monkeypatch.setattr(PrefillCosts, "fixed_tokens", lambda self, fixed=fixed: fixed)
        groups = PrefillCosts().groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(g[0] for g in groups)
        assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 300 for g in groups)
        feasible = [p for p in all_partitions(list(range(len(lengths))))
                    if all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 300 for g in p)]
        best = min(partition_cost(p, lengths, fixed) for p in feasible)
        assert partition_cost(groups, lengths, fixed) == pytest.approx(best)


def test_prefill_costs_fit_a_forwards_fixed_cost_in_tokens():
    """seconds = fixed + per_token x tokens, fitted by least squares from the forwards timed: the prior before four
    timings or without two sizes, a line's own ratio after, none on CUDA (untimed: every prompt shares a forward)."""
    costs = PrefillCosts()
    assert costs.fixed_tokens() == continuous_device.FIXED_TOKENS
    for tokens in (50, 50, 50, 50):
        costs.observe(tokens, 0.01)
    assert costs.fixed_tokens() == continuous_device.FIXED_TOKENS  # one size: no slope
    for tokens in (10, 100, 400, 1000, 60):
        costs.observe(tokens, 0.006 + 0.0002 * tokens)
    costs.samples = costs.samples[4:]
    assert costs.fixed_tokens() == pytest.approx(30.0)
    assert len(costs.samples) <= continuous_device.COST_SAMPLES
    untimed = PrefillCosts(timed=False)
    untimed.observe(100, 1.0)
    assert untimed.samples == [] and untimed.fixed_tokens() == PREFILL_TOKENS
    assert list(itertools.chain(*untimed.groups([5, 200, 7]))) == [0, 1, 2]  # one forward for all three


def test_a_group_failing_to_join_fails_its_requests_alone_and_the_engine_serves_on(monkeypatch):
    """The running sides fail to take a prefilled group's row in (absorb raises): its requests' generate() calls raise
    that error, the engine's thread lives on, and the next request is answered as target.generate's."""
    pair = pair_of("llama", **DEVICE)
    target = pair.target
    target.generation_config.eos_token_id = None
    absorb, failures = DeviceSides.absorb, [1]

    def failing(self, *args, **kwargs):
        if failures:
            failures.pop()
            raise RuntimeError("absorb failed on purpose")
        return absorb(self, *args, **kwargs)

    monkeypatch.setattr(DeviceSides, "absorb", failing)
    prompts = random_prompts((9, 14), 5, 98)
    calls = {f"r{i}": dict(input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False) for i, p in enumerate(prompts)}
    engine = pair.continuous_engine()
    try:
        with pytest.raises(AssertionError, match="absorb failed on purpose"):  # (decode_together: every call's error)
            decode_together(pair, engine, calls)
        assert engine.thread.is_alive() and not engine.groups and not engine.joining
        after = dict(input_ids=torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False)
        assert pair.generate(swiftspec_engine=(engine, "after"), **after).tolist() == target.generate(**after).tolist()
    finally:
        engine.close()
