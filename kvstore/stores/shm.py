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
import mmap
import os
import re
import shutil
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import xxhash

from kvstore.buffers import SELF_CHECK_BYTES, BufferPool, Lease, borrow
from kvstore.config import build, check_options, option, query_options
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.stores.base import LeaseStream, Place, Value
from kvstore.stores.file import FileConfig, FileStore

__all__ = ["ShmConfig", "ShmStore"]

_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$", re.ASCII)
_ORPHAN_SECONDS = 60.0  # a writer directory without its lock file (a reaper that died) is removed after this


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
        self._hash_pool: ThreadPoolExecutor | None = None
        self._hash_pid = -1
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

    def _mapping(self, key: str, path: str | Path) -> memoryview | int | None:
        """``key``'s record as a view of a mapping if it is ``map_bytes`` or larger (the cached
        one while the file is the same), else an open descriptor; None on a miss."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._maps.drop(key)
            return None
        if st.st_size >= self.shm.map_bytes and st.st_size > 0:
            view = self._maps.find(key, st.st_dev, st.st_ino)
            if view is not None:
                self._touch(path)
                return view
        fd = self._open(path)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)  # the file opened, whichever was renamed into place last
            if st.st_size < self.shm.map_bytes or st.st_size == 0:
                self._touch(path)
                return fd
            # Not MAP_POPULATE: filling every page table entry up front costs more than the
            # faults, which map 16 pages each (fault-around).
            view = memoryview(mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the mapping keeps the file
        self._maps.keep(key, st.st_dev, st.st_ino, view)
        self._touch(path)
        return view

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
                return found
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

        A mapped value is hashed (``Lease.digest``) on a thread of the store's one value ahead of
        the caller: while the caller verifies and places value i, value i+1 is hashed (xxh3
        releases the GIL), so a load reads each record's bytes once in its own thread. A record
        file is never written after its rename, so the bytes hashed are the bytes placed."""
        ahead: deque[tuple[Lease | None, Future[bytes | None] | None]] = deque()
        try:
            for key in keys:
                lease = self._lease(key, pool)
                hashing = None
                if lease is not None and lease.digest is None and len(lease.view) >= self.shm.map_bytes:
                    hashing = self._hasher().submit(_digest, lease.view)
                ahead.append((lease, hashing))
                if len(ahead) > 1:
                    yield _finish(*ahead.popleft())
            while ahead:
                yield _finish(*ahead.popleft())
        finally:
            for lease, hashing in ahead:  # the caller stopped early
                if hashing is not None:
                    hashing.cancel()
                if lease is not None:
                    lease.release()

    def _hasher(self) -> ThreadPoolExecutor:
        """This process's hashing thread (a fork gets its own)."""
        with self._writer_lock:
            if self._hash_pool is None or self._hash_pid != os.getpid():
                self._hash_pool, self._hash_pid = ThreadPoolExecutor(1, thread_name_prefix="kvstore-shm-hash"), os.getpid()
            return self._hash_pool

    def _lease(self, key: str, pool: BufferPool) -> Lease | None:
        path = self._file(key)
        try:
            found = self._mapping(key, path)
            if found is None or isinstance(found, memoryview):
                return None if found is None else borrow(found)
            try:
                size = os.fstat(found).st_size
                lease = pool.lease(size) if size else None
                if lease is None:
                    out = bytearray(size)
                    self._read(found, memoryview(out))
                    return borrow(bytes(out))
                try:
                    self._read(found, lease.view)
                except BaseException:
                    lease.release()
                    raise
                return lease
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
            if self._hash_pool is not None and self._hash_pid == os.getpid():
                self._hash_pool.shutdown(wait=True)
            self._hash_pool = None
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


def _digest(view: memoryview) -> bytes | None:
    """``Lease.digest`` of a whole value: xxh3-64 of all but its last ``SELF_CHECK_BYTES``."""
    return xxhash.xxh3_64_digest(view[:len(view) - SELF_CHECK_BYTES]) if len(view) >= SELF_CHECK_BYTES else None


def _finish(lease: Lease | None, hashing: Future[bytes | None] | None) -> Lease | None:
    if lease is not None and hashing is not None:
        lease.digest = hashing.result()
    return lease


class _Mappings:
    """This process's mappings of large records, least recently used first, bounded in bytes.

    An entry is valid while the key's file is the one mapped: the same ``(st_dev, st_ino)``. A
    mapping keeps its file's inode alive, so no other file can take that inode number meanwhile.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, tuple[int, int, memoryview]] = OrderedDict()
        self._bytes = 0

    def find(self, key: str, dev: int, ino: int) -> memoryview | None:
        with self._lock:
            entry = self._maps.get(key)
            if entry is None or entry[0] != dev or entry[1] != ino:
                return None
            self._maps.move_to_end(key)
            return entry[2]

    def keep(self, key: str, dev: int, ino: int, view: memoryview) -> None:
        with self._lock:
            self._pop(key)
            if len(view) > self._max:
                return
            self._maps[key] = (dev, ino, view)
            self._bytes += len(view)
            while self._bytes > self._max:
                self._bytes -= len(self._maps.popitem(last=False)[1][2])

    def drop(self, key: str) -> None:
        with self._lock:
            self._pop(key)

    def _pop(self, key: str) -> None:
        old = self._maps.pop(key, None)
        if old is not None:
            self._bytes -= len(old[2])

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._bytes = 0
