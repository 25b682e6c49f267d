"""What the Redis and Redis Cluster stores share: ``RedisStoreBase`` holds every operation and
talks to whichever client a subclass's ``_make_client`` builds (``redis.Redis`` in ``single``,
``redis.cluster.RedisCluster`` in ``cluster``). Both clients pipeline the same way; a cluster
pipeline groups commands by node and sends one batch per node, so batch operations and
``longest_prefix`` cost one round trip per node involved. Keys are spread over slots by their
own hash (no hash tags).

Large values go out without being copied and GET replies are received straight into buffers of
their final size, over direct sockets (``direct``). A batch of large values is spread over up
to ``connections`` connections per server, as many as the batches before it showed pay for
themselves (``spread.py``; a cluster's over every node it touches at once, the connections
shared out over them). A batch on one connection is sent or read on the caller's thread; a
wider one by a thread per connection, with the GIL released in the socket calls.
``get_into`` yields value i while values after it are still arriving (the kernel receives
them meanwhile on one connection), and a wider ``put_many`` sends value i while its caller
produces value i+1. GETs go out in waves under one
budget per server of a batch (about 8 MiB of replies requested ahead, at least two values and one
per connection, at most 64 MiB, whatever the number of connections: ``waves.py``), so a server
never builds a whole batch of large replies before sending the first, and builds the next ones
while they still fit its CPU's cache. On one server, batches of EXISTS and DEL (lookups,
discards) go over a direct socket too, as one packed buffer whose integer replies are read in
place.

Errors: every redis-py error (refused, timed out, cluster down or unreachable, OOM...), the
cluster client's ``RedisClusterException`` family included, becomes
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
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.buffers import BufferPool, Lease, Pieces
from kvstore.config import redact_url
from kvstore.errors import ConfigError, StoreTimeoutError, StoreUnavailableError
from kvstore.stores.base import Head, LeaseStream, Place, Store, Value, WriteValue, check_head_bytes
from kvstore.stores.redis import hooks
from kvstore.stores.redis.config import MAX_SPREAD, RedisConfig
from kvstore.stores.redis.direct import (
    Sender,
    Slot,
    as_redis_error,
    exchange,
    is_redirect,
    read_here,
    read_into,
    run_sender,
)
from kvstore.stores.redis.spread import Spread
from kvstore.stores.redis.waves import Waves

_SCAN_COUNT = 1000
# redis-py reads replies in socket_read_size pieces (64 KiB by default) and feeds each to
# hiredis; 1 MiB pieces halve the cost of multi-MiB GETs.
_READ_SIZE = 1 << 20

# A batch of GETs keeps about this much of its replies requested ahead per server, and at most
# the limit (Waves: what the server builds in its CPU's cache, and the silence a socket may see).
_IN_FLIGHT_BYTES = 8 << 20
_IN_FLIGHT_LIMIT = 64 << 20

#: What ``_errors`` turns into ``StoreUnavailableError``. The cluster client's own family
#: (``RedisClusterException``: no startup node reachable, a slot no node serves, slots not all
#: covered) is not a ``RedisError`` in redis-py 7 and later; this store sends no command that
#: could raise one of its deterministic members (cross-slot transactions, unsupported methods).
_OUTAGES = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)

#: A pipelined command: the client method's name, its arguments and its keyword arguments.
_Command = tuple[str, tuple[Any, ...], dict[str, Any]]


class RedisStoreBase(Store):
    """Every Redis operation, over whichever redis-py client ``_make_client`` returns."""

    is_local = False
    Config = RedisConfig
    #: Whether this class serves ``redis+cluster://`` URLs (``from_url`` refuses the others).
    _cluster: ClassVar[bool] = False

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
        #: Connections per server of the next write and read batch: up to ``_spread``, learned (spread.py).
        self._write_spread = Spread(self._spread, adaptive=config.adapt_writes)
        self._read_spread = Spread(self._spread, adaptive=config.adapt_reads)
        self._reply_size = 0  # the largest value of the last get_into: the next one's first wave
        self._executors: dict[bool, ThreadPoolExecutor] = {}  # reads' and writes' threads (writes=True)
        self._streaming = threading.Lock()  # held by the one write batch whose senders run

    @classmethod
    def from_url(cls, url: str) -> RedisStoreBase:
        config = RedisConfig.from_url(url)
        if config.cluster != cls._cluster:
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
        except _OUTAGES as exc:
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
            exchange(pool, [hooks.pack_command("GET", self._key(k)) for k in keys], on_reply, self.config.retries,
                     Waves(len(keys), _IN_FLIGHT_BYTES, limit=_IN_FLIGHT_LIMIT))
        return out

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """Values received straight into leases of ``pool`` over up to ``connections`` connections
        per server, as many as pay for themselves (``adapt_reads``, ``spread.py``; on a cluster:
        to every node of the batch at once), under a ``Waves`` budget per server of about
        ``_IN_FLIGHT_BYTES`` requested ahead (``_IN_FLIGHT_LIMIT`` at most); value i
        is yielded while later ones are still arriving. A cluster whose slots moved under a batch
        finishes it through the client's pipeline, which follows the redirections. The direct readers land values where
        ``place`` says (the store contract), the pipeline's in their leases."""
        routes = self._direct_reads(keys) if keys else None
        if routes is None:
            yield from super().get_into(keys, pool)
            return
        done = yield from self._get_into_direct(keys, routes, pool, place)
        if done < len(keys):  # the pipeline, told MOVED too, relearns the slots' homes
            yield from super().get_into(keys[done:], pool)

    def _get_into_direct(self, keys: Sequence[str], routes: list[tuple[Any, list[int]]],
                         pool: BufferPool, place: Place | None) -> Generator[Lease | None, None, int]:
        """The direct part of ``get_into``; returns how many values it yielded (all of them
        unless a key was redirected). A batch on one connection is read on this thread, each
        value when the caller asks for it (the kernel receives the next meanwhile); a wider one
        by a reader thread per connection."""
        commands = [hooks.pack_command("GET", self._key(k)) for k in keys]
        per_server = self._read_spread.width(max(1, self._spread // len(routes)))
        # One budget per server, over its own keys: each builds only its own replies, so the
        # silence a socket can see stays that of one, and each keeps its next value in flight
        # whatever the order of the batch's keys across servers (waves.py).
        readers: list[tuple[Any, list[int], Waves]] = []
        for direct, share in routes:
            n = max(1, min(per_server, len(share)))
            waves = Waves(len(keys), _IN_FLIGHT_BYTES, self._reply_size, n, limit=_IN_FLIGHT_LIMIT, indices=share)
            readers += [(direct, share[r::n], waves) for r in range(n)]
        every = list({id(w): w for _, _, w in readers}.values())
        if len(readers) == 1:
            values = read_here(*readers[0], commands, pool, self.config.retries, place)
        else:
            values = self._read_by_threads(readers, commands, pool, every, place)
        done = nbytes = 0
        start = time.perf_counter()
        try:
            for lease in values:
                done += 1
                nbytes += 0 if lease is None else len(lease)
                if done == len(keys):  # a caller that zips the keys with the values stops here
                    self._read_spread.measured(per_server, done, nbytes, time.perf_counter() - start)
                yield lease
        except Exception as exc:
            if is_redirect(exc):
                return done
            with self._errors():
                raise
        finally:
            values.close()
            self._reply_size = max(w.size for w in every)  # a store's records are mostly of one size
        return len(keys)

    def _read_by_threads(self, readers: list[tuple[Any, list[int], Waves]], commands: list[list[Any]],
                         pool: BufferPool, every: list[Waves],
                         place: Place | None) -> Generator[Lease | None, None, None]:
        """A ``get_into`` batch read by one thread per ``(pool, share)`` reader: the values in
        order, each as soon as it has arrived; a reader's error is raised at the first value it
        did not deliver."""
        slots = [Slot() for _ in commands]
        futures: list[Future[None]] = []
        try:
            threads = self._threads()
            for direct, share, waves in readers:
                futures.append(threads.submit(read_into, direct, commands, share, slots, pool, every, waves,
                                              self.config.retries, place))
            for slot in slots:
                slot.done.wait()
                if slot.error is not None:
                    raise slot.error
                lease, slot.lease = slot.lease, None
                yield lease
        finally:
            for waves in every:
                waves.cancel()
            for fut in futures:
                fut.exception()  # wait: a reader must stop before its slots are released
            for slot in slots:
                if slot.lease is not None:
                    slot.lease.release()
                    slot.lease = None

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        """SETs over direct sockets (a cluster's go to each key's node). A single server's batch
        is spread over up to ``connections`` connections, as many as pay for themselves
        (``adapt_writes``, ``spread.py``); a cluster's over every node it touches at once
        (``connections`` shared out over the nodes, at least one each). A batch on one
        connection is sent from this thread. Otherwise ``items`` is consumed lazily: each value
        is sent by a sender thread as soon as the iterable produces it, so a caller that encodes
        value i+1 in its generator does so while value i is on the wire, and each value goes to
        the sender of its server with the fewest bytes so far, so the bytes split evenly (as a
        read's keys do). A value a cluster node redirects (its slot moved) is sent again through
        the client's pipeline, which follows the redirection. Writes use the write client's
        connections and threads; one batch at a time streams."""
        sent = [0, 0]  # values taken from ``items`` so far, and their bytes

        def tallied() -> Iterator[tuple[str, WriteValue]]:
            for key, value in items:
                sent[0] += 1
                sent[1] += len(value) if isinstance(value, Pieces) else memoryview(value).nbytes
                yield key, value

        it = tallied()
        head = [item for item in (next(it, None), next(it, None)) if item is not None]
        if not head:
            return
        with self._errors():
            routes = self._write_routes()
            one = self._direct_pool(writes=True)
            width = self._write_spread.width(self._spread // routes[1] if routes is not None else 1)
            if routes is not None and len(head) == 2 and (width > 1 or one is None):
                with self._streaming:  # one batch's senders at a time: they need every thread at once
                    start = time.perf_counter()
                    self._send_streamed(routes[0], itertools.chain(head, it), width)
            elif one is not None:
                start, width = time.perf_counter(), 1
                self._send_here(one, [*head, *it])
            else:
                self._put_pipelined([*head, *it])
                return
        self._write_spread.measured(width, sent[0], sent[1], time.perf_counter() - start)

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
            exchange(pool, [self._set_command(*item) for item in batch], on_reply, self.config.retries)

    def _send_streamed(self, route: Callable[[str], Any], items: Iterator[tuple[str, WriteValue]],
                       per_server: int) -> None:
        """SETs of ``items`` by ``per_server`` sender threads per server, each value queued as
        soon as ``items`` yields it (``put_many``). Values whose server has no sender (no route
        now, or no thread could be started: at interpreter exit executors refuse work before
        ``atexit`` hooks run, and the last background writes must still go out) and values a
        node redirected go through the client's pipeline from this thread afterwards. The
        caller holds ``_streaming``: a batch whose senders could not all run at once would wait
        forever on one that never starts. ``route`` maps a key to its server's pool
        (``_write_routes``)."""
        senders: dict[int, list[Sender]] = {}  # by id() of their server's pool
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
            raise as_redis_error(failed[0])
        if redirected:
            self._rerouted(self._redis_writes)
        if redirected or here:
            self._put_pipelined([*redirected, *here])

    def _start_senders(self, pool: Any, n: int, redirected: list[tuple[str, WriteValue]],
                       failed: list[BaseException]) -> list[Sender]:
        """Up to ``n`` senders on ``pool``'s connections, running; fewer (maybe none) if the
        executor refuses work."""
        executor = self._threads(writes=True)
        started: list[Sender] = []
        for _ in range(n):
            sender = Sender(pool)
            try:
                executor.submit(run_sender, sender, redirected, failed, self.config.retries)
            except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
                break
            started.append(sender)
        return started

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [n > 0 for n in self._integers("EXISTS", "exists", keys)]

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(self._integers("DEL", "delete", keys))

    def _integers(self, command: str, method: str, keys: Sequence[str]) -> list[int]:
        """``command key`` for each of ``keys``, pipelined, and the integer replies in order: over
        a direct socket where one connection serves every key (no per-command Python of
        redis-py's pipeline), else through the client's pipeline (``method``: a cluster's
        follows each slot to its node)."""
        pool = self._direct_pool() if keys else None
        if pool is None:
            return [int(n) for n in self._pipeline((method, (self._key(k),), {}) for k in keys)]
        out: list[int] = []

        def on_reply(reader: hooks.DirectReplies, _: int) -> int:
            out[:] = reader.integers(len(keys))
            return 0

        # The whole batch as one "command" (send_all joins its small pieces): sent at once, retried whole.
        batch = [piece for k in keys for piece in hooks.pack_command(command, self._key(k))]
        with self._errors():
            exchange(pool, [batch], on_reply, self.config.retries)
        return out

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        # STRLEN cannot tell an empty value from a missing key; EXISTS beside it can.
        no_kwargs: dict[str, Any] = {}
        replies = self._pipeline(cmd for k in keys for cmd in (("exists", (self._key(k),), no_kwargs),
                                                                ("strlen", (self._key(k),), no_kwargs)))
        return [int(replies[i + 1]) if replies[i] else None for i in range(0, len(replies), 2)]

    def get_heads(self, keys: Sequence[str], nbytes: int) -> list[Head | None]:
        """EXISTS, STRLEN and GETRANGE per key in one pipeline (one round trip, one per node in a
        cluster)."""
        check_head_bytes(nbytes)
        no_kwargs: dict[str, Any] = {}
        replies = self._pipeline(cmd for k in keys for cmd in (("exists", (self._key(k),), no_kwargs),
                                                                ("strlen", (self._key(k),), no_kwargs),
                                                                ("getrange", (self._key(k), 0, nbytes - 1), no_kwargs)))
        return [(int(replies[i + 1]), bytes(replies[i + 2])) if replies[i] else None
                for i in range(0, len(replies), 3)]

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
                "ttl": c.ttl, "max_connections": c.max_connections, "timeout": c.timeout,
                "write_connections": self._write_spread.current, "read_connections": self._read_spread.current}



def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
