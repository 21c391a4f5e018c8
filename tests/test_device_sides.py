"""round="device" (engine/device_sides.py): the draft model's growth, the selection, the target's verification,
the walk and both caches' commits on the device, read once a round, decode exactly as target.generate does
(greedy, float32) on two full-attention architectures, one sequence and a left-padded batch, with EOS,
max_new_tokens and stop strings (rows that decode on after theirs); sampling draws what the host round draws under
the same seed (its rule: the target's distribution, test_sampling.py); and a call it cannot decode exactly is a
ValueError naming why, never a silent fallback."""

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_swiftspec import SwiftSpecConfig, SwiftSpecForCausalLM
from hf_swiftspec.engine import rounds
from hf_swiftspec.policy.shapes import Shape, ShapeMenu
from hf_swiftspec.tools.models import char_tokenizer, left_padded, random_prompts, tiny_model, truncated_draft
from sync_counter import SyncCounter

DEVICE = dict(round="device", ngram_size=0)
FIXED = dict(draft_depth=3, draft_width=2, tree_budget=6)  # one shape: what a round accepts follows no clock


@pytest.fixture(scope="module")
def pairs():
    """Per architecture: the target, and its pair on the device round (the draft cut from the target's first two
    layers, so it agrees often)."""
    out = {}
    for arch in ("llama", "qwen3"):
        target = tiny_model(arch, seed=0)
        target.generation_config.eos_token_id = None  # each test names the EOS it stops at
        out[arch] = target, SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE, **FIXED)
    return out


def batch(lengths=(3, 17, 9, 1), seed=0):
    return left_padded(random_prompts(lengths, seed, 98))


def reads_per_round(monkeypatch) -> list[int]:
    """Host reads of each round (rounds.one_round, the round's whole body), as SyncCounter counts them."""
    counts, body = [], rounds.one_round

    def counted(sides, rows):
        with SyncCounter() as counter:
            keep = body(sides, rows)
        counts.append(sum(counter.calls.values()))
        return keep

    monkeypatch.setattr(rounds, "one_round", counted)
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [1, 4])
def test_greedy_equals_target_generate_reading_once_a_round(pairs, arch, rows, monkeypatch):
    """Token for token target.generate's output (EOS and max_new_tokens as generate applies them, left padding),
    with the draft model running every round (draft forwards > rounds), proposals accepted (more tokens than
    verifications), and at most one host read per round."""
    target, pair = pairs[arch]
    ids, mask = batch() if rows > 1 else (torch.tensor([[5, 17, 33, 8, 61, 9, 40]]), None)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    eos = int(free[0, ids.shape[1] + 11])  # row 0 stops mid-call at an EOS of its own
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos)
    expected = target.generate(ids, **kwargs)
    reads = reads_per_round(monkeypatch)
    actual = pair.generate(ids, **kwargs)
    assert actual.tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and max(reads) <= 1 and len(reads) == len(stats.rounds)
    assert stats.draft_forwards > len(stats.rounds) and stats.draft_depth > 0
    assert stats.new_tokens > sum(r.rows for r in stats.rounds)  # the draft's nodes were accepted
    phases = stats.phases  # the round's breakdown: growth, verification graph, the read and the host's part
    assert phases.rounds == len(stats.rounds) and min(phases.expand, phases.verify, phases.walk) > 0, phases


def test_stop_strings_and_rows_that_decode_on():
    """Stop strings (applied on the host to the round's one read): with no EOS id generate decodes a row on past its
    stop string until every row's has appeared; the device round cuts its walk there and goes on from the cut.
    (The criteria run on host copies of the tokens, so SyncCounter, which cannot tell host tensors from device
    ones, sees their calls: the reads are bounded by the greedy test, which has no stop strings.)"""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE)
    tok = char_tokenizer()
    ids, mask = batch(seed=5)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)[:, ids.shape[1]:]
    stops = [tok.decode(free[b, at: at + 2]) for b, at in enumerate((4, 20, 9, 13))]
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, stop_strings=stops, tokenizer=tok)
    expected = target.generate(ids, **kwargs)
    actual = pair.generate(ids, **kwargs)
    assert actual.tolist() == expected.tolist()
    out = actual[:, ids.shape[1]:]
    stopped_at = [next(t + 1 for t in range(out.shape[1]) if tok.decode(row[: t + 1]).endswith(tuple(stops)))
                  for row in out]
    assert max(stopped_at) == out.shape[1] < 40 and min(stopped_at) < out.shape[1] - 5  # rows decoded on


def test_sampling_draws_what_the_host_round_draws():
    """Under one seed, each row's sampled tokens are the host round's (the same Gumbel-max rule, noise keyed by seed,
    row and position: the target's distribution, which test_sampling.py checks by chi-square), and not greedy's."""
    target = tiny_model("llama", seed=0)
    draft = truncated_draft(target, 2)
    device = SwiftSpecForCausalLM.from_models(target, draft, **DEVICE)
    host = SwiftSpecForCausalLM.from_models(target, draft, ngram_size=0)
    ids, mask = batch(seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, temperature=0.9, top_k=20)
    drawn = device.generate(ids, do_sample=True, generator=torch.Generator().manual_seed(11), **kwargs)
    assert drawn.tolist() == host.generate(ids, do_sample=True, generator=torch.Generator().manual_seed(11),
                                           **kwargs).tolist()
    assert device.swiftspec_stats.engine == "device" and host.swiftspec_stats.engine == "serial"
    assert drawn.tolist() != device.generate(ids, do_sample=False, **kwargs).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_replayed_phases_decode_as_the_eager_ones(arch):
    """capture=True on a CPU replays both phases from the emulating stand-in (steps/phase_graphs.py), whose replay
    calls the phase captured in the first round again: every prefix length, root, budget, EOS id and noise must reach
    it as an input, or a later round reuses the first's and decodes other tokens. Greedy equals target.generate
    (rows leaving: a new batch shape, captured anew), and a seed draws the host round's tokens."""
    target = tiny_model(arch, seed=0)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 2)
    pair = SwiftSpecForCausalLM.from_models(target, draft, capture=True, **DEVICE, **FIXED)
    ids, mask = batch(seed=1)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=int(free[1, ids.shape[1] + 9]))
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    assert "replayed phases, emulate" in pair.swiftspec_stats.attention and "eager:" not in pair.swiftspec_stats.attention
    assert len(pair.swiftspec_stats.rounds) > 4  # graphs replayed (2 phases x a few row counts were captured)
    host = SwiftSpecForCausalLM.from_models(target, draft, ngram_size=0)
    sampled = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20)
    assert pair.generate(ids, generator=torch.Generator().manual_seed(2), **sampled).tolist() == host.generate(
        ids, generator=torch.Generator().manual_seed(2), **sampled).tolist()


def test_output_scores_are_generates():
    """return_dict_in_generate's scores and logits: each step's equals target.generate's."""
    target = tiny_model("llama", seed=0)
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE)
    ids = torch.tensor([[5, 17, 33, 8, 61]])
    kwargs = dict(do_sample=False, max_new_tokens=10, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=None)
    expected, actual = target.generate(ids, **kwargs), pair.generate(ids, **kwargs)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    for name in ("scores", "logits"):
        for got, want in zip(getattr(actual, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def refused(pair, ids, **kwargs) -> str:
    with pytest.raises(ValueError, match="round='device'") as raised:
        pair.generate(ids, max_new_tokens=4, do_sample=False, **kwargs)
    return str(raised.value)


def test_calls_it_cannot_decode_exactly_are_refused_with_the_reason():
    """Draft-free pairs with nothing to propose (ngram_size=0), sliding windows, path-dependent processors: a ValueError
    naming the cause and the fix, never the host round or the target's loop instead."""
    target = tiny_model("llama", seed=0)
    ids = torch.tensor([[5, 17, 33, 8]])
    message = refused(SwiftSpecForCausalLM.from_models(target, None, **DEVICE), ids)
    assert "draft-free" in message and "ngram_size > 0" in message
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE)
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    assert "RepetitionPenaltyLogitsProcessor" in refused(pair, ids, logits_processor=penalty)
    windowed = tiny_model("mistral", seed=0, sliding_window=4)
    message = refused(SwiftSpecForCausalLM.from_models(windowed, truncated_draft(windowed, 2), **DEVICE), ids)
    assert "sliding-window" in message and "round='host'" in message
    with pytest.raises(ValueError, match="round='gpu'"):
        SwiftSpecConfig(round="gpu")
    limit = target.config.max_position_embeddings
    long = torch.randint(1, 90, (1, limit - 10))
    with pytest.raises(ValueError, match=f"{limit + 20} positions, past the models' context of {limit}; ask for at "
                                         "most 10 new tokens"):
        pair.generate(long, max_new_tokens=30, do_sample=False)


def test_every_documented_refusal_names_its_reason():
    """settings.md's list of what the device round refuses, each by its message (beside the test above's): compile=True,
    attention="kernel", a placement other than serial, a slot rule past which only one-token steps are exact (doge's
    key budget). (An attention that takes no 4D mask is refused by the pair itself, whatever the round:
    architectures.UnsupportedArchitecture. Recurrent models and those placing tokens by slot run chains:
    test_device_chains.py.)"""
    target = tiny_model("llama", seed=0)
    ids = torch.tensor([[5, 17, 33, 8]])
    for settings in (dict(compile=True), dict(attention="kernel")):
        message = refused(SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE, **settings), ids)
        assert "compile=True and attention='kernel' are not honoured" in message
    threads = dict(placement={"target": ["cpu"], "draft": ["cpu"]})
    message = refused(SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **DEVICE, **threads), ids)
    assert "placement='serial'" in message
    from hf_swiftspec.tools import sweep

    budgeted = sweep.tiny_of_type("doge", seed=0, vocab_size=98, keep_window_size=4)
    message = refused(SwiftSpecForCausalLM.from_models(budgeted, None, round="device", ngram_size=3), ids)
    assert "slot-limited layers" in message and "keeps only its 4 best-scored keys" in message


@pytest.mark.parametrize("capture", [False, True])
def test_eos_lists_of_other_widths_across_calls_replay_exactly(capture):
    """A first call with one EOS id captures its phases; later calls of the same rows with three and then five EOS ids
    (Llama-3 Instruct targets have three), one of them reached mid-call, equal target.generate's (the EOS width is in
    the graphs' key: a wider list captures its own graphs rather than failing to copy into the narrower ones)."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), capture=capture, **DEVICE, **FIXED)
    ids, mask = batch(seed=4)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    new = free[:, ids.shape[1]:]
    unused = [t for t in range(98) if t not in set(new.flatten().tolist())]
    for eos in ([unused[0]], [unused[1], int(new[2, 8]), unused[2]], unused[3:6] + [int(new[0, 12]), int(new[1, 5])]):
        kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos)
        assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist(), eos
        assert pair.swiftspec_stats.engine == "device"


@pytest.mark.parametrize("ngram_size", [0, 3])
def test_sampled_draws_follow_the_targets_distribution(ngram_size):
    """The device round's own draws (noise drawn on the device: verify.gumbel_noise) against the target's exact joint
    distribution of the first two new tokens, by chi-square: 1,500 rows of one batched call, each row its own draw."""
    from test_sampling import ALPHA, VOCAB, exact_joint, pooled_chisquare, warpers

    target = tiny_model("llama", seed=3, vocab_size=VOCAB)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), round="device", ngram_size=ngram_size,
                                            draft_depth=2, draft_width=3, tree_budget=6)
    prompt = [3, 7, 5, 9, 3, 7, 5] if ngram_size else [3, 7, 5, 9]
    draws = 1500
    out = pair.generate(torch.tensor([prompt] * draws), do_sample=True, temperature=0.9, max_new_tokens=2,
                        generator=torch.Generator().manual_seed(0))
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and stats.verify_steps < 2 * draws  # trees were accepted: some rows took both at once
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    for t1, t2 in out[:, -2:].tolist():
        counts[t1 * VOCAB + t2] += 1
    expected = exact_joint(target, torch.tensor([prompt]), warpers(0.9))
    pvalue = pooled_chisquare(counts, expected.flatten() * draws)
    assert pvalue > ALPHA, f"p={pvalue:.2e}: the device round's draws do not follow the target's distribution"


def test_the_menu_prices_shapes_by_measured_rounds():
    """Every shape runs once, then the best measured tokens per second runs, and the others again every `retry_every`
    rounds while a re-price pays, twice as far apart after each that does not; a round with no time (the first) prices
    nothing; settings that fix the shape give a menu of one."""
    menu = ShapeMenu((Shape(1, 2, 2), Shape(3, 2, 6), Shape(4, 4, 8)), retry_every=10)
    first = menu.pick()
    menu.observe(first, 5, None)
    assert menu.pick() == first  # unpriced still
    for shape, tokens in ((Shape(1, 2, 2), 4), (Shape(3, 2, 6), 9), (Shape(4, 4, 8), 8)):
        assert menu.pick() == shape
        menu.observe(shape, tokens, 1.0)
    picks = [menu.pick() for _ in range(20)]
    assert picks.count(Shape(3, 2, 6)) == 18 and len(set(picks)) == 3
    retried = []
    for _ in range(400):  # re-prices that never pay: each one twice as far from the last
        shape = menu.pick()
        if shape != Shape(3, 2, 6):
            retried.append(menu.rounds)
        menu.observe(shape, 9 if shape == Shape(3, 2, 6) else 1, 1.0)
    gaps = [b - a for a, b in zip(retried, retried[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 8 * gaps[0], retried
    assert ShapeMenu.of(3, 5, 9, room=100).shapes == (Shape(3, 5, 9),)
    with pytest.raises(ValueError, match="positions"):
        ShapeMenu.of(3, 5, 9, room=2)


def test_a_proposal_in_hand_prices_the_draft_free_shapes():
    """With the round's suffix proposal in hand, a draft-free shape is worth rows + calibration x the P(accepted) of its
    best T - 1 nodes over its cost per round, against the draft's shapes at their measured rates: nothing proposed
    runs plain (a larger shape never for no more expected tokens), three sure nodes the 8-node shape, fifteen the
    16-node one; rounds that gained less than they promised scale the promise down; under the latency guard the
    slowest row's promise counts; a suffix shape is re-priced only where the proposal has nodes for it."""
    from hf_swiftspec.policy.shapes import DECAY, Hand, Price

    draft, plain, eight, sixteen = Shape(2, 2, 4), Shape(0, 0, 1), Shape(0, 0, 8), Shape(0, 0, 16)

    def menu_of(draft_tokens=15, promised=0.0, gained=0.0, retry_every=1000):
        # measured per round: plain 10 ms, 8 nodes 12 ms, 16 nodes 15 ms; the draft's shape 20 ms
        menu = ShapeMenu((draft, plain, eight, sixteen), retry_every=retry_every)
        menu.prices = {plain: Price(10, 10, 0.1, 10), eight: Price(10, 10, 0.12, 10, promised, gained),
                       sixteen: Price(10, 10, 0.15, 10), draft: Price(10, draft_tokens, 0.2, 10)}
        return menu

    sure3, sure15 = Hand([[0.9] * 3]), Hand([[0.95] * 15])
    assert sure3.promise(8) == sure3.promise(16) == pytest.approx(2.7) and sure15.promise(8) == pytest.approx(6.65)
    assert menu_of().pick(Hand([[]])) == plain
    assert menu_of().pick(Hand([[0.1]])) == plain  # (1 + 0.1) / 12 ms < 1 / 10 ms
    assert menu_of().pick(sure3) == eight  # 16 nodes promise no more than 8
    assert menu_of().pick(sure15) == sixteen
    assert menu_of().pick(None) == plain  # no hand: measured rates (plain 100 tokens/s, the others 83, 67, 75)
    assert menu_of(draft_tokens=40).pick(Hand([[]])) == draft  # 200 tokens/s measured beats a plain round
    assert menu_of(promised=100.0, gained=1.0).pick(sure15) == plain  # calibration (1 + 1) / (100 + 1)
    assert menu_of(promised=50.0, gained=4.0).pick(sure15) == sixteen  # (4 + 1) / (50 + 1)
    both = [[0.95] * 15, []]
    assert menu_of().pick(Hand(both)) == sixteen and menu_of().pick(Hand(both, guard=True)) == plain
    assert Hand(both, guard=True).promise(16) == 0 and Hand(both).promise(16) == pytest.approx(14.25)
    menu = menu_of(retry_every=2)
    picks = {menu.pick(Hand([[]])) for _ in range(40)}
    assert picks == {plain, draft}  # nothing proposed: the re-prices run the draft's shape, no suffix shape
    menu = menu_of(retry_every=2, promised=100.0, gained=1.0)
    assert {menu.pick(sure15) for _ in range(40)} == {plain, draft, eight, sixteen}  # a low calibration is re-priced
    menu = menu_of(retry_every=2)
    assert {menu.pick(None) for _ in range(40)} == {plain, draft, eight, sixteen}
    menu = menu_of()
    menu.observe(eight, 5, 0.012, promised=6.0, gained=4.0)
    price = menu.prices[eight]
    assert price.promised == pytest.approx(6.0) and price.gained == pytest.approx(4.0)
    assert price.weight == pytest.approx(DECAY * 10 + 1) and price.cost == pytest.approx((DECAY * 0.12 + 0.012) / price.weight)
    assert menu.calibration() == pytest.approx(5.0 / 7.0)


@pytest.mark.parametrize("width,capture", [(1, False), (2, False), (2, True)])
def test_a_draft_equal_to_the_target_has_its_whole_chain_accepted(width, capture):
    """With the target as its own draft, the tree of depth 3 (all of it verified) holds the target's own greedy
    continuation, so every round but the call's last accepts 3 nodes in every row (at width 2 the greedy path can
    fall out of the tree, a second child's path outscoring it, so: most rounds, and 26 tokens in 8 rounds at most):
    the draft's cache holds exactly the committed sequence after each round (its commit of the nodes it ran, moved
    from their tree slots at width 2, its catch-up on the last one, the rows' prefixes). Replayed (capture=True), a draft input baked into the growth's
    graph would grow the first round's tree again: the tokens stay the target's, but acceptance drops."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, tiny_model("llama", seed=0), draft_width=width, draft_depth=3,
                                            tree_budget=1 + 3 * width, capture=capture, **DEVICE)
    ids, mask = batch(seed=3)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=26)
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    records = pair.swiftspec_stats.rounds
    full = [r.accepted == 3 * r.rows for r in records]  # 26 tokens: 6 rounds of 4, and the last's 2
    assert all(r.budget == 1 + 3 * width for r in records)
    assert (sum(full), len(records)) == (6, 7) if width == 1 else (sum(full) >= 4 and len(records) <= 8)


class OnCuda(torch.nn.Module):
    """A model as choose_round sees one on CUDA (its device and config; nothing runs)."""

    def __init__(self, model):
        super().__init__()
        self.config, self.wrapped = model.config, [model]

    @property
    def device(self):
        return torch.device("cuda")


def test_auto_takes_the_device_round_on_cuda_where_it_applies_and_says_why():
    """round="auto" (the default): on a CPU the host round; on CUDA the device round, unless it cannot decode the call
    exactly (then the host round, naming the reason); each call's stats say which ran and why."""
    from hf_swiftspec.engine.device_sides import choose_round
    from hf_swiftspec.steps.probes import describe

    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2))
    assert pair.config.round == "auto"
    ids = torch.tensor([[5, 17, 33, 8, 61]])
    assert pair.generate(ids, max_new_tokens=8, do_sample=False).tolist() == target.generate(
        ids, max_new_tokens=8, do_sample=False).tolist()
    assert pair.swiftspec_stats.engine == "serial" and "round='auto' on cpu" in pair.swiftspec_stats.round_choice
    config, cuda = SwiftSpecConfig(ngram_size=3), OnCuda(target)
    architectures = describe(target, "target"), None
    assert choose_round(config, cuda, None, architectures, [], None, None, False, []) == (
        "device", "round='auto' on CUDA: the device round")
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    round_, why = choose_round(config, cuda, None, architectures, penalty, None, None, False, [])
    assert round_ == "host" and "RepetitionPenaltyLogitsProcessor" in why
    assert choose_round(SwiftSpecConfig(round="host"), cuda, None, architectures, [], None, None, False, [])[0] == "host"


def test_the_re_price_schedule_goes_on_across_calls():
    """The menu's re-price schedule is kept with the pair beside its prices: a call starts where the last call of as
    many rows left it (its round count, its interval), so re-prices that did not pay stay as rare in a series of
    short calls as in one long one; a call's own tokens are target.generate's all the same."""
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, tiny_model("llama", seed=1, layers=1), round="device",
                                            ngram_size=0)
    menus, total = [], 0
    for seed in range(3):
        ids = torch.tensor(random_prompts([6], seed, 98))
        out = pair.generate(ids, max_new_tokens=24, do_sample=False)
        assert out.tolist() == target.generate(ids, max_new_tokens=24, do_sample=False).tolist()
        total += len(pair.swiftspec_stats.rounds)
        menu = pair.captures.device.schedules[1]
        menus.append(menu)
        assert menu.rounds == total  # counted across the calls, one pick a round
    assert len({id(m) for m in menus}) == 3  # a menu a call, the schedule handed on
    assert menus[2].next_retry > total - len(pair.swiftspec_stats.rounds)  # counted from the earlier calls' rounds


def priced_plain_first(pair, rows: int) -> None:
    """The pair's device pool with every shape of `rows`' bucket priced and the plain shape the best: a call's first
    round is plain (its re-prices far off)."""
    from hf_swiftspec.engine.device_pool import SlotPool, bucket_for
    from hf_swiftspec.policy.shapes import MENU, PLAIN, Price
    from hf_swiftspec.steps.capture import capture_backend

    pair.captures.device = pool = SlotPool(capture_backend(pair.config.capture, pair.target.device))
    pool.prices[bucket_for(rows)] = {Shape(*s): Price(1, 10 if s == PLAIN else 1, 1.0) for s in MENU}


@pytest.mark.parametrize("rows,capture", [(1, False), (4, False), (4, True)])
def test_a_plain_first_round_takes_the_roots_from_the_prefill(rows, capture, monkeypatch):
    """Where the menu's first pick is the plain shape, the target's prefill runs each whole prompt (right-aligned, the
    root last) and keeps the roots' logits, as generate's prefill does, so round 1 runs no target forward: one forward
    a token, not one more a call. Greedy tokens, scores and logits equal target.generate's (prompts of 3, 17, 9 and 1
    tokens: the alignment's padding), and a seed draws the host round's tokens; replayed too (round 1 runs eagerly)."""
    from hf_swiftspec.engine import device_sides

    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    draft = truncated_draft(target, 2)
    pair = SwiftSpecForCausalLM.from_models(target, draft, capture=capture, **DEVICE)
    ids, mask = batch(seed=4) if rows > 1 else (torch.tensor([[5, 17, 33, 8, 61, 9, 40]]), None)
    firsts = []
    pick = device_sides.DeviceSides.start

    def start(sides, request):
        pick(sides, request)
        firsts.append((sides.first, sides.root_logits is not None))

    monkeypatch.setattr(device_sides.DeviceSides, "start", start)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    priced_plain_first(pair, rows)
    expected, actual = target.generate(ids, **kwargs), pair.generate(ids, **kwargs)
    assert firsts == [(Shape(0, 0, 1), True)]
    assert actual.sequences.tolist() == expected.sequences.tolist()
    for name in ("scores", "logits"):
        for got, want in zip(getattr(actual, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and stats.rounds[0].budget == 1
    assert stats.target_forwards == len(stats.rounds)  # the prefill, and a forward in every round but the first
    host = SwiftSpecForCausalLM.from_models(target, draft, ngram_size=0)
    sampled = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20)
    priced_plain_first(pair, rows)
    drawn = pair.generate(ids, generator=torch.Generator().manual_seed(3), **sampled)
    assert firsts[-1] == (Shape(0, 0, 1), True)
    assert drawn.tolist() == host.generate(ids, generator=torch.Generator().manual_seed(3), **sampled).tolist()
