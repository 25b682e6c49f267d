"""``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://`` stores on redis-py + hiredis.

One implementation serves a single server and a cluster: ``_RedisStoreBase`` holds every
operation and talks to whichever client ``_make_client`` builds (``redis.Redis`` or
``redis.cluster.RedisCluster``). Both clients pipeline the same way; a cluster pipeline groups
commands by node and sends one batch per node, so batch operations and ``longest_prefix`` cost
one round trip per node involved. Keys are spread over slots by their own hash (no hash tags).

Large values go out without being copied (a record's header and payload are sent as separate
pieces) and GET replies are received straight into buffers of their final size: leased pool
buffers for ``get_into`` (``hooks``: the parts of redis-py this relies on). A batch of large
values is spread over ``connections`` connections (a cluster's over every node it touches at
once, the connections shared out over them), each sent and read by its own thread with the GIL
released in the socket calls; ``get_into`` yields value i while values after it are still
arriving, and ``put_many`` sends value i while its caller produces value i+1. GETs go out in
waves under one budget per batch (about 64 MiB of replies requested ahead, whatever the number
of connections: ``waves.py``), so the server never builds a whole batch of large replies before
sending the first.

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

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.buffers import BufferPool, Lease, Pieces, borrow
from kvstore.config import redact_url
from kvstore.errors import ConfigError, StoreTimeoutError, StoreUnavailableError
from kvstore.stores.base import LeaseStream, Store, Value, WriteValue
from kvstore.stores.redis import hooks
from kvstore.stores.redis.config import MAX_SPREAD, RedisConfig
from kvstore.stores.redis.waves import Cancelled, Waves
from kvstore.types import array_view

__all__ = ["RedisStore", "RedisClusterStore"]

log = logging.getLogger("kvstore.stores")

_SCAN_COUNT = 1000
# redis-py reads replies in socket_read_size pieces (64 KiB by default) and feeds each to
# hiredis; 1 MiB pieces halve the cost of multi-MiB GETs.
_READ_SIZE = 1 << 20

_LEASE_WAIT = 0.05  # a reader waits this long for a pool buffer, then receives into a fresh one
_IN_FLIGHT_BYTES = 64 << 20  # a batch of GETs keeps about this much of its replies requested ahead (Waves)

#: A pipelined command: the client method's name, its arguments and its keyword arguments.
_Command = tuple[str, tuple[Any, ...], dict[str, Any]]
_TIMEOUTS = (TimeoutError, redis.exceptions.TimeoutError)  # a frozen server: never retried
_NETWORK_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def _as_redis_error(exc: BaseException) -> BaseException:
    """A socket error of our direct I/O as the redis-py error ``_errors`` maps (others as they are)."""
    if isinstance(exc, redis.exceptions.RedisError) or not isinstance(exc, OSError):
        return exc
    kind = redis.exceptions.TimeoutError if isinstance(exc, TimeoutError) else redis.exceptions.ConnectionError
    error = kind(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _redirected(exc: BaseException) -> bool:
    """A cluster's answer that the key's slot is served elsewhere (MOVED, ASK)."""
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(("MOVED ", "ASK "))


class _Slot:
    """One value of a ``get_into`` batch, filled by a reader thread."""

    __slots__ = ("done", "error", "lease")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.lease: Lease | None = None
        self.error: BaseException | None = None


class _Sender:
    """One connection's share of a streamed write batch: its queue of ``(item, packed command)``
    (None ends it), the bytes given to it so far, and whether it has finished."""

    __slots__ = ("done", "loaded", "pool", "work")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.work: queue.Queue[tuple[tuple[str, WriteValue], list[Any]] | None] = queue.Queue(maxsize=1)
        self.loaded = 0
        self.done = threading.Event()


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
        #: Connections (and threads) one batch of large values is spread over.
        self._spread = min(config.connections, config.max_connections)
        self._reply_size = 0  # the largest value of the last get_into: the next one's first wave
        self._executors: dict[bool, ThreadPoolExecutor] = {}  # reads' and writes' threads (writes=True)
        self._streaming = threading.Lock()  # held by the one write batch whose senders run

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

    def _direct_pool(self, *, writes: bool = False) -> Any:
        """The pool (of the read or the write client) whose connections can serve any key, for
        direct I/O; None in a cluster."""
        return None

    def _write_threads(self) -> int:
        """Sender threads a write batch may need at once (``put_many``)."""
        return self._spread

    def _rerouted(self, client: Any) -> None:
        """Learn where keys live after a server redirected one (a cluster's moved slot):
        ``client`` is the redis-py client or pipeline that was told."""

    def _direct_reads(self, keys: Sequence[str]) -> list[tuple[Any, list[int]]] | None:
        """Where direct reads of ``keys`` go: ``(connection pool, indices of the keys it
        serves)`` per server, or None where only the client's pipeline can."""
        pool = self._direct_pool()
        return None if pool is None else [(pool, list(range(len(keys))))]

    #: Threads of direct reads beyond the spread, created only as needed: enough that a batch's
    #: reader never queues behind another batch's (a batch's readers wait on each other's
    #: progress through ``Waves``), and that a cluster reads every node of a batch at once.
    _READ_THREADS = 4 * MAX_SPREAD

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
            return self._execute(pipe)

    def _execute(self, pipe: Any) -> list[Any]:
        replies: list[Any] = pipe.execute()
        return replies

    # -- direct socket I/O (a single server) -----------------------------------------------------
    def _threads(self, *, writes: bool = False) -> ThreadPoolExecutor:
        """Threads of direct I/O, one set for reads and one for writes: a long background save
        never queues an engine's load behind its senders."""
        executor = self._executors.get(writes)
        if executor is None:
            with self._client_lock:
                if self._closed:
                    raise StoreUnavailableError(f"{self.config.safe_url()} is closed")
                executor = self._executors.get(writes)
                if executor is None:
                    executor = self._executors[writes] = ThreadPoolExecutor(
                        self._write_threads() if writes else self._spread + self._READ_THREADS,
                        thread_name_prefix=f"kvstore-redis-{'w' if writes else 'r'}")
        return executor

    def _exchange(self, pool: Any, commands: Sequence[list[Any]],
                  on_reply: Callable[[hooks.DirectReplies, int], int], waves: Waves | None = None,
                  share: Sequence[int] | None = None) -> None:
        """Send the commands ``share`` (indices into ``commands``, packed; all of them by
        default) on one pooled connection and hand reply i to ``on_reply(reader, i)``, which
        returns the reply's size in bytes.

        Without ``waves`` every command goes out at once. With it (GETs of values of any size),
        command i goes out once ``waves`` lets value i be requested: several connections, each
        with its own share, can run one batch under one budget (``waves.py`` says why).

        A connection error before the first reply retries on a fresh connection (a pooled socket
        may be stale after a server restart), resending what the failed one was asked; a timeout
        never retries (a frozen server would only double the wait); a connection left
        mid-stream is dropped, never reused."""
        order = list(range(len(commands))) if share is None else list(share)
        waves = waves or Waves(len(commands), None)
        sent = answered = 0  # positions in order
        for attempt in range(self.config.retries + 1):
            conn = pool.get_connection()
            try:
                sock = hooks.raw_socket(conn)
                if sent > answered:  # a retry: what the failed connection was asked
                    hooks.send_all(sock, [b for i in order[answered:sent] for b in commands[i]])
                reader = hooks.DirectReplies(sock)
                while answered < len(order):
                    idle = sent == answered
                    limit = waves.frontier(order[sent] if idle else None)
                    more = sent
                    while more < len(order) and order[more] < limit:
                        more += 1
                    if more > sent:
                        hooks.send_all(sock, [b for i in order[sent:more] for b in commands[i]])
                        sent = more
                    waves.received(on_reply(reader, order[answered]))
                    answered += 1
                return
            except _NETWORK_ERRORS as exc:
                conn.disconnect()
                if answered or attempt == self.config.retries or isinstance(exc, _TIMEOUTS):
                    raise _as_redis_error(exc) from exc
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)

    def _set_command(self, key: str, value: WriteValue) -> list[Any]:
        args: list[Any] = ["SET", self._key(key), value if isinstance(value, Pieces) else hooks.wire(value)]
        if self._px:
            args += ["PX", self._px]
        return hooks.pack_command(*args)

    # -- the small contract --------------------------------------------------------------------
    def get(self, key: str) -> Value | None:
        if self._direct_pool() is not None:
            return self.get_many([key])[0]
        with self._errors():
            value: Value | None = self._redis.get(self._key(key))
            return value

    def put(self, key: str, value: WriteValue) -> None:
        self.put_many([(key, value)])

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

    # -- batch forms: one pipeline each (several connections for large values) --------------------
    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        pool = self._direct_pool() if keys else None
        if pool is None:
            return self._pipeline(("get", (self._key(k),), {}) for k in keys)
        out: list[Value | None] = [None] * len(keys)

        def on_reply(reader: hooks.DirectReplies, i: int) -> int:
            value = out[i] = reader.value()
            return 0 if value is None else len(value)

        with self._errors():
            self._exchange(pool, [hooks.pack_command("GET", self._key(k)) for k in keys], on_reply,
                           Waves(len(keys), _IN_FLIGHT_BYTES))
        return out

    def get_into(self, keys: Sequence[str], pool: BufferPool) -> LeaseStream:
        """Values received straight into leases of ``pool`` over ``connections`` connections per
        server (on a cluster: to every node of the batch at once), under one ``Waves`` budget of
        about ``_IN_FLIGHT_BYTES`` requested ahead per server; value i is yielded while later
        ones are still arriving. A cluster whose slots moved under a batch finishes it through the
        client's pipeline, which follows the redirections."""
        routes = self._direct_reads(keys) if keys else None
        if routes is None:
            yield from super().get_into(keys, pool)
            return
        done = yield from self._get_into_direct(keys, routes, pool)
        if done < len(keys):  # the pipeline, told MOVED too, relearns the slots' homes
            yield from super().get_into(keys[done:], pool)

    def _get_into_direct(self, keys: Sequence[str], routes: list[tuple[Any, list[int]]],
                         pool: BufferPool) -> Generator[Lease | None, None, int]:
        """The direct part of ``get_into``; returns how many values it yielded (all of them
        unless a key was redirected)."""
        slots = [_Slot() for _ in keys]
        commands = [hooks.pack_command("GET", self._key(k)) for k in keys]
        per_server = max(1, self._spread // len(routes))
        readers = [(direct, share[r::n]) for direct, share in routes
                   for n in [max(1, min(per_server, len(share)))] for r in range(n)]
        # One budget per server: each builds only its own replies (a cluster's keys spread over
        # its nodes evenly, by hash slot), so the silence a socket can see stays that of one.
        waves = Waves(len(keys), _IN_FLIGHT_BYTES * len(routes), self._reply_size, len(readers))
        futures: list[Future[None]] = []
        try:
            threads = self._threads()
            for direct, share in readers:
                futures.append(threads.submit(self._read_into, direct, commands, share, slots, pool, waves))
            for i, slot in enumerate(slots):
                slot.done.wait()
                if slot.error is not None:
                    if _redirected(slot.error):
                        return i
                    with self._errors():
                        raise slot.error
                lease, slot.lease = slot.lease, None
                yield lease
            return len(keys)
        finally:
            waves.cancel()
            for fut in futures:
                fut.exception()  # wait: a reader must stop before its slots are released
            self._reply_size = waves.size  # a store's records are mostly of one size
            for slot in slots:
                if slot.lease is not None:
                    slot.lease.release()
                    slot.lease = None

    def _read_into(self, direct: Any, commands: list[list[Any]], share: Sequence[int], slots: list[_Slot],
                   pool: BufferPool, waves: Waves) -> None:
        """One connection's share of a ``get_into`` batch. A failure ends the whole batch: every
        slot not yet filled gets the error (the consumer raises it at the first such value)."""
        def on_reply(reader: hooks.DirectReplies, i: int) -> int:
            leased: list[Lease] = []

            def into(size: int) -> memoryview:
                lease = pool.lease(size, wait=_LEASE_WAIT) or borrow(array_view(np.empty(size, np.uint8)))
                leased.append(lease)
                return lease.view

            try:
                view = reader.value(into, hashed=True)
            except BaseException:
                for lease in leased:
                    lease.release()
                raise
            slot = slots[i]
            slot.lease = leased[0] if view is not None else None
            if slot.lease is not None:
                slot.lease.digest = reader.digest
            slot.done.set()
            return 0 if view is None else len(view)

        try:
            self._exchange(direct, commands, on_reply, waves, share)
        except Cancelled:
            pass  # abandoned by the consumer, or another reader failed and filled the slots
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer through the slots
            waves.cancel()
            for slot in slots:
                if not slot.done.is_set():
                    slot.error = exc
                    slot.done.set()

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        """SETs over direct sockets (a cluster's go to each key's node). ``items`` is consumed
        lazily: each value is sent by one of the sender threads as soon as the iterable produces
        it, so a caller that encodes value i+1 in its generator does so while value i is on the
        wire. A single server's batch is spread over ``connections`` connections, a cluster's
        over every node it touches at once (``connections`` shared out over the nodes, at least
        one each), and each value goes to the sender of its server with the fewest bytes so far,
        so the bytes split evenly (as a read's keys do). A value a cluster node redirects (its
        slot moved) is sent again through the client's pipeline, which follows the redirection.
        Writes use the write client's connections and threads; one batch at a time streams."""
        it = iter(items)
        head = [item for item in (next(it, None), next(it, None)) if item is not None]
        if not head:
            return
        with self._errors():
            routes = self._write_routes()
            one = self._direct_pool(writes=True)
            if routes is not None and len(head) == 2 and (self._spread > 1 or one is None):
                with self._streaming:  # one batch's senders at a time: they need every thread at once
                    self._send_streamed(routes, itertools.chain(head, it))
            elif one is not None:
                self._send_here(one, [*head, *it])
            else:
                self._put_pipelined([*head, *it])

    def _write_routes(self) -> tuple[Callable[[str], Any], int] | None:
        """Where direct writes go: a function from a key to the write client's connection pool
        of its server (None where it cannot tell now), and how many servers there are; None
        where only the client's pipeline can write."""
        pool = self._direct_pool(writes=True)
        return None if pool is None else ((lambda _key: pool), 1)

    def _put_pipelined(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        """SETs through the write client's pipeline (a cluster's follows redirections)."""
        px = self._px
        self._pipeline((("set", (self._key(k), v if isinstance(v, Pieces) else hooks.wire(v)), {"px": px})
                        for k, v in items), writes=True)

    def _send_here(self, pool: Any, batch: list[tuple[str, WriteValue]]) -> None:
        """SETs of ``batch`` from this thread, on one connection."""
        def on_reply(reader: hooks.DirectReplies, _: int) -> int:
            reader.status()
            return 0

        if batch:
            self._exchange(pool, [self._set_command(*item) for item in batch], on_reply)

    def _send_streamed(self, routes: tuple[Callable[[str], Any], int],
                       items: Iterator[tuple[str, WriteValue]]) -> None:
        """SETs of ``items`` by sender threads, each value queued as soon as ``items`` yields it
        (``put_many``). Values whose server has no sender (no route now, or no thread could be
        started: at interpreter exit executors refuse work before ``atexit`` hooks run, and the
        last background writes must still go out) and values a node redirected go through the
        client's pipeline from this thread afterwards. The caller holds ``_streaming``: a batch
        whose senders could not all run at once would wait forever on one that never starts."""
        route, servers = routes
        per_server = max(1, self._spread // servers)
        senders: dict[int, list[_Sender]] = {}  # by id() of their server's pool
        redirected: list[tuple[str, WriteValue]] = []  # told MOVED or ASK
        here: list[tuple[str, WriteValue]] = []  # no sender: from this thread
        failed: list[BaseException] = []
        try:
            for item in items:
                if failed:
                    break  # the batch fails anyway: stop encoding it
                pool = route(item[0])
                group = None if pool is None else senders.get(id(pool))
                if group is None and pool is not None:
                    group = senders[id(pool)] = self._start_senders(pool, per_server, redirected, failed)
                if not group:
                    here.append(item)
                    continue
                # Each value to its server's sender with the fewest bytes so far. Senders taking
                # values as they ask would split the bytes by who asks first: a send returns once
                # the value is in the kernel's buffers, long before a capped link has carried
                # it (benchmarks/results/datapath.md, "Writes split by bytes").
                least = min(group, key=lambda s: s.loaded)
                packed = self._set_command(*item)
                least.loaded += sum(len(part) for part in packed)
                least.work.put((item, packed))
        finally:
            every = [sender for group in senders.values() for sender in group]
            for sender in every:
                sender.work.put(None)
            for sender in every:
                sender.done.wait()
        if failed:
            raise _as_redis_error(failed[0])
        if redirected:
            self._rerouted(self._redis_writes)
        if redirected or here:
            self._put_pipelined([*redirected, *here])

    def _start_senders(self, pool: Any, n: int, redirected: list[tuple[str, WriteValue]],
                       failed: list[BaseException]) -> list[_Sender]:
        """Up to ``n`` senders on ``pool``'s connections, running; fewer (maybe none) if the
        executor refuses work."""
        executor = self._threads(writes=True)
        started: list[_Sender] = []
        for _ in range(n):
            sender = _Sender(pool)
            try:
                executor.submit(self._sender, sender, redirected, failed)
            except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
                break
            started.append(sender)
        return started

    def _sender(self, sender: _Sender, redirected: list[tuple[str, WriteValue]],
                failed: list[BaseException]) -> None:
        """One connection's share of a streamed write batch: sends each command as it is queued,
        then reads the replies; a value its node redirected goes to ``redirected``. A connection
        error retries on a fresh connection, resending what the failed one had (a SET may land
        twice, to the same effect); a timeout never retries. A failure stops the batch
        (``failed``)."""
        pool, work = sender.pool, sender.work
        sent: list[tuple[tuple[str, WriteValue], list[Any]]] = []
        done = False  # every command taken from the queue (our end marker seen)
        try:
            for attempt in range(self.config.retries + 1):
                conn = None
                try:
                    conn = pool.get_connection()
                    sock = hooks.raw_socket(conn)
                    for _, packed in sent:  # a retry resends what the failed connection had
                        hooks.send_all(sock, packed)
                    while not done:
                        taken = work.get()
                        if taken is None:
                            done = True
                        elif not failed:
                            sent.append(taken)
                            hooks.send_all(sock, taken[1])
                    reader = hooks.DirectReplies(sock)
                    moved = []
                    for item, _ in sent:
                        try:
                            reader.status()
                        except redis.exceptions.ResponseError as exc:
                            if not _redirected(exc):
                                raise
                            moved.append(item)
                    redirected.extend(moved)
                    return
                except BaseException as exc:  # noqa: BLE001 - handed to the producer through ``failed``
                    if conn is not None:
                        conn.disconnect()
                    retry = (isinstance(exc, _NETWORK_ERRORS) and not isinstance(exc, _TIMEOUTS)
                             and attempt < self.config.retries and not failed)
                    if not retry:
                        failed.append(exc)
                        while not done:  # keep draining: the producer must never block on a dead sender
                            done = work.get() is None
                        return
                finally:
                    if conn is not None:
                        pool.release(conn)
        finally:
            sender.done.set()

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
            executors = list(self._executors.values())
            self._executors.clear()
        for executor in executors:
            executor.shutdown(wait=True)
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

    def _direct_pool(self, *, writes: bool = False) -> Any:
        return (self._redis_writes if writes else self._redis).connection_pool


class RedisClusterStore(_RedisStoreBase):
    """A Redis Cluster: keys hash to slots on several primaries; batches go one per node, and
    ``get_into`` reads every node of a batch at once."""

    def _direct_reads(self, keys: Sequence[str]) -> list[tuple[Any, list[int]]] | None:
        client = self._redis
        by_node: dict[str, tuple[Any, list[int]]] = {}
        try:
            for i, key in enumerate(keys):
                node = client.get_node_from_key(self._key(key))
                by_node.setdefault(node.name, (node, []))[1].append(i)
            if len(by_node) > MAX_SPREAD:
                return None  # more nodes than one batch reads at once: the pipeline visits them
            return [(client.get_redis_connection(node).connection_pool, share) for node, share in by_node.values()]
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
            return None  # e.g. a slot not covered now: the pipeline says what is wrong

    def _write_threads(self) -> int:
        return MAX_SPREAD  # at least one sender per node a batch touches

    def _write_routes(self) -> tuple[Callable[[str], Any], int] | None:
        client = self._redis_writes
        primaries = len(client.get_primaries())
        if not 0 < primaries <= MAX_SPREAD:
            return None  # more nodes than one batch writes at once: the pipeline visits them

        def route(key: str) -> Any:
            try:
                return client.get_redis_connection(client.get_node_from_key(self._key(key))).connection_pool
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
                return None  # e.g. a slot not covered now: the pipeline says what is wrong

        return route, primaries

    def _execute(self, pipe: Any) -> list[Any]:
        """The pipeline's replies, a failed command raising. A timeout ends the batch: one
        deadline. (redis-py's own ``execute`` would then resend every command that failed one by
        one, a deadline each against a frozen node, and retry timeouts as if they were lost
        connections.) Only a moved slot runs the batch again: after refreshing the slot map,
        following the redirections."""
        stack = hooks.cluster_pipeline_commands(pipe)
        try:
            replies: list[Any] = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
            if any(isinstance(r, (redis.exceptions.MovedError, redis.exceptions.AskError)) for r in replies):
                self._rerouted(pipe)
                replies = pipe.send_cluster_commands(stack, raise_on_error=False)
        finally:
            pipe.reset()
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _rerouted(self, client: Any) -> None:
        """Learn the slots' new homes (best effort: the batch that was told MOVED then follows
        the redirections itself)."""
        try:
            client.nodes_manager.initialize()
        except Exception as exc:  # noqa: BLE001 - an outage shows in the next call, not here
            log.debug("refreshing the cluster's slots failed: %s", exc)


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
