"""`swiftspec serve`: transformers' OpenAI-compatible server with the demo pair loaded, driven by the real
`openai` client over HTTP on localhost. Every greedy answer is checked against the target alone
(`target.generate` on the same tokens, decoded as the server decodes)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hf_swiftspec import SwiftSpecForCausalLM, compat  # noqa: E402
from hf_swiftspec.cli import main  # noqa: E402
from hf_swiftspec.pair.locate import bundled_pair  # noqa: E402
from hf_swiftspec.serving import batching  # noqa: E402
from hf_swiftspec.serving.routing import SpeculationRouter  # noqa: E402
from hf_swiftspec.serving.server import ServeOptions, serve, split_revision  # noqa: E402

pytestmark = pytest.mark.skipif(not compat.serving_available(), reason="transformers' server dependencies are not installed")

PROMPTS = [
    "def read_config(path):\n",
    "import os\n\ndef list_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n",
    "for i in range(10):\n",
    "def __repr__(self):\n",
    "try:\n    import json\n",
    "def main():\n    ",
]
NEW_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# A chat template for the demo pair, as a chat pair's tokenizer carries one. The demo pair ships none: its target is a
# code completion model, and `swiftspec bench` would wrap its prompts in a template it has (serving.md: use
# /v1/completions with it).
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}def answer():\n{% endif %}"
)


@pytest.fixture(scope="module")
def pair_folder(tmp_path_factory):
    """The demo pair with a chat template added to its tokenizer (the pair's and both members', which share it)."""
    folder = tmp_path_factory.mktemp("chat-pair") / "swiftspec-demo-pystdlib"
    shutil.copytree(bundled_pair("swiftspec-demo-pystdlib"), folder)
    for config in (folder / "tokenizer_config.json", folder / "target" / "tokenizer_config.json",
                   folder / "draft" / "tokenizer_config.json"):
        settings = json.loads(config.read_text())
        config.write_text(json.dumps({**settings, "chat_template": CHAT_TEMPLATE}, indent=2))
    return folder


@pytest.fixture(scope="module")
def reference(pair_folder):
    """The target alone and the pair's tokenizer: what every greedy answer must equal."""
    target = AutoModelForCausalLM.from_pretrained(pair_folder / "target", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pair_folder)

    def answer(input_ids: torch.Tensor, max_new_tokens: int = NEW_TOKENS) -> str:
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
        return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)

    return tokenizer, answer


@pytest.fixture(scope="module")
def lone_pair(pair_folder):
    """The pair, loaded in the test: what a seeded sampled request must equal (its lone call with that seed)."""
    return SwiftSpecForCausalLM.from_pretrained(pair_folder, dtype=torch.float32)


MODES = ["sequential", "continuous-batching", "router"]
BATCHER_INIT = batching.SpeculatingBatcher.__init__  # the "router" mode's servers patch it while they live
FIXED_TREES = {"tree_budget": 8, "draft_depth": 4}  # so speculation provably happens: no measured cost decides it


@contextlib.contextmanager
def started(pair_folder, mode: str, options: dict | None = None, **settings):
    """A served pair: one request at a time, in one speculating batch, or (as for a pair whose models cannot
    share a batch) routed: speculating alone, batched without speculation among others. options: more
    ServeOptions (admission limits)."""
    threads = torch.get_num_threads()
    port = free_port()
    patch = pytest.MonkeyPatch()
    if mode == "router":
        def cannot_batch(*args, **kwargs):
            raise ValueError("this pair cannot decode rows in one batch (the test says so)")

        patch.setattr(batching.SpeculatingBatcher, "__init__", cannot_batch)
    options = ServeOptions(pair=str(pair_folder), port=port, log_level="error", continuous_batching=mode != "sequential",
                           settings=settings, cb_max_memory_percent=0.08,  # transformers' batch (the router's): 60% of RAM else; 2% of a 13 GiB NUMA node is too little for its 8192-token batch
                           **(options or {}))
    running = serve(options, blocking=False)
    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key=options.access.key or "unused", max_retries=0,
                           timeout=120)
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield running, client, str(pair_folder)
    finally:
        running.kill_server()
        patch.undo()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=MODES)
def server(pair_folder, request):
    """The served demo pair, with fixed trees, in each mode (module-scoped: tests share it)."""
    with started(pair_folder, request.param, **FIXED_TREES) as running:
        yield running


@pytest.fixture(params=MODES)
def fresh_server(pair_folder, request):
    """A served demo pair no request has reached yet."""
    with started(pair_folder, request.param) as running:
        yield running


def served_model(running):
    (timed,) = running._model_manager.loaded_models.values()
    return timed.model


def manager(running):
    """With --continuous-batching, the pair's batching manager (None before the first request, or sequential)."""
    state = running._generation_state._cb_manager
    return None if state is None else state._cb


def batcher(running):
    """The speculating batch's manager, if the server runs one."""
    return manager(running) if isinstance(manager(running), batching.SpeculatingBatcher) else None


def router(running):
    """The router, if the server routes (a pair that cannot batch)."""
    return manager(running) if isinstance(manager(running), SpeculationRouter) else None


def speculation(usage) -> dict:
    """What a response's usage says speculation did for it (swiftspec serve's addition to OpenAI's usage)."""
    return usage.model_extra["speculation"]


def test_completions_equal_the_target_alone_and_speculate(server, reference):
    running, client, name = server
    tokenizer, answer = reference
    assert [m.id for m in client.models.list().data] == [name]
    for prompt in PROMPTS[:3]:
        expected = answer(tokenizer(prompt, return_tensors="pt").input_ids)
        reply = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert reply.choices[0].text == expected
        assert reply.usage.completion_tokens == NEW_TOKENS
        stats = served_model(running).swiftspec_stats
        assert stats.new_tokens == NEW_TOKENS and stats.verify_steps < NEW_TOKENS  # speculated, not plain steps
        streamed = list(client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True))
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected
        figures = speculation(reply.usage)  # each response says what speculation did for it, in every mode
        assert figures["verifications"] == stats.verify_steps < NEW_TOKENS
        assert figures["accepted_tokens"] + figures["verifications"] == NEW_TOKENS
        assert 0 < figures["accepted_tokens"] <= figures["proposed_tokens"]
        (last,) = [chunk for chunk in streamed if chunk.usage is not None]
        assert speculation(last.usage)["accepted_tokens"] + speculation(last.usage)["verifications"] == NEW_TOKENS
    if batcher(running) is not None:
        assert batcher(running).engine.served == 6
    if router(running) is not None:  # one request at a time: each was alone, so each speculated
        assert router(running).routed == {"speculate": 6, "batch": 0, "joined": 0}


def test_chat_completions_equal_the_target_alone(server, reference):
    _, client, name = server
    tokenizer, answer = reference
    messages = [{"role": "user", "content": "sum a list of numbers"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    expected = answer(ids)
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected
    streamed = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected
    stop, before = a_stop_in(expected)  # a stop string, cut from the message, streamed or not
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stop=stop)
    assert reply.choices[0].message.content == before and reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stop=stop,
                                              stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == before


def test_concurrent_clients_get_their_own_answers(server, reference):
    """16 clients x 2 requests at once, half streaming: none lost, none mixed with another's tokens. With
    --continuous-batching, requests that arrive while others decode are batched (the target alone)."""
    running, client, name = server
    tokenizer, answer = reference
    expected = {p: answer(tokenizer(p, return_tensors="pt").input_ids, 12) for p in PROMPTS}

    def ask(job: int) -> tuple[str, str]:
        prompt = PROMPTS[job % len(PROMPTS)]
        if job % 2:
            chunks = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True)
            return prompt, "".join(chunk.choices[0].text for chunk in chunks)
        return prompt, client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(32), timeout=300))
    assert len(answers) == 32
    for prompt, text in answers:
        assert text == expected[prompt]
    if batcher(running) is not None:
        assert max(batcher(running).engine.rounds_by_batch) > 1  # requests decoded together
        assert not batcher(running).requests  # every request finished is forgotten
    if router(running) is not None:
        assert router(running).routed["batch"] > 0 and router(running).routed["speculate"] > 0
        assert not router(running).requests


def test_a_routed_request_joins_the_batch_when_others_arrive(server, reference):
    """A pair that cannot batch: a long streamed answer starts alone (speculating); requests that arrive
    meanwhile are batched (the target alone), and it joins them, carrying its tokens so far. Its answer,
    streamed and whole, is still the target's own, and so are the others'."""
    running, client, name = server
    if router(running) is None:
        pytest.skip("the server does not route")
    tokenizer, answer = reference
    long_prompt, others = PROMPTS[0], PROMPTS[1:4]
    before = dict(router(running).routed)
    stream = client.completions.create(model=name, prompt=long_prompt, max_tokens=160, temperature=0, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # it is decoding, alone
    with ThreadPoolExecutor(3) as pool:
        replies = pool.map(lambda p: client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0), others)
        text += "".join(chunk.choices[0].text for chunk in chunks)
        replies = [r.choices[0].text for r in replies]
    routed = router(running).routed
    assert routed["joined"] == before["joined"] + 1 and routed["batch"] == before["batch"] + 3
    assert text == answer(tokenizer(long_prompt, return_tensors="pt").input_ids, 160)
    assert replies == [answer(tokenizer(p, return_tensors="pt").input_ids, 8) for p in others]


def test_a_speculating_request_goes_on_speculating_when_others_join(server, reference):
    """--continuous-batching: a long streamed answer starts alone; requests that arrive meanwhile join its
    running batch, all speculating there. Every answer, streamed and whole, is still the target's own, and
    the server's totals count the rounds they shared."""
    running, client, name = server
    if batcher(running) is None:
        pytest.skip("sequential server: requests never batch")
    tokenizer, answer = reference
    long_prompt, others = PROMPTS[0], PROMPTS[1:4]
    shared_before = sum(n for size, n in batcher(running).engine.rounds_by_batch.items() if size > 1)
    stream = client.completions.create(model=name, prompt=long_prompt, max_tokens=160, temperature=0, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # it is decoding, alone
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda p: client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0), others))
        rest = list(chunks)
        text += "".join(chunk.choices[0].text for chunk in rest)
    assert text == answer(tokenizer(long_prompt, return_tensors="pt").input_ids, 160)
    assert [r.choices[0].text for r in replies] == [answer(tokenizer(p, return_tensors="pt").input_ids, 8) for p in others]
    (last,) = [chunk for chunk in rest if chunk.usage is not None]
    assert speculation(last.usage)["accepted_tokens"] > 0  # it speculated, also while the others decoded beside it
    with urllib.request.urlopen(f"{client.base_url}swiftspec/usage") as response:
        totals = json.loads(response.read())
    assert totals["requests"] == batcher(running).engine.served and totals["usage"]["accepted_tokens"] > 0
    shared = sum(n for size, n in totals["rounds_by_batch_size"].items() if int(size) > 1)
    assert shared > shared_before  # rounds shared by this test's requests, not an earlier test's


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, reference):
    _, client, name = server
    tokenizer, answer = reference
    with pytest.raises(openai.BadRequestError, match="reads at most 256"):
        client.completions.create(model=name, prompt="x = 1\n" * 400, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens=-1 must be at least 1"):
        client.completions.create(model=name, prompt="def f", max_tokens=-1)
    for stream in (False, True):  # an empty prompt: a 400 naming the prompt, not the decoding loop's 500
        with pytest.raises(openai.BadRequestError, match="The prompt is empty") as refused:
            client.completions.create(model=name, prompt="", max_tokens=4, stream=stream)
        assert refused.value.body["param"] == "prompt" and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as refused:  # in OpenAI's error shape, naming the model
        client.completions.create(model="some-org/another-model", prompt="def f", max_tokens=4)
    assert refused.value.body["param"] == "model" and "pinned" in refused.value.body["message"]
    assert set(refused.value.body) == {"message", "type", "param", "code"}
    # a client that leaves mid-stream: the server cancels that generation and answers the next request
    stream = client.completions.create(model=name, prompt="def f", max_tokens=200, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    prompt = PROMPTS[0]
    reply = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.choices[0].text == answer(tokenizer(prompt, return_tensors="pt").input_ids, 8)


def a_stop_in(text: str) -> tuple[str, str]:
    """A stop string from the middle of `text` and the text before its first occurrence."""
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    return stop, text[: text.index(stop)]


def test_a_requests_settings_never_reach_another(fresh_server, reference):
    """A fresh server whose first request streams with `stop`: it ends at the stop string, which its text
    leaves out (OpenAI's semantics); the next request, without one, gets its whole answer; a later `stop` is
    honoured, not the first request's."""
    _, client, name = fresh_server
    tokenizer, answer = reference
    prompt, other = PROMPTS[0], PROMPTS[2]
    whole = answer(tokenizer(prompt, return_tensors="pt").input_ids, 40)
    stop, before = a_stop_in(whole)
    chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=40, temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = client.completions.create(model=name, prompt=prompt, max_tokens=40, temperature=0)
    assert plain.choices[0].text == whole and plain.choices[0].finish_reason == "length"
    other_whole = answer(tokenizer(other, return_tensors="pt").input_ids, 40)
    other_stop, other_before = a_stop_in(other_whole)
    reply = client.completions.create(model=name, prompt=other, max_tokens=40, temperature=0, stop=other_stop)
    assert reply.choices[0].text == other_before and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 40  # it stopped there, not only its text


def test_stop_strings_end_each_request_at_its_own_string(server, reference):
    """Concurrent requests, each with its own stop strings (or none), streaming and not: each ends at its own."""
    _, client, name = server
    tokenizer, answer = reference
    jobs = []
    for i, prompt in enumerate(PROMPTS[:6]):
        whole = answer(tokenizer(prompt, return_tensors="pt").input_ids, 32)
        stop, before = a_stop_in(whole)
        jobs.append((prompt, [stop, "\x00never"] if i % 3 else None, before if i % 3 else whole, bool(i % 2)))

    def ask(job) -> str:
        prompt, stop, _, stream = job
        reply = client.completions.create(model=name, prompt=prompt, max_tokens=32, temperature=0, stop=stop, stream=stream)
        return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(ask, jobs, timeout=300))
    assert texts == [expected for _, _, expected, _ in jobs]


def test_temperature_samples_and_a_seed_draws_what_a_lone_call_draws(server, reference, lone_pair):
    """temperature > 0 samples whatever the pair's do_sample (it is greedy); a seeded request, sent together
    with others (in the running batch with --continuous-batching), draws what the pair's lone call with that
    seed draws."""
    _, client, name = server
    tokenizer, answer = reference
    assert not lone_pair.generation_config.do_sample
    prompt = PROMPTS[1]
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    def ask(seed: int) -> str:
        return client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=seed,
                                         extra_body={"top_k": 20}).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, range(4), timeout=300))
    lone = [
        tokenizer.decode(lone_pair.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=True,
                                            temperature=1.0, top_p=0.9, top_k=20,
                                            generator=torch.Generator().manual_seed(seed))[0, ids.shape[1]:],
                         skip_special_tokens=True)
        for seed in range(4)
    ]
    assert texts == lone
    assert len(set(texts)) > 1 and answer(ids, 16) not in texts


def test_a_request_past_the_context_is_refused_and_an_open_one_ends_at_it(server, reference):
    """max_tokens past the target's 256 positions: a 400 naming the value and the fix, streaming or not. Without
    max_tokens, the answer runs to the context's end and says finish_reason "length"."""
    _, client, name = server
    tokenizer, answer = reference
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=name, prompt="def f", max_tokens=1000, temperature=0, stream=stream)
        assert refused.value.body["param"] == "max_tokens"
        assert "max_tokens=1000" in refused.value.body["message"] and "max_tokens <= 254" in refused.value.body["message"]
    prompt = "x = 1\n" * 60  # 240 tokens: 16 left
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    room = 256 - ids.shape[1]
    reply = client.completions.create(model=name, prompt=prompt, temperature=0)
    assert reply.usage.completion_tokens == room and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text == answer(ids, room)


def test_settings_the_server_cannot_honour_are_refused_by_name(server):
    _, client, name = server
    refusals = {
        "n": dict(n=2, stream=True), "logprobs": dict(logprobs=2, stream=True),
        "presence_penalty": dict(presence_penalty=3.0, temperature=1.0),
        "top_p": dict(temperature=0, top_p=0.5), "top_k": dict(temperature=0, extra_body={"top_k": 5}),
        "stop": dict(stop=["a", "b", "c", "d", "e"]),
    }
    for param, kwargs in refusals.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=name, prompt="def f", max_tokens=4, **kwargs)
        assert refused.value.body["param"] == param, refused.value.body
        assert param in refused.value.body["message"]


def test_split_revision():
    assert split_revision("org/pair@v1") == ("org/pair", "v1")
    assert split_revision("org/pair") == ("org/pair", None)
    assert split_revision(".") == (".", None)


def test_serve_without_the_server_dependencies_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(compat, "serving_available", lambda: False)
    assert main(["serve", "swiftspec-demo-pystdlib"]) == 1
    assert "pip install 'hf_swiftspec[serve]'" in capsys.readouterr().err


def test_serve_flags_reach_the_server_and_the_running_batch(monkeypatch, capsys):
    """--cb-max-memory-percent goes to transformers' server as its own flag of that name does (its continuous
    batch, the router's); --no-latency-guard to the running batch's engine; a share outside (0, 1] is refused."""
    from hf_swiftspec.serving import server as serve_module

    monkeypatch.setattr(batching.SpeculatingBatcher, "__init__", BATCHER_INIT)  # whatever server still lives beside
    threads = torch.get_num_threads()
    started_with, options = {}, []
    monkeypatch.setattr(compat, "serving_server", lambda: lambda **kwargs: started_with.update(kwargs))
    manager_of = serve_module.pair_model_manager
    monkeypatch.setattr(serve_module, "pair_model_manager", lambda o, *a: options.append(o) or manager_of(o, *a))
    try:
        argv = ["serve", "swiftspec-demo-pystdlib", "--continuous-batching", "--cb-max-memory-percent", "0.3"]
        assert main(argv) == 0 and main([*argv, "--no-latency-guard"]) == 0
        assert main(["serve", "swiftspec-demo-pystdlib", "--cb-max-memory-percent", "60"]) == 1
    finally:
        torch.set_num_threads(threads)
    assert started_with["cb_max_memory_percent"] == 0.3
    assert [o.latency_guard for o in options] == [True, False]
    assert "--cb-max-memory-percent 60.0: it is the share of free memory" in capsys.readouterr().err
    from hf_swiftspec.tools.models import tiny_model

    target = tiny_model("llama", seed=0)
    for guard in (True, False):
        batcher = batching.SpeculatingBatcher(SwiftSpecForCausalLM.from_models(target, None), latency_guard=guard)
        try:
            assert batcher.engine.latency_guard is guard
            assert batcher.served.usage.totals()["latency_guard"]["on"] is guard
        finally:
            batcher.stop()


@pytest.mark.parametrize("recurrent", ["draft", "target"])
def test_a_pair_that_cannot_batch_is_routed_and_the_server_says_so(recurrent, tmp_path, monkeypatch):
    """Real folders the running batch cannot take, started as a user starts them: a pair whose draft is recurrent
    (Mamba-2 layers beside attention) is routed (speculating alone, batched without speculation among others);
    a recurrent target, which transformers' continuous batching refuses too, serves one request at a time.
    The server says which and why; every answer is the target's own, alone and among others."""
    from hf_swiftspec.serving import server as serve_module
    from hf_swiftspec.pair.repo import create_pair_repo
    from hf_swiftspec.tools import sweep

    monkeypatch.setattr(batching.SpeculatingBatcher, "__init__", BATCHER_INIT)  # whatever server still lives beside
    said = []  # the server's status lines (printed on stderr as well)
    monkeypatch.setattr(serve_module, "progress", lambda line, real=serve_module.progress: said.append(line) or real(line))
    from hf_swiftspec.tools.models import char_tokenizer, tiny_model

    tokenizer = char_tokenizer()
    bamba = sweep.tiny_of_type("bamba", layers=4, vocab_size=98)
    target = bamba if recurrent == "target" else tiny_model("llama", seed=0)
    for name, model in (("target", target), ("draft", bamba)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    folder = tmp_path / "target" if recurrent == "target" else create_pair_repo(
        tmp_path / "pair", str(tmp_path / "target"), str(tmp_path / "draft")).folder
    prompts = ["def f(x):\n", "for i in range(3):\n", "import os\n"]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        expected.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    with started(folder, "continuous-batching") as (running, client, name):
        lone = client.completions.create(model=name, prompt=prompts[0], max_tokens=8, temperature=0).choices[0].text
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(
                lambda p: client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0).choices[0].text, prompts
            ))
        chosen = manager(running)
    said = "\n".join(said)
    because = f"this pair cannot decode rows in one batch: the {recurrent}'s recurrent state rolls back per sequence"
    if recurrent == "draft":
        assert isinstance(chosen, SpeculationRouter) and chosen.routed["speculate"] > 0
        assert f"requests speculate alone and batch without speculation: {because}" in said
    else:
        assert isinstance(chosen, batching.SequentialServer)
        assert f"requests run one at a time, each speculating: {because}" in said
        assert "transformers' continuous batching of the target refuses it (Invalid layer type" in said
    assert lone == expected[0] and together == expected


def test_chat_on_the_shipped_demo_pair_is_a_clear_400_pointing_to_completions():
    """The demo pair ships no chat template (a code completion model): chat is refused in OpenAI's error shape, and
    the same server answers completions."""
    with started(bundled_pair("swiftspec-demo-pystdlib"), "sequential") as (_, client, name):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert set(refused.value.body) == {"message", "type", "param", "code"}, refused.value.body
        assert "chat template" in refused.value.body["message"], refused.value.body
        assert client.completions.create(model=name, prompt="def f", max_tokens=4, temperature=0).choices[0].text
