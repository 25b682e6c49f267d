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
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvstore._version import FORMAT_VERSION, __version__
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import INFO
from kvstore.metrics.registry import REGISTRY, Registry

log = logging.getLogger(__name__)

#: The port the dev stack (docker-compose.yml, docker/prometheus.yml) scrapes.
DEFAULT_PORT = 9477
#: Environment of ``start_from_env``.
ENV_PORT, ENV_HOST, ENV_PORT_RANGE = "KVSTORE_METRICS_PORT", "KVSTORE_METRICS_HOST", "KVSTORE_METRICS_PORT_RANGE"
DEFAULT_PORT_RANGE = 4
#: Prometheus text exposition format 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_servers: dict[tuple[str, int], MetricsServer] = {}
_servers_lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    registry: Registry = REGISTRY
    server_version = "kvstore-metrics"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body = self.registry.render().encode()
            content_type = CONTENT_TYPE
            status = 200
        elif path in ("/healthz", "/"):
            body, content_type, status = b"ok\n", "text/plain; charset=utf-8", 200
        else:
            body, content_type, status = b"not found; metrics are at /metrics\n", "text/plain; charset=utf-8", 404
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET

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
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        with _servers_lock:
            for k in [k for k, s in _servers.items() if s is self]:
                del _servers[k]
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int = DEFAULT_PORT, host: str = "127.0.0.1", *,
                         registry: Registry = REGISTRY) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    Raises ``ConfigError`` when the port is out of range or cannot be bound (in use, no
    permission), naming it.
    """
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"metrics port {port} is not in 0..65535")
    key = (host, int(port))
    INFO.set(1, version=__version__, format_version=str(FORMAT_VERSION))
    with _servers_lock:
        running = _servers.get(key) if port else None
        if running is not None:
            return running
        handler = type("Handler", (_Handler,), {"registry": registry})
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
    last: ConfigError | None = None
    for candidate in range(port, port + tries):
        try:
            _env_server = start_metrics_server(candidate, host)
            return _env_server
        except ConfigError as exc:
            last = exc
    raise ConfigError(f"no free metrics port in {port}..{port + tries - 1} on {host}: {last}")
