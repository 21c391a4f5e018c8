"""The device round's asynchronous engine (engine/device_async.py: two threads, the draft's tree across rounds,
re-rooted on the device): greedy output equal to target.generate's, sampling equal to the serial device round's for
the same seed, its scores, stops, windowed layers and suffix proposals; the draft grows while the target verifies and re-roots into
what it grew; a failed or silent worker surfaces in generate(); calls it cannot decode are refused by name where it
was asked for, and left to the host round's engine under round='auto' (which runs it for the calls it decodes)."""

import copy
import threading

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import SwiftSpecWorkerError
from hf_swiftspec.tools.models import tiny_model, truncated_draft
from fixed_costs import CostClock
from test_async import verdicts_wait_for_the_draft  # noqa: F401 (the host engine's tests' fixture, same link)

THREADS = {"target": ["cpu"], "draft": ["cpu"]}
ENGINE = "async-threads-device"


def asynchronous(target, draft, **settings):
    settings = dict(dict(tree_budget=6, draft_width=3, ngram_size=0), **settings)
    return SwiftSpecForCausalLM.from_models(target, draft, placement=THREADS, round="device", **settings)


def prompts(lengths=(1, 3, 8, 21, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 98, (1, n), generator=g) for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("draft_kind", ["agreeing", "random"])
def test_greedy_equals_target_generate(arch, draft_kind):
    overrides = {"sliding_window": 4} if arch == "mistral" else {}  # (mistral: a window, a term of the masks)
    target = tiny_model(arch, seed=2, **overrides)
    draft = truncated_draft(target, 2) if draft_kind == "agreeing" else tiny_model(arch, seed=9, layers=1)
    model = asynchronous(target, draft)
    for p in prompts(seed=len(arch)):
        expected = target.generate(p, do_sample=False, max_new_tokens=40)
        assert model.generate(p, do_sample=False, max_new_tokens=40).tolist() == expected.tolist()
        assert model.swiftspec_stats.engine == ENGINE


@pytest.mark.parametrize("ngram_size", [0, 3])
def test_sampling_equals_the_serial_device_round_for_each_seed(ngram_size):
    """The target's tokens come from the noise of generate()'s positions (the other rounds'), whatever tree the draft
    sent (its suffix nodes too): a seed gives the serial device round's tokens, draw by draw."""
    target = tiny_model("llama", seed=2)
    model = asynchronous(target, truncated_draft(target, 2), ngram_size=ngram_size)
    serial = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), tree_budget=6, draft_width=3,
                                              ngram_size=0, round="device")
    for seed, p in enumerate(prompts((2, 9, 30))):
        outs = []
        for m in (model, serial):
            torch.manual_seed(seed)
            outs.append(m.generate(p, do_sample=True, temperature=0.9, top_k=30, max_new_tokens=30).tolist())
        assert outs[0] == outs[1]
    assert model.swiftspec_stats.engine == ENGINE


def test_scores_and_an_early_eos_equal_target_generate():
    target = tiny_model("llama", seed=2)
    model = asynchronous(target, truncated_draft(target, 2))
    p = prompts((12,))[0]
    plain = target.generate(p, do_sample=False, max_new_tokens=30)
    eos = int(plain[0, p.shape[1] + 6])  # a token the target emits 7th: generation stops there
    kw = dict(do_sample=False, max_new_tokens=30, eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
    want, got = target.generate(p, **kw), model.generate(p, **kw)
    assert got.sequences.tolist() == want.sequences.tolist() and got.sequences.shape[1] < plain.shape[1]
    assert len(got.scores) == len(want.scores)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft_depth", [2, None], ids=["every-round-a-tree", "drafting-chosen"])
@pytest.mark.parametrize("draft_kind", ["agreeing", "random"])
def test_suffix_proposals_join_the_drafts_tree_and_a_path_through_them_restarts_it(draft_kind, draft_depth):
    """With the target's own continuation as the corpus (ngram_corpus), the draft side's suffix proposals, merged into
    its tree before the selection, are right: rounds verify several tokens though a random draft's never are (the
    records count them as the suffix nodes'), and where every round is a tree, a path through suffix nodes the draft
    never grew starts its tree afresh (a re-root miss; plain rounds send the proposal alone); every output is
    target.generate's, and the same pair decodes a call without a corpus exactly after it."""
    target = tiny_model("llama", seed=2)
    draft = truncated_draft(target, 2) if draft_kind == "agreeing" else tiny_model("llama", seed=9, layers=1)
    model = asynchronous(target, draft, ngram_size=3, draft_depth=draft_depth)
    for p in prompts((3, 12), seed=4):
        expected = target.generate(p, do_sample=False, max_new_tokens=40)
        out = model.generate(p, do_sample=False, max_new_tokens=40, ngram_corpus=[expected[0].tolist()])
        assert out.tolist() == expected.tolist()
        stats = model.swiftspec_stats
        assert stats.engine == ENGINE and stats.tau > 2.0, stats.summary()
        if draft_depth is not None:  # every round a tree: paths through the suffix nodes restarted it
            assert stats.reroot_misses > 0
        if draft_kind == "random":  # its tokens are the suffix nodes' (each round's record counts them)
            assert stats.ngram_share > 0.8, stats.summary()
    for p in prompts((5, 9), seed=6):  # no corpus: the index holds the prompt and the earlier outputs
        assert model.generate(p, do_sample=False, max_new_tokens=30).tolist() == target.generate(
            p, do_sample=False, max_new_tokens=30).tolist()


def test_a_call_reaching_the_models_context_places_no_node_past_it():
    """A learned-position target (gpt2: no row past n_positions) decodes to its last position as target.generate
    does: no tree node is placed past the context (a node there would index past the position table)."""
    from hf_swiftspec.tools.models import tiny_gpt2

    target = tiny_gpt2(n_positions=48)
    target.generation_config.eos_token_id = None  # every call runs to the context's last position
    model = asynchronous(target, copy.deepcopy(target))  # a draft that always agrees: its trees grow deep
    p = prompts((20,))[0]
    expected = target.generate(p, do_sample=False, max_new_tokens=28)
    assert model.generate(p, do_sample=False, max_new_tokens=28).tolist() == expected.tolist()
    assert model.swiftspec_stats.engine == ENGINE


def test_the_draft_grows_while_the_target_verifies_and_reroots_into_it(verdicts_wait_for_the_draft):
    """With the verification waiting for the draft's in-flight growth: the draft expanded while subtrees were
    verified, and its re-roots found the target's next token among what it had grown (the subtree sent, run in
    flight, holds its children), so rounds verify more than one token."""
    target = tiny_model("llama", seed=2)
    model = asynchronous(target, truncated_draft(target, 2), draft_depth=2)
    p = prompts((8,))[0]
    out = model.generate(p, do_sample=False, max_new_tokens=30)
    assert out.tolist() == target.generate(p, do_sample=False, max_new_tokens=30).tolist()
    stats = model.swiftspec_stats
    assert stats.in_flight_expansions > 0 and stats.reroot_hits > 0
    assert stats.reroot_hits + stats.reroot_misses == stats.verify_steps - 1
    assert stats.new_tokens > stats.verify_steps
    rounds = stats.rounds  # a record a round: its tree, its expansions in flight, what it accepted
    assert len(rounds) == stats.verify_steps and sum(r.expansions for r in rounds) == stats.in_flight_expansions
    assert sum(r.accepted for r in rounds) + len(rounds) == stats.new_tokens
    assert max(r.budget for r in rounds) > 1 and stats.mean_tree_budget > 1


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_a_worker_failure_surfaces_and_the_next_call_works(worker):
    target = tiny_model("llama", seed=2)
    draft = truncated_draft(target, 2)
    model = asynchronous(target, draft, worker_timeout_s=20)
    count = {"n": 0}

    def hook(*args):
        count["n"] += 1
        if count["n"] > 3:
            raise Boom("injected failure after 3 forwards")

    handle = (target if worker == "target" else draft).register_forward_hook(hook)
    p = prompts((5,))[0]
    try:
        with pytest.raises(SwiftSpecWorkerError, match=f"the {worker} worker failed: Boom"):
            model.generate(p, do_sample=False, max_new_tokens=40)
    finally:
        handle.remove()
    assert model.generate(p, do_sample=False, max_new_tokens=20).tolist() == target.generate(
        p, do_sample=False, max_new_tokens=20).tolist()


def test_a_silent_draft_times_out():
    target = tiny_model("llama", seed=2)
    draft = truncated_draft(target, 2)
    model = asynchronous(target, draft, worker_timeout_s=1)
    release = threading.Event()
    handle = draft.register_forward_hook(lambda *args: release.wait(60))
    try:
        with pytest.raises(SwiftSpecWorkerError, match="draft worker sent nothing for 1s"):
            model.generate(prompts((3,))[0], do_sample=False, max_new_tokens=5)
    finally:
        release.set()
        handle.remove()
        for thread in threading.enumerate():
            if thread.name == "swiftspec-draft":
                thread.join(timeout=10)


def test_a_call_it_cannot_decode_is_refused_by_name_and_auto_takes_the_host_engine_for_it():
    target = tiny_model("llama", seed=2)
    model = asynchronous(target, truncated_draft(target, 2))
    p = prompts((6,))[0]
    with pytest.raises(ValueError, match="logits processors read the path.*round='host'"):
        model.generate(p, do_sample=False, max_new_tokens=10, repetition_penalty=1.2)
    auto = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), placement=THREADS)
    expected = target.generate(p, do_sample=False, max_new_tokens=10, repetition_penalty=1.2)
    assert auto.generate(p, do_sample=False, max_new_tokens=10, repetition_penalty=1.2).tolist() == expected.tolist()
    assert auto.swiftspec_stats.engine == "async-threads"
    assert "asynchronous engine cannot decode this call (its logits processors read the path)" in (
        auto.swiftspec_stats.round_choice)
    # a call it decodes: round='auto' runs it on the device round's engine, saying so
    assert auto.generate(p, do_sample=False, max_new_tokens=10).tolist() == target.generate(
        p, do_sample=False, max_new_tokens=10).tolist()
    assert auto.swiftspec_stats.engine == ENGINE and "asynchronous engine" in auto.swiftspec_stats.round_choice


@pytest.mark.parametrize("async_s, serial_s", [(1.0, 0.5), (0.5, 1.0)], ids=["serial-faster", "async-faster"])
def test_serial_fallback_runs_the_faster_device_engine_exactly_and_says_so(monkeypatch, async_s, serial_s):
    """With serial_fallback on the device round, calls run the asynchronous device engine and the serial device round
    alternately, two calls each, then whichever was faster, the other one call in 8; every output target.generate's,
    and the stats name the engine and why. Each call of an engine charges the choice's clock a fixed time."""
    import hf_swiftspec.engine.launch as launch

    target = tiny_model("llama", seed=2)
    clock = CostClock()
    monkeypatch.setattr(launch, "run_device_async", clock.charging(launch.run_device_async, async_s))
    monkeypatch.setattr(launch, "run_device", clock.charging(launch.run_device, serial_s))
    model = asynchronous(target, truncated_draft(target, 2), serial_fallback=True)
    model.policy().engines.clock = clock
    engines = []
    for p in prompts((3, 8, 12, 5, 9, 20, 7, 4, 10, 6), seed=5):
        expected = target.generate(p, do_sample=False, max_new_tokens=20)
        assert model.generate(p, do_sample=False, max_new_tokens=20).tolist() == expected.tolist()
        stats = model.swiftspec_stats
        engines.append(stats.engine)
        assert stats.engine_choice.startswith(stats.engine) and "round='device'" in stats.round_choice
    serial = next(e for e in engines if e != ENGINE)
    faster, slower = (serial, ENGINE) if serial_s < async_s else (ENGINE, serial)
    assert engines[:4] == [ENGINE, serial] * 2, engines
    assert engines[4:] == [faster] * 3 + [slower] + [faster] * 2, engines
    assert "measured" in model.swiftspec_stats.engine_choice


def test_drafting_choice_times_both_modes_then_runs_the_faster_and_probes_less_often():
    """Trees first; plain rounds once trees were timed; then the faster mode, the other for a few rounds after every
    probe_every, twice as far apart after each probe that lost. Rounds are given (tokens, seconds): no clock."""
    from hf_swiftspec.policy.choice import (MODE_MAX_PROBE_EVERY, MODE_PROBE_EVERY, MODE_PROBE_ROUNDS, PLAIN, TREE,
                                            DraftingChoice)

    choice = DraftingChoice()
    cost = {TREE: (1, 0.2), PLAIN: (1, 0.1)}  # trees yield 1 token in twice a plain round's time: plain wins
    modes, previous = [], None
    for _ in range(16 * MODE_PROBE_EVERY):
        mode = choice.next_mode()
        choice.observe(mode, *cost[mode], switched=previous is None or previous != mode)  # (as the engine)
        modes.append(mode)
        previous = mode
    first_plain = modes.index(PLAIN)
    assert modes[:first_plain] == [TREE] * (MODE_PROBE_ROUNDS + 1)  # (the first was a switch: not timed)
    assert choice.best() == PLAIN and choice.rates[PLAIN] == pytest.approx(10.0) and choice.rates[TREE] == 5.0
    # the tree probes: MODE_PROBE_ROUNDS rounds each, further apart each time they lose
    runs, mode, length = [], modes[first_plain], 0
    for m in modes[first_plain:]:
        if m == mode:
            length += 1
        else:
            runs.append((mode, length))
            mode, length = m, 1
    probes = [n for m, n in runs if m == TREE]
    gaps = [n for m, n in runs if m == PLAIN]  # (the first began as the plain rounds' own probe, which won)
    assert probes and all(n == MODE_PROBE_ROUNDS for n in probes)
    assert gaps[:4] == [MODE_PROBE_EVERY, 2 * MODE_PROBE_EVERY, 4 * MODE_PROBE_EVERY, 8 * MODE_PROBE_EVERY], runs
    # a plain run asks the target for the steps up to the next probe, within a quarter of the timeout at its rate
    choice.mode, choice.streak, choice.probing = PLAIN, 10, False
    assert choice.plain_steps(timeout_s=60.0) == min(choice.probe_every - 10, 64)
    assert choice.plain_steps(timeout_s=2.2) == 5  # 0.25 x 2.2 s x 10 tokens/s
    cost[TREE] = (4, 0.2)  # the text became predictable: the next probe wins and trees run again
    for _ in range(8 * MODE_MAX_PROBE_EVERY):  # (within a few probes: each moves the rate further)
        mode = choice.next_mode()
        choice.observe(mode, *cost[mode], switched=previous != mode)
        previous = mode
    assert choice.best() == TREE and choice.mode == TREE and "tree rounds" in choice.describe()


@pytest.mark.parametrize("root_ran", [False, True], ids=["fresh-root", "root-ran"])
def test_after_plain_rounds_the_draft_expands_from_the_whole_committed_text(root_ran):
    """Plain rounds run nothing on the draft (the prompt too waits): when trees come back, the tokens behind run first,
    and the new root's children are what a fresh causal forward of the draft over the whole text ranks best."""
    from hf_swiftspec.engine.device_async import AsyncShape, DraftSide, Verdict

    draft = tiny_model("llama", seed=3).requires_grad_(False)
    prompt = torch.tensor([[5, 17, 33, 8, 40]])
    shape = AsyncShape(budget=6, width=3, children=3, nodes=64, expansions=2)
    side = DraftSide(draft, prompt, shape, capacity=128, vocab_limit=draft.config.vocab_size)
    if root_ran:
        side.expand()  # a tree round ran the prompt and the root
    side.go_plain()
    assert side.root_ran == root_ran
    plain = [61, 7, 23, 90]  # the target's next tokens, one a plain round
    for token in plain:
        side.follow_plain(Verdict(torch.zeros(1, 1, dtype=torch.long), 1, torch.tensor([token]), False,
                                  tokens=(token,)))
    side.leave_plain()
    side.expand()
    with torch.no_grad():
        logits = draft(input_ids=torch.cat([prompt, torch.tensor([plain])], dim=1)).logits[0, -1]
    best, tokens = torch.log_softmax(logits.float(), -1).topk(3)
    tree = side.tree.tree
    assert tree.tokens[0, 0] == plain[-1] and int(tree.size[0]) == 4
    assert tree.tokens[0, 1:4].tolist() == tokens.tolist()
    torch.testing.assert_close(tree.scores[0, 1:4], best, atol=1e-4, rtol=1e-4)


def test_rounds_follow_the_drafting_choice_and_stay_exact_across_switches(monkeypatch):
    """The engine runs each round in the mode its choice names (here a fixed schedule: rates given, never moved by a
    clock), plain rounds and tree rounds alternating often; every output is target.generate's, and the tree rounds
    after plain ones still get the agreeing draft's tokens accepted (its cache caught up right)."""
    from hf_swiftspec.policy.choice import PLAIN, TREE, DraftingChoice

    class Scheduled(DraftingChoice):
        """Plain rounds measured faster, a tree probe of a few rounds after every 3 plain ones."""

        def observe(self, mode, tokens, seconds, switched, rounds=1):  # the rates stay as given
            self.streak += rounds

        def next_mode(self):
            mode = super().next_mode()
            self.probe_every = 3  # (never backed off)
            return mode

    from hf_swiftspec.engine.links import ThreadLink

    sent = []  # what each message asked: a plain run's steps run on the target with no message between
    send = ThreadLink.send_subtree
    monkeypatch.setattr(ThreadLink, "send_subtree", lambda self, message: (sent.append(message.steps),
                                                                           send(self, message))[1])
    target = tiny_model("llama", seed=2)
    model = asynchronous(target, truncated_draft(target, 3))
    model.policy().drafting = Scheduled(rates={TREE: 1.0, PLAIN: 2.0}, timed={TREE: 9, PLAIN: 9}, mode=PLAIN)
    for p in prompts((4, 11, 30), seed=7):
        sent.clear()
        expected = target.generate(p, do_sample=False, max_new_tokens=40)
        assert model.generate(p, do_sample=False, max_new_tokens=40).tolist() == expected.tolist()
        assert max(sent) > 1 and len(sent) < model.swiftspec_stats.verify_steps, sent
        rounds = model.swiftspec_stats.rounds
        trees = [r for r in rounds if r.budget > 1]
        plains = [r for r in rounds if r.budget == 1]
        assert trees and plains, rounds
        assert sum(r.accepted for r in trees) / len(trees) > 0.5, trees
        assert all(r.accepted == 0 for r in plains)
