"""``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://`` stores on redis-py + hiredis.

One implementation serves a single server and a cluster: ``_RedisStoreBase`` holds every
operation and talks to whichever client ``_make_client`` builds (``redis.Redis`` or
``redis.cluster.RedisCluster``). Both clients pipeline the same way; a cluster pipeline groups
commands by node and sends one batch per node, so batch operations and ``longest_prefix`` cost
one round trip per node involved. Keys are spread over slots by their own hash (no hash tags).

Large values go out without being copied: redis-py with hiredis packs every command into one
new buffer (a memoryview is first turned into bytes, then joined with the header: 2x the value,
0.75 GB/s at 1-4 MiB). ``_ZeroCopyPacker`` keeps hiredis for small commands and, when an
argument is large, sends the RESP header and the caller's buffer as separate pieces that go to
``sendall`` untouched (the same as redis-py's ``PythonRespSerializer``, about 6 GB/s).

Errors: every redis-py error (refused, timed out, cluster down, OOM...) becomes
``StoreUnavailableError`` raised from it; a missing key is ``None``. No network I/O happens in
the constructor: a store built while Redis is down works once Redis is back.

URL forms::

    redis://[user:password@]host[:port][/db]?ttl=1h&prefix=app/&max_connections=16&timeout=2s
    rediss://...                       (TLS; ?ca_certs=/path/ca.pem&tls_verify=false)
    unix://[user:password@]/path/to/redis.sock?db=0
    redis+cluster://[user:password@]host:port[,host:port...]?...
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence
from urllib.parse import unquote, urlsplit

import numpy as np
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from kvstore.config import build, option, query_options, redact_url
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.stores.base import Buffer, Store

try:  # hiredis packs small commands faster than Python; redis-py works without it
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # pragma: no cover - older redis-py
    HIREDIS_AVAILABLE = False

_DEFAULT_PORT = 6379
_SCAN_COUNT = 1000
# redis-py reads replies in socket_read_size pieces (64 KiB by default) and feeds each to
# hiredis; 1 MiB pieces halve the cost of multi-MiB GETs (32 MiB: 0.2 -> 0.4 GB/s measured).
_READ_SIZE = 1 << 20
_HUGE_VALUE = 1 << 20


@dataclass(frozen=True)
class RedisConfig:
    """Options of a Redis or Redis Cluster store; host, credentials and db come from the URL."""

    hosts: tuple[tuple[str, int], ...] = option((("127.0.0.1", _DEFAULT_PORT),), internal=True,
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
    timeout: float = option(1.0, kind="duration", help="Deadline of each socket read or write (an engine waits at most this, times 1 + retries, per call before the circuit breaker skips the tier).")
    connect_timeout: float = option(1.0, kind="duration", help="Deadline to connect.")
    retries: int = option(1, help="Immediate retries of a failed command (a pooled socket may be stale).")

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError(f"max_connections={self.max_connections} must be at least 1")
        if self.retries < 0:
            raise ConfigError(f"retries={self.retries} must not be negative")
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("timeout and connect_timeout must be positive: every remote call has a deadline")
        if self.cluster and self.db != 0:
            raise ConfigError(f"db={self.db}: a Redis Cluster has only database 0")

    @classmethod
    def from_url(cls, url: str) -> "RedisConfig":
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        where = redact_url(url)
        if scheme not in RedisStore.schemes + RedisClusterStore.schemes:
            raise ConfigError(f"{where!r} is not a Redis URL; accepted schemes: redis, rediss, unix, "
                              "redis+cluster, rediss+cluster")
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
        return host, int(port) if port else _DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"{where!r}: port {port!r} of {text!r} is not a number") from None


# -- sending large values without copies ---------------------------------------------------------
class _ZeroCopyPacker:
    """Packs commands for the wire; large arguments are sent as they are, never joined.

    Small commands (lookups, deletes) go through hiredis' C packer. A command with an argument
    over the cutoff is packed as a list ``[header, value, CRLF+next header, ...]`` whose value
    pieces are the caller's own buffers: the connection ``sendall``s them one by one.
    """

    def __init__(self, buffer_cutoff: int, encode: Any) -> None:
        self._cutoff = buffer_cutoff
        self._python = PythonRespSerializer(buffer_cutoff, encode)
        self._small = HiredisRespSerializer() if HIREDIS_AVAILABLE else self._python

    def pack(self, *args: Any) -> list:
        cutoff = self._cutoff
        for arg in args:
            if isinstance(arg, (bytes, bytearray, memoryview)) and len(arg) > cutoff:
                return self._python.pack(*args)
        return self._small.pack(*args)


class _PackerMixin:
    def _construct_command_packer(self, packer: Any) -> Any:
        return packer if packer is not None else _ZeroCopyPacker(self._buffer_cutoff, self.encoder.encode)


class _Connection(_PackerMixin, redis.Connection):
    pass


class _SSLConnection(_PackerMixin, redis.SSLConnection):
    pass


class _UnixConnection(_PackerMixin, redis.UnixDomainSocketConnection):
    pass


def _wire(value: Buffer) -> bytes | memoryview:
    """``value`` as a byte-addressed buffer whose ``len`` is its size in bytes (RESP needs that)."""
    if isinstance(value, bytes):
        return value
    view = memoryview(value)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _DirectReplies:
    """Reads GET replies (RESP2 or RESP3) from a socket straight into buffers of their final size.

    redis-py hands every reply to hiredis, whose buffer grows by reallocation and is then copied
    into a new ``bytes``: three copies of a 32 MiB value. Here the bulk header is parsed and the
    value is received with ``recv_into`` into one new buffer: one write per byte. Values come back
    as memoryviews of that buffer (the caller owns it). Only used right
    after sending GETs on a connection whose parser holds nothing (request/response order).
    """

    _HEADER_READ = 1 << 16

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _fill(self) -> None:
        chunk = self._sock.recv(self._HEADER_READ)
        if not chunk:
            raise redis.exceptions.ConnectionError("server closed the connection mid-reply")
        self._buf += chunk

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def value(self) -> memoryview | None:
        line = self._line()
        kind = line[:1]
        if kind == b"_" or line == b"$-1":
            return None
        if kind == b"-":
            raise redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
        if kind != b"$":
            raise redis.exceptions.InvalidResponse(f"unexpected reply to GET: {line[:40]!r}")
        size = int(line[1:])
        # A fresh buffer over glibc's mmap threshold page-faults per 4 KiB page (about 0.4 GB/s
        # here for 32 MiB); numpy asks the kernel for transparent huge pages: about 2x faster.
        view = memoryview(np.empty(size, dtype=np.uint8) if size >= _HUGE_VALUE else bytearray(size))
        have = min(size, len(self._buf))
        view[:have] = self._buf[:have]
        del self._buf[:have]
        while have < size:
            n = self._sock.recv_into(view[have:])
            if not n:
                raise redis.exceptions.ConnectionError("server closed the connection mid-value")
            have += n
        while len(self._buf) < 2:  # the CRLF after the value
            self._fill()
        del self._buf[:2]
        return view


# -- the shared implementation -------------------------------------------------------------------
class _RedisStoreBase(Store):
    """Every Redis operation, over whichever redis-py client ``_make_client`` returns."""

    is_local = False
    Config = RedisConfig

    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self._prefix = config.prefix
        self._px = int(config.ttl * 1000) or None
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> "_RedisStoreBase":
        config = RedisConfig.from_url(url)
        if config.cluster != issubclass(cls, RedisClusterStore):
            raise ConfigError(f"{redact_url(url)!r} is served by "
                              f"{'RedisClusterStore' if config.cluster else 'RedisStore'}, not {cls.__name__}")
        return cls(config)

    # -- subclasses: how to build the client --------------------------------------------------------
    def _make_client(self) -> Any:
        raise NotImplementedError

    def _direct_pool(self) -> Any:
        """The pool whose connections can serve any key (GETs read directly); None in a cluster."""
        return None

    def _connection_kwargs(self) -> dict[str, Any]:
        c = self.config
        kwargs: dict[str, Any] = {
            "username": c.username or None, "password": c.password or None,
            "socket_timeout": c.timeout, "socket_connect_timeout": c.connect_timeout,
            "max_connections": c.max_connections, "socket_read_size": _READ_SIZE,
            # Wait for a pooled connection (bounded), instead of failing when all are busy.
            "connection_pool_class": redis.BlockingConnectionPool, "timeout": c.connect_timeout + c.timeout,
        }
        if c.tls:
            kwargs.update(connection_class=_SSLConnection, ssl_ca_certs=c.ca_certs or None,
                          ssl_cert_reqs="required" if c.tls_verify else "none",
                          ssl_check_hostname=c.tls_verify)
        else:
            kwargs["connection_class"] = _Connection
        return kwargs

    @property
    def _redis(self) -> Any:
        client = self._client
        if client is None:
            with self._client_lock:
                if self._closed:
                    raise StoreUnavailableError(f"{self.config.safe_url()} is closed")
                if self._client is None:
                    with self._errors():  # a cluster client asks the nodes for slots right away
                        self._client = self._make_client()
                client = self._client
        return client

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.DataError:
            raise  # a caller's bug (a value of the wrong type), not an outage
        except redis.exceptions.RedisError as exc:
            raise StoreUnavailableError(f"{self.config.safe_url()}: {type(exc).__name__}: {exc}") from exc

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _pipeline(self, commands: Iterable[tuple[str, tuple, dict]]) -> list[Any]:
        """Send commands in one pipeline (one batch per node in a cluster); their replies in order."""
        with self._errors():
            pipe = self._redis.pipeline(transaction=False)
            n = 0
            for name, args, kwargs in commands:
                getattr(pipe, name)(*args, **kwargs)
                n += 1
            if n == 0:
                return []
            return pipe.execute()

    # -- the small contract --------------------------------------------------------------------
    def get(self, key: str) -> bytes | memoryview | None:
        if self._direct_pool() is not None:
            return self.get_many([key])[0]
        with self._errors():
            return self._redis.get(self._key(key))

    def put(self, key: str, value: Buffer) -> None:
        with self._errors():
            self._redis.set(self._key(key), _wire(value), px=self._px)

    def delete(self, key: str) -> bool:
        with self._errors():
            return bool(self._redis.delete(self._key(key)))

    def exists(self, key: str) -> bool:
        with self._errors():
            return bool(self._redis.exists(self._key(key)))

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        pattern = _glob_escape(self._prefix + prefix) + "*"
        cut = len(self._prefix)
        with self._errors():  # scan_iter visits every primary of a cluster
            for raw in self._redis.scan_iter(match=pattern, count=_SCAN_COUNT):
                yield (raw.decode() if isinstance(raw, bytes) else raw)[cut:]

    # -- batch forms: one pipeline each --------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        pool = self._direct_pool() if keys else None
        if pool is None:
            return self._pipeline(("get", (self._key(k),), {}) for k in keys)
        packed_args = [("GET", self._key(k)) for k in keys]
        with self._errors():
            for attempt in range(self.config.retries + 1):  # a pooled socket may be stale
                conn = pool.get_connection()
                try:
                    conn.send_packed_command(conn.pack_commands(packed_args))
                    reader = _DirectReplies(conn._sock)
                    return [reader.value() for _ in keys]
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
                    conn.disconnect()  # the stream is mid-reply: never reuse it
                    if attempt == self.config.retries:
                        if isinstance(exc, redis.exceptions.RedisError):
                            raise
                        raise redis.exceptions.ConnectionError(f"{type(exc).__name__}: {exc}") from exc
                except BaseException:
                    conn.disconnect()
                    raise
                finally:
                    pool.release(conn)
        raise AssertionError("unreachable")

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> None:
        px = self._px
        self._pipeline(("set", (self._key(k), _wire(v)), {"px": px}) for k, v in items)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in self._pipeline(("exists", (self._key(k),), {}) for k in keys)]

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(self._pipeline(("delete", (self._key(k),), {}) for k in keys))

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        # STRLEN cannot tell an empty value from a missing key; EXISTS beside it can.
        replies = self._pipeline(cmd for k in keys for cmd in (("exists", (self._key(k),), {}),
                                                                ("strlen", (self._key(k),), {})))
        return [int(replies[i + 1]) if replies[i] else None for i in range(0, len(replies), 2)]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """One pipelined EXISTS per key: a single round trip (one per node in a cluster).

        Every key is checked, not only up to the first miss: a miss found early costs nothing
        extra on the wire, and a server-side script could not span a cluster's slots.
        """
        for i, present in enumerate(self.exists_many(keys)):
            if not present:
                return i
        return len(keys)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        with self._client_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
                # redis.Redis.close() leaves a pool it was given open; release its sockets now
                # rather than whenever the pool is garbage collected.
                pool = getattr(client, "connection_pool", None)
                if pool is not None:
                    pool.disconnect()
            except redis.exceptions.RedisError:
                pass  # closing a store whose server is gone must not fail

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"store": "redis+cluster" if c.cluster else "redis", "url": c.safe_url(), "prefix": c.prefix,
                "ttl": c.ttl, "max_connections": c.max_connections, "timeout": c.timeout}


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class RedisStore(_RedisStoreBase):
    """One Redis (or Valkey) server over TCP, TLS or a Unix socket."""

    schemes = ("redis", "rediss", "unix")

    def _make_client(self) -> redis.Redis:
        c = self.config
        kwargs = self._connection_kwargs()
        pool_class = kwargs.pop("connection_pool_class")
        if c.unix_path:
            kwargs.update(connection_class=_UnixConnection, path=c.unix_path)
        else:
            host, port = c.hosts[0]
            kwargs.update(host=host, port=port)
        # A failed command is retried at once (a pooled socket may be stale after a server
        # restart); never with backoff: a cache answers "miss" rather than wait.
        kwargs["retry"] = Retry(NoBackoff(), c.retries)
        pool = pool_class(db=c.db, **kwargs)
        return redis.Redis(connection_pool=pool)

    def _direct_pool(self) -> Any:
        return self._redis.connection_pool


class RedisClusterStore(_RedisStoreBase):
    """A Redis Cluster: keys hash to slots on several primaries; batches go one per node."""

    schemes = ("redis+cluster", "rediss+cluster")

    def _make_client(self) -> redis.cluster.RedisCluster:
        c = self.config
        kwargs = self._connection_kwargs()
        (host, port), *others = c.hosts
        # ``url=`` makes redis-py build node pools from these kwargs as given, so our connection
        # class (and its packer) is used; credentials and TLS stay in kwargs, not in the URL.
        return redis.cluster.RedisCluster(
            url=f"redis://{host}:{port}",
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in others],
            retry=Retry(NoBackoff(), c.retries),
            **kwargs,
        )
