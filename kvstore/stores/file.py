"""``file:///path`` — records as files in a local directory, shared by the processes of one host.

Writes go to a temporary file in the same file system and are renamed into place, so a reader
sees a whole value or none. The directory is bounded by ``max_bytes``: every writer adds what it
wrote to a usage counter shared by all processes (``.usage``, updated under ``flock``); when the
counter passes the budget, that writer takes an exclusive ``flock`` on ``.lock`` and evicts the
least recently used files (by modification time, which ``get`` refreshes) down to ``low_water``
of the budget, and resets the counter from what it scanned. Several processes may use one
directory at once.

``get_into`` reads each file straight into a pool lease, in slices each hashed right after it
lands (``Lease.digest``): no intermediate ``bytes``, and the reader checks the record against
the digest instead of reading it again.

``put_many`` writes values of ``PARALLEL_BYTES`` or more on ``kvstore.buffers.workers()``, one
thread a file (each streams its value, computing its checksum as its bytes go out), while the
caller produces the next; like ``put``, it returns once every file is in place or has failed,
and raises the first failure then.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from kvstore.buffers import (
    IOV_MAX,
    STREAM_SLICE,
    ArrivalDigest,
    BufferPool,
    Lease,
    Pieces,
    byte_view,
    io_batches,
    lease_or_fresh,
    workers,
    write_all,
)
from kvstore.config import build, check_options, option, query_options
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.metrics.catalog import EVICTIONS
from kvstore.stores.base import Evicting, Head, LeaseStream, Place, Store, WriteValue, check_head_bytes

_STALE_TMP_SECONDS = 3600.0
#: Values at least this large are written on worker threads by ``put_many`` (smaller ones cost
#: less to write than to hand over).
PARALLEL_BYTES = 1 << 20


@dataclass(frozen=True)
class FileConfig:
    path: str = option(help="Directory holding the records (created if missing).")
    max_bytes: int = option(10 << 30, kind="size", lo=0, hi=1 << 50,
                            help="Capacity; least recently used files are evicted beyond it (0: unbounded).")
    low_water: float = option(0.9, lo=0.01, hi=1.0, help="Eviction frees space down to this fraction of max_bytes.")
    fsync: bool = option(False, help="fsync each file before renaming it into place (durable across power loss).")

    def __post_init__(self) -> None:
        check_options(self)  # the path without control characters, every number within its range

    @classmethod
    def from_url(cls, url: str) -> FileConfig:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            meant = os.path.abspath(os.path.expanduser(parts.netloc + unquote(parts.path)))
            raise ConfigError(f"file URL {url.split('?')[0]!r} reads {parts.netloc!r} as a host name: file URLs need an "
                              f"absolute path after three slashes, file:///absolute/dir (here perhaps file://{meant})")
        path = unquote(parts.path)
        if not path:
            raise ConfigError(f"file:// URL {url!r} has no path; use file:///absolute/dir")
        return build(cls, query_options(url), where="file://", path=os.path.expanduser(path))

#: Keys ``quote(key, safe="")`` changes only by escaping "/" (every kvstore key).
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.~/-]*")


class FileStore(Evicting, Store):
    is_local = True
    Config = FileConfig

    def __init__(self, config: FileConfig) -> None:
        self.config = config
        self.root = Path(config.path)
        self._data = self.root / "data"
        self._data_dir = str(self._data)
        self._tmp = self.root / "tmp"
        try:
            self._data.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path (file:///a%00b)
            raise ConfigError(f"file store path {config.path!r} is not usable: {exc}") from exc
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> FileStore:
        return cls(FileConfig.from_url(url))

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        """The path of ``key``'s file as a string: lookups and reads build one per key, and a
        ``Path`` and ``quote`` cost more than the ``stat`` they lead to."""
        # quote(key, safe="") leaves these characters as they are and turns "/" into "%2F".
        name = key.replace("/", "%2F") if _PLAIN_KEY.fullmatch(key) else quote(key, safe="")
        if len(name) > 240:
            raise ValueError(f"key of {len(key)} characters is too long for the file store")
        shard = hashlib.blake2b(key.encode(), digest_size=1).hexdigest()
        return f"{self._data_dir}/{shard}/{name}"

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailableError(f"file store read {path} failed: {exc}") from exc
        try:
            os.utime(path)  # LRU clock for eviction
        except OSError:
            pass
        return data

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """Each value read into a lease of ``pool`` (a fresh buffer when the pool has no room
        within ``_LEASE_WAIT``), or where ``place`` lands it (the store contract), and hashed
        as it lands (``Lease.digest``); one file open at a time, in key order."""
        for i, key in enumerate(keys):
            path = self._file(key)
            try:
                lease = _read_into(path, pool, None if place is None else functools.partial(place, i))
            except OSError as exc:
                raise StoreUnavailableError(f"file store read {path} failed: {exc}") from exc
            if lease is not None:
                try:
                    os.utime(path)  # LRU clock for eviction, as get's
                except OSError:
                    pass
            yield lease

    def exists(self, key: str) -> bool:
        return os.path.exists(self._file(key))

    def put(self, key: str, value: WriteValue) -> None:
        path = self._path(key)
        parts = value.stream() if isinstance(value, Pieces) else (byte_view(value),)
        size = 0
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._tmp)
            try:
                try:
                    size = _write_parts(fd, parts)
                    if self.config.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as exc:
            raise StoreUnavailableError(f"file store write {path} failed: {exc}") from exc
        try:
            self._account(size)
        except OSError as exc:
            raise StoreUnavailableError(f"file store {self.root} could not count or evict: {exc}") from exc

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        writing: list[Future[None]] = []
        try:
            for key, value in items:
                size = len(value) if isinstance(value, Pieces) else memoryview(value).nbytes
                if size >= PARALLEL_BYTES:
                    writing.append(workers().submit(self.put, key, value))
                else:
                    self.put(key, value)
        finally:
            wait(writing)  # every write ends before this returns or raises: callers reuse their buffers
        for done in writing:
            exc = done.exception()
            if exc is not None:
                raise exc

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:  # an outage like any other, not a bug: callers catch KVStoreError
            raise StoreUnavailableError(f"file store delete {path} failed: {exc}") from exc

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        for shard in sorted(self._data.iterdir()):
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                key = unquote(entry.name)
                if key.startswith(prefix):
                    yield key

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        out: list[int | None] = []
        for k in keys:
            try:
                out.append(self._path(k).stat().st_size)
            except FileNotFoundError:
                out.append(None)
        return out

    def get_heads(self, keys: Sequence[str], nbytes: int) -> list[Head | None]:
        """Each file's size and first bytes; not an access: the LRU clock is left alone."""
        check_head_bytes(nbytes)
        out: list[Head | None] = []
        for k in keys:
            path = self._file(k)
            try:
                with open(path, "rb") as f:
                    out.append((os.fstat(f.fileno()).st_size, f.read(nbytes)))
            except FileNotFoundError:
                out.append(None)
            except OSError as exc:
                raise StoreUnavailableError(f"file store read {path} failed: {exc}") from exc
        return out

    # -- capacity ----------------------------------------------------------------------------
    def _account(self, added: int) -> None:
        if not self.config.max_bytes:
            return
        # Shared by every process: a per-process estimate would let N writers that each stay
        # under the budget fill N times it.
        # Never counted yet: the scan finds this value's file too.
        total = self._usage(lambda t: self._scan_total() if t is None else t + added)
        if total > self.config.max_bytes:
            self.evict()

    def _usage(self, update: Callable[[int | None], int]) -> int:
        """Replace the shared usage counter ``t`` by ``update(t)`` (``None``: never counted)."""
        with self._lock:  # flock does not exclude threads of one process
            # Opened per call: a descriptor inherited across fork would share its lock.
            fd = os.open(self.root / ".usage", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                raw = os.pread(fd, 8, 0)
                total = update(int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else None)
                os.pwrite(fd, total.to_bytes(8, "little", signed=True), 0)
                return total
            finally:
                os.close(fd)  # releases the flock

    def _scan_total(self) -> int:
        total = 0
        for shard in self._data.iterdir():
            if shard.is_dir():
                for entry in os.scandir(shard):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
        return total

    def evict(self) -> int:
        """Evict least recently used files down to ``low_water * max_bytes``; returns bytes freed."""
        target = int(self.config.max_bytes * self.config.low_water)
        gone: list[str] = []
        with open(self.root / ".lock", "a+b") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)  # one evictor at a time across processes
            counted = self._usage(lambda t: t or 0)
            files = []
            for shard in self._data.iterdir():
                if not shard.is_dir():
                    continue
                for entry in os.scandir(shard):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    files.append((st.st_mtime, st.st_size, entry.path))
            total = sum(f[1] for f in files)
            freed = 0
            files.sort()
            for _, size, path in files:
                if total - freed <= target:
                    break
                try:
                    os.unlink(path)
                    freed += size
                    EVICTIONS.inc(store="file")
                    gone.append(unquote(os.path.basename(path)))
                except FileNotFoundError:
                    pass
            now = time.time()
            for entry in os.scandir(self._tmp):  # writers that died mid-write
                try:
                    if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass
            # What the scan found, plus what writers counted since it began (perhaps counted
            # twice: an overestimate only brings the next eviction forward).
            self._usage(lambda t: total - freed + max(0, (t or 0) - counted))
        if gone and self._eviction_listeners:
            self._evicted(gone)
        return freed

    def describe(self) -> dict[str, Any]:
        return {"store": "file", "path": str(self.root), "max_bytes": self.config.max_bytes}


_LEASE_WAIT = 0.05  # a read waits this long for a pool buffer, then reads into a fresh one


def _write_parts(fd: int, parts: Iterable[memoryview | bytes]) -> int:
    """Write ``parts`` in order at ``fd``'s position, several per ``writev`` (``io_batches``);
    returns the bytes written."""
    total = 0
    for batch in io_batches(parts):
        total += sum(len(v) for v in batch)  # before write_all, which consumes the batch
        write_all(functools.partial(os.writev, fd), batch)
    return total


def _read_into(path: str, pool: BufferPool,
               land: Callable[[memoryview], Iterator[Sequence[memoryview]]] | None = None) -> Lease | None:
    """The whole file at ``path`` in a lease of ``pool`` (or where ``land(view)`` says, the store
    contract's ``place``) with its ``digest`` set (None if there is no such file), read in
    ``STREAM_SLICE`` slices, several buffers per ``preadv``, each hashed while it is in the CPU's
    cache. A file is never rewritten in place (writes rename a whole new file over it), so the
    size the open file has is the value's."""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        lease = lease_or_fresh(pool, size, _LEASE_WAIT)
        try:
            arrival = ArrivalDigest(size)
            done = 0
            for views in (land(lease.view) if land is not None else ((lease.view,),)):
                done = _pread_into(f.fileno(), views, done, arrival)
                if done > size:
                    raise ValueError(f"the landing buffers exceed the {size}-byte value")
            if done != size:
                raise ValueError(f"the landing buffers hold {done} bytes of a {size}-byte value")
            lease.digest = arrival.digest()
        except BaseException:
            lease.release()
            raise
    return lease


def _pread_into(fd: int, views: Sequence[memoryview], offset: int, arrival: ArrivalDigest) -> int:
    """Fill ``views`` in order from ``fd`` at ``offset``, ``STREAM_SLICE`` bytes (and at most
    ``IOV_MAX`` buffers) per ``preadv``, each piece hashed after its read; the offset after them."""
    pieces = [v[at:at + STREAM_SLICE] for v in views for at in range(0, len(v), STREAM_SLICE)]
    i = 0
    while i < len(pieces):
        batch, nbytes = [pieces[i]], len(pieces[i])
        while i + len(batch) < len(pieces) and len(batch) < IOV_MAX and nbytes + len(pieces[i + len(batch)]) <= STREAM_SLICE:
            batch.append(pieces[i + len(batch)])
            nbytes += len(batch[-1])
        n = os.preadv(fd, batch, offset)
        if not n:
            raise OSError(f"the file ended at byte {offset}")
        offset += n
        for piece in batch:  # a short read (rare on a regular file) resumes inside its piece
            if n >= len(piece):
                arrival.arrived(piece)
                n -= len(piece)
                i += 1
            else:
                if n:
                    arrival.arrived(piece[:n])
                    pieces[i] = piece[n:]
                break
    return offset
