"""``mooncake://master:50051`` — a store in Mooncake Store's distributed DRAM pool (options:
``config``; the client: ``client``; registered memory: ``memory``).

Each key is one object, named ``prefix + key``. Bytes move only through the client's zero-copy
batch calls, between the pool's segments and buffers of this process:

* a load (``get_into``) asks the master for the values' sizes (one call), leases a buffer of the
  reader's pool for each, and receives them with one ``batch_get_into`` per window of ``window``
  bytes, straight into the leases; the next window arrives while the reader works on this one.
  On CUDA the reader's pool is the pinned one: the bytes land where the device copies them from.
* a lookup (``exists_many``, ``longest_prefix``) is one ``batch_is_exist``.
* a write (``put_many``) is one ``batch_upsert_from`` (an upsert: a value replaces the one
  before; a plain put keeps the old one) from where each value lies: a ``bytes``, an array, a
  one-piece ``Pieces``. A value in several pieces (a record's header, payload and trailer) is
  gathered into a buffer of the store's own first (``staging``; its trailer computed as it is
  copied): the client upserts an object from one buffer only.

Over RDMA the NIC reads and writes only registered memory: pool buffers are registered the first
time a value lands in them or leaves from them, for as long as they live (``memory``), and memory
no array owns (a ``bytes``) is copied into the store's registered buffers first. Over TCP the
transfer engine reads and writes through plain pointers and registering would only publish each
buffer to the metadata server, so the store registers nothing (``register=always`` does, to
measure it).

Misses: an absent object, one evicted, one whose lease expired while it was read, one whose
segment's owner has died (its objects die with it: an embedded engine's segment) are all
``None``, never errors. An outage (the master killed: its RPC fails; frozen: no answer within
``deadline``) raises ``StoreUnavailableError`` (``StoreTimeoutError`` for the deadline). A call
that outlives its deadline runs on in its thread; a lease it writes into goes back to the pool
only when it ends, and a write that reads memory the caller may reuse (neither ``bytes`` nor an
owned ``Pieces``) returns only when it ends (the client's RPC timeout bounds it).

Mooncake stores no empty object: an empty value is a one-byte object under ``name + "\\0"``
(keys hold no NUL). A non-empty value takes precedence over it, so writing one costs no second
call; writing an empty value removes the non-empty one. (So a key written empty, then not, reads
as empty again should the pool evict its value: kvstore's records are never empty.)

``iter_keys`` (tools only) reads the master's admin server (``admin``): the client has no listing.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvstore.buffers import BufferPool, Lease, Pieces, borrow, byte_view, lease_or_fresh
from kvstore.errors import StoreTimeoutError, StoreUnavailableError
from kvstore.stores.base import Head, LeaseStream, Place, Store, Value, WriteValue, check_head_bytes
from kvstore.stores.mooncake.client import (
    NO_SPACE,
    NOT_FOUND,
    RACES,
    Connection,
    ReplicateConfig,
    describe_code,
    is_outage,
    outage,
)
from kvstore.stores.mooncake.config import MooncakeConfig
from kvstore.stores.mooncake.memory import address
from kvstore.types import array_view

__all__ = ["MooncakeStore"]

T = TypeVar("T")
_EMPTY = "\x00"  # suffix of the object that says a key's value is empty
_ONE = array_view(np.zeros(1, dtype=np.uint8))  # the body of such an object
_LEASE_WAIT = 0.05  # seconds a read waits for pool space before receiving into a buffer of its own
_ADMIN_TIMEOUT = 10.0  # seconds to list the keys (a tool's call)


@dataclass
class _Read:
    """One batch read: which values it moves, into which leases, and the call doing it."""

    indexes: list[int]
    leases: list[Lease]
    call: Future[list[int]] | None = None

    def abandon(self) -> None:
        """Give the leases back once no call writes into them any more."""
        leases, self.leases = self.leases, []
        if not leases:
            return
        if self.call is None or self.call.done():
            for lease in leases:
                lease.release()
        else:
            def release(_: object) -> None:
                for lease in leases:
                    lease.release()

            self.call.add_done_callback(release)


class MooncakeStore(Store):
    """Objects in a Mooncake Store pool. See the module docstring for the contract."""

    is_local = False
    Config = MooncakeConfig

    def __init__(self, config: MooncakeConfig) -> None:
        self.config = config
        self._conn = Connection.shared(config)  # set up by the first call: no I/O here
        self._where = f"mooncake://{config.master}"
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kvstore-mooncake")
        self._staging = BufferPool(config.staging)
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replicas
        # Over RDMA the NIC moves the bytes: it can only reach registered memory.
        self._registers = config.protocol == "rdma" or config.register == "always"
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> MooncakeStore:
        return cls(MooncakeConfig.from_url(url))

    # -- plumbing --------------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        if _EMPTY in key:
            raise ValueError(f"key {key!r} holds a NUL; the mooncake:// store takes keys without one")
        return self.config.prefix + key

    def _submit(self, fn: Callable[[Any], T]) -> tuple[Future[T], float]:
        """``fn(client)`` sent to a thread of the store's; returns its future and its deadline."""
        end = time.monotonic() + self.config.deadline
        if self._closed:
            raise StoreUnavailableError(f"{self._where}: closed")
        self._conn.enter()  # until the call has run (or was cancelled), the client stays open
        try:
            future = self._pool.submit(fn, self._conn.client(end))
        except RuntimeError as exc:  # closed meanwhile (or the interpreter is exiting)
            self._conn.leave()
            raise StoreUnavailableError(f"{self._where}: closed ({exc})") from None
        except BaseException:
            self._conn.leave()
            raise
        future.add_done_callback(lambda _: self._conn.leave())
        return future, end

    def _wait(self, future: Future[T], end: float, *, on_late: Callable[[Future[T]], None] | None = None,
              wait_late: bool = False) -> T:
        """``future``'s result by ``end``, or ``StoreTimeoutError``. A call that outlives its
        deadline runs on: ``on_late(future)`` is called when it ends (to let go of what it
        held), or with ``wait_late`` the caller waits for its end before the error is raised (it
        reads memory the caller may reuse)."""
        done, _ = wait([future], timeout=max(0.0, end - time.monotonic()))
        if not done:
            if wait_late:
                wait([future])
            elif on_late is not None:
                future.add_done_callback(on_late)
            raise StoreTimeoutError(f"{self._where}: no answer within deadline={self.config.deadline:g}s")
        return future.result()

    def _call(self, fn: Callable[[Any], T], *, wait_late: bool = False) -> T:
        future, end = self._submit(fn)
        return self._wait(future, end, wait_late=wait_late)

    def _present(self, names: Sequence[str]) -> list[int]:
        """``batch_is_exist`` of ``names`` and of their empty-value objects, in one call: per key
        1 (a value), 0 (absent) or -1 (an empty value)."""
        if not names:
            return []
        answers = self._codes(self._call(lambda c: c.batch_is_exist([*names, *(n + _EMPTY for n in names)])),
                              2 * len(names), "a lookup")
        out = []
        for i in range(len(names)):
            value, empty = answers[i], answers[len(names) + i]
            for code in (value, empty):
                if code < 0 and is_outage(code):
                    raise outage(self._where, code, "a lookup")
            out.append(1 if value == 1 else (-1 if empty == 1 else 0))
        return out

    def _codes(self, answers: Any, n: int, what: str) -> list[int]:
        """The client's per-key answers to a batch call, checked: one integer per key."""
        codes = [int(a) for a in answers]
        if len(codes) != n:
            raise StoreUnavailableError(f"{self._where}: {what} of {n} keys was answered with {len(codes)} codes "
                                        f"({', '.join(describe_code(c) for c in codes[:3])})")
        return codes

    def _sizes(self, names: Sequence[str]) -> list[int | None]:
        """Each object's size from the master (one call), ``None`` where there is none."""
        if not names:
            return []
        found = self._call(lambda c: _sizes_of(c.batch_get_replica_desc(list(names))))
        return [found.get(n) for n in names]

    def _register(self, views: Iterable[memoryview], *, always: bool = False) -> None:
        """On a worker thread, before a call moves bytes through ``views``: register them where the
        store registers memory, or ``always`` (a call to the metadata server: under the call's
        deadline)."""
        if not (self._registers or always):
            return
        for view in views:
            if len(view) and not self._conn.registrations.register(view):
                raise StoreUnavailableError(f"{self._where}: {len(view)} bytes at {address(view):#x} could not be "
                                            "registered with the transfer engine")

    def _registrable(self, view: memoryview) -> bool:
        return not self._registers or not len(view) or self._conn.registrations.registrable(view)

    # -- the small contract ----------------------------------------------------------------------
    def get(self, key: str) -> Value | None:
        return self.get_many([key])[0]

    def put(self, key: str, value: WriteValue) -> None:
        self.put_many([(key, value)])

    def delete(self, key: str) -> bool:
        return self.delete_many([key]) == 1

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """Every key under ``prefix``, from the master's admin server (``/get_all_keys``)."""
        url = f"{self.config.admin_url}/get_all_keys"
        try:
            with urllib.request.urlopen(url, timeout=_ADMIN_TIMEOUT) as reply:
                text = reply.read().decode("utf-8", "surrogateescape")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise StoreUnavailableError(f"{self._where}: listing keys at {url} failed: {exc}") from exc
        start = self.config.prefix + prefix
        cut = len(self.config.prefix)
        seen = set()
        for name in text.split("\n"):
            if name.startswith(start):
                key = name[cut:].removesuffix(_EMPTY)
                if key not in seen:
                    seen.add(key)
                    yield key

    # -- reads -----------------------------------------------------------------------------------
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [p != 0 for p in self._present([self._name(k) for k in keys])]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """One ``batch_is_exist`` of every key (stops counting at the first absent one)."""
        present = self.exists_many(keys)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        names = [self._name(k) for k in keys]
        present = self._present(names)
        sizes = self._sizes([n for n, p in zip(names, present) if p == 1])
        it = iter(sizes)
        return [next(it) if p == 1 else (0 if p == -1 else None) for p in present]

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Values received into one fresh buffer of the caller's (one ``batch_get_into``)."""
        names = [self._name(k) for k in keys]
        sizes = self._sizes(names)
        wanted = [i for i, s in enumerate(sizes) if s]
        out: list[Value | None] = [None] * len(keys)
        if wanted:
            whole = array_view(np.empty(sum(sizes[i] or 0 for i in wanted), dtype=np.uint8))
            views, pos = [], 0
            for i in wanted:
                n = sizes[i] or 0
                views.append(whole[pos:pos + n])
                pos += n

            def receive(client: Any) -> list[int]:  # a late one writes into ``whole``, which only it holds then
                self._register([whole])
                return list(client.batch_get_into([names[i] for i in wanted], [address(v) for v in views],
                                                  [len(v) for v in views]))

            results = self._codes(self._call(receive), len(wanted), "a read")
            for i, view, code in zip(wanted, views, results):
                if code == len(view):
                    out[i] = view
                else:
                    self._miss(code, "a read")
        for i in self._empty([i for i, v in enumerate(out) if v is None], names):
            out[i] = b""
        return out

    def _miss(self, code: int, what: str) -> None:
        """A read's code that is not a whole value: a miss, or an outage raised."""
        if code < 0 and is_outage(code):
            raise outage(self._where, code, what)

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """Values received straight into leases of ``pool`` (registered with the transfer engine):
        their sizes in one call, then one ``batch_get_into`` per window of at most ``window``
        bytes, each answered within ``deadline`` of when the reader waits for it (its own work
        between windows does not count against the pool). Window i+1 is sent once window i has
        arrived, before its values are yielded. A lease that a late call still writes into goes back to
        the pool when that call ends, however the stream ends. ``place`` is not used: every value
        lands whole in its lease."""
        names = [self._name(k) for k in keys]
        if not names:
            return
        sizes = self._sizes(names)
        empties = self._empty([i for i, s in enumerate(sizes) if s is None], names)
        windows = self._windows(sizes)
        sent: deque[_Read] = deque()
        got: dict[int, Lease | None] = {}  # received values not yet yielded
        try:
            if windows:
                sent.append(self._read(names, sizes, windows[0], pool))
            done = 0
            for i, size in enumerate(sizes):
                if size is None:
                    yield borrow(b"") if i in empties else None
                    continue
                if i not in got:
                    got.update(self._received(sent[0]))
                    sent.popleft()
                    done += 1
                    # The next window moves while the reader uses this one; never two at once:
                    # two batches in flight share the transfer engine's threads and lose to one.
                    if done < len(windows):
                        sent.append(self._read(names, sizes, windows[done], pool))
                yield got.pop(i)
        finally:
            for lease in got.values():
                if lease is not None:
                    lease.release()
            for read in sent:
                read.abandon()

    def _windows(self, sizes: Sequence[int | None]) -> list[list[int]]:
        """The indexes of the values to read, in order, cut into windows of ``window`` bytes (at
        least one value each)."""
        windows: list[list[int]] = []
        held = self.config.window
        for i, size in enumerate(sizes):
            if size is None:
                continue
            if held >= self.config.window:
                windows.append([])
                held = 0
            windows[-1].append(i)
            held += size
        return windows

    def _empty(self, missing: list[int], names: Sequence[str]) -> set[int]:
        """Which of the ``missing`` values are empty ones (one lookup, only if any is missing)."""
        if not missing:
            return set()
        answers = self._codes(self._call(lambda c: c.batch_is_exist([names[i] + _EMPTY for i in missing])),
                              len(missing), "a lookup")
        for code in answers:
            if code < 0 and is_outage(code):
                raise outage(self._where, code, "a lookup")
        return {i for i, code in zip(missing, answers) if code == 1}

    def _read(self, names: Sequence[str], sizes: Sequence[int | None], indexes: list[int], pool: BufferPool) -> _Read:
        """Lease a buffer of ``pool`` for each value of ``indexes`` and send their ``batch_get_into``."""
        read = _Read(indexes, [])
        try:
            for i in indexes:
                lease = lease_or_fresh(pool, sizes[i] or 0, _LEASE_WAIT)
                read.leases.append(lease)
            leases, wanted = list(read.leases), [names[i] for i in indexes]

            def receive(client: Any) -> list[int]:  # holds ``leases``: their memory lives while it runs
                self._register(lease.view for lease in leases)
                return list(client.batch_get_into(wanted, [address(lease.view) for lease in leases],
                                                  [lease.nbytes for lease in leases]))

            read.call, _ = self._submit(receive)
        except BaseException:
            read.abandon()
            raise
        return read

    def _received(self, read: _Read) -> dict[int, Lease | None]:
        """Wait for ``read`` (until its deadline) and sort its values into hits and misses."""
        assert read.call is not None
        # Within a deadline of when the reader comes to wait for it: the reader's own work on the
        # window before (verifying it, on the same cores) never counts against the pool.
        codes = self._codes(self._wait(read.call, time.monotonic() + self.config.deadline),  # late: abandoned
                            len(read.leases), "a read")
        out: dict[int, Lease | None] = {}
        leases, read.leases = read.leases, []
        try:
            for i, lease, code in zip(read.indexes, leases, codes):
                if code == lease.nbytes:
                    out[i] = lease
                else:
                    out[i] = None
                    lease.release()
                    self._miss(code, "a read")
        except BaseException:
            for hit in out.values():
                if hit is not None:
                    hit.release()
            for rest in leases[len(out):]:
                rest.release()
            raise
        return out

    def get_heads(self, keys: Sequence[str], nbytes: int) -> list[Head | None]:
        """Each value's size (one call) and its first ``nbytes`` bytes (one ranged read)."""
        check_head_bytes(nbytes)
        names = [self._name(k) for k in keys]
        present = self._present(names)
        full = [i for i, p in enumerate(present) if p == 1]
        sizes = self._sizes([names[i] for i in full])
        out: list[Head | None] = [(0, b"") if p == -1 else None for p in present]
        reads = [(i, s) for i, s in zip(full, sizes) if s]
        if reads:
            lease = lease_or_fresh(self._staging, sum(min(nbytes, s) for _, s in reads), _LEASE_WAIT)
            try:
                base, offsets, pos = address(lease.view), [], 0
                for _, s in reads:
                    offsets.append(pos)
                    pos += min(nbytes, s)

                def read_heads(client: Any) -> Any:
                    self._register([lease.view], always=True)  # the ranged read takes registered memory only
                    return client.get_into_ranges([base], [[names[i] for i, _ in reads]], [[[o] for o in offsets]],
                                                  [[[0] for _ in reads]], [[[min(nbytes, s)] for _, s in reads]])

                answers = self._call(read_heads, wait_late=True)
                for (i, s), o, got in zip(reads, offsets, answers[0]):
                    n = min(nbytes, s)
                    code = got[0] if got else -1
                    if code == n:
                        out[i] = (s, bytes(lease.view[o:o + n]))
                    else:
                        self._miss(code, "a ranged read")
            finally:
                lease.release()
        return out

    # -- writes ----------------------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        """One ``batch_upsert_from`` of the non-empty values, from where they lie (see the module
        docstring); empty values are one more upsert and a removal."""
        names: list[str] = []
        views: list[memoryview] = []
        held: list[Lease | Pieces] = []  # released once no call reads the values any more
        kept = True  # every value's memory stays as it is until then (bytes, or held)
        empties: list[str] = []
        try:
            for key, value in items:
                name = self._name(key)
                view, hold, fixed = self._source(value)
                if hold is not None:
                    held.append(hold)
                if not len(view):
                    empties.append(name)
                    continue
                names.append(name)
                views.append(view)
                kept = kept and fixed
            if names:
                self._write(names, views, held, kept)
                held = []  # the write owns them now
            if empties:
                self._write_empties(empties)
        finally:
            for hold in held:
                hold.release()

    def _source(self, value: WriteValue) -> tuple[memoryview, Lease | Pieces | None, bool]:
        """Where ``value``'s bytes lie for an upsert: one view, what holds it (released after the
        call), and whether its memory stays unchanged until then."""
        if isinstance(value, Pieces):
            whole = value.whole
            if whole is None or not self._registrable(whole):
                return self._gathered(value)
            if value.owner is not None:
                return whole, value.retain(), True
            return whole, None, whole.readonly and isinstance(whole.obj, bytes)
        view = byte_view(value)
        fixed = view.readonly and isinstance(view.obj, bytes)
        if not self._registrable(view):
            return self._gathered(value)
        return view, None, fixed

    def _gathered(self, value: WriteValue) -> tuple[memoryview, Lease | Pieces | None, bool]:
        """``value`` copied into a registered lease of the store's own (a record's trailer is
        computed as its bytes are copied: ``Pieces.copy_into``)."""
        n = len(value) if isinstance(value, Pieces) else byte_view(value).nbytes
        lease = lease_or_fresh(self._staging, n, _LEASE_WAIT)
        if isinstance(value, Pieces):
            value.copy_into(lease.view)
        else:
            lease.view[:] = byte_view(value)
        return lease.view, lease, True

    def _write(self, names: list[str], views: list[memoryview], held: list[Lease | Pieces], kept: bool) -> None:
        def upsert(client: Any) -> list[int]:
            self._register(views)
            return list(client.batch_upsert_from(names, [address(v) for v in views], [len(v) for v in views],
                                                 self._replicate))

        def let_go(_: object = None) -> None:
            for hold in held:
                hold.release()

        try:
            future, end = self._submit(upsert)
        except BaseException:
            let_go()
            raise
        try:
            results = self._codes(self._wait(future, end, on_late=let_go, wait_late=not kept), len(names),
                                  "a write")
        except StoreTimeoutError:
            if not kept:  # the call has ended (waited for); a kept one lets go when it ends
                let_go()
            raise
        except BaseException:
            let_go()
            raise
        let_go()
        failed = [(n, code) for n, code in zip(names, results) if code < 0 and code not in RACES]
        if failed:
            name, code = failed[0]
            if code == NO_SPACE or is_outage(code):
                raise outage(self._where, code, f"writing {len(failed)} of {len(names)} values ({name!r} first)")
            raise StoreUnavailableError(f"{self._where}: writing {name!r} failed: {describe_code(code)}")

    def _write_empties(self, names: list[str]) -> None:
        one = address(_ONE)

        def write(client: Any) -> tuple[list[int], list[int]]:
            self._register([_ONE])
            marked = list(client.batch_upsert_from([n + _EMPTY for n in names], [one] * len(names), [1] * len(names),
                                                   self._replicate))
            return marked, list(client.batch_remove(names, True))

        marked, removed = self._call(write, wait_late=True)
        marked, removed = self._codes(marked, len(names), "a write"), self._codes(removed, len(names), "a removal")
        for name, code in zip(names, marked):
            if code < 0 and code not in RACES:
                raise outage(self._where, code, f"writing the empty value of {name!r}")
        for code in removed:
            if code < 0 and code != NOT_FOUND and is_outage(code):
                raise outage(self._where, code, "removing a value an empty one replaced")

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove every key's objects (force: a reader's lease does not keep them); how many
        keys had a value."""
        names = [self._name(k) for k in keys]
        if not names:
            return 0
        codes = self._codes(self._call(lambda c: c.batch_remove([*names, *(n + _EMPTY for n in names)], True)),
                            2 * len(names), "a removal")
        for code in codes:
            if code < 0 and code != NOT_FOUND and is_outage(code):
                raise outage(self._where, code, "a removal")
        return sum(1 for i in range(len(names)) if codes[i] == 0 or codes[len(names) + i] == 0)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the store's threads and let go of the client (the last store over it closes it,
        in the background). Calls still running end by the client's own timeouts."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._conn.release()

    @property
    def deadline(self) -> float:
        return self.config.deadline

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"store": "mooncake", "master": c.master, "metadata": c.metadata_url, "protocol": c.protocol,
                "segment": c.segment, "replicas": c.replicas, "prefix": c.prefix, "deadline": c.deadline,
                "window": c.window}


def _sizes_of(descriptors: dict[str, Any]) -> dict[str, int]:
    """Object sizes from ``batch_get_replica_desc``'s answer (the first complete memory replica's)."""
    out = {}
    for name, replicas in descriptors.items():
        for replica in replicas:
            if replica.is_memory_replica():
                out[name] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                break
    return out
