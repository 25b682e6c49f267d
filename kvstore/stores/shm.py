"""``shm://NAME`` — one bounded memory tier shared by every process of a host (files in /dev/shm).

The engines of one host (replicas, tensor-parallel workers, the warming tool) open the same
``NAME`` and see one cache: a record one of them saved is a memory mapping away for the others.
Each record is a file in a tmpfs (``/dev/shm/kvstore-NAME/data``), so the directory is the index
every process reads, with no daemon and no shared structure a crashed process could leave locked.

Contract, beyond ``Store``'s:

* **No torn or stale values.** A writer fills a private temporary file and renames it into
  place; a reader opens a key's file and sees either the whole previous value or the whole new
  one. Files are never written in place or truncated after the rename, so a mapping a reader
  holds stays a complete value even after the key is overwritten or evicted (the memory is freed
  when the last mapping of it goes).
* **Reads without a copy.** ``get`` and ``get_into`` hand out values of ``map_bytes`` or more as
  read-only views of a mapping of the record, which a reader verifies and scatters straight into
  its KV cache. Each process keeps its mappings (``map_cache`` bytes of them, least recently used
  dropped first) and reuses one while the key's file is the same inode, so a prefix loaded again
  costs no page faults; a file replaced by another writer is a different inode, mapped afresh
  (never a stale value). Smaller values are read into ``get_into``'s pool leases (one ``preadv``).
  After ``pin_host_memory`` every mapping is registered with the accelerator once, when it is
  first used (its registration ends when the last view of it goes), and its leases say
  ``pinned``: a GPU reader DMAs a verified record straight from the mapping. Registrations are
  driver calls (about 1 ms per 33 MB): ``get_into`` starts those of the values ahead of the
  reader on threads of their own, several at once, and a reader that meets a registration in
  flight (another reader's) waits for it rather than copying from pageable memory.
* **Trust.** A record is hashed where it lies, in a shared mapping, and then DMA'd or copied
  from there: a process that can write the tier's files (``root``/kvstore-NAME) could rewrite
  a record in place between its verification and its use, past ``auth``'s tag. The tier trusts
  every process that can write its directory (run its engines under one user, with a private
  directory: ``umask 077``); ``auth`` guards what comes through the store, not the files.
* **Writes in parallel.** ``put_many`` writes large values on ``kvstore.buffers.workers()``, each
  file by one thread (its checksum computed as its bytes go out), so a prefix's records go to
  the tmpfs at the speed of several cores, not one.
* **Bounded, LRU across processes.** Capacity accounting and eviction are the file store's
  (``FileStore``): a usage counter shared under ``flock``, least recently used files (by
  modification time, which reads refresh) evicted down to ``low_water`` of ``max_bytes``.
* **Crash-safe.** Every lock is an ``flock``, released by the kernel when its holder dies. Each
  process writes its temporary files in a directory of its own beside a lock file it holds for
  its lifetime (``tmp/<pid>-<id>/`` and ``tmp/<pid>-<id>.alive``); a store that opens, and every
  eviction, removes the directories whose owner no longer holds its lock: a writer killed
  mid-record leaves no visible partial record and, after the next eviction or start, no space.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import shutil
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvstore.buffers import BufferPool, Lease, borrow, hashers, self_digest, thread_pool
from kvstore.config import build, check_options, option, query_options
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.pinned import HostPinner
from kvstore.stores.base import LeaseStream, Place, Value
from kvstore.stores.file import FileConfig, FileStore
from kvstore.types import array_view

__all__ = ["ShmConfig", "ShmStore"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$", re.ASCII)
_ORPHAN_SECONDS = 60.0  # a writer directory without its lock file (a reaper that died) is removed after this
_AHEAD = 8  # mapped values get_into prepares ahead of its reader (their registrations and hashes started)


@dataclass(frozen=True)
class ShmConfig:
    name: str = option(help="The tier's name: every process that opens the same name shares it.")
    max_bytes: int = option(4 << 30, kind="size", lo=1, hi=1 << 44,
                            help="Capacity, shared by every process; least recently used values are evicted beyond it.")
    low_water: float = option(0.9, lo=0.01, hi=1.0, help="Eviction frees space down to this fraction of max_bytes.")
    map_bytes: int = option(1 << 20, kind="size", lo=0, hi=1 << 40,
                            help="Values at least this large are read as views of a memory mapping (no copy); "
                                 "smaller ones are copied into the reader's buffers.")
    map_cache: int = option(1 << 30, kind="size", lo=0, hi=1 << 44,
                            help="Mappings of large records each process keeps for its next reads (no page "
                                 "faults when a prefix is loaded again); a mapping of a record since evicted or "
                                 "overwritten holds its memory until dropped from here. 0: map on every read.")
    root: str = option("/dev/shm", help="The memory-backed (tmpfs) directory the tier lives under, "
                                        "as kvstore-NAME.")

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"shm:// name {self.name!r} is not usable; accepted: 1 to 100 of A-Z a-z 0-9 . _ -, "
                              "not starting with a dot")
        check_options(self)  # every number within its range (a shared memory tier is bounded), no control characters
        if not os.path.isabs(self.root):
            raise ConfigError(f"root={self.root!r} must be an absolute path")

    @property
    def path(self) -> str:
        return os.path.join(self.root, f"kvstore-{self.name}")

    @classmethod
    def from_url(cls, url: str) -> ShmConfig:
        parts = urlsplit(url)
        if parts.path not in ("", "/") or not parts.netloc:
            raise ConfigError(f"shm:// URLs name the tier as their host: shm://NAME?max_bytes=8GiB, got {url!r}")
        return build(cls, query_options(url), where="shm://", name=parts.netloc)


class ShmStore(FileStore):
    """Records as files in a tmpfs, shared by the processes of one host; see the module docstring."""

    Config = ShmConfig  # type: ignore[assignment]

    def __init__(self, config: ShmConfig) -> None:
        self.shm = config
        self._writer_lock = threading.Lock()
        self._writer_pid = -1
        self._writer_dir = Path()
        self._writer_alive = -1
        self._tmp_root = Path(config.path) / "tmp"
        self._maps = _Mappings(config.map_cache)
        super().__init__(FileConfig(path=config.path, max_bytes=config.max_bytes, low_water=config.low_water))
        try:
            fs = os.statvfs(config.root)
        except OSError as exc:
            raise ConfigError(f"shm:// root {config.root!r} is not usable: {exc}") from exc
        if config.max_bytes > fs.f_blocks * fs.f_frsize:
            raise ConfigError(f"max_bytes={config.max_bytes} is more than the {fs.f_blocks * fs.f_frsize} bytes of "
                              f"the file system at {config.root}; accepted: at most that")
        self._reap()

    @classmethod
    def from_url(cls, url: str) -> ShmStore:
        return cls(ShmConfig.from_url(url))

    # -- this process's temporary files ------------------------------------------------------
    # ``FileStore`` writes temporary files in ``self._tmp``: here, a directory of this process's
    # own (claimed again after a fork), which others remove once its lock file is unlocked.
    @property
    def _tmp(self) -> Path:
        if self._writer_pid != os.getpid():
            self._claim_writer_dir()
        return self._writer_dir

    @_tmp.setter
    def _tmp(self, value: Path) -> None:
        pass  # FileStore's shared tmp directory: this store uses one per process instead

    def _claim_writer_dir(self) -> None:
        with self._writer_lock:
            pid = os.getpid()
            if self._writer_pid == pid:
                return
            self._tmp_root.mkdir(parents=True, exist_ok=True)
            stem = f"{pid}-{os.urandom(4).hex()}"  # pid namespaces may share a /dev/shm
            alive = os.open(self._tmp_root / f"{stem}.alive", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(alive, fcntl.LOCK_EX)  # held until this process exits (the kernel drops it)
            (self._tmp_root / stem).mkdir()
            # A forked child keeps its parent's descriptor open (harmless: it only delays
            # reaping the parent's directory until the child exits too).
            self._writer_dir, self._writer_alive, self._writer_pid = self._tmp_root / stem, alive, pid

    def _reap(self) -> int:
        """Remove the temporary directories of writers that are gone; returns how many."""
        removed = 0
        try:
            entries = list(os.scandir(self._tmp_root))
        except FileNotFoundError:
            return 0
        names = {e.name for e in entries}
        for entry in entries:
            if entry.name.endswith(".alive"):
                stem = entry.name[:-len(".alive")]
                try:
                    fd = os.open(entry.path, os.O_RDWR)
                except FileNotFoundError:
                    continue
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # its writer is alive
                    shutil.rmtree(self._tmp_root / stem, ignore_errors=True)
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass
                    removed += 1
                finally:
                    os.close(fd)
            elif entry.is_dir(follow_symlinks=False) and f"{entry.name}.alive" not in names:
                try:  # its lock file is gone: a reaper died between the two removals
                    if time.time() - entry.stat().st_mtime > _ORPHAN_SECONDS:
                        shutil.rmtree(entry.path, ignore_errors=True)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def evict(self) -> int:
        freed = super().evict()
        try:
            self._reap()
        except OSError:
            pass  # best effort: the next eviction tries again
        return freed

    # -- reads -------------------------------------------------------------------------------
    def _open(self, path: str | Path) -> int | None:
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailableError(f"shm store read {path} failed: {exc}") from exc

    def _touch(self, path: str | Path) -> None:
        try:
            os.utime(path)  # LRU clock for eviction
        except OSError:
            pass  # evicted meanwhile: the value read is still whole

    def pin_host_memory(self, pinner: HostPinner) -> None:
        self._maps.pinner = pinner

    def _mapping(self, key: str, path: str | Path) -> _Mapped | int | None:
        """``key``'s record as a mapping if it is ``map_bytes`` or larger (the cached one while
        the file is the same), else an open descriptor; None on a miss."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._maps.drop(key)
            return None
        if st.st_size >= self.shm.map_bytes and st.st_size > 0:
            found = self._maps.find(key, st.st_dev, st.st_ino)
            if found is not None:
                self._touch(path)
                return found
        fd = self._open(path)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)  # the file opened, whichever was renamed into place last
            if st.st_size < self.shm.map_bytes or st.st_size == 0:
                self._touch(path)
                return fd
            # Not MAP_POPULATE: filling every page table entry up front costs more than the
            # faults, which map 16 pages each (fault-around). The array is the mapping's one
            # owner: a registration with an accelerator ends when it goes (kvstore.pinned).
            array = np.frombuffer(mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ),
                                  dtype=np.uint8)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the mapping keeps the file
        mapped = self._maps.keep(key, st.st_dev, st.st_ino, array)
        self._touch(path)
        return mapped

    def _read(self, fd: int, into: memoryview) -> None:
        size, got = len(into), 0
        while got < size:
            n = os.preadv(fd, [into[got:]], got)
            if n == 0:
                raise StoreUnavailableError(f"shm store record shrank while read ({got} of {size} bytes)")
            got += n

    def get(self, key: str) -> Value | None:  # type: ignore[override]  # FileStore's is bytes only
        path = self._file(key)
        try:
            found = self._mapping(key, path)
            if not isinstance(found, int):
                return None if found is None else found.view
            try:
                out = bytearray(os.fstat(found).st_size)
                self._read(found, memoryview(out))
                return bytes(out)
            finally:
                os.close(found)
        except OSError as exc:
            raise StoreUnavailableError(f"shm store read of {key!r} failed: {exc}") from exc

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """Each value as a borrowed view of its mapping (``map_bytes`` or more), or read into a
        lease of ``pool`` (a borrowed copy when the pool has no room).

        Mapped values are prepared up to ``_AHEAD`` ahead of the caller: each is hashed on
        ``kvstore.buffers.hashers()`` and yielded with its digest pending (``Lease.hash_later``),
        so a caller verifying value i reads its digest while later ones are hashed (xxh3 releases
        the GIL) and one that moves values to a device starts each DMA while it is hashed; and
        a mapping not yet registered with the accelerator is registered on threads of its own,
        several at once, each lease yielded once its registration is known (``Lease.pinned``).
        Values read into the pool stay one ahead. A record file is never written after its
        rename, so the bytes hashed are the bytes placed."""
        ahead: deque[_Pending] = deque()
        try:
            for key in keys:
                ahead.append(self._pending(key, pool))
                while len(ahead) > _AHEAD or (len(ahead) > 1 and ahead[0].ready()):
                    yield ahead.popleft().lease()
            while ahead:
                yield ahead.popleft().lease()
        finally:
            for pending in ahead:  # the caller stopped early
                pending.release()

    def _pending(self, key: str, pool: BufferPool) -> _Pending:
        """``key``'s value on its way to a reader: read into a lease, or a mapping (hashed, and
        registered, on other threads)."""
        path = self._file(key)
        try:
            found = self._mapping(key, path)
            if found is None or isinstance(found, _Mapped):
                if found is None:
                    return _Pending(None)
                mapped = borrow(found.view)
                if len(mapped.view) >= self.shm.map_bytes:
                    mapped.hash_later(hashers().submit(self_digest, mapped.view))
                return _Pending(mapped, self._maps.register(found))
            try:
                size = os.fstat(found).st_size
                lease = pool.lease(size) if size else None
                if lease is None:
                    out = bytearray(size)
                    self._read(found, memoryview(out))
                    return _Pending(borrow(bytes(out)))
                try:
                    self._read(found, lease.view)
                except BaseException:
                    lease.release()
                    raise
                return _Pending(lease)
            finally:
                os.close(found)
        except OSError as exc:
            raise StoreUnavailableError(f"shm store read of {key!r} failed: {exc}") from exc

    def delete(self, key: str) -> bool:
        self._maps.drop(key)
        return super().delete(key)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._file(key))

    def close(self) -> None:
        """Give up this process's temporary directory (the records stay: other processes share them)."""
        with self._writer_lock:
            self._maps.clear()
            if self._writer_pid != os.getpid():
                return  # a fork's copy: the directory is its parent's
            shutil.rmtree(self._writer_dir, ignore_errors=True)
            try:
                os.unlink(f"{self._writer_dir}.alive")
            except FileNotFoundError:
                pass
            os.close(self._writer_alive)
            self._writer_pid = -1

    def describe(self) -> dict[str, Any]:
        return {"store": "shm", "name": self.shm.name, "path": str(self.root), "max_bytes": self.shm.max_bytes}


@dataclass
class _Mapped:
    """One mapping of a record file: its array (the mapping's one owner), a view of it, and its
    registration with an accelerator (started once; it lasts until the array goes)."""

    dev: int
    ino: int
    array: np.ndarray
    view: memoryview
    registration: Future[bool] | None = None


class _Pending:
    """A value ``get_into`` prepared for its reader: a lease, or None for a miss; for a mapping,
    its registration (None: no pinner)."""

    __slots__ = ("_lease", "_registration")

    def __init__(self, lease: Lease | None, registration: Future[bool] | None = None) -> None:
        self._lease, self._registration = lease, registration

    def ready(self) -> bool:
        """Whether ``lease`` would not wait for a registration."""
        return self._registration is None or self._registration.done()

    def lease(self) -> Lease | None:
        """The lease, ``pinned`` once its mapping's registration is known (waits for it)."""
        lease = self._lease
        if lease is not None and self._registration is not None:
            lease.pinned = _registered(self._registration)
        return lease

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()


def _registered(registration: Future[bool]) -> bool:
    try:
        return registration.result()
    except Exception:  # a registration that failed: the mapping is read as pageable memory
        log.warning("registering a shared-memory mapping with the accelerator failed", exc_info=True)
        return False


class _Mappings:
    """This process's mappings of large records, least recently used first, bounded in bytes.

    An entry is valid while the key's file is the one mapped: the same ``(st_dev, st_ino)``. A
    mapping keeps its file's inode alive, so no other file can take that inode number meanwhile.
    With a ``pinner`` each mapping is registered once (``register``: on the ``register`` thread
    pool, started by its first reader since there is one; later readers wait for the same call).
    Mappings dropped from the cache are let go outside the lock (their registration ends on the
    unpin thread, ``kvstore.pinned``).
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()
        self._bytes = 0
        self.pinner: HostPinner | None = None

    def find(self, key: str, dev: int, ino: int) -> _Mapped | None:
        with self._lock:
            entry = self._maps.get(key)
            if entry is None or entry.dev != dev or entry.ino != ino:
                return None
            self._maps.move_to_end(key)
        return entry

    def keep(self, key: str, dev: int, ino: int, array: np.ndarray) -> _Mapped:
        """A new mapping of ``key``'s file (``array``), cached if it fits; the one another reader
        cached meanwhile, if it maps the same file (one mapping, one registration)."""
        entry = _Mapped(dev, ino, array, array_view(array))
        dropped: list[_Mapped] = []
        with self._lock:
            found = self._maps.get(key)
            if found is not None and found.dev == dev and found.ino == ino:
                self._maps.move_to_end(key)
                return found
            self._pop(key, dropped)
            if len(entry.view) <= self._max:
                self._maps[key] = entry
                self._bytes += len(entry.view)
                while self._bytes > self._max:
                    old = self._maps.popitem(last=False)[1]
                    self._bytes -= len(old.view)
                    dropped.append(old)
        del dropped  # let go here, not under the lock
        return entry

    def register(self, entry: _Mapped) -> Future[bool] | None:
        """``entry``'s registration with the pinner (started now if it was not: on the register
        pool), or None without a pinner."""
        pinner = self.pinner
        if pinner is None:
            return None
        with self._lock:
            if entry.registration is None:
                entry.registration = thread_pool("register").submit(pinner.pin, entry.array, read_only=True)
            return entry.registration

    def drop(self, key: str) -> None:
        dropped: list[_Mapped] = []
        with self._lock:
            self._pop(key, dropped)
        del dropped

    def _pop(self, key: str, dropped: list[_Mapped]) -> None:
        old = self._maps.pop(key, None)
        if old is not None:
            self._bytes -= len(old.view)
            dropped.append(old)

    def clear(self) -> None:
        with self._lock:
            dropped, self._maps = self._maps, OrderedDict()
            self._bytes = 0
        del dropped
