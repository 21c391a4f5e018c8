"""`swiftspec serve` under load and for the clients that need more than text: admission control (a bounded queue
answering 429 with Retry-After, a request timeout, the running batch's cache positions), /metrics in Prometheus'
text format, logprobs against the target alone, n answers, and the model named as the client named it. Every
answer is checked against the target alone (`target.generate`, or one causal forward of the target)."""

from __future__ import annotations

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
