"""Options of the Redis and Redis Cluster stores, parsed from their URLs.

URL forms::

    redis://[user:password@]host[:port][/db]?ttl=1h&prefix=app/&max_connections=16&timeout=2s
    rediss://...                       (TLS; ?ca_certs=/path/ca.pem&tls_verify=false)
    unix://[user:password@]/path/to/redis.sock?db=0
    redis+cluster://[user:password@]host:port[,host:port...]?...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from kvstore.config import build, option, query_options, redact_url
from kvstore.errors import ConfigError

__all__ = ["RedisConfig", "SCHEMES", "DEFAULT_PORT"]

#: The schemes ``RedisConfig`` parses (the registry routes them to the two store classes).
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class RedisConfig:
    """Options of a Redis or Redis Cluster store; host, credentials and db come from the URL."""

    hosts: tuple[tuple[str, int], ...] = option((("127.0.0.1", DEFAULT_PORT),), internal=True,
                                                help="Server, or cluster startup nodes.")
    unix_path: str = option("", internal=True, help="Unix socket path (unix:// URLs).")
    db: int = option(0, help="Database number (standalone only).")
    username: str = option("", internal=True)
    password: str = option("", secret=True, internal=True)
    tls: bool = option(False, internal=True, help="rediss:// URLs.")
    cluster: bool = option(False, internal=True)
    ca_certs: str = option("", help="CA bundle to verify the server's certificate (rediss://).")
    tls_verify: bool = option(True, help="Verify the server's certificate (rediss://).")
    ttl: float = option(0.0, kind="duration", help="Expire values this long after writing; 0 keeps them.")
    prefix: str = option("", help="Prepended to every key (several caches in one database).")
    max_connections: int = option(16, help="Connection pool size (per node in a cluster).")
    connections: int = option(2, help="Connections a batch of large values is spread over, each read or written by "
                                      "its own thread (at most max_connections).")
    timeout: float = option(1.0, kind="duration", help="Deadline of each socket read or write (an engine waits at most this, times 1 + retries, per call before the circuit breaker skips the tier).")
    connect_timeout: float = option(1.0, kind="duration", help="Deadline to connect.")
    retries: int = option(1, help="Immediate retries of a failed command (a pooled socket may be stale).")

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError(f"max_connections={self.max_connections} must be at least 1")
        if not 1 <= self.connections <= self.max_connections:
            raise ConfigError(f"connections={self.connections} must be in [1, max_connections={self.max_connections}]")
        if self.retries < 0:
            raise ConfigError(f"retries={self.retries} must not be negative")
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("timeout and connect_timeout must be positive: every remote call has a deadline")
        if self.cluster and self.db != 0:
            raise ConfigError(f"db={self.db}: a Redis Cluster has only database 0")

    @classmethod
    def from_url(cls, url: str) -> RedisConfig:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        where = redact_url(url)
        if scheme not in SCHEMES:
            raise ConfigError(f"{where!r} is not a Redis URL; accepted schemes: {', '.join(SCHEMES)}")
        userinfo, _, hostinfo = parts.netloc.rpartition("@")
        username, _, password = userinfo.partition(":")
        fixed: dict[str, Any] = {
            "username": unquote(username), "password": unquote(password),
            "tls": scheme.startswith("rediss"), "cluster": scheme.endswith("+cluster"),
        }
        options = query_options(url)
        if scheme == "unix":
            if hostinfo or not parts.path:
                raise ConfigError(f"{where!r}: use unix:///path/to/redis.sock (the path is the socket)")
            fixed["unix_path"] = parts.path
        else:
            fixed["hosts"] = tuple(_parse_host(h, where) for h in (hostinfo or "127.0.0.1").split(","))
            path = parts.path.strip("/")
            if path:
                if "db" in options:
                    raise ConfigError(f"{where!r} gives the database both in the path and as ?db=")
                try:
                    options["db"] = str(int(path))
                except ValueError:
                    raise ConfigError(f"{where!r}: the path must be a database number, got {path!r}") from None
            if not fixed["cluster"] and len(fixed["hosts"]) > 1:
                raise ConfigError(f"{where!r} names several hosts; use redis+cluster:// for a cluster")
        return build(cls, options, where=f"{scheme}://", **fixed)

    def safe_url(self) -> str:
        """The store's address for logs: no password."""
        user = f"{self.username}:***@" if self.password else (f"{self.username}@" if self.username else "")
        if self.unix_path:
            return f"unix://{user}{self.unix_path}?db={self.db}"
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        return f"{scheme}://{user}{hosts}" + ("" if self.cluster else f"/{self.db}")


def _parse_host(text: str, where: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:6379
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ConfigError(f"{where!r}: empty host in {text!r}")
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"{where!r}: port {port!r} of {text!r} is not a number") from None
