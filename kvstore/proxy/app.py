"""The P/D proxy's HTTP front (aiohttp): ``POST /v1/completions`` and ``/v1/chat/completions``.

For each request (``docs/disagg.md``):

1. **Prefill.** A copy of the body, non-streaming, with ``max_tokens=1`` (and
   ``max_completion_tokens=1`` where given; ``n=1``, no ``min_tokens``, no ``stream_options``) and
   ``kv_transfer_params={"do_remote_decode": true}``, goes to a prefill server of the pool. Its
   response's ``kv_transfer_params`` is the hand-off: the prefill engine's promise of records in
   the store. A client's own ``kv_transfer_params`` are never forwarded (the proxy owns the hand-off).
2. **Decode.** The original body, streaming or not, goes to a decode server with those params;
   its answer (status, body, stream) is the client's. vLLM's ``remote_prefill_cached_tokens`` is
   dropped unless ``report_prefill_cache_hits`` (``ProxyConfig``).
3. **Fallbacks.** A prefill pool with no healthy server, or a prefill server that cannot be
   reached, times out or answers 5xx: the decode server gets the request without params and
   prefills it itself (counted, logged). A 4xx from the prefill server is the client's error and is
   returned as it is. A decode server that cannot be reached is marked unhealthy and the next one
   is tried, as long as nothing was sent to the client yet. No decode server: 503.

Errors are OpenAI-style JSON: ``{"error": {"message", "type", "param", "code"}}``. Servers are
health-checked every ``health_interval`` (``GET /health``). ``GET /health`` of the proxy answers
200 while a decode server is healthy (503 otherwise), with the pools' state; ``GET /v1/models``
is a decode server's. HTTP is aiohttp's on both sides: nothing here parses HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.errors import ConfigError
from kvstore.proxy.pools import Backend, Pool, ProxyConfig

__all__ = ["build_app", "RunningProxy", "start_in_thread", "serve", "ProxyStats"]

log = logging.getLogger("kvstore.proxy")

#: Paths the proxy serves with the P/D hand-off.
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Headers passed on to the servers (the body is re-encoded; hop-by-hop headers are aiohttp's).
FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "OpenAI-Organization", "OpenAI-Project")
MAX_BODY = 64 << 20  # bytes: a 128k-token prompt as JSON token ids fits with room to spare


@dataclass
class ProxyStats:
    """Counters the proxy keeps (``GET /health`` shows them)."""

    requests: int = 0
    prefilled: int = 0  #: requests whose prefill server answered with params
    fallbacks: int = 0  #: requests sent to a decode server without a prefill (pool down, prefill failed)
    errors: int = 0  #: requests answered with an error the proxy made (no decode server, bad body)


def error_body(status: int, message: str, kind: str = "", param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = kind or ("invalid_request_error" if status < 500 else "service_unavailable" if status == 503
                    else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error(status: int, message: str, kind: str = "") -> web.Response:
    return web.json_response(error_body(status, message, kind), status=status)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill server's request: the prompt computed, one token sampled, params asked for."""
    out = copy.deepcopy(dict(body))
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("min_tokens", "stream_options", "best_of"):
        out.pop(key, None)
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any] | None, *,
                report_prefill_cache_hits: bool = False) -> dict[str, Any]:
    """The decode server's request: the client's, with the prefill's params (or none)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if params:
        handed = dict(params)
        if not report_prefill_cache_hits:
            handed.pop("remote_prefill_cached_tokens", None)
        out["kv_transfer_params"] = handed
    return out


class Proxy:
    """The pools, one HTTP client session, and the handlers."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = Pool("prefill", config.prefill, config.policy)
        self.decode = Pool("decode", config.decode, config.policy)
        self.stats = ProxyStats()
        self._session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task[None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy's app is not running"
        return self._session

    async def startup(self, app: web.Application) -> None:
        # No pooled-connection limit per host: a decode server streams to many clients at once.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None,
                                                                            sock_connect=self.config.connect_timeout))
        self._health = asyncio.create_task(self._check_health_forever())

    async def cleanup(self, app: web.Application) -> None:
        if self._health is not None:
            self._health.cancel()
            try:
                await self._health
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()

    # -- health ----------------------------------------------------------------------------------
    async def _check_health_forever(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.config.health_interval)

    async def check_health(self) -> None:
        """One ``GET /health`` of every server, at once."""
        checks = [(pool, b) for pool in (self.prefill, self.decode) for b in pool.backends]
        results = await asyncio.gather(*(self._healthy(b) for _, b in checks))
        for (pool, backend), reason in zip(checks, results):
            self._mark(pool, backend, reason)

    async def _healthy(self, backend: Backend) -> str:
        """'' if ``backend`` answers its health check, else why not."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
            async with self.session.get(backend.url + "/health", timeout=timeout) as resp:
                return "" if resp.status == 200 else f"health check answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return f"health check failed: {type(exc).__name__} {exc}".strip()

    def _mark(self, pool: Pool, backend: Backend, reason: str) -> None:
        if pool.mark(backend, not reason, reason):
            if reason:
                log.warning("kvstore proxy: %s server %s is out of the pool: %s", pool.role, backend.url, reason)
            else:
                log.info("kvstore proxy: %s server %s is back in the pool", pool.role, backend.url)

    # -- handlers --------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        try:
            body = await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError) as exc:
            self.stats.errors += 1
            return error(400, f"the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            self.stats.errors += 1
            return error(400, "the request body must be a JSON object")
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        params, answer = await self._prefill(request.path, body, headers)
        if answer is not None:
            return answer
        return await self._decode(request, body, params, headers)

    async def _prefill(self, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[dict[str, Any] | None, web.Response | None]:
        """The prefill's params (None: the decode server prefills), or the client's error response."""
        backend = self.prefill.pick()
        if backend is None:
            if self.prefill.backends:
                log.info("kvstore proxy: no prefill server is healthy: the decode server prefills")
            self.stats.fallbacks += 1
            return None, None
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout, sock_connect=self.config.connect_timeout)
        backend.outstanding += 1
        try:
            async with self.session.post(backend.url + path, json=prefill_body(body), headers=headers,
                                         timeout=timeout) as resp:
                text = await resp.read()
                if 400 <= resp.status < 500:  # the request's own fault: the decode server would say the same
                    return None, web.Response(body=text, status=resp.status,
                                              content_type=resp.content_type or "application/json")
                if resp.status != 200:
                    raise _Failed(f"answered {resp.status}: {text[:200]!r}")
                try:
                    answer = json.loads(text)
                except ValueError as exc:
                    raise _Failed(f"answered with a body that is not JSON: {exc}") from None
            backend.served += 1
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if isinstance(params, dict):
                self.stats.prefilled += 1
                return params, None
            log.info("kvstore proxy: prefill server %s returned no kv_transfer_params (is it a kv_producer with "
                     "KVStoreConnector?): the decode server prefills", backend.url)
            self.stats.fallbacks += 1
            return None, None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, _Failed) as exc:
            if not isinstance(exc, (_Failed, asyncio.TimeoutError)):
                self._mark(self.prefill, backend, f"request failed: {type(exc).__name__} {exc}")
            log.warning("kvstore proxy: prefill on %s failed (%s: %s): the decode server prefills", backend.url,
                        type(exc).__name__, exc)
            self.stats.fallbacks += 1
            return None, None
        finally:
            backend.outstanding -= 1

    async def _decode(self, request: web.Request, body: dict[str, Any], params: dict[str, Any] | None,
                      headers: dict[str, str]) -> web.StreamResponse:
        payload = decode_body(body, params, report_prefill_cache_hits=self.config.report_prefill_cache_hits)
        tried: list[Backend] = []
        while (backend := self.decode.pick(exclude=tried)) is not None:
            tried.append(backend)
            backend.outstanding += 1
            try:
                return await self._relay(request, backend, payload, headers)
            except _NotConnected as exc:
                self._mark(self.decode, backend, f"request failed: {exc}")
            finally:
                backend.outstanding -= 1
        self.stats.errors += 1
        return error(503, "no decode server is available", "service_unavailable")

    async def _relay(self, request: web.Request, backend: Backend, payload: dict[str, Any],
                     headers: dict[str, str]) -> web.StreamResponse:
        """The decode server's answer, relayed as it comes. ``_NotConnected`` before any byte was
        relayed (another server may take the request); once relaying, a failure ends the response."""
        try:
            resp = await self.session.post(backend.url + request.path, json=payload, headers=headers)
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise _NotConnected(f"{type(exc).__name__} {exc}") from exc
        async with resp:
            backend.served += 1
            out = web.StreamResponse(status=resp.status, reason=resp.reason)
            out.content_type = resp.content_type or "application/json"
            if resp.charset:
                out.charset = resp.charset
            await out.prepare(request)
            try:
                async for piece in resp.content.iter_any():
                    await out.write(piece)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("kvstore proxy: decode server %s broke off its answer: %s", backend.url, exc)
                return out  # what was relayed stays relayed; the client sees the stream end
            await out.write_eof()
            return out

    async def health(self, request: web.Request) -> web.Response:
        doc = {"decode": [_state(b) for b in self.decode.backends],
               "prefill": [_state(b) for b in self.prefill.backends],
               "requests": self.stats.requests, "prefilled": self.stats.prefilled,
               "fallbacks": self.stats.fallbacks, "errors": self.stats.errors}
        return web.json_response(doc, status=200 if self.decode.healthy() else 503)

    async def models(self, request: web.Request) -> web.StreamResponse:
        backend = self.decode.pick()
        if backend is None:
            return error(503, "no decode server is available", "service_unavailable")
        try:
            async with self.session.get(backend.url + "/v1/models") as resp:
                return web.Response(body=await resp.read(), status=resp.status,
                                    content_type=resp.content_type or "application/json")
        except (aiohttp.ClientError, OSError) as exc:
            return error(502, f"decode server {backend.url} failed: {exc}", "server_error")

    async def not_found(self, request: web.Request) -> web.Response:
        return error(404, f"no such endpoint: {request.method} {request.path} (the proxy serves POST "
                          f"{' and '.join(GENERATE_PATHS)}, GET /v1/models and GET /health)", "not_found_error")


class _Failed(Exception):
    """Internal: a prefill server answered, but not with a usable response."""


class _NotConnected(Exception):
    """Internal: a decode server could not be reached; nothing was relayed."""


def _state(b: Backend) -> dict[str, Any]:
    return {"url": b.url, "healthy": b.healthy, "outstanding": b.outstanding, "served": b.served,
            **({"reason": b.reason} if b.reason else {})}


@web.middleware
async def _openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (405, 413...) as OpenAI error objects too."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error(exc.status, exc.reason or "error")


PROXY = web.AppKey("proxy", Proxy)


def build_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (``app[PROXY]`` is its ``Proxy``)."""
    proxy = Proxy(config)
    app = web.Application(client_max_size=MAX_BODY, middlewares=[_openai_errors])
    app[PROXY] = proxy
    app.on_startup.append(proxy.startup)
    app.on_cleanup.append(proxy.cleanup)
    for path in GENERATE_PATHS:
        app.router.add_post(path, proxy.generate)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_route("*", "/{tail:.*}", proxy.not_found)
    return app


def serve(config: ProxyConfig, host: str, port: int) -> None:
    """Run the proxy until interrupted (``kvstore proxy``): one line on stdout once it listens,
    ``ConfigError`` when it cannot (the port is taken, the address is not this host's)."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    listening = False

    def say_listening(_: str) -> None:  # aiohttp's own banner, once every site is bound
        nonlocal listening
        listening = True
        print(f"kvstore proxy: listening on {url} (prefill: {', '.join(config.prefill) or 'none'}; decode: "
              f"{', '.join(config.decode)}; {config.policy}); Ctrl-C stops it", flush=True)

    try:
        web.run_app(build_app(config), host=host, port=port, print=say_listening, access_log=None)
    except OSError as exc:
        if listening:
            raise
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}"
                          + (" (another server has the port: choose another with --port)"
                             if exc.errno == errno.EADDRINUSE else "")) from exc


class RunningProxy:
    """A proxy serving from a thread of this process (tests, benchmarks); ``close()`` stops it."""

    def __init__(self, config: ProxyConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = build_app(config)
        self.proxy: Proxy = self.app[PROXY]
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self.app, access_log=None)
        self._ready = threading.Event()
        self._host, self._port = host, port
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or not self.port:
            raise RuntimeError("the proxy did not start")

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            await self._runner.setup()
            await web.TCPSite(self._runner, self._host, self._port).start()
            self.port = int(self._runner.addresses[0][1])

        try:
            self._loop.run_until_complete(start())
        finally:
            self._ready.set()
        self._loop.run_forever()

    def call(self, fn: Any) -> Any:
        """Run coroutine function ``fn()`` on the proxy's loop; its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(30)

    def close(self) -> None:
        if not self._loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def start_in_thread(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0) -> RunningProxy:
    return RunningProxy(config, host, port)
