"""`swiftspec serve --api-key`: a keyed server answers 401 in OpenAI's shape without its key (or with another), and
serves the target's own answers with it; /metrics and /health are open unless --key-metrics; the key is never
printed nor in a repr. Driven by the real `openai` client over HTTP on localhost."""

from __future__ import annotations

import hmac
import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from hf_swiftspec import compat  # noqa: E402
from hf_swiftspec.cli import main  # noqa: E402
from hf_swiftspec.serving import access as access_module  # noqa: E402
from hf_swiftspec.serving.access import KEY_VARIABLE, Access  # noqa: E402
from hf_swiftspec.serving.server import ServeOptions  # noqa: E402
from test_serve import PROMPTS, pair_folder, reference, started  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not compat.serving_available(), reason="transformers' server dependencies are not installed")

KEY = "sk-test-7c1f0e9b2d"


def status_of(url: str, authorization: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def a_client_of(client, api_key: str):
    """The same server, another client, carrying `api_key`."""
    return openai.OpenAI(base_url=str(client.base_url), api_key=api_key, max_retries=0, timeout=120)


def posted_without_a_key(url: str, body: dict) -> tuple[int, dict, dict]:
    """POST `body` with no Authorization header (the openai client always sends one): status, JSON body, headers."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), {k.lower(): v for k, v in error.headers.items()}


def test_a_keyed_server_refuses_without_the_key_and_serves_with_it(pair_folder, reference, capsys):
    tokenizer, answer = reference
    with started(pair_folder, "sequential", {"api_key": KEY}) as (running, client, name):
        ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        reply = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert reply.choices[0].text == answer(ids, 12)
        for other in ("sk-wrong", KEY + "x", KEY[:-1]):
            with pytest.raises(openai.AuthenticationError) as refused:
                a_client_of(client, other).completions.create(model=name, prompt=PROMPTS[0], max_tokens=4)
            assert refused.value.status_code == 401
            body = refused.value.body
            assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error", body
            assert KEY not in body["message"] and "Bearer" in body["message"]
            assert refused.value.response.headers["www-authenticate"] == "Bearer"
            with pytest.raises(openai.AuthenticationError):  # every /v1 path, not only the generating ones
                a_client_of(client, other).models.list()
        root = str(client.base_url).removesuffix("v1/")
        status, body, headers = posted_without_a_key(f"{root}v1/completions", {"model": name, "prompt": "x"})
        assert status == 401 and body["error"]["code"] == "missing_api_key" and headers["www-authenticate"] == "Bearer"
        assert status_of(f"{root}metrics") == 200 and status_of(f"{root}health") == 200  # open for a scraper, probes
        assert status_of(f"{root}v1/swiftspec/usage") == 401
        assert status_of(f"{root}v1/swiftspec/usage", f"Bearer {KEY}") == 200
        assert status_of(f"{root}v1/swiftspec/usage", f"Basic {KEY}") == 401  # the key, but not as a bearer token
    out = capsys.readouterr()
    assert KEY not in out.out + out.err
    assert "need the API key" in out.err


def test_key_metrics_keys_metrics_and_health_too(pair_folder, monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, KEY)  # the key from the environment, as a user keeps it out of `ps`
    with started(pair_folder, "sequential", {"key_metrics": True}) as (running, client, name):
        root = str(client.base_url).removesuffix("v1/")
        for path in ("metrics", "health"):
            assert status_of(f"{root}{path}") == 401
            assert status_of(f"{root}{path}", f"Bearer {KEY}") == 200
        assert client.api_key == KEY and client.models.list().data  # the environment's key is the server's
        with pytest.raises(openai.AuthenticationError):
            a_client_of(client, "unused").models.list()


def test_access_rules():
    access = Access(KEY)
    assert KEY not in repr(access) and KEY not in repr(ServeOptions(pair="p", api_key=KEY))
    assert access.keyed("POST", "/v1/completions") and access.keyed("GET", "/v1/models")
    assert not access.keyed("OPTIONS", "/v1/completions")  # a CORS preflight carries no credentials
    assert not access.keyed("GET", "/metrics") and Access(KEY, key_metrics=True).keyed("GET", "/metrics")
    assert not Access(None).keyed("POST", "/v1/completions")
    assert access.admits(f"Bearer {KEY}") and access.admits(f"bearer {KEY}")
    assert not any(access.admits(h) for h in (None, "", KEY, f"Bearer {KEY[:-1]}", f"Token {KEY}", "Bearer "))
    with pytest.raises(ValueError, match="empty"):
        Access("  ")
    with pytest.raises(ValueError, match="--key-metrics"):
        ServeOptions(pair="p", key_metrics=True)
    assert "warning" in Access(None).line("0.0.0.0") and Access(None).line("localhost") is None


def test_the_key_is_compared_in_constant_time(monkeypatch):
    compared, constant_time = [], hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(access_module.hmac, "compare_digest", compare_digest)
    assert Access(KEY).admits(f"Bearer {KEY}") and not Access(KEY).admits("Bearer other")
    assert compared == [(KEY.encode(), KEY.encode()), (b"other", KEY.encode())]


def test_serve_flags_carry_the_key(monkeypatch):
    seen = {}
    monkeypatch.setattr("hf_swiftspec.serving.server.serve", lambda options: seen.setdefault("options", options))
    main(["serve", "some/pair", "--api-key", KEY, "--key-metrics"])
    options = seen["options"]
    assert options.api_key == KEY and options.key_metrics and options.access.keyed("GET", "/health")
