"""`swiftspec serve --api-key`: a shared server that answers only clients carrying its key.

With a key (`--api-key KEY`, or the environment variable `SWIFTSPEC_API_KEY`, which keeps it out of the process
list), every request to a path under /v1 must carry `Authorization: Bearer KEY` (what the `openai` client sends as
its `api_key`), or is answered 401 in OpenAI's error shape. /metrics and /health stay open for a scraper and a load
balancer's probe, unless `--key-metrics` keys them too. CORS preflights (OPTIONS) pass: a browser sends them without
credentials. The key is compared in constant time (hmac.compare_digest) and never printed, logged nor echoed in an
answer. As vLLM's and SGLang's `--api-key`.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field

KEY_VARIABLE = "SWIFTSPEC_API_KEY"
OPEN_PATHS = ("/metrics", "/health")  # open unless --key-metrics


@dataclass(frozen=True)
class Access:
    """Who the server answers. key: the API key (None: everyone); key_metrics: /metrics and /health need it too."""

    key: str | None = field(default=None, repr=False)  # never in a repr, so never in a log line or a traceback
    key_metrics: bool = False

    def __post_init__(self):
        if self.key is not None and not self.key.strip():
            raise ValueError(f"The API key is empty: give --api-key (or {KEY_VARIABLE}) a non-empty key, or neither "
                             "to serve without one.")
        if self.key_metrics and self.key is None:
            raise ValueError(f"--key-metrics keys /metrics and /health with the API key, but no key is set: give "
                             f"--api-key (or {KEY_VARIABLE}), or leave --key-metrics out.")

    @classmethod
    def from_flags(cls, key: str | None, key_metrics: bool = False) -> "Access":
        """The flag's key, else the environment variable's (None if neither)."""
        return cls(key if key is not None else os.environ.get(KEY_VARIABLE), key_metrics)

    def keyed(self, method: str, path: str) -> bool:
        """Whether a request to `path` must carry the key."""
        if self.key is None or method == "OPTIONS":
            return False
        if path.startswith("/v1/") or path == "/v1":
            return True
        return self.key_metrics and path in OPEN_PATHS

    def admits(self, authorization: str | None) -> bool:
        """Whether an Authorization header carries the key (`Bearer KEY`), compared in constant time."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), self.key.encode())

    def refusal(self, authorization: str | None) -> tuple[str, str]:
        """(message, code) of the 401, in OpenAI's words; the key given is never repeated."""
        if not authorization:
            return ("You didn't provide an API key. This server needs one: send it in an Authorization header as "
                    "'Authorization: Bearer KEY' (the openai client's api_key).", "missing_api_key")
        return ("Incorrect API key provided. Send the server's key as 'Authorization: Bearer KEY' (the openai "
                "client's api_key).", "invalid_api_key")

    def line(self, host: str) -> str | None:
        """What `swiftspec serve` prints about access at start (never the key), or a warning for an open server that
        other machines can reach."""
        if self.key is not None:
            keyed = "/v1, /metrics and /health" if self.key_metrics else "/v1 (/metrics and /health open)"
            return f"requests to {keyed} need the API key (Authorization: Bearer)"
        if host not in ("localhost", "127.0.0.1", "::1"):
            return (f"warning: serving on {host} without an API key: anyone who reaches the port can use the model. "
                    f"Set --api-key (or {KEY_VARIABLE}).")
        return None
