"""Options of the Redis and Redis Cluster stores, parsed from their URLs.

URL forms::

    redis://[user:password@]host[:port][/db]?ttl=1h&prefix=app/&max_connections=16&timeout=250ms
    rediss://...                       (TLS; ?ca_certs=/path/ca.pem&tls_verify=false)
    unix://[user:password@]/path/to/redis.sock?db=0
    redis+cluster://[user:password@]host:port[,host:port...]?...

Secrets: the password may instead come from an environment variable (``?password_env=NAME``) or
a file (``?password_file=/run/secrets/redis``), read when the URL is parsed, i.e. when the store
opens, so it appears neither in the URL nor on a command line (``ps``). No variable is read
unless a URL names it: an engine's environment often holds a ``REDIS_PASSWORD`` meant for
something else. A missing variable or an unreadable, empty file is a ``ConfigError`` naming the
option and the variable or path, never the secret.

Deadlines: reads, lookups and deletes (the engine's critical path) wait at most
``connect_timeout + timeout`` per call (``deadline``); background writes use ``write_timeout``
on their own connections. A failed command is retried at once only after a connection error
(a stale pooled socket), never after a timeout. Every value is range-checked here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from kvstore.config import build, check_range, option, query_options, redact_url, split_url
from kvstore.errors import ConfigError

__all__ = ["RedisConfig", "parse_scheme", "DEFAULT_PORT"]

DEFAULT_PORT = 6379
MAX_DB = (1 << 31) - 1  # Redis's `databases` is an int
MAX_TIMEOUT = 300.0  # seconds; a cache call that may wait longer is a hang, not a deadline
MAX_TTL = 10 * 365 * 86400.0
MAX_RETRIES = 10
MAX_SPREAD = 64  # connections one batch spreads over: more only adds threads
_PORT = re.compile(r"^[0-9]{1,5}$", re.ASCII)  # int() alone takes "-1", " 7", "1_0" and other scripts' digits
_DB = re.compile(r"^[0-9]{1,10}$", re.ASCII)
_HOST = re.compile(r"^[A-Za-z0-9._-]+$", re.ASCII)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$", re.ASCII)
MAX_SECRET = 4096  # bytes of a password file: more is not a password (a wrong path, say)
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?$", re.ASCII)


@dataclass(frozen=True)
class RedisConfig:
    """Options of a Redis or Redis Cluster store; host, credentials and db come from the URL."""

    hosts: tuple[tuple[str, int], ...] = option((("127.0.0.1", DEFAULT_PORT),), internal=True,
                                                help="Server, or cluster startup nodes.")
    unix_path: str = option("", internal=True, help="Unix socket path (unix:// URLs).")
    db: int = option(0, help="Database number (standalone only).")
    username: str = option("", internal=True)
    password: str = option("", secret=True, internal=True)
    password_env: str = option("", help="Environment variable holding the password, read when the store opens "
                                        "(e.g. password_env=REDIS_PASSWORD): not in the URL, not in `ps`.")
    password_file: str = option("", help="File holding the password (one trailing newline dropped), read when the "
                                         "store opens, e.g. a mounted secret; keep it readable by the engine only.")
    tls: bool = option(False, internal=True, help="rediss:// URLs.")
    cluster: bool = option(False, internal=True)
    ca_certs: str = option("", help="CA bundle to verify the server's certificate (rediss://).")
    tls_verify: bool = option(True, help="Verify the server's certificate (rediss://).")
    ttl: float = option(0.0, kind="duration", help="Expire values this long after writing (1ms to 10 years); 0 keeps them.")
    prefix: str = option("", help="Prepended to every key (several caches in one database).")
    max_connections: int = option(16, help="Connection pool size (per node in a cluster), for reads and for writes each.")
    connections: int = option(4, help="Connections a batch of large values is spread over, each read or written by "
                                      "its own thread (1 to 64; capped at max_connections). A cluster shares them out "
                                      "over the nodes a batch touches, at least one each, all nodes at once.")
    adapt_writes: bool = option(
        True, help="Write batches start on one connection per server and spread over more (up to connections) only "
        "while doubling them makes batches (4 MiB or more, a value per connection or more) at least 1.5x as fast, "
        "rechecked now and then: where nothing caps each connection, more only cost CPU. false: every write batch "
        "uses connections.")
    adapt_reads: bool = option(
        True, help="Read batches learn their connections per server the same way (from batches of 4 MiB or more): "
        "where one connection carries the bytes as fast, the extra reader threads only cost CPU. false: every read "
        "batch uses connections.")
    timeout: float = option(
        0.25, kind="duration", help="Deadline of each socket read or write of a read, lookup or delete (the engine's "
        "critical path). A frozen server costs one call at most connect_timeout + timeout; the circuit breaker then "
        "skips the tier.")
    connect_timeout: float = option(0.25, kind="duration", help="Deadline to connect.")
    write_timeout: float = option(
        5.0, kind="duration", help="Deadline of each socket read or write of a background write (its own connections: "
        "a slow write never holds a connection a read needs).")
    retries: int = option(1, help="Immediate retries after a connection error (a pooled socket may be stale); "
                                  "never after a timeout. 0 to 10.")

    def __post_init__(self) -> None:
        check_range("max_connections", self.max_connections, 1, 4096)
        check_range("connections", self.connections, 1, MAX_SPREAD)
        check_range("retries", self.retries, 0, MAX_RETRIES)
        check_range("db", self.db, 0, MAX_DB)
        for name in ("timeout", "connect_timeout", "write_timeout"):
            value = getattr(self, name)
            if not 0 < value <= MAX_TIMEOUT:  # NaN fails too
                raise ConfigError(f"{name}={value!r} is out of range; accepted: more than 0 and at most "
                                  f"{MAX_TIMEOUT:g}s (every remote call has a deadline)")
        if self.ttl != 0 and not 1e-3 <= self.ttl <= MAX_TTL:
            raise ConfigError(f"ttl={self.ttl!r} is out of range; accepted: 0 (no expiry) or 1ms to 10 years")
        if len(self.prefix) > 1024:
            raise ConfigError(f"prefix of {len(self.prefix)} characters is too long; accepted: up to 1024")
        for _host, port in self.hosts:
            check_range("port", port, 1, 65535)
        if self.cluster and self.db != 0:
            raise ConfigError(f"db={self.db}: a Redis Cluster has only database 0")
        if self.password_env and not _ENV_NAME.match(self.password_env):
            raise ConfigError(f"password_env={self.password_env!r} is not an environment variable name; accepted: "
                              "letters, digits and _, not starting with a digit")
        if self.password_env and self.password_file:
            raise ConfigError("give the password by password_env or by password_file, not both")

    @classmethod
    def from_url(cls, url: str) -> RedisConfig:
        parts = split_url(url)
        scheme = parts.scheme.lower()
        where = redact_url(url)
        tls, cluster = parse_scheme(scheme, where)
        userinfo, _, hostinfo = parts.netloc.rpartition("@")
        username, _, password = userinfo.partition(":")
        fixed: dict[str, Any] = {
            "username": unquote(username), "password": unquote(password), "tls": tls, "cluster": cluster,
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
                if not _DB.match(path):
                    raise ConfigError(f"{where!r}: the path must be a database number (0 to {MAX_DB}), got {path!r}")
                options["db"] = path
            if not fixed["cluster"] and len(fixed["hosts"]) > 1:
                raise ConfigError(f"{where!r} names several hosts; use redis+cluster:// for a cluster")
        config = build(cls, options, where=f"{scheme}://", **fixed)
        if not (config.password_env or config.password_file):
            return config
        if config.password:
            raise ConfigError(f"{where!r} gives a password in the URL and by "
                              f"{'password_env' if config.password_env else 'password_file'}; give one")
        return dataclasses.replace(config, password=config.read_password())

    def read_password(self) -> str:
        """The password that ``password_env`` or ``password_file`` names (``password`` itself
        when neither does). ``ConfigError`` names the option and the variable or file, never
        the value."""
        if self.password_env:
            what = f"password_env={self.password_env}"
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(f"{what}: no such environment variable in this process (set it in the "
                                  "environment the engine starts with)")
        elif self.password_file:
            what = f"password_file={self.password_file}"
            try:
                with open(self.password_file, "rb") as f:
                    data = f.read(MAX_SECRET + 1)
            except OSError as exc:
                raise ConfigError(f"{what}: cannot read it: {exc.strerror or type(exc).__name__}") from None
            if len(data) > MAX_SECRET:
                raise ConfigError(f"{what}: larger than {MAX_SECRET} bytes; not a password file")
            try:
                value = data.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{what}: not UTF-8 text") from None
            value = value[:-2] if value.endswith("\r\n") else value.removesuffix("\n")
        else:
            return self.password
        if not value:
            raise ConfigError(f"{what}: the password is empty")
        if any(unicodedata.category(ch) == "Cc" for ch in value):  # the value itself is never shown
            raise ConfigError(f"{what}: the password holds a control character; accepted: printable characters")
        return value

    def safe_url(self) -> str:
        """The store's address for logs: no password."""
        user = f"{self.username}:***@" if self.password else (f"{self.username}@" if self.username else "")
        if self.unix_path:
            return f"unix://{user}{self.unix_path}?db={self.db}"
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        return f"{scheme}://{user}{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse_scheme(scheme: str, where: str = "") -> tuple[bool, bool]:
    """``(tls, cluster)`` of a Redis URL scheme, read from its grammar: ``redis`` or ``rediss``
    (TLS), optionally ``+cluster``; or ``unix``. Which schemes are served, and by which class, is
    the store registry's table (``kvstore.stores.registry.BACKENDS``); a test ties the two."""
    base, plus, topology = scheme.partition("+")
    if scheme == "unix" or (base in ("redis", "rediss") and (not plus or topology == "cluster")):
        return base == "rediss", topology == "cluster"
    raise ConfigError(f"{where or scheme + '://'!r} is not a Redis URL; accepted schemes: redis or rediss (TLS), "
                      "optionally +cluster, or unix")


def _parse_host(text: str, where: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:6379
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"{where!r}: {text!r} is not [IPv6 address]:port")
        port = rest[1:]
        if rest == ":":
            raise ConfigError(f"{where!r}: empty port in {text!r}")
    else:
        host, colon, port = text.partition(":")
        if colon and not port:
            raise ConfigError(f"{where!r}: empty port in {text!r}")
    if not host:
        raise ConfigError(f"{where!r}: empty host in {text!r}")
    if not (_IPV6 if text.startswith("[") else _HOST).match(host):
        raise ConfigError(f"{where!r}: {host!r} is not a host name or address")
    if not port:
        return host, DEFAULT_PORT
    if not _PORT.match(port) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where!r}: port {port!r} of {text!r} is not a port number; accepted: 1 to 65535 "
                          "(ASCII digits)")
    return host, int(port)
