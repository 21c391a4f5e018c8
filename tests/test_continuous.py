"""The continuous engine (engine/continuous.py): requests join a running batch between rounds and leave
when done, each decoding exactly as its own target.generate call would.

Joins are made deterministic: a request's streamer, at its k-th round, starts the next request and holds
the engine's thread until that request waits in the engine's queue, so it joins at the next round
boundary, while the others are mid-answer. Greedy answers are checked against target.generate on each
prompt alone; sampled answers against the same pair's lone speculative call with the same seed (the
noise of a row is its seed's and position's alone, verify.Sampler), which follows the target's
distribution (test_sampling.py).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.steps.cache import TreeCache
from hf_swiftspec.engine import continuous
from hf_swiftspec.engine.continuous import RequestCancelled
from hf_swiftspec.tools import sweep
from hf_swiftspec.tools.models import random_prompts, sharpen, tiny_gpt2, tiny_model, truncated_draft

VOCAB = 98
PROMPTS = random_prompts((3, 23, 9, 1, 14, 30), 0, VOCAB)
NEW = (20, 7, 33, 12, 1, 25)


def pair_of(family: str, **settings) -> SwiftSpecForCausalLM:
    if family == "llama":
        target = tiny_model("llama", seed=0)
        return SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), **settings)
    if family == "draft-free":
        return SwiftSpecForCausalLM.from_models(tiny_model("llama", seed=0), None, **settings)
    if family == "gemma3":  # sliding-window layers beside full ones (window 16: the long prompts pass it)
        target = sweep.tiny_of_type("gemma3_text", seed=0, vocab_size=VOCAB)
        sharpen(target, 4.0)
        return SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target), **settings)
    if family == "gpt2":  # learned absolute positions
        target = tiny_gpt2(VOCAB, n_positions=256)
        return SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target), **settings)
    if family == "eagle3":
        from test_eagle3 import random_head

        target = tiny_model("llama", seed=1, vocab_size=VOCAB)
        return SwiftSpecForCausalLM.from_models(target, random_head(target, draft_vocab=48), **settings)
    raise ValueError(family)


class Relay:
    """A streamer that, at its request's `at`-th put (the first is the prompt's), starts `next_request` and
    holds its caller (the engine's thread, past the prompt) until the engine has that request (named
    `next_key`), so that it joins at the next round boundary."""

    def __init__(self, engine, next_request: threading.Event | None, at: int, next_key=None):
        self.engine, self.next_request, self.at, self.next_key, self.rounds = engine, next_request, at, next_key, 0

    def put(self, value) -> None:
        self.rounds += 1
        if self.next_request is not None and self.rounds == self.at:
            self.next_request.set()
            deadline = time.monotonic() + 30
            while self.next_key not in self.engine.by_key and time.monotonic() < deadline:
                time.sleep(0.001)

    def end(self) -> None:
        pass


def run_relay(pair, engine, prompts, news, at=(2, 1, 3, 2, 1, 2), **kwargs) -> dict[int, torch.Tensor]:
    """Each request starts when the one before it is `at[i]` rounds in; returns each one's output."""
    calls = [dict(input_ids=torch.tensor([p]), max_new_tokens=n, **kwargs) for p, n in zip(prompts, news)]
    return relay_calls(pair, engine, calls, at)


def relay_calls(pair, engine, calls: list[dict], at, wait_s: float = 120) -> dict[int, torch.Tensor]:
    """Each call (generate()'s keyword arguments, input_ids included) starts when the one before it is at[i] rounds
    in (or done), in the running batch; returns each one's output."""
    starts = [threading.Event() for _ in calls]
    starts[0].set()
    out, errors = {}, {}

    def request(i: int) -> None:
        starts[i].wait(60)
        nxt = starts[i + 1] if i + 1 < len(calls) else None
        try:
            out[i] = pair.generate(streamer=Relay(engine, nxt, at[i], f"request-{i + 1}"),
                                   swiftspec_engine=(engine, f"request-{i}"), **calls[i])
        except Exception as error:  # noqa: BLE001  (reported below)
            errors[i] = error
        finally:
            if nxt is not None:
                nxt.set()  # a request that ended before its k-th round still lets the next one start

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(wait_s)
    assert not errors, errors
    return out

def assert_greedy_answers(pair, out: dict[int, torch.Tensor], prompts, news, **kwargs) -> None:
    """Each relayed answer (run_relay's) equals target.generate's greedy one for its prompt and length."""
    for i, prompt in enumerate(prompts):
        expected = pair.target.generate(torch.tensor([prompt]), max_new_tokens=news[i], do_sample=False, **kwargs)
        assert out[i].tolist() == expected.tolist(), f"request {i}"


@pytest.mark.parametrize("family", [
    pytest.param("llama", marks=pytest.mark.floor),  # generate()'s hand-off to the engine: also on the floor release
    "draft-free", "gemma3", "gpt2", "eagle3",
])
@pytest.mark.parametrize("piece", [continuous.PREFILL_PIECE, 4])  # whole prompts; 4 tokens per prefill forward
def test_requests_joining_a_running_batch_equal_target_generate(family, piece, monkeypatch):
    monkeypatch.setattr(continuous, "PREFILL_PIECE", piece)
    pair = pair_of(family)
    engine = pair.continuous_engine()
    try:
        out = run_relay(pair, engine, PROMPTS, NEW, do_sample=False)
    finally:
        engine.close()
    assert_greedy_answers(pair, out, PROMPTS, NEW)
    assert max(engine.rounds_by_batch) >= 3, engine.rounds_by_batch  # rows did decode together
    assert engine.served == len(PROMPTS)
    assert engine.usage.verifications > 0 and engine.usage.accepted <= engine.usage.proposed


def test_a_long_prompt_joins_a_piece_per_round_and_the_batch_decodes_meanwhile(monkeypatch):
    """A 30-token prompt prefilled 4 tokens per forward joins over 8 forwards, one between two rounds of the
    request already decoding (which runs 7 rounds meanwhile); both answers are target.generate's."""
    from hf_swiftspec.engine.device_sides import DeviceSides  # the running batch's round (round="auto")

    monkeypatch.setattr(continuous, "PREFILL_PIECE", 4)
    target = tiny_model("llama", seed=0)
    # a draft that seldom agrees, no suffix proposals: the first request takes about a round per token
    pair = SwiftSpecForCausalLM.from_models(target, tiny_model("llama", seed=1, layers=1), ngram_size=0)
    batch_sizes = []
    verify = DeviceSides.verify
    monkeypatch.setattr(DeviceSides, "verify", lambda self, p, rows: batch_sizes.append(len(rows.live)) or verify(self, p, rows))
    engine = pair.continuous_engine()
    prompts, news = [PROMPTS[0], PROMPTS[5]], (60, 20)  # 3 and 30 tokens
    try:
        out = run_relay(pair, engine, prompts, news, at=(2, 1), do_sample=False)
    finally:
        engine.close()
    assert_greedy_answers(pair, out, prompts, news)
    alone_before = batch_sizes.index(2)
    assert alone_before >= 1 + 7, batch_sizes  # the first request's round that started the second, then 7 more


def test_rows_stop_at_their_own_eos_and_lengths():
    pair = pair_of("llama")
    lone = [pair.target.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS[:4]]
    eos = lone[0][5]  # request 0 stops where it first meets this token (the others too, if they do)
    engine = pair.continuous_engine()
    try:
        out = run_relay(pair, engine, PROMPTS[:4], (30, 4, 30, 9), do_sample=False, eos_token_id=eos, pad_token_id=0)
    finally:
        engine.close()
    assert_greedy_answers(pair, out, PROMPTS[:4], (30, 4, 30, 9), eos_token_id=eos, pad_token_id=0)
    assert out[0].shape[1] == len(PROMPTS[0]) + lone[0].index(eos) + 1 < len(PROMPTS[0]) + 30


def test_sampled_rows_draw_what_a_lone_call_with_their_seed_draws():
    pair = pair_of("llama")
    kwargs = dict(do_sample=True, temperature=0.9, top_k=40)
    lone = {}
    for i, prompt in enumerate(PROMPTS):
        lone[i] = pair.generate(torch.tensor([prompt]), max_new_tokens=NEW[i], generator=torch.Generator().manual_seed(i),
                                swiftspec=True, **kwargs)
    engine = pair.continuous_engine()
    outs = {}
    try:
        starts = [threading.Event() for _ in PROMPTS]
        starts[0].set()

        def request(i):
            starts[i].wait(60)
            nxt = starts[i + 1] if i + 1 < len(PROMPTS) else None
            try:
                outs[i] = pair.generate(
                    torch.tensor([PROMPTS[i]]), max_new_tokens=NEW[i], generator=torch.Generator().manual_seed(i),
                    streamer=Relay(engine, nxt, 2, i + 1), swiftspec_engine=(engine, i), **kwargs,
                )
            finally:
                if nxt is not None:
                    nxt.set()

        threads = [threading.Thread(target=request, args=(i,)) for i in range(len(PROMPTS))]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
    finally:
        engine.close()
    assert {i: o.tolist() for i, o in outs.items()} == {i: o.tolist() for i, o in lone.items()}
    assert max(engine.rounds_by_batch) >= 3


def test_a_cancelled_request_leaves_and_the_others_finish_exactly():
    pair = pair_of("llama")
    engine = pair.continuous_engine()
    results, errors = {}, {}
    started = threading.Event()

    class Canceller:
        rounds = 0

        def put(self, value):
            Canceller.rounds += 1
            if Canceller.rounds == 3:
                started.set()
                engine.cancel("doomed")

        def end(self):
            pass

    def request(key, prompt, streamer=None):
        try:
            results[key] = pair.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, streamer=streamer,
                                         swiftspec_engine=(engine, key))
        except Exception as error:  # noqa: BLE001
            errors[key] = error

    doomed = threading.Thread(target=request, args=("doomed", PROMPTS[1], Canceller()))
    doomed.start()
    keeper = threading.Thread(target=request, args=("kept", PROMPTS[2]))
    keeper.start()
    doomed.join(60)
    keeper.join(60)
    engine.close()
    assert isinstance(errors.get("doomed"), RequestCancelled)
    expected = pair.target.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=40, do_sample=False)
    assert results["kept"].tolist() == expected.tolist()


def test_a_failing_streamer_fails_its_request_alone():
    """A request whose streamer fails while another decodes beside it: it alone fails, the other finishes exactly."""
    pair = pair_of("llama")
    engine = pair.continuous_engine()
    start_broken = threading.Event()
    results, errors = {}, {}

    class Broken:
        prompt_put = False  # generate() puts the prompt first, before the request reaches the engine

        def put(self, value):
            if self.prompt_put:
                raise OSError("client went away")
            self.prompt_put = True

        def end(self):
            pass

    def keeper():
        results["kept"] = pair.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=30, do_sample=False,
                                        streamer=Relay(engine, start_broken, 2, "broken"), swiftspec_engine=(engine, "kept"))

    def broken():
        start_broken.wait(60)
        try:
            pair.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, streamer=Broken(), swiftspec_engine=(engine, "broken"))
        except OSError as error:
            errors["broken"] = error

    threads = [threading.Thread(target=keeper), threading.Thread(target=broken)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    engine.close()
    assert "client went away" in str(errors["broken"])
    assert max(engine.rounds_by_batch) == 2  # it failed in a round it shared with the other request
    expected = pair.target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=30, do_sample=False)
    assert results["kept"].tolist() == expected.tolist()


def test_a_cancelled_row_leaves_the_batch_within_one_round():
    """The server cancels a request whose client left (engine.cancel): by the next round its row is gone from
    the batch (the engine's row count), and the request raises RequestCancelled."""
    pair = pair_of("llama")
    engine = pair.continuous_engine()
    start_doomed = threading.Event()
    rows_after_cancel, errors = [], {}

    class Watcher(Relay):
        """The staying request's streamer: once the doomed request shares its rounds, cancels it, then counts rows."""

        cancelled = False

        def put(self, value) -> None:
            super().put(value)
            if self.cancelled:
                rows_after_cancel.append(len(engine.rows.live))
            elif len(engine.rows.live) == 2:
                self.cancelled = engine.cancel("doomed")

    def doomed():
        start_doomed.wait(60)
        try:
            pair.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=60, do_sample=False, swiftspec_engine=(engine, "doomed"))
        except RequestCancelled as error:
            errors["doomed"] = error

    thread = threading.Thread(target=doomed)
    thread.start()
    out = pair.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40, do_sample=False,
                        streamer=Watcher(engine, start_doomed, 2, "doomed"), swiftspec_engine=(engine, "kept"))
    thread.join(60)
    engine.close()
    assert isinstance(errors.get("doomed"), RequestCancelled)
    assert rows_after_cancel and rows_after_cancel[0] == 1, rows_after_cancel
    assert out.tolist() == pair.target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40, do_sample=False).tolist()


def live_tensors() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


def test_hundreds_of_joins_and_leaves_keep_capacity_and_tensors_bounded():
    """300 requests through one engine, 3 at a time: the running caches never hold more positions per row than
    the largest lone request needs, and the live tensors once idle do not grow with the requests served."""
    pair = pair_of("llama")
    engine = pair.continuous_engine()
    capacities = []

    class Gauge:
        def put(self, value) -> None:
            if engine.sides is not None:  # the device round's slots (the host round's: its target cache's)
                capacities.append(engine.capacity if engine.on_device else engine.sides.target.cache.capacity)

        def end(self) -> None:
            pass

    def ask(i: int) -> None:
        pair.generate(torch.tensor([PROMPTS[i % len(PROMPTS)]]), max_new_tokens=4 + i % 5, do_sample=False,
                      streamer=Gauge(), swiftspec_engine=(engine, f"r{i}"))

    from concurrent.futures import ThreadPoolExecutor

    try:
        for i in range(len(PROMPTS)):  # each prompt alone: the capacity a lone request needs
            ask(1000 + i * 5 + 4)
        lone_most = max(capacities)
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(ask, range(60)))
            # the engine keeps some state per batch size (at most 3 here): reach 3 rows before counting, with three
            # long requests at once (timing decides how often three overlap among the 60)
            for attempt in range(20):
                if max(engine.rounds_by_batch) >= 3:
                    break
                list(pool.map(lambda i: pair.generate(torch.tensor([PROMPTS[i]]), max_new_tokens=24, do_sample=False,
                                                      swiftspec_engine=(engine, f"w{attempt}-{i}")), range(3)))
        assert max(engine.rounds_by_batch) == 3, engine.rounds_by_batch
        warm = live_tensors()
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(ask, range(60, 300)))
        after = live_tensors()
    finally:
        engine.close()
    assert max(engine.rounds_by_batch) > 1
    assert max(capacities) <= lone_most
    assert after <= warm + 10, (warm, after)


def penalised(prompt_length: int, frequency: float, presence: float):
    """OpenAI's penalties written out token by token (the reference for the server's vectorised processor):
    each generated token's logit loses `frequency` per time it was generated, and `presence` once."""

    def process(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        generated = ids[0, prompt_length:].tolist()
        for token in generated:
            scores[0, token] -= frequency
        for token in set(generated):
            scores[0, token] -= presence
        return scores

    return process


def test_each_row_samples_with_its_own_settings():
    """Requests with different settings in one running batch (the server's: RequestSettings.generation_kwargs):
    each setting's first two tokens follow the target's distribution under that setting (its temperature,
    top_p, OpenAI penalties), chi-square over its own draws."""
    from scipy.stats import binomtest
    from test_sampling import ALPHA, exact_joint, pooled_chisquare
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    from hf_swiftspec.serving.request_settings import RequestSettings

    target = tiny_model("llama", seed=3, vocab_size=12)
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2))
    for config in (pair.generation_config, target.generation_config):  # two tokens every draw (generate() falls
        config.eos_token_id = None  # back to the model's EOS where the call's config has none)
    base = copy.deepcopy(pair.generation_config)
    prompt = [3, 7, 5]
    settings = [
        RequestSettings(temperature=0.6),
        RequestSettings(temperature=1.4, top_p=0.8),
        RequestSettings(temperature=1.0, frequency_penalty=0.5, presence_penalty=2.0),
    ]
    processors = [
        LogitsProcessorList([TemperatureLogitsWarper(0.6)]),
        LogitsProcessorList([TemperatureLogitsWarper(1.4), TopPLogitsWarper(0.8)]),
        LogitsProcessorList([penalised(len(prompt), 0.5, 2.0), TemperatureLogitsWarper(1.0)]),
    ]
    draws = 300
    engine = pair.continuous_engine()
    counts = [torch.zeros(12, 12) for _ in settings]

    def draw(i: int) -> None:
        kind = i % len(settings)
        kwargs = settings[kind].generation_kwargs(base, len(prompt), 2, None, "cpu")
        kwargs["generator"] = torch.Generator().manual_seed(i)
        out = pair.generate(torch.tensor([prompt]), swiftspec_engine=(engine, f"d{i}"), **kwargs)[0, len(prompt):]
        counts[kind][out[0], out[1]] += 1

    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(9) as pool:
            list(pool.map(draw, range(draws * len(settings))))
    finally:
        engine.close()
    assert max(engine.rounds_by_batch) > 2  # rows of different settings shared rounds
    for kind, processor in enumerate(processors):
        expected = exact_joint(target, torch.tensor([prompt]), processor)
        assert pooled_chisquare(counts[kind].flatten(), expected.flatten() * draws) > ALPHA, settings[kind]
        # a repeated token is where the penalties act; pooling spreads its rare cells, so test it on its own too
        repeats = int(counts[kind].diagonal().sum())
        assert binomtest(repeats, draws, float(expected.diagonal().sum())).pvalue > ALPHA, (settings[kind], repeats)


def test_what_cannot_join_a_batch_is_refused_by_name():
    pair = pair_of("llama")
    engine = pair.continuous_engine()
    with pytest.raises(ValueError, match="one sequence per request"):
        pair.generate(torch.tensor([PROMPTS[0], PROMPTS[0]]), max_new_tokens=3, swiftspec_engine=(engine, "x"))
    engine.close()
    recurrent = sweep.tiny_of_type("bamba", layers=4)  # Mamba-2 layers and one attention layer
    with pytest.raises(ValueError, match="cannot decode rows in one batch.*recurrent"):
        SwiftSpecForCausalLM.from_models(recurrent, None).continuous_engine()


def cache_rows(model, prompts: list[list[int]], capacity: int) -> TreeCache:
    """A TreeCache holding each prompt's KV, prefilled alone and absorbed one after another."""
    from hf_swiftspec.steps.probes import describe
    from hf_swiftspec.steps.recurrent import new_cache
    from hf_swiftspec.steps.step import model_step

    architecture = describe(model, "target")
    joined = None
    for i, prompt in enumerate(prompts):
        cache = new_cache(architecture, capacity + 4 * i, 1)  # later rows ask for more room: the buffers grow
        if prompt:
            ids = torch.tensor([prompt])
            model_step(model, cache, ids, torch.arange(len(prompt))[None], keep=1)
            cache.seal_prefix()
        if joined is None:
            joined = cache
        else:
            joined.absorb(cache)
    return joined


@torch.no_grad()
def test_absorbed_rows_hold_the_keys_and_values_their_own_prefill_wrote():
    model = tiny_model("llama", seed=0)
    prompts = [[2], [5, 6, 7], [], [9] * 11, [], [3, 1]]  # rows with nothing run yet (a joining draft's) among them
    joined = cache_rows(model, prompts, capacity=24)
    assert joined.lengths == [len(p) for p in prompts] and joined.batch_size == len(prompts)
    assert joined.capacity == 24 + 1 + 4 * (len(prompts) - 1)
    for b, prompt in enumerate(prompts):
        if not prompt:
            continue
        alone = cache_rows(model, [prompt], capacity=24)
        for layer, own in zip(joined.layers, alone.layers):
            assert torch.equal(layer.keys[b, :, : len(prompt)], own.keys[0, :, : len(prompt)])
            assert torch.equal(layer.values[b, :, : len(prompt)], own.values[0, :, : len(prompt)])
    joined.keep_rows([3, 1])  # rows leave, and one joins into the room they left
    joined.absorb(cache_rows(model, [[4, 4, 4, 4]], capacity=24))
    alone = cache_rows(model, [[9] * 11], capacity=24)
    assert torch.equal(joined.layers[0].keys[0, :, :11], alone.layers[0].keys[0, :, :11])
    assert joined.lengths == [11, 3, 4]


def test_a_failing_round_fails_its_rows_and_the_engine_serves_on(monkeypatch):
    """An error in a round (here the verification's) reaches every row's generate() as that error, never a
    hang; the next request starts a fresh batch and decodes exactly."""
    from hf_swiftspec.engine.device_sides import DeviceSides  # the running batch's round (round="auto")

    pair = pair_of("llama")
    engine = pair.continuous_engine()
    verify = DeviceSides.verify
    calls = []

    def failing_once(self, proposed, rows):  # the first round the two requests share
        calls.append(len(rows.live))
        if calls.count(2) == 1 and calls[-1] == 2:
            raise RuntimeError("device lost")
        return verify(self, proposed, rows)

    monkeypatch.setattr(DeviceSides, "verify", failing_once)
    errors, second = {}, threading.Event()

    def request(i, streamer=None):
        if i == 2:
            second.wait(60)
        try:
            pair.generate(torch.tensor([PROMPTS[i]]), max_new_tokens=30, streamer=streamer, swiftspec_engine=(engine, i))
        except RuntimeError as error:
            errors[i] = str(error)

    run = [threading.Thread(target=request, args=(1, Relay(engine, second, 2, 2))), threading.Thread(target=request, args=(2,))]
    [t.start() for t in run]
    [t.join(60) for t in run]
    assert errors == {1: "device lost", 2: "device lost"}
    out = pair.generate(torch.tensor([PROMPTS[3]]), max_new_tokens=12, do_sample=False, swiftspec_engine=(engine, 3))
    engine.close()
    expected = pair.target.generate(torch.tensor([PROMPTS[3]]), max_new_tokens=12, do_sample=False)
    assert out.tolist() == expected.tolist()


def test_openai_penalties_equal_the_token_by_token_reference():
    """The server's penalties processor against `penalised` on sequences with tokens repeated up to 5 times
    (the sampling test above draws two tokens, where frequency and presence act alike)."""
    from hf_swiftspec.serving.request_settings import OpenAIPenalties

    torch.manual_seed(0)
    ids = torch.cat([torch.tensor([[1, 1, 1]]), torch.randint(0, 6, (1, 12))], dim=1)
    scores = torch.randn(1, 9)
    for frequency, presence in [(0.5, 0.0), (0.0, 1.5), (1.2, -0.7)]:
        expected = penalised(3, frequency, presence)(ids, scores)
        torch.testing.assert_close(OpenAIPenalties(3, frequency, presence)(ids, scores.clone()), expected)
