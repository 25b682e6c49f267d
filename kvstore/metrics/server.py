"""An opt-in HTTP endpoint serving kvstore's metrics in the Prometheus text format.

``start_metrics_server(port)`` serves ``REGISTRY.render()`` at ``/metrics`` (and ``ok`` at
``/healthz``) from a daemon thread, so it never keeps a process alive or blocks its exit. It
binds to loopback unless told otherwise: metrics name models and tiers, and a scrape should not
be open to the world by accident. Port 0 picks a free port (``server.port`` tells which).

Nothing starts it implicitly: an engine adapter, ``kvstore warm --metrics-port`` or the user
calls it once per process. Starting it twice on the same port returns the running server.

``start_from_env()`` is the hook for process entry points that have no option of their own
(an engine's worker processes): with ``KVSTORE_METRICS_PORT`` set it serves on that port, or
on the next free one of ``KVSTORE_METRICS_PORT_RANGE`` ports when a sibling process (vLLM's
scheduler and worker processes) took it first; ``KVSTORE_METRICS_HOST`` chooses the address.

**Router lookups** (``docs/lookup.md``). The same server answers ``POST /v1/lookup`` (how many
leading tokens of given token ids the store holds, per tier, for a namespace) and
``GET /v1/namespaces`` (what it can answer for) from the providers registered in
``kvstore.metrics.lookup.LOOKUPS``; it knows no keys or stores itself. Read-only: every other
method is answered 405 and nothing writes. Bad requests get a one-line JSON reason (400; 404 for
an unknown namespace or path; 411 without a ``Content-Length``; 413 for a body over the bound);
lookups in flight are bounded (503 beyond), and a client that stops sending its body is cut off
after ``REQUEST_TIMEOUT``. What http.server answers itself (501 for a method it has no handler
for, 400 for a malformed request line) is JSON too. ``lookups=None`` (or ``KVSTORE_METRICS_LOOKUP=0``) turns them off.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstore._version import FORMAT_VERSION, __version__
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import INFO, ROUTER_LOOKUPS
from kvstore.metrics.lookup import LOOKUPS, MAX_LOOKUP_TOKENS, BadLookup, LookupRegistry, max_body_bytes, parse_lookup
from kvstore.metrics.registry import REGISTRY, Registry

log = logging.getLogger(__name__)

#: The port the dev stack (docker-compose.yml, docker/prometheus.yml) scrapes.
DEFAULT_PORT = 9477
#: Environment of ``start_from_env``.
ENV_PORT, ENV_HOST, ENV_PORT_RANGE = "KVSTORE_METRICS_PORT", "KVSTORE_METRICS_HOST", "KVSTORE_METRICS_PORT_RANGE"
ENV_LOOKUP = "KVSTORE_METRICS_LOOKUP"
DEFAULT_PORT_RANGE = 4
#: Prometheus text exposition format 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TEXT, _JSON = "text/plain; charset=utf-8", "application/json"
#: Lookups answered at once (each may wait for a tier's deadline); more are refused with 503.
MAX_CONCURRENT_LOOKUPS = 8
#: Seconds a client may take to send a request (a stalled one would hold a thread).
REQUEST_TIMEOUT = 10.0
_ALLOW = {"/metrics": "GET, HEAD", "/healthz": "GET, HEAD", "/": "GET, HEAD", "/v1/namespaces": "GET, HEAD",
          "/v1/lookup": "POST"}

_servers: dict[tuple[str, int], MetricsServer] = {}
_servers_lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    registry: Registry = REGISTRY
    lookups: LookupRegistry | None = LOOKUPS
    max_tokens: int = MAX_LOOKUP_TOKENS
    in_flight: threading.BoundedSemaphore = threading.BoundedSemaphore(MAX_CONCURRENT_LOOKUPS)
    server_version = "kvstore-metrics"
    timeout = REQUEST_TIMEOUT  # socket timeout of every request: a stalled client is cut off

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.registry.render().encode(), CONTENT_TYPE)
        elif path in ("/healthz", "/"):
            self._send(200, b"ok\n", _TEXT)
        elif path == "/v1/namespaces" and self.lookups is not None:
            self._json(200, {"max_tokens": self.max_tokens,
                             "namespaces": [{"namespace": p.namespace_id, **p.describe()}
                                            for p in self.lookups.providers()]})
        elif path == "/v1/lookup" and self.lookups is not None:
            self._not_allowed(path)
        else:
            self._send(404, b"not found; metrics are at /metrics\n", _TEXT)

    do_HEAD = do_GET

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != "/v1/lookup" or self.lookups is None:
            if path in _ALLOW and (self.lookups is not None or not path.startswith("/v1/")):
                self._not_allowed(path)
            else:
                self._error(404, f"no such endpoint: {path}")
            return
        body = self._body()
        if body is None:
            return
        if not self.in_flight.acquire(blocking=False):
            self._error(503, f"more than {MAX_CONCURRENT_LOOKUPS} lookups in flight; retry", retry=True)
            return
        try:
            try:
                request = parse_lookup(body, max_tokens=self.max_tokens)
                provider = self.lookups.find(request)
            except BadLookup as exc:
                self._error(exc.status, str(exc))
                return
            try:
                answer = provider.lookup(request.tokens, request.cache_salt, request.inputs)
            except Exception as exc:  # a provider's bug is this request's 500, not a dead server thread
                log.warning("router lookup for namespace %s failed", provider.namespace_id, exc_info=True)
                self._error(500, f"lookup failed: {type(exc).__name__}: {exc}")
                return
            self._json(200, answer)
        finally:
            self.in_flight.release()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own answers (an unsupported method: 501; a malformed request line, an
        over-long header: 400, 414, 431) in the JSON of every other error, not its HTML page."""
        self.log_message("code %d, message %s", code, message)
        if code == 501 and self.command:
            reason = f"{self.command} is not a method this server answers (GET, HEAD, POST); the endpoint is read-only"
        else:
            reason = message or self.responses.get(code, ("error",))[0]
        self._error(code, reason, close=True)

    def _reject_write(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in _ALLOW and (self.lookups is not None or not path.startswith("/v1/")):
            self._not_allowed(path)
        else:
            self._error(404, f"no such endpoint: {path}")

    do_PUT = do_DELETE = do_PATCH = _reject_write

    def _body(self) -> bytes | None:
        """The request's body, or ``None`` once an error was answered (no length, too long)."""
        if self.headers.get("Transfer-Encoding"):
            self._error(411, "send the body with a Content-Length (no Transfer-Encoding)", close=True)
            return None
        raw = self.headers.get("Content-Length")
        if raw is None:
            self._error(411, "a lookup needs a Content-Length", close=True)
            return None
        try:
            length = int(raw)
            if length < 0:
                raise ValueError(raw)
        except ValueError:
            self._error(400, f"Content-Length {raw[:40]!r} is not a length", close=True)
            return None
        limit = max_body_bytes(self.max_tokens)
        if length > limit:
            # Not read: the connection is closed instead of taking in what was refused.
            self._error(413, f"a body of {length} bytes is over the {limit} a lookup takes", close=True)
            return None
        try:
            body = self.rfile.read(length)
        except OSError:  # the client stalled (REQUEST_TIMEOUT) or left
            self.close_connection = True
            return None
        if len(body) < length:
            self.close_connection = True
            return None
        return body

    def _not_allowed(self, path: str) -> None:
        allow = _ALLOW[path]
        self._error(405, f"{self.command} is not served at {path} (allowed: {allow}); the endpoint is read-only",
                    headers={"Allow": allow})

    def _error(self, status: int, reason: str, *, close: bool = False, retry: bool = False,
               headers: Mapping[str, str] | None = None) -> None:
        extra = dict(headers or {})
        if retry:
            extra["Retry-After"] = "1"
        if close:
            self.close_connection = True
            extra["Connection"] = "close"
        self._json(status, {"error": reason}, extra)

    def _json(self, status: int, doc: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc, separators=(",", ":")).encode() + b"\n", _JSON, headers)

    def _send(self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        if self.command == "POST" and self.path.split("?", 1)[0] == "/v1/lookup":
            ROUTER_LOOKUPS.inc(status=str(status))
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # scrapes every few seconds: not worth a log line
        log.debug("metrics %s - %s", self.address_string(), format % args)


class _HTTPServer6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """A running endpoint; ``close()`` stops it (tests), otherwise it lives as long as the process."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread, key: tuple[str, int]) -> None:
        self._httpd = httpd
        self._thread = thread
        self._key = key

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """``http://host:port`` (the lookups are at ``base_url + "/v1/lookup"``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/metrics"

    def close(self) -> None:
        with _servers_lock:
            for k in [k for k, s in _servers.items() if s is self]:
                del _servers[k]
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int = DEFAULT_PORT, host: str = "127.0.0.1", *,
                         registry: Registry = REGISTRY, lookups: LookupRegistry | None = LOOKUPS,
                         lookup_max_tokens: int = MAX_LOOKUP_TOKENS) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` and the router lookups of ``lookups``
    (``None``: none) at ``/v1/...`` from a daemon thread.

    Raises ``ConfigError`` when the port or ``lookup_max_tokens`` is out of range or the port
    cannot be bound (in use, no permission), naming it. A server already running on the port
    is returned as it is.
    """
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"metrics port {port} is not in 0..65535")
    if type(lookup_max_tokens) is not int or not 1 <= lookup_max_tokens <= MAX_LOOKUP_TOKENS:
        raise ConfigError(f"lookup_max_tokens={lookup_max_tokens!r} is not in 1..{MAX_LOOKUP_TOKENS}")
    key = (host, int(port))
    INFO.set(1, version=__version__, format_version=str(FORMAT_VERSION))
    with _servers_lock:
        running = _servers.get(key) if port else None
        if running is not None:
            return running
        handler = type("Handler", (_Handler,), {
            "registry": registry, "lookups": lookups, "max_tokens": lookup_max_tokens,
            "in_flight": threading.BoundedSemaphore(MAX_CONCURRENT_LOOKUPS)})
        server_class = _HTTPServer6 if ":" in host else ThreadingHTTPServer
        try:
            httpd = server_class((host, int(port)), handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        httpd.daemon_threads = True
        thread = threading.Thread(target=httpd.serve_forever, name=f"kvstore-metrics:{port}", daemon=True)
        thread.start()
        server = MetricsServer(httpd, thread, key)
        _servers[(host, server.port)] = server
    log.info("serving kvstore metrics at %s", server.url)
    return server


_env_server: MetricsServer | None = None


def start_from_env(environ: Mapping[str, str] | None = None) -> MetricsServer | None:
    """Serve metrics as ``KVSTORE_METRICS_*`` say (see the module docstring); ``None`` when unset.

    Idempotent per process. ``ConfigError`` for a malformed value or when every port of the
    range is taken.
    """
    global _env_server
    env = os.environ if environ is None else environ
    raw = env.get(ENV_PORT, "").strip()
    if not raw:
        return None
    if _env_server is not None:
        return _env_server
    try:
        port = int(raw)
        tries = int(env.get(ENV_PORT_RANGE, "").strip() or DEFAULT_PORT_RANGE)
    except ValueError:
        raise ConfigError(f"{ENV_PORT}={raw!r} / {ENV_PORT_RANGE} must be port numbers") from None
    if tries < 1:
        raise ConfigError(f"{ENV_PORT_RANGE}={tries} must be at least 1")
    host = env.get(ENV_HOST, "").strip() or "127.0.0.1"
    switch = env.get(ENV_LOOKUP, "").strip().lower() or "1"
    if switch not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ConfigError(f"{ENV_LOOKUP}={switch!r} must be 1 or 0 (true/false, yes/no, on/off)")
    lookups = LOOKUPS if switch in ("1", "true", "yes", "on") else None
    _env_server = start_on_free_port(port, tries, host, lookups=lookups)
    return _env_server


def start_on_free_port(port: int, tries: int, host: str = "127.0.0.1", *,
                       lookups: LookupRegistry | None = LOOKUPS) -> MetricsServer:
    """``start_metrics_server`` on the first of ``port .. port + tries - 1`` it can bind (sibling
    processes of one host each take one). ``ConfigError`` when every one is taken."""
    last: ConfigError | None = None
    for candidate in range(port, port + tries):
        try:
            return start_metrics_server(candidate, host, lookups=lookups)
        except ConfigError as exc:
            last = exc
    raise ConfigError(f"no free metrics port in {port}..{port + tries - 1} on {host}: {last}")
