"""`swiftspec serve` under load and for the clients that need more than text: admission control (a bounded queue
answering 429 with Retry-After, a request timeout, the running batch's cache positions), /metrics in Prometheus'
text format, logprobs against the target alone, n answers, and the model named as the client named it. Every
answer is checked against the target alone (`target.generate`, or one causal forward of the target)."""

from __future__ import annotations

import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hf_swiftspec import compat  # noqa: E402
from hf_swiftspec.config import MAX_BUDGET  # noqa: E402
from hf_swiftspec.serving.admission import Admission, Busy, Limits  # noqa: E402
from hf_swiftspec.serving.server import ServeOptions  # noqa: E402
from test_serve import PROMPTS, lone_pair, pair_folder, reference, served_model, started  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not compat.serving_available(), reason="transformers' server dependencies are not installed")


def scrape(client) -> dict[str, float]:
    """GET /metrics, parsed by prometheus_client's own parser: {sample name with its labels: value}."""
    root = str(client.base_url).removesuffix("v1/")
    with urllib.request.urlopen(f"{root}metrics") as response:
        assert response.headers["content-type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_a_flood_past_what_the_server_admits_gets_answers_or_429s_and_nothing_is_lost(pair_folder, reference):
    """The running batch holds 2 rows' cache positions and 2 more requests may wait: 8 clients at once (twice
    what it admits) each get either the target's own answer or a 429 in OpenAI's shape with Retry-After; none is
    lost, mixed or cut. /metrics counts them the same way."""
    tokenizer, answer = reference
    prompts = [PROMPTS[i % 4] for i in range(8)]
    need = max(len(tokenizer(p).input_ids) for p in prompts) + 64 + MAX_BUDGET
    limits = {"max_queue": 2, "cache_positions": 2 * need}
    expected = {p: answer(tokenizer(p, return_tensors="pt").input_ids, 64) for p in set(prompts)}
    with started(pair_folder, "continuous-batching", limits) as (running, client, name):
        def ask(prompt: str):
            try:
                return client.completions.create(model=name, prompt=prompt, max_tokens=64, temperature=0)
            except openai.RateLimitError as refused:
                return refused

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, prompts, timeout=300))
        busy = [r for r in replies if isinstance(r, openai.RateLimitError)]
        answered = [(p, r) for p, r in zip(prompts, replies) if not isinstance(r, openai.RateLimitError)]
        assert len(busy) + len(answered) == 8
        assert busy and len(answered) >= 2, (len(busy), len(answered))
        for prompt, reply in answered:
            assert reply.choices[0].text == expected[prompt] and reply.usage.completion_tokens == 64
        for refused in busy:
            assert refused.status_code == 429 and set(refused.body) == {"message", "type", "param", "code"}
            assert refused.body["code"] == "server_busy" and "--max-queue 2" in refused.body["message"]
            assert int(refused.response.headers["retry-after"]) >= 1
        engine = served_model(running).served.usage.engine
        assert max(engine.rounds_by_batch) <= 2  # the cache positions it was given bound the batch
        metrics = scrape(client)
        assert metrics["swiftspec_requests_total{outcome=busy}"] == len(busy)
        assert metrics["swiftspec_requests_total{outcome=finished}"] == len(answered)
        assert metrics["swiftspec_requests_waiting"] == 0 and metrics["swiftspec_requests_running"] == 0
        # a request that could never fit the cache positions is a 400 naming the flag, not a wait forever
        with pytest.raises(openai.BadRequestError, match="--cache-positions"):
            client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=2 * need, temperature=0)


@pytest.mark.parametrize("mode", ["sequential", "continuous-batching"])
def test_a_request_past_its_timeout_is_a_504_and_the_server_goes_on(pair_folder, reference, mode):
    """--request-timeout 0.05 s against 200 tokens (200 target forwards at least): the request is cancelled and
    answered 504 in OpenAI's shape (a streamed one ends with the error), and the next request is served."""
    tokenizer, answer = reference
    with started(pair_folder, mode, {"request_timeout": 0.05}) as (_, client, name):
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=200, temperature=0)
        assert failed.value.status_code == 504 and failed.value.body["code"] == "request_timeout"
        assert "--request-timeout 0.05" in failed.value.body["message"]
        with pytest.raises(openai.APIError, match="--request-timeout 0.05") as failed:  # the stream's last event
            list(client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=200, temperature=0, stream=True))
        assert failed.value.body["code"] == "request_timeout"
        assert scrape(client)["swiftspec_requests_total{outcome=timed_out}"] == 2
    with started(pair_folder, mode, {"request_timeout": 60}) as (_, client, name):
        reply = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=8, temperature=0)
        assert reply.choices[0].text == answer(tokenizer(PROMPTS[2], return_tensors="pt").input_ids, 8)


def test_admission_counts_and_refuses_past_the_queue():
    admission = Admission(Limits(max_queue=2))
    admission.admit("a")
    admission.admit("b")
    with pytest.raises(Busy) as refused:
        admission.admit("c")
    assert refused.value.retry_after == 1 and "--max-queue 2" in str(refused.value)
    admission.started("a")  # a row began decoding: its place in the queue is free
    admission.admit("c")
    assert admission.counts() == (2, 1)
    for latency, request_id in ((3.2, "a"), (1.0, "b"), (7.0, "c")):
        admission.ended(request_id, latency)
    assert admission.counts() == (0, 0) and admission.retry_after() == 4  # the median answer, rounded up
    with pytest.raises(ValueError, match="--max-queue -1"):
        ServeOptions(pair="x", max_queue=-1)
    with pytest.raises(ValueError, match="--request-timeout 0"):
        ServeOptions(pair="x", request_timeout=0)


@pytest.fixture(scope="module", params=["sequential", "continuous-batching"])
def plain_server(pair_folder, request):
    """The served demo pair (trees the policy sizes), alone or in the running batch."""
    with started(pair_folder, request.param) as running:
        yield running


def target_logprobs(target, ids: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) the target's log-probabilities at each of `tokens`' positions: one causal forward of the
    target alone over the prompt and the answer."""
    sequence = torch.cat([ids, torch.tensor([tokens])], dim=1)
    logits = target(sequence).logits[0, ids.shape[1] - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_are_the_targets_own(plain_server, pair_folder, reference, lone_pair):
    """Completions' logprobs (3 alternatives) of a greedy answer equal target.generate(output_logits=True)'s, token
    for token; a sampled answer's equal one causal forward of the target over its tokens; chat's logprobs with
    top_logprobs too. The chosen token's log-probability is the largest on a greedy answer."""
    running, client, name = plain_server
    tokenizer, _ = reference
    target = lone_pair.target
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    alone = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                            return_dict_in_generate=True, output_logits=True)
    tokens = alone.sequences[0, ids.shape[1]:].tolist()
    expected = torch.log_softmax(torch.cat(alone.logits).float(), dim=-1)  # (16, V)
    reply = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=3)
    got = reply.choices[0].logprobs
    assert got.tokens == [tokenizer.decode([t]) for t in tokens]
    assert torch.allclose(torch.tensor(got.token_logprobs), expected[torch.arange(16), tokens], atol=1e-4)
    for k, top in enumerate(got.top_logprobs):
        values, best = expected[k].topk(3)
        assert list(top) == [tokenizer.decode([t]) for t in best.tolist()] or len(set(top)) < 3  # (pieces may decode alike)
        assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), values, atol=1e-4)
    assert got.text_offset == [len(tokenizer.decode(tokens[:k])) for k in range(16)]
    for seed in range(3, 13):  # the first seed whose answer re-tokenizes to the tokens it was decoded from (known)
        sampled = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=seed,
                                            logprobs=0)
        answer_tokens = tokenizer(sampled.choices[0].text, add_special_tokens=False).input_ids
        if tokenizer.decode(answer_tokens) == sampled.choices[0].text and len(answer_tokens) == 12:
            break
    assert len(answer_tokens) == 12, answer_tokens
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    forward = target_logprobs(target, ids, answer_tokens)
    assert torch.allclose(torch.tensor(sampled.choices[0].logprobs.token_logprobs),
                          forward[torch.arange(12), answer_tokens], atol=1e-4)
    messages = [{"role": "user", "content": "sum a list"}]
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    chat_alone = target.generate(chat_ids, attention_mask=torch.ones_like(chat_ids), max_new_tokens=8, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
    chat_expected = torch.log_softmax(torch.cat(chat_alone.logits).float(), dim=-1)
    chat_tokens = chat_alone.sequences[0, chat_ids.shape[1]:].tolist()
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in chat_tokens]
    assert torch.allclose(torch.tensor([c.logprob for c in content]), chat_expected[torch.arange(8), chat_tokens], atol=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
               for c in content)


def test_logprobs_end_where_a_stop_string_cuts_the_text(plain_server, reference):
    _, client, name = plain_server
    tokenizer, answer = reference
    whole = answer(tokenizer(PROMPTS[2], return_tensors="pt").input_ids, 24)
    stop = whole[len(whole) // 2: len(whole) // 2 + 3]
    reply = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop, logprobs=1)
    text = reply.choices[0].text
    assert text == whole[: whole.index(stop)]
    assert "".join(reply.choices[0].logprobs.tokens) == text[: len("".join(reply.choices[0].logprobs.tokens))]
    assert len("".join(reply.choices[0].logprobs.tokens)) <= len(text)


def test_n_answers_share_a_request_greedy_all_the_targets_and_seeded_reproducible(plain_server, reference, lone_pair,
                                                                                   monkeypatch):
    """n=3 greedy: three choices, each the target's own answer (in the running batch, three rows that share the
    prompt's one prefill). n=3 sampled with a seed: answer i is the pair's lone call with seed + i, and the same
    request again gets the same three; usage counts all three answers."""
    from test_shared_prefill import counting_prefills

    running, client, name = plain_server
    tokenizer, answer = reference
    ids = tokenizer(PROMPTS[3], return_tensors="pt").input_ids
    prefills = counting_prefills(monkeypatch)
    greedy = client.completions.create(model=name, prompt=PROMPTS[3], max_tokens=12, temperature=0, n=3)
    if served_model(running).served.usage.engine is not None:
        assert prefills == [ids.shape[1]]  # one prefill for the three rows
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.text for c in greedy.choices] == [answer(ids, 12)] * 3
    assert greedy.usage.completion_tokens == 36
    figures = greedy.usage.model_extra["speculation"]
    assert figures["accepted_tokens"] + figures["verifications"] == 36
    ask = lambda: client.completions.create(model=name, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, top_p=0.9,  # noqa: E731
                                            seed=7, n=3)
    first, again = ask(), ask()
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    lone = [tokenizer.decode(lone_pair.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=True,
                                                temperature=1.0, top_p=0.9,
                                                generator=torch.Generator().manual_seed(7 + i))[0, ids.shape[1]:],
                             skip_special_tokens=True) for i in range(3)]
    assert texts == lone and len(set(texts)) > 1
    for bad, param in ((dict(n=17), "n"), (dict(n=2, stream=True), "n"), (dict(logprobs=6), "logprobs")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=name, prompt="def f", max_tokens=4, **bad)
        assert refused.value.body["param"] == param


@pytest.mark.parametrize("mode", ["sequential", "continuous-batching"])
def test_the_model_is_named_as_the_client_named_it(mode):
    """The shipped demo pair served by its bundled name: every response, whole or streamed, names the model as the
    client did and /v1/models lists it (transformers' handler writes 'swiftspec-demo-pystdlib@main')."""
    name = "swiftspec-demo-pystdlib"
    with started(name, mode) as (_, client, served_as):
        assert served_as == name and [m.id for m in client.models.list().data] == [name]
        assert client.completions.create(model=name, prompt="def f", max_tokens=4, temperature=0).model == name
        chunks = list(client.completions.create(model=name, prompt="def f", max_tokens=4, temperature=0, stream=True))
        assert chunks and {c.model for c in chunks} == {name}


def test_time_to_first_token_waits_for_the_first_text_not_the_role_chunk(pair_folder, reference, monkeypatch):
    """A streamed chat answer whose decoding is held until the client has its first chunk (the role alone, sent
    before any token): no first token is counted then; once decoding goes on, one is, and the answer is the
    target's."""
    tokenizer, answer = reference
    with started(pair_folder, "sequential") as (running, client, name):
        model, go = served_model(running), threading.Event()
        decode = model.generate

        def held(*args, **kwargs):
            go.wait(120)
            return decode(*args, **kwargs)

        monkeypatch.setattr(model, "generate", held)
        messages = [{"role": "user", "content": "hi"}]
        chunks = iter(client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                     stream=True))
        first = next(chunks)
        try:
            assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
            assert scrape(client)["swiftspec_time_to_first_token_seconds_count"] == 0
        finally:
            go.set()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        assert text == answer(prompt["input_ids"], 8)
        metrics = scrape(client)
        assert metrics["swiftspec_time_to_first_token_seconds_count"] == 1
        assert 0 < metrics["swiftspec_time_to_first_token_seconds_sum"] <= metrics["swiftspec_request_latency_seconds_sum"]


def test_metrics_add_up_to_what_the_responses_said(pair_folder, reference):
    """A fresh server, 6 requests (2 at a time, one streamed): /metrics, read by prometheus_client's parser, counts
    them, their tokens, and sums their usage.speculation; the streamed one's text events are timed (first token,
    each later one); its rounds are the engine's."""
    _, answer = reference
    streamed = {}
    with started(pair_folder, "continuous-batching") as (running, client, name):
        def ask(i: int):
            if i == 5:
                chunks = list(client.completions.create(model=name, prompt=PROMPTS[i], max_tokens=10, temperature=0,
                                                        stream=True))
                streamed["text events"] = sum(bool(c.choices and c.choices[0].text) for c in chunks)
                return next(c.usage for c in chunks if c.usage is not None)
            return client.completions.create(model=name, prompt=PROMPTS[i], max_tokens=10 + i, temperature=0).usage

        with ThreadPoolExecutor(2) as pool:
            usages = list(pool.map(ask, range(6)))
        metrics = scrape(client)
        figures = [u.model_extra["speculation"] for u in usages]
        assert metrics["swiftspec_requests_total{outcome=finished}"] == 6
        assert metrics["swiftspec_generation_tokens_total"] == sum(u.completion_tokens for u in usages)
        assert metrics["swiftspec_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
        assert metrics["swiftspec_verifications_total"] == sum(f["verifications"] for f in figures)
        assert metrics["swiftspec_accepted_tokens_total"] == sum(f["accepted_tokens"] for f in figures)
        assert metrics["swiftspec_proposed_tokens_total"] == sum(f["proposed_tokens"] for f in figures)
        assert metrics["swiftspec_request_latency_seconds_count"] == 6
        assert metrics["swiftspec_acceptance_length_count"] == 6
        assert metrics["swiftspec_time_to_first_token_seconds_count"] == 1
        # the streamed request's later text events, each timed from the one before; and its time per token
        assert streamed["text events"] > 1
        assert metrics["swiftspec_inter_token_latency_seconds_count"] == streamed["text events"] - 1
        assert metrics["swiftspec_time_per_output_token_seconds_count"] == 1
        assert metrics["swiftspec_inter_token_latency_seconds_sum"] <= metrics["swiftspec_request_latency_seconds_sum"]
        engine = served_model(running).served.usage.engine
        assert metrics["swiftspec_rounds_total"] == sum(engine.rounds_by_batch.values()) > 0
        assert metrics["swiftspec_plain_rounds_total"] == engine.plain_rounds
        assert metrics["swiftspec_plain_round_share"] == pytest.approx(engine.plain_rounds / metrics["swiftspec_rounds_total"])
        assert metrics["swiftspec_generation_tokens_per_second"] > 0


SYSTEM = ("You write short Python functions with docstrings and type hints, and nothing else. Keep names plain, "
          "avoid globals, and return early.")


def test_a_shared_system_prompt_is_prefilled_once(pair_folder, reference):
    """Three chat requests, one after another, with the same system prompt and their own question: each answer is the
    target's, and the later two copy the KV of the prefix they share with a prompt before them (in whole 16-token
    blocks) instead of prefilling it, as /metrics counts."""
    from hf_swiftspec.engine.prefix_store import BLOCK, common_length

    tokenizer, answer = reference
    prompts = []
    with started(pair_folder, "continuous-batching") as (running, client, name):
        for question in ("sum a list", "reverse a string", "count words"):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            reply = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0)
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            assert reply.choices[0].message.content == answer(ids, 10), question
            prompts.append(ids[0].tolist()[:-1])  # what is prefilled: all but the root
        metrics = scrape(client)
    reused = [max(common_length(tuple(before), prompt[:-1]) for before in prompts[:i]) // BLOCK * BLOCK
              for i, prompt in enumerate(prompts) if i]
    assert min(reused) >= 2 * BLOCK  # the system prompt's blocks at least
    assert metrics["swiftspec_prefix_cache_hits_total"] == 2
    assert metrics["swiftspec_prefix_cache_reused_tokens_total"] == sum(reused)


def test_prefix_cache_positions_bound_the_running_batchs_store():
    """--prefix-cache-positions sizes the running batch's store (0: none kept); without it, a quarter of
    --cache-positions where that is given, else the engine's default."""
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.engine.continuous_device import PREFIX_POSITIONS
    from hf_swiftspec.serving.batching import Served, SpeculatingBatcher
    from hf_swiftspec.tools.models import tiny_model

    pair = SwiftSpecForCausalLM.from_models(tiny_model("llama", seed=0), None)
    for limits, positions in ((Limits(), PREFIX_POSITIONS), (Limits(prefix_cache_positions=0), 0),
                              (Limits(cache_positions=4000), 1000),
                              (Limits(cache_positions=4000, prefix_cache_positions=64), 64)):
        batcher = SpeculatingBatcher(pair, Served(admission=Admission(limits)))
        try:
            assert batcher.engine.prefixes.positions == positions, limits
        finally:
            batcher.stop()
    with pytest.raises(ValueError, match="--prefix-cache-positions -1"):
        Limits(prefix_cache_positions=-1)
