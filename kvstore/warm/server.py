"""``ServerWarmEngine``: warm through a running vLLM OpenAI-compatible server."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey
from kvstore.stores import Store
from kvstore.warm.engine import EngineUnavailableError, WarmEngine

__all__ = ["ServerWarmEngine"]


class ServerWarmEngine(WarmEngine):
    """A running vLLM OpenAI-compatible server whose kvstore connector saves the KV.

    Each prompt goes to ``/v1/completions`` as token ids with ``max_tokens=1``: the server
    prefills it (loading any stored prefix) and its connector saves the rest. Connection errors
    and 5xx answers are retried ``retries`` times; a 4xx answer (a prompt too long for the
    model, a wrong model name) fails that prompt at once with the server's message.
    """

    name = "server"

    def __init__(self, url: str, *, model: str | None = None, concurrency: int = 4, timeout: float = 600.0,
                 retries: int = 2, api_key: str | None = None, store: Store | None = None,
                 keys: Callable[[Sequence[int]], list[ChunkKey]] | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {url!r} must be an http:// or https:// URL of a vLLM OpenAI-compatible server")
        if concurrency < 1:
            raise ConfigError(f"--concurrency {concurrency} must be at least 1")
        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.api_key = api_key
        self._store = store
        self._keys = keys
        self.model = model or self._first_model()

    @property
    def store(self) -> Store | None:
        return self._store

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey] | None:
        return None if self._keys is None else self._keys(tokens)

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            reply: dict[str, Any] = json.loads(resp.read() or b"{}")
            return reply

    def _first_model(self) -> str:
        try:
            models = self._request("/v1/models").get("data") or []
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise EngineUnavailableError(f"server {self.base} did not list its models (GET /v1/models): "
                                         f"{_http_reason(exc)}") from exc
        if not models:
            raise EngineUnavailableError(f"server {self.base} serves no model; pass --served-model NAME")
        return str(models[0]["id"])

    def prefill(self, tokens: Sequence[int]) -> None:
        body = {"model": self.model, "prompt": list(tokens), "max_tokens": 1, "temperature": 0.0, "stream": False}
        attempt = 0
        while True:
            try:
                self._request("/v1/completions", body)
                return
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or attempt >= self.retries:
                    raise RuntimeError(_http_reason(exc)) from exc
            except (urllib.error.URLError, OSError) as exc:
                if attempt >= self.retries:
                    raise EngineUnavailableError(f"{self.base}: {_http_reason(exc)}") from exc
            attempt += 1
            time.sleep(min(0.5 * 2 ** attempt, 10.0))

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "url": self.base, "model": self.model, "concurrency": self.concurrency}



def _http_reason(exc: BaseException) -> str:
    """A short reason from an HTTP error: the server's own message when it sent one."""
    if isinstance(exc, urllib.error.HTTPError):
        detail: object = ""
        try:
            payload = json.loads(exc.read() or b"{}")
            err = payload.get("error", payload)
            detail = err.get("message") if isinstance(err, dict) else str(err)
        except Exception:  # noqa: BLE001 - the body is only a nicety
            pass
        return f"HTTP {exc.code}" + (f": {detail}" if detail else f" {exc.reason}")
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"
