"""``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://`` stores on redis-py + hiredis.

One implementation serves a single server and a cluster: ``_RedisStoreBase`` holds every
operation and talks to whichever client ``_make_client`` builds (``redis.Redis`` or
``redis.cluster.RedisCluster``). Both clients pipeline the same way; a cluster pipeline groups
commands by node and sends one batch per node, so batch operations and ``longest_prefix`` cost
one round trip per node involved. Keys are spread over slots by their own hash (no hash tags).

Large values go out without being copied and GET replies are received straight into buffers of
their final size (``hooks``: the parts of redis-py this relies on).

Errors: every redis-py error (refused, timed out, cluster down, OOM...) becomes
``StoreUnavailableError`` raised from it (``StoreTimeoutError`` when a deadline expired); a
missing key is ``None``. No network I/O happens in the constructor: a store built while Redis
is down works once Redis is back.

Deadlines: reads, lookups and deletes run on one client (socket timeout ``timeout``), writes on
another with its own connections (``write_timeout``), so a background write to a slow server
never holds a connection or a deadline an engine's read needs. A command is retried at once
after a connection error only (a stale pooled socket), never after a timeout: one call to a
frozen server costs at most ``deadline`` = ``connect_timeout + timeout``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.config import redact_url
from kvstore.errors import ConfigError, StoreTimeoutError, StoreUnavailableError
from kvstore.stores.base import Buffer, Store, Value
from kvstore.stores.redis import hooks
from kvstore.stores.redis.config import RedisConfig

__all__ = ["RedisStore", "RedisClusterStore"]

_SCAN_COUNT = 1000
# redis-py reads replies in socket_read_size pieces (64 KiB by default) and feeds each to
# hiredis; 1 MiB pieces halve the cost of multi-MiB GETs.
_READ_SIZE = 1 << 20

#: A pipelined command: the client method's name, its arguments and its keyword arguments.
_Command = tuple[str, tuple[Any, ...], dict[str, Any]]


class _RedisStoreBase(Store):
    """Every Redis operation, over whichever redis-py client ``_make_client`` returns."""

    is_local = False
    Config = RedisConfig

    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self._prefix = config.prefix
        self._px = int(config.ttl * 1000) or None
        self._client: Any = None
        self._write_client: Any = None
        self._client_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> _RedisStoreBase:
        config = RedisConfig.from_url(url)
        if config.cluster != issubclass(cls, RedisClusterStore):
            raise ConfigError(f"{redact_url(url)!r} is served by "
                              f"{'RedisClusterStore' if config.cluster else 'RedisStore'}, not {cls.__name__}")
        return cls(config)

    # -- subclasses: how to build the client --------------------------------------------------------
    def _make_client(self, timeout: float) -> Any:
        """A client whose sockets time out after ``timeout`` (reads and writes get one each)."""
        raise NotImplementedError

    def _direct_pool(self) -> Any:
        """The pool whose connections can serve any key (GETs read directly); None in a cluster."""
        return None

    def _connection_kwargs(self, timeout: float) -> dict[str, Any]:
        c = self.config
        kwargs: dict[str, Any] = {
            "username": c.username or None, "password": c.password or None,
            "socket_timeout": timeout, "socket_connect_timeout": c.connect_timeout,
            "max_connections": c.max_connections, "socket_read_size": _READ_SIZE,
            # Wait for a pooled connection (bounded), instead of failing when all are busy.
            "connection_pool_class": redis.BlockingConnectionPool, "timeout": c.connect_timeout + timeout,
        }
        if c.tls:
            kwargs.update(connection_class=hooks.SSLConnection, ssl_ca_certs=c.ca_certs or None,
                          ssl_cert_reqs="required" if c.tls_verify else "none",
                          ssl_check_hostname=c.tls_verify)
        else:
            kwargs["connection_class"] = hooks.Connection
        return kwargs

    @property
    def _redis(self) -> Any:
        """The client of reads, lookups and deletes (the engine's critical path)."""
        client = self._client
        if client is None:
            client = self._connect("_client", self.config.timeout)
        return client

    @property
    def _redis_writes(self) -> Any:
        """The client of writes: its own connections, ``write_timeout``."""
        client = self._write_client
        if client is None:
            client = self._connect("_write_client", self.config.write_timeout)
        return client

    def _connect(self, attr: str, timeout: float) -> Any:
        with self._client_lock:
            if self._closed:
                raise StoreUnavailableError(f"{self.config.safe_url()} is closed")
            if getattr(self, attr) is None:
                hooks.check_redis_py()
                with self._errors():  # a cluster client asks the nodes for slots right away
                    setattr(self, attr, self._make_client(timeout))
            return getattr(self, attr)

    def _retry(self) -> Retry:
        # Retried at once after a connection error only (a pooled socket may be stale after a
        # server restart); never after a timeout, and never with backoff: a cache answers "miss"
        # rather than wait.
        return Retry(NoBackoff(), self.config.retries, supported_errors=(redis.exceptions.ConnectionError,))

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.DataError:
            raise  # a caller's bug (a value of the wrong type), not an outage
        except redis.exceptions.TimeoutError as exc:
            raise StoreTimeoutError(f"{self.config.safe_url()}: {type(exc).__name__}: {exc}") from exc
        except redis.exceptions.RedisError as exc:
            raise StoreUnavailableError(f"{self.config.safe_url()}: {type(exc).__name__}: {exc}") from exc

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _pipeline(self, commands: Iterable[_Command], *, writes: bool = False) -> list[Any]:
        """Send commands in one pipeline (one batch per node in a cluster); their replies in order."""
        with self._errors():
            pipe = (self._redis_writes if writes else self._redis).pipeline(transaction=False)
            n = 0
            for name, args, kwargs in commands:
                getattr(pipe, name)(*args, **kwargs)
                n += 1
            if n == 0:
                return []
            replies: list[Any] = pipe.execute()
            return replies

    # -- the small contract --------------------------------------------------------------------
    def get(self, key: str) -> Value | None:
        if self._direct_pool() is not None:
            return self.get_many([key])[0]
        with self._errors():
            value: Value | None = self._redis.get(self._key(key))
            return value

    def put(self, key: str, value: Buffer) -> None:
        with self._errors():
            self._redis_writes.set(self._key(key), hooks.wire(value), px=self._px)

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
    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        pool = self._direct_pool() if keys else None
        if pool is None:
            return self._pipeline(("get", (self._key(k),), {}) for k in keys)
        packed_args = [("GET", self._key(k)) for k in keys]
        with self._errors():
            for attempt in range(self.config.retries + 1):  # a pooled socket may be stale
                conn = pool.get_connection()
                try:
                    conn.send_packed_command(conn.pack_commands(packed_args))
                    reader = hooks.DirectReplies(hooks.raw_socket(conn))
                    return [reader.value() for _ in keys]
                except (TimeoutError, redis.exceptions.TimeoutError) as exc:
                    conn.disconnect()  # a frozen server: retrying would only double the wait
                    if isinstance(exc, redis.exceptions.RedisError):
                        raise
                    raise redis.exceptions.TimeoutError(f"{type(exc).__name__}: {exc}") from exc
                except (redis.exceptions.ConnectionError, OSError) as exc:
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
        self._pipeline((("set", (self._key(k), hooks.wire(v)), {"px": px}) for k, v in items), writes=True)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in self._pipeline(("exists", (self._key(k),), {}) for k in keys)]

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(self._pipeline(("delete", (self._key(k),), {}) for k in keys))

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        # STRLEN cannot tell an empty value from a missing key; EXISTS beside it can.
        no_kwargs: dict[str, Any] = {}
        replies = self._pipeline(cmd for k in keys for cmd in (("exists", (self._key(k),), no_kwargs),
                                                                ("strlen", (self._key(k),), no_kwargs)))
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
            clients = [self._client, self._write_client]
            self._client = self._write_client = None
        for client in clients:
            if client is None:
                continue
            try:
                client.close()
                # redis.Redis.close() leaves a pool it was given open; release its sockets now
                # rather than whenever the pool is garbage collected.
                pool = getattr(client, "connection_pool", None)
                if pool is not None:
                    pool.disconnect()
            except redis.exceptions.RedisError:
                pass  # closing a store whose server is gone must not fail

    @property
    def deadline(self) -> float:
        """One read, lookup or delete: a connect and a socket timeout (no retry after a timeout;
        a connection error fails fast, and its one immediate retry is the same bound again)."""
        c = self.config
        return c.connect_timeout + c.timeout

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"store": "redis+cluster" if c.cluster else "redis", "url": c.safe_url(), "prefix": c.prefix,
                "ttl": c.ttl, "max_connections": c.max_connections, "timeout": c.timeout}


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class RedisStore(_RedisStoreBase):
    """One Redis (or Valkey) server over TCP, TLS or a Unix socket."""


    def _make_client(self, timeout: float) -> redis.Redis:
        c = self.config
        kwargs = self._connection_kwargs(timeout)
        pool_class = kwargs.pop("connection_pool_class")
        if c.unix_path:
            kwargs.update(connection_class=hooks.UnixConnection, path=c.unix_path)
        else:
            host, port = c.hosts[0]
            kwargs.update(host=host, port=port)
        kwargs["retry"] = self._retry()
        pool = pool_class(db=c.db, **kwargs)
        return redis.Redis(connection_pool=pool)

    def _direct_pool(self) -> Any:
        return self._redis.connection_pool


class RedisClusterStore(_RedisStoreBase):
    """A Redis Cluster: keys hash to slots on several primaries; batches go one per node."""


    def _make_client(self, timeout: float) -> redis.cluster.RedisCluster:
        c = self.config
        kwargs = self._connection_kwargs(timeout)
        (host, port), *others = c.hosts
        # ``url=`` makes redis-py build node pools from these kwargs as given, so our connection
        # class (and its packer) is used; credentials and TLS stay in kwargs, not in the URL.
        return redis.cluster.RedisCluster(
            url=f"redis://{host}:{port}",
            # redis-py leaves ClusterNode.__init__ unannotated.
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in others],  # type: ignore[no-untyped-call]
            retry=self._retry(),
            **kwargs,
        )
