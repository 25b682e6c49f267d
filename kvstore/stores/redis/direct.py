"""Direct socket I/O on one pooled connection of a Redis server, beside redis-py's pipeline.

Large values go out without being copied (a record's header and payload are sent as separate
pieces) and GET replies are received straight into buffers of their final size: leased pool
buffers for ``get_into`` (``hooks``: the parts of redis-py this relies on). ``exchange`` sends a
share of a batch's packed commands on one connection and reads their replies, in waves under
their server's budget when ``Waves`` says so; ``read_into`` is one reader thread of a ``get_into`` batch
and ``run_sender`` one sender thread of a streamed ``put_many``. A command is retried on a
fresh connection after a connection error only (a stale pooled socket), never after a timeout.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import redis

from kvstore.buffers import BufferPool, Lease, lease_or_fresh
from kvstore.stores.base import Place, WriteValue
from kvstore.stores.redis import hooks
from kvstore.stores.redis.waves import Cancelled, Waves

_LEASE_WAIT = 0.05  # a reader waits this long for a pool buffer, then receives into a fresh one
_TIMEOUTS = (TimeoutError, redis.exceptions.TimeoutError)  # a frozen server: never retried
_NETWORK_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def as_redis_error(exc: BaseException) -> BaseException:
    """A socket error of our direct I/O as the redis-py error the store's ``_errors`` maps (others as they are)."""
    if isinstance(exc, redis.exceptions.RedisError) or not isinstance(exc, OSError):
        return exc
    kind = redis.exceptions.TimeoutError if isinstance(exc, TimeoutError) else redis.exceptions.ConnectionError
    error = kind(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def is_redirect(exc: BaseException) -> bool:
    """A cluster's answer that the key's slot is served elsewhere (MOVED, ASK)."""
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(("MOVED ", "ASK "))


class Slot:
    """One value of a ``get_into`` batch, filled by a reader thread."""

    __slots__ = ("done", "error", "lease")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.lease: Lease | None = None
        self.error: BaseException | None = None


class Sender:
    """One connection's share of a streamed write batch: its queue of ``(item, packed command)``
    (None ends it), the bytes given to it so far, and whether it has finished."""

    __slots__ = ("done", "loaded", "pool", "work")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.work: queue.Queue[tuple[tuple[str, WriteValue], list[Any]] | None] = queue.Queue(maxsize=1)
        self.loaded = 0
        self.done = threading.Event()


def exchange(pool: Any, commands: Sequence[list[Any]], on_reply: Callable[[hooks.DirectReplies, int], int],
             retries: int, waves: Waves | None = None, share: Sequence[int] | None = None) -> None:
    """Send the commands ``share`` (indices into ``commands``, packed; all of them by
    default) on one pooled connection and hand reply i to ``on_reply(reader, i)``, which
    returns the reply's size in bytes; ``retries`` is the store's ``retries``.

    Without ``waves`` every command goes out at once. With it (GETs of values of any size),
    command i goes out once ``waves`` lets value i be requested: several connections, each
    with its own share, can run one server's part of a batch under one budget (``waves.py`` says why).

    A connection error before the first reply retries on a fresh connection (a pooled socket
    may be stale after a server restart), resending what the failed one was asked; a timeout
    never retries (a frozen server would only double the wait); a connection left
    mid-stream is dropped, never reused."""
    for _ in exchanges(pool, commands, on_reply, retries, waves, share):
        pass


def exchanges(pool: Any, commands: Sequence[list[Any]], on_reply: Callable[[hooks.DirectReplies, int], int],
              retries: int, waves: Waves | None = None,
              share: Sequence[int] | None = None) -> Generator[int, None, None]:
    """``exchange`` step by step: yields i after ``on_reply`` handled reply i, so a caller can
    read a batch on its own thread and take each value before the next is read. Closed before
    the last reply, it drops the connection (replies are still on their way)."""
    order = list(range(len(commands))) if share is None else list(share)
    waves = waves or Waves(len(commands), None)
    sent = answered = 0  # positions in order
    for attempt in range(retries + 1):
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
                yield order[answered - 1]
            return
        except _NETWORK_ERRORS as exc:
            conn.disconnect()
            if answered or attempt == retries or isinstance(exc, _TIMEOUTS):
                raise as_redis_error(exc) from exc
        except BaseException:
            if answered < len(order):  # closed after the last reply, the connection is in step
                conn.disconnect()
            raise
        finally:
            pool.release(conn)


def receive_value(reader: hooks.DirectReplies, i: int, pool: BufferPool, place: Place | None) -> Lease | None:
    """Value i of a ``get_into`` batch, the next reply on ``reader``: landed where ``place``
    says (the store contract) or in a lease of ``pool`` (a fresh buffer if none frees up soon),
    hashed as it arrives (the lease's ``digest``); None for a miss."""
    leased: list[Lease] = []

    def into(size: int) -> memoryview:
        lease = lease_or_fresh(pool, size, _LEASE_WAIT)
        leased.append(lease)
        return lease.view

    try:
        view = reader.value(into, hashed=True, land=None if place is None else functools.partial(place, i))
    except BaseException:
        for lease in leased:
            lease.release()
        raise
    if view is None:
        return None
    leased[0].digest = reader.digest
    return leased[0]


def read_here(direct: Any, share: Sequence[int], waves: Waves, commands: list[list[Any]], pool: BufferPool,
              retries: int, place: Place | None = None) -> Generator[Lease | None, None, None]:
    """A ``get_into`` batch on one connection, read on the caller's thread: yields each value
    of ``share`` in order (``receive_value``), receiving it when the caller asks for the next
    (the kernel keeps receiving meanwhile). Closed before the last value was received, it drops
    the connection; closed after, the connection goes back to the pool in step."""
    got: list[Lease | None] = []

    def on_reply(reader: hooks.DirectReplies, i: int) -> int:
        lease = receive_value(reader, i, pool, place)
        got.append(lease)
        return 0 if lease is None else len(lease)

    replies = exchanges(direct, commands, on_reply, retries, waves, share)
    try:
        for _ in replies:
            yield got.pop()
    finally:
        replies.close()
        for lease in got:  # received, never taken: the caller stopped
            if lease is not None:
                lease.release()


def read_into(direct: Any, commands: list[list[Any]], share: Sequence[int], slots: list[Slot], pool: BufferPool,
              every: Sequence[Waves], waves: Waves, retries: int, place: Place | None = None) -> None:
    """One connection's share of a ``get_into`` batch read by a thread of its own under
    ``waves`` (its server's, one of the batch's ``every``), each value (``receive_value``)
    handed to its slot. A failure ends the whole batch: every server's waves are cancelled and
    every slot not yet filled gets the error (the consumer raises it at the first such value)."""
    def on_reply(reader: hooks.DirectReplies, i: int) -> int:
        slot = slots[i]
        slot.lease = receive_value(reader, i, pool, place)
        slot.done.set()
        return 0 if slot.lease is None else len(slot.lease)

    try:
        exchange(direct, commands, on_reply, retries, waves, share)
    except Cancelled:
        pass  # abandoned by the consumer, or another reader failed and filled the slots
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer through the slots
        for each in every:
            each.cancel()
        for slot in slots:
            if not slot.done.is_set():
                slot.error = exc
                slot.done.set()


def run_sender(sender: Sender, redirected: list[tuple[str, WriteValue]], failed: list[BaseException],
               retries: int) -> None:
    """One connection's share of a streamed write batch: sends each command as it is queued,
    then reads the replies; a value its node redirected goes to ``redirected``. A connection
    error retries on a fresh connection, resending what the failed one had (a SET may land
    twice, to the same effect); a timeout never retries. A failure stops the batch
    (``failed``)."""
    pool, work = sender.pool, sender.work
    sent: list[tuple[tuple[str, WriteValue], list[Any]]] = []
    done = False  # every command taken from the queue (our end marker seen)
    try:
        for attempt in range(retries + 1):
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
                        if not is_redirect(exc):
                            raise
                        moved.append(item)
                redirected.extend(moved)
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the producer through ``failed``
                if conn is not None:
                    conn.disconnect()
                retry = (isinstance(exc, _NETWORK_ERRORS) and not isinstance(exc, _TIMEOUTS)
                         and attempt < retries and not failed)
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
