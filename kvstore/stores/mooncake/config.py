"""The options of a ``mooncake://`` store (``MooncakeConfig``), parsed and checked from its URL.

URL: ``mooncake://MASTER_HOST[:PORT]?metadata=http://HOST:8080/metadata&protocol=tcp&segment=4GiB
&replicas=1&deadline=2s&prefix=app/``. The host part is the ``mooncake_master``'s RPC address (port
50051 by default). Defaults that depend on it (the metadata server, the admin address) are
filled in by ``metadata_url`` and ``admin_url``, so the config stays what the user wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstore.config import build, check_options, option, query_options, redact_url, split_url
from kvstore.errors import ConfigError

__all__ = ["MooncakeConfig", "DEFAULT_MASTER_PORT"]

#: ``mooncake_master``'s default RPC port.
DEFAULT_MASTER_PORT = 50051
#: The master's default ports for its HTTP metadata server and its admin (metrics) server.
DEFAULT_METADATA_PORT = 8080
DEFAULT_ADMIN_PORT = 9003
MAX_TIMEOUT = 300.0  # seconds; a cache call that may wait longer is a hang, not a deadline
_HOST = re.compile(r"^[A-Za-z0-9._-]+$", re.ASCII)
_PORT = re.compile(r"^[0-9]{1,5}$", re.ASCII)
_DEVICES = re.compile(r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$", re.ASCII)


@dataclass(frozen=True)
class MooncakeConfig:
    """Options of a Mooncake Store client; the master's address comes from the URL's host part."""

    master_host: str = option("127.0.0.1", internal=True, help="The master's host (the URL's host).")
    master_port: int = option(DEFAULT_MASTER_PORT, internal=True, help="The master's RPC port (the URL's port).")
    metadata: str = option("", help="The transfer engine's metadata server, an http:// URL (the master's own with "
                                    "`--enable_http_metadata_server=true`); empty: "
                                    f"`http://MASTER_HOST:{DEFAULT_METADATA_PORT}/metadata`.")
    protocol: str = option("tcp", choices=("tcp", "rdma"),
                           help="Transport of the transfer engine: `tcp` (anywhere) or `rdma` (RoCE / InfiniBand NICs).")
    device: str = option("", help="RDMA devices to use, comma-separated (`mlx5_0,mlx5_1`); empty: Mooncake's "
                                  "choice. Only with protocol=rdma.")
    segment: int = option(512 << 20, kind="size", lo=0, hi=1 << 40,
                          help="Memory this process contributes to the pool (embedded: its objects die with it); "
                               "0: none, a `mooncake_client` process on the host owns the pool (standalone).")
    replicas: int = option(1, lo=1, hi=8, help="Copies of each object, on different segments.")
    register: str = option("auto", choices=("auto", "always"),
                           help="Register buffers with the transfer engine: `auto` over RDMA only (the NIC reaches "
                                "only registered memory; over TCP bytes move through plain pointers), `always` over "
                                "TCP too.")
    host: str = option("", help="This process's address as other hosts reach its transfer endpoint; empty: the "
                                "address of the interface that routes to the master.")
    prefix: str = option("", help="Prefix of every object name (several deployments on one pool).")
    deadline: float = option(2.0, kind="duration",
                             help="Longest one call may take (the client's own calls block up to 30 s on a frozen "
                                  "master); then it is a miss and the circuit breaker skips the tier.")
    window: int = option(256 << 20, kind="size", lo=1 << 20, hi=1 << 36,
                         help="Bytes one batch read moves at most: a load reads window after window, the next "
                              "one arriving while the reader verifies this one.")
    workers: int = option(16, lo=1, hi=64, help="Threads that call the client (each call runs on one, its "
                                                "deadline counted from when it was asked for, waiting included).")
    staging: int = option(256 << 20, kind="size", lo=1 << 20, hi=1 << 40,
                          help="Registered memory of the store's own, for values written in several pieces "
                               "(gathered into one) and for `get_many`.")
    admin: str = option("", help="The master's admin HTTP server, an http:// URL, read only to list keys "
                                 f"(`iter_keys`); empty: `http://MASTER_HOST:{DEFAULT_ADMIN_PORT}`.")

    def __post_init__(self) -> None:
        check_options(self)
        if not _HOST.match(self.master_host):
            raise ConfigError(f"mooncake:// master host {self.master_host!r} is not a host name or IPv4 address")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"mooncake:// master port {self.master_port} is out of range; accepted: 1 to 65535")
        if not 0 < self.deadline <= MAX_TIMEOUT:  # NaN fails too
            raise ConfigError(f"deadline={self.deadline!r} is out of range; accepted: more than 0 and at most "
                              f"{MAX_TIMEOUT:g}s (every remote call has a deadline)")
        for name in ("metadata", "admin"):
            value = getattr(self, name)
            if value:
                parts = split_url(value, name=name)
                try:
                    parts.port  # noqa: B018  (a property: raises for a port that is not a number)
                except ValueError as exc:
                    raise ConfigError(f"{name}={value!r} is not a valid URL: {exc}") from None
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ConfigError(f"{name}={value!r} must be an http:// or https:// URL with a host")
        if self.device and not _DEVICES.match(self.device):
            raise ConfigError(f"device={self.device!r} is not a comma-separated list of device names (mlx5_0,mlx5_1)")
        if self.device and self.protocol != "rdma":
            raise ConfigError(f"device={self.device!r} needs protocol=rdma (the tcp transport uses no device)")
        if self.host and not _HOST.match(self.host):
            raise ConfigError(f"host={self.host!r} is not a host name or IPv4 address")
        if "\x00" in self.prefix:
            raise ConfigError(f"prefix={self.prefix!r} holds a NUL; accepted: printable characters")

    @property
    def master(self) -> str:
        """The master's RPC address, ``host:port``."""
        return f"{self.master_host}:{self.master_port}"

    @property
    def metadata_url(self) -> str:
        return self.metadata or f"http://{self.master_host}:{DEFAULT_METADATA_PORT}/metadata"

    @property
    def admin_url(self) -> str:
        return (self.admin or f"http://{self.master_host}:{DEFAULT_ADMIN_PORT}").rstrip("/")

    @classmethod
    def from_url(cls, url: str) -> MooncakeConfig:
        parts = split_url(url)
        if parts.scheme.lower() != "mooncake":
            raise ConfigError(f"{redact_url(url)!r} is not a mooncake:// URL")
        if "@" in parts.netloc:
            raise ConfigError("mooncake:// URLs take no credentials: the master has none")
        if parts.path not in ("", "/"):
            raise ConfigError(f"mooncake:// takes no path ({parts.path!r}); name a key prefix with ?prefix=")
        host, colon, port = parts.netloc.partition(":")
        if not host:
            raise ConfigError(f"{redact_url(url)!r} names no master: mooncake://MASTER_HOST[:PORT]")
        fixed: dict[str, object] = {"master_host": host}
        if colon:
            if not _PORT.match(port) or not 1 <= int(port) <= 65535:
                raise ConfigError(f"mooncake:// master port {port!r} is not a port number; accepted: 1 to 65535 "
                                  "(ASCII digits)")
            fixed["master_port"] = int(port)
        return build(cls, query_options(url), where="mooncake://", **fixed)
