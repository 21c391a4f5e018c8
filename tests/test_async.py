"""The host round's asynchronous engine (threads in one process, round='host'; round='auto' gives it the calls the
device round's engine cannot decode: tests/test_device_async.py): lossless, really overlapped, fails loudly."""

import threading

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import SwiftSpecWorkerError
from hf_swiftspec.engine.placement import resolve_placement
from hf_swiftspec.tools.models import tiny_model, truncated_draft

from fixed_costs import CostClock, given_costs

CPU_THREADS = {"target": ["cpu"], "draft": ["cpu"]}


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 98, (1, L), generator=g) for L in [1, 3, 8, 21, 40, 2, 5, 13][:n]]


@pytest.mark.parametrize("draft_kind", ["agreeing", "random"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_async_threads_greedy_equals_target(arch, draft_kind):
    target = tiny_model(arch, seed=2)
    draft = truncated_draft(target, 2) if draft_kind == "agreeing" else tiny_model(arch, seed=9, layers=1)
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host", tree_budget=6, draft_width=4)
    for p in prompts(8, seed=len(arch)):
        expected = target.generate(p, do_sample=False, max_new_tokens=40, repetition_penalty=1.1)
        out = model.generate(p, do_sample=False, max_new_tokens=40, repetition_penalty=1.1)
        assert out.tolist() == expected.tolist()
        assert model.swiftspec_stats.engine == "async-threads"


@pytest.fixture
def verdicts_wait_for_the_draft(monkeypatch):
    """Each verification starts once the draft, having sent its subtree, has grown what it would grow in flight and
    waits for the verdict: the draft's in-flight growth then follows from the order of events, not from how long a
    verification takes on this machine (a loaded CI runner could otherwise answer before the draft's first expansion).
    The wait is bounded only so that a broken engine fails instead of hanging."""
    from hf_swiftspec.engine.links import ThreadLink

    waiting = threading.Event()  # the draft reached receive_verdict since its last subtree was sent
    send, receive, verdict = ThreadLink.send_subtree, ThreadLink.receive_subtree, ThreadLink.receive_verdict

    def send_subtree(self, subtree):
        waiting.clear()
        return send(self, subtree)

    def receive_subtree(self):
        subtree = receive(self)
        waiting.wait(timeout=60)
        return subtree

    def receive_verdict(self):
        waiting.set()
        return verdict(self)

    monkeypatch.setattr(ThreadLink, "send_subtree", send_subtree)
    monkeypatch.setattr(ThreadLink, "receive_subtree", receive_subtree)
    monkeypatch.setattr(ThreadLink, "receive_verdict", receive_verdict)


def test_draft_expands_while_the_target_verifies(llama_pair, verdicts_wait_for_the_draft):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host")
    p = prompts(4)[3]
    out = model.generate(p, do_sample=False, max_new_tokens=30)
    assert out.tolist() == target.generate(p, do_sample=False, max_new_tokens=30).tolist()
    stats = model.swiftspec_stats
    assert stats.in_flight_expansions > 0
    assert stats.reroot_hits + stats.reroot_misses == stats.verify_steps - 1
    # a record per round, as the serial round keeps them: its tree, its expansions in flight, what it accepted
    rounds = stats.rounds
    assert len(rounds) == stats.verify_steps and sum(r.expansions for r in rounds) == stats.in_flight_expansions
    assert sum(r.accepted for r in rounds) + len(rounds) == stats.new_tokens, rounds
    assert stats.mean_tree_budget > 1 and "mean tree" in stats.summary()


def test_the_verdict_leaves_before_the_target_commits(llama_pair, monkeypatch):
    """The target answers as soon as its walk is done, so the draft re-roots while the target commits the
    accepted KV; the output still equals target.generate's and the call ends on the walk's last verdict."""
    from hf_swiftspec.steps.cache import TreeCache
    from hf_swiftspec.engine.links import ThreadLink

    target, draft, _ = llama_pair
    events, commit, send = [], TreeCache.commit_rows, ThreadLink.send_verdict
    main = threading.main_thread()

    def commit_rows(self, *args, **kwargs):
        if threading.current_thread() is main:  # the target's worker (the draft's runs on its own thread)
            events.append("commit")
        return commit(self, *args, **kwargs)

    def send_verdict(self, verified):
        events.append("verdict")
        return send(self, verified)

    monkeypatch.setattr(TreeCache, "commit_rows", commit_rows)
    monkeypatch.setattr(ThreadLink, "send_verdict", send_verdict)
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host")
    p = prompts(4)[3]
    out = model.generate(p, do_sample=False, max_new_tokens=30)
    assert out.tolist() == target.generate(p, do_sample=False, max_new_tokens=30).tolist()
    rounds = model.swiftspec_stats.verify_steps
    assert rounds > 3 and events == ["verdict", "commit"] * rounds


class Boom(RuntimeError):
    pass


def fail_after(model, calls):
    count = {"n": 0}

    def hook(*args):
        count["n"] += 1
        if count["n"] > calls:
            raise Boom(f"injected failure after {calls} forwards")

    return model.register_forward_hook(hook)


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_worker_failure_surfaces_and_the_next_call_works(llama_pair, worker):
    target, draft, _ = llama_pair
    # draft_depth: the draft expands every round, whether it pays or not (draft_pays), so its 4th forward comes
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host", worker_timeout_s=20, draft_depth=2)
    p = prompts(5)[4]
    hook = fail_after(target if worker == "target" else draft, 3)
    try:  # (the peer is told at once, not after worker_timeout_s: the Failure message; no clock needed to see it)
        with pytest.raises(SwiftSpecWorkerError, match=f"the {worker} worker failed: Boom") as info:
            model.generate(p, do_sample=False, max_new_tokens=40)
    finally:
        hook.remove()
    assert isinstance(info.value.__cause__, Boom)
    assert model.generate(p, do_sample=False, max_new_tokens=20).tolist() == target.generate(
        p, do_sample=False, max_new_tokens=20
    ).tolist()


def test_silent_draft_times_out(llama_pair):
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host", worker_timeout_s=1)
    release = threading.Event()
    hook = draft.register_forward_hook(lambda *args: release.wait(60))  # no subtree comes until the test is over
    try:
        with pytest.raises(SwiftSpecWorkerError, match="draft worker sent nothing for 1s"):
            model.generate(prompts(1)[0], do_sample=False, max_new_tokens=5)
    finally:
        release.set()
        hook.remove()
        # the stuck draft thread is left behind (a daemon): let it end here, not mid-forward at interpreter exit
        # ("terminate called without an active exception" when this test ran shortly before the end)
        for thread in threading.enumerate():
            if thread.name == "swiftspec-draft":
                thread.join(timeout=10)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("everywhere", "placement='everywhere' is not understood"),
        ({"target": [0]}, "is not understood"),
        ({"target": [], "draft": ["cpu"]}, "placement\\['target'\\] is empty"),
        ({"target": [0], "draft": [1]}, "names cuda:0, but this machine has 0 CUDA device"),
        ({"target": ["cpu", "cpu"], "draft": ["cpu"]}, "several devices per group need one process per device"),
    ],
)
def test_bad_placements(spec, match):
    if torch.cuda.device_count():
        pytest.skip("expectations written for a machine without GPUs")
    with pytest.raises(ValueError, match=match):
        resolve_placement(spec)


def test_auto_placement_without_gpus_is_serial(llama_pair):
    target, draft, _ = llama_pair
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    model = SwiftSpecForCausalLM.from_models(target, draft, placement="auto")
    model.generate(prompts(2)[1], max_new_tokens=5, do_sample=False)
    assert model.swiftspec_stats.engine == "device"  # one device: the one serial round
    assert not hasattr(model, "hf_device_map") or model.hf_device_map is None


def test_breakdown_says_where_the_target_waits():
    """stats.overlap splits a round from its workers' counters (given here, as a slow target's and a slow draft's
    calls would fill them): a slow target shows as verification with the draft's growth hidden under it; a slow
    draft as target idle time, explained by the draft's work on the critical path (the expansion it was finishing,
    the catch-up of a fresh tree, the re-root, the choice), what is left being the link; the call's start apart.
    Which engine phase fills which counter is checked on a real call in the next test."""
    from hf_swiftspec.stats import DraftCounters, OverlapBreakdown, TargetCounters

    slow_target = OverlapBreakdown.of(
        TargetCounters(verify_steps=10, busy_s=0.50, idle_s=0.012, first_wait_s=0.002),
        DraftCounters(rounds=10, grow_s=0.30, wait_s=0.19, reroot_s=0.004, select_s=0.003, start_s=0.004,
                      grown_rounds=10), message_bytes=0)
    assert (slow_target.verify, slow_target.grow, slow_target.wait) == pytest.approx((50.0, 30.0, 19.0))
    assert slow_target.idle == pytest.approx(1.0) and slow_target.link == pytest.approx(0.3)
    assert slow_target.start_wait == pytest.approx(2.0) and slow_target.grown_share == 1.0
    slow_draft = OverlapBreakdown.of(
        TargetCounters(verify_steps=10, busy_s=0.10, idle_s=0.26, first_wait_s=0.04),
        DraftCounters(rounds=10, grow_s=0.10, overrun_s=0.12, catch_up_s=0.05, reroot_s=0.02, select_s=0.02,
                      start_s=0.05, grown_rounds=4), message_bytes=264)
    assert slow_draft.idle == pytest.approx(22.0) and slow_draft.verify == pytest.approx(10.0)
    assert (slow_draft.overrun, slow_draft.catch_up, slow_draft.reroot, slow_draft.select) == pytest.approx(
        (12.0, 5.0, 2.0, 2.0))
    assert slow_draft.link == pytest.approx(1.0)  # idle the draft's work does not explain
    assert (slow_draft.start, slow_draft.start_wait) == pytest.approx((50.0, 40.0)) and slow_draft.grown_share == 0.4
    line = slow_draft.line()
    assert "target idle 22.0 = draft overrun 12.0 + re-root 2.0 + catch-up 5.0 + select 2.0 + link 1.0" in line
    assert "264 bytes a round" in line and "the target waited 40.0 of it" in line


def test_the_breakdown_is_the_calls_counters(llama_pair, verdicts_wait_for_the_draft):
    """On a real call, the breakdown is what the workers counted: its rounds are the verifications, its verify and idle
    the target's busy and idle time, its share of grown rounds the rounds whose records say they expanded in flight."""
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host", tree_budget=6)
    p = prompts(4)[3]
    out = model.generate(p, do_sample=False, max_new_tokens=24)
    assert out.tolist() == target.generate(p, do_sample=False, max_new_tokens=24).tolist()
    stats = model.swiftspec_stats
    overlap = stats.overlap
    assert overlap.rounds == stats.verify_steps and overlap.message_bytes == 0  # threads hand objects over
    assert overlap.verify * overlap.rounds == pytest.approx(1e3 * stats.target_time_s)
    assert overlap.idle * overlap.rounds + overlap.start_wait == pytest.approx(1e3 * stats.target_idle_s)
    grown = sum(r.expansions > 0 for r in stats.rounds)
    assert grown > 0 and overlap.grown_share == pytest.approx(grown / len(stats.rounds)), stats.rounds
    assert min(overlap.verify, overlap.grow, overlap.select, overlap.start) > 0, overlap  # each phase was timed
    assert overlap.line() in stats.summary()


def test_replayed_steps_on_both_threads_equal_target_generate(llama_pair, verdicts_wait_for_the_draft):
    """capture=True with the draft in its own thread: each worker replays its own steps (this CPU's stand-in for
    CUDA graphs) while the other runs, and the tokens are the target's own."""
    target, draft, _ = llama_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host", capture=True, tree_budget=6,
                                             draft_width=4)
    for p in prompts(4):
        expected = target.generate(p, do_sample=False, max_new_tokens=30)
        assert model.generate(p, do_sample=False, max_new_tokens=30).tolist() == expected.tolist()
    stats = model.swiftspec_stats
    assert stats.engine == "async-threads" and stats.in_flight_expansions > 0
    assert "target=sdpa-grouped (replayed, emulate" in stats.attention  # (tiny models share key / value heads)
    assert "draft=sdpa-grouped (replayed, emulate" in stats.attention
    replays = {role: sum(b.replays for b in g.buckets.values()) for role, g in model.captures.runners.items()}
    assert min(replays.values()) > 5, replays


def test_a_draft_that_does_not_pay_sends_the_root_alone_and_grows_one_round_in_eight(
    llama_pair, verdicts_wait_for_the_draft, monkeypatch
):
    """Where the draft's proposals do not repay its expansions (a random draft, priced here at 1 s an expansion
    against a 10 s verification: given costs, so the decision does not hang on this machine's speed), after the
    first round the draft neither runs a fresh tree's catch-up expansion before sending (it sends the root alone,
    a plain step, instead of making the target wait) nor grows the tree during verifications, except during one in
    PROBE_GROWTH_EVERY. Before, each round waited for an expansion."""
    from hf_swiftspec.drafters.drafting import Drafters
    from hf_swiftspec.engine.asynchronous import PROBE_GROWTH_EVERY

    target, _, _ = llama_pair
    random_draft = tiny_model("llama", seed=9, layers=1)
    model = SwiftSpecForCausalLM.from_models(target, random_draft, placement=CPU_THREADS, round="host", ngram_size=0)
    given_costs(model, expand_s=1.0, verify_s={1: 10.0, 2: 10.0})
    top_ups, top_up = [], Drafters.top_up

    def recording_top_up(self, budget):
        top_ups.append(budget)
        return top_up(self, budget)

    monkeypatch.setattr(Drafters, "top_up", recording_top_up)
    p = prompts(4)[3]
    out = model.generate(p, do_sample=False, max_new_tokens=40)
    assert out.tolist() == target.generate(p, do_sample=False, max_new_tokens=40).tolist()
    stats = model.swiftspec_stats
    assert stats.tau < 1.2, stats.summary()  # it never agreed (nothing here depends on the clock)
    catch_ups = len(top_ups) - 1  # the first top-up is the call's first tree, while the target prefills
    assert catch_ups <= 1, top_ups  # the first round's alone: nothing measured yet, so the draft tries
    grown = [i for i, r in enumerate(stats.rounds) if r.expansions > 0]
    assert len(grown) <= 1 + len(stats.rounds) // PROBE_GROWTH_EVERY, (grown, stats.rounds)
    assert grown and all(i == 0 or (i + 1) % PROBE_GROWTH_EVERY == 0 for i in grown), grown  # the probes' rounds


def test_draft_pays_while_its_rounds_repay_an_expansion():
    from hf_swiftspec.policy.goodput import GoodputPolicy

    policy = GoodputPolicy()
    assert policy.draft_pays(1.0, 0.07)  # nothing measured yet: the draft runs
    policy.costs.observe_expansions(0.02, 1)
    assert not policy.draft_pays(1.0, 0.07) and not policy.draft_pays(1.25, 0.07)  # 1 + 0.02 / 0.07 = 1.29
    assert policy.draft_pays(1.3, 0.07) and policy.draft_pays(3.0, 0.07)
    assert GoodputPolicy(draft_depth=2).draft_pays(1.0, 0.07)  # a fixed depth is the user's choice


def test_engine_choice_measures_both_then_runs_the_faster_and_retries_the_other():
    from hf_swiftspec.policy.choice import ASYNC, RETRY_EVERY, SERIAL, EngineChoice

    choice = EngineChoice()
    measuring = []
    for _ in range(2):  # alternately, two calls each
        measuring.append(choice.pick())
        choice.observe(ASYNC, 64, 1.0)
        assert "measuring" in choice.describe(ASYNC)
        measuring.append(choice.pick())
        choice.observe(SERIAL, 64, 0.5)  # serial twice as fast
    assert measuring == [ASYNC, SERIAL, ASYNC, SERIAL]
    picks = [choice.pick() for _ in range(2 * RETRY_EVERY)]
    assert picks.count(ASYNC) == 2 and picks.count(SERIAL) == 2 * RETRY_EVERY - 2, picks
    assert choice.describe(SERIAL) == (
        "serial: the asynchronous engine measured 0.50x the serial round's tokens per second on this pair (over 2 and 2 calls)"
    )
    assert choice.describe(ASYNC, "async-threads").startswith(f"async-threads: retried one call in {RETRY_EVERY}")
    for _ in range(3):  # the asynchronous engine turns faster: it is chosen again
        choice.observe(ASYNC, 64, 0.1)
    assert choice.ranked() == (ASYNC, SERIAL)
    choice.observe(SERIAL, 0, 1.0)  # a call that made nothing teaches nothing
    assert choice.calls[SERIAL] == 2


@pytest.mark.parametrize("async_s, serial_s", [(1.0, 0.5), (0.5, 1.0)], ids=["serial-faster", "async-faster"])
def test_serial_fallback_runs_the_faster_engine_exactly_and_says_so(llama_pair, monkeypatch, async_s, serial_s):
    """With serial_fallback, a placement's calls run the asynchronous engine and the serial round alternately, two
    calls each, then whichever was faster, the other one call in 8; every output equal to target.generate's, and the
    stats say which engine ran and why. The engine choice's clock is given: each call of an engine costs a fixed
    time (both directions), so which one is faster is the test's, not this machine's load."""
    import hf_swiftspec.engine.launch as launch

    target, draft, _ = llama_pair
    clock = CostClock()
    monkeypatch.setattr(launch, "run_threads", clock.charging(launch.run_threads, async_s))
    monkeypatch.setattr(launch, "run_serial", clock.charging(launch.run_serial, serial_s))
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=CPU_THREADS, round="host", serial_fallback=True)
    model.policy().engines.clock = clock
    engines = []
    for p in prompts(8, seed=3) + prompts(2, seed=4):
        expected = target.generate(p, do_sample=False, max_new_tokens=24)
        assert model.generate(p, do_sample=False, max_new_tokens=24).tolist() == expected.tolist()
        stats = model.swiftspec_stats
        engines.append(stats.engine)
        assert stats.engine_choice.startswith(stats.engine) and "engine choice" in stats.summary()
    faster, slower = ("serial", "async-threads") if serial_s < async_s else ("async-threads", "serial")
    assert engines[:4] == ["async-threads", "serial"] * 2, engines
    assert engines[4:] == [faster] * 3 + [slower] + [faster] * 2, engines
    assert "measured" in model.swiftspec_stats.engine_choice


def test_serial_fallback_is_on_for_auto_placement_only():
    from dataclasses import replace

    from hf_swiftspec.engine.launch import check_serial_fallback, falls_back
    from hf_swiftspec.engine.placement import Placement

    config = SwiftSpecForCausalLM.from_models(tiny_model("llama"), tiny_model("llama", layers=1)).config
    threads = Placement("threads", ("cpu",), ("cpu",))
    assert not falls_back(config, threads) and falls_back(config, Placement("threads", ("cpu",), ("cpu",), auto=True))
    config.serial_fallback = True
    assert falls_back(config, threads)
    assert resolve_placement("auto").auto  # (serial on a machine with fewer than two GPUs, outside torchrun)
    # under torchrun only beside a target group of one rank: a sharded target's ranks would have to agree on every tree
    lone, sharded = Placement("distributed", (0,), (1,)), Placement("distributed", (0, 1), (2,), auto=True)
    assert falls_back(config, lone) and not falls_back(config, sharded)
    with pytest.raises(ValueError, match=r"shards the target over ranks \[0, 1\].*Give the target group one rank"):
        check_serial_fallback(config, sharded)
    config.serial_fallback = None
    check_serial_fallback(config, sharded)  # (the default: off there, as the stats' engine says)
    assert not falls_back(config, sharded) and falls_back(config, replace(lone, auto=True))
    with pytest.raises(ValueError, match="serial_fallback='yes'"):
        SwiftSpecForCausalLM.from_models(tiny_model("llama"), tiny_model("llama", layers=1), serial_fallback="yes")
