"""Mooncake's Python client (``mooncake.store.MooncakeDistributedStore``) as this package uses it:
one per process and set of settings (``Connection.shared``), set up on a thread of its own when
the first call needs it (building a store does no network I/O), every call on a worker thread
with a deadline, and its integer answers sorted into hits, misses and outages.

Why a worker thread: the client's calls block. A frozen master (SIGSTOP) holds each of them for
the client's RPC timeout (30 s), and its ``setup`` retries a master that does not answer for
about 90 s, holding the interpreter's lock all along (so do its ``close``, for a second or two):
a set-up is tried only once the master's RPC port and metadata server answer from Python. A caller waits at most its deadline, then gets ``StoreTimeoutError`` (the tiered
store's breaker skips the tier at once); the call itself runs to its end on its thread, and
whatever it holds (a lease it writes into, a value it reads) is let go only then.

Why one client per process: each client mounts its own segment on the master and starts its own
transfer engine; every store over the same master and settings in a process shares one
(reference-counted), so an engine process contributes one segment however many stores it opens.
Closing a client takes the library a second or two (it joins its heartbeat): the last store to
let go closes it on a daemon thread, once no call uses it any more (the library frees what a
running call still uses). A forked child makes a client of its own.

Answers: ``>= 0`` is success (bytes moved, for reads); the codes of ``MISSES`` say the object
cannot be read (absent, evicted, its lease expired, its segment's owner gone): a miss; ``RPC``
codes say the master did not answer: an outage.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from kvstore.errors import StoreTimeoutError, StoreUnavailableError
from kvstore.stores.mooncake.config import MooncakeConfig
from kvstore.stores.mooncake.memory import Registrations

try:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
except ImportError as _exc:  # the wheel, or the system libraries its binaries need even over TCP
    if "libibverbs" in str(_exc) or "librdmacm" in str(_exc):
        raise ImportError(f"{_exc}: Mooncake's client needs libibverbs1 and librdmacm1 even over TCP "
                          "(apt-get install libibverbs1 librdmacm1)") from _exc
    raise

__all__ = ["Connection", "Settings", "MISSES", "NOT_FOUND", "describe_code", "ReplicateConfig"]

log = logging.getLogger(__name__)

NOT_FOUND = -704
NO_SPACE = -200
#: Codes of a read or lookup that mean "this object cannot be read now": a miss.
MISSES = {
    -101: "SEGMENT_NOT_FOUND", -600: "INVALID_PARAMS (the object grew since its size was read)",
    -701: "INVALID_READ", -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY", NOT_FOUND: "OBJECT_NOT_FOUND",
    -707: "LEASE_EXPIRED", -710: "REPLICA_NOT_FOUND", -712: "REPLICA_IS_GONE", -713: "REPLICA_NOT_IN_LOCAL_MEMORY",
    -714: "REPLICA_IS_PROCESSING", -800: "TRANSFER_FAIL (the segment's owner is gone)",
}
#: Codes of a write that another writer of the same key explains: the key is being or was written.
RACES = {-705: "OBJECT_ALREADY_EXISTS", -714: "REPLICA_IS_PROCESSING"}
#: Codes that say the master did not answer (or not in time).
RPC_FAIL, RPC_TIMEOUT = -900, -901
_NAMES = {**MISSES, **RACES, NO_SPACE: "NO_AVAILABLE_HANDLE (no room in the pool)", RPC_FAIL: "RPC_FAIL",
          RPC_TIMEOUT: "RPC_TIMEOUT", -1: "INTERNAL_ERROR", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT",
          -1010: "UNAVAILABLE_IN_CURRENT_STATUS", -1011: "UNAVAILABLE_IN_CURRENT_MODE"}
_RETRY_SETUP = 1.0  # seconds between set-up attempts after one failed
_PROBE_TIMEOUT = 1.0  # seconds for each of the two checks before a set-up
_CLOSE_WAIT = 120.0  # seconds a closing client waits for its running calls (the client's RPC timeout is 30 s)


def describe_code(code: int) -> str:
    return f"{code} ({_NAMES.get(code, 'error')})"


@dataclass(frozen=True)
class Settings:
    """What a client is set up with: stores with equal settings in one process share it."""

    master: str
    metadata: str
    protocol: str
    device: str
    segment: int
    host: str

    @classmethod
    def of(cls, config: MooncakeConfig) -> Settings:
        return cls(config.master, config.metadata_url, config.protocol, config.device, config.segment, config.host)


def local_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (a UDP socket's ``connect`` sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostname()


class Connection:
    """One set-up client and what belongs to it (its registrations); see the module docstring."""

    _shared: dict[tuple[int, Settings], Connection] = {}
    _shared_lock = threading.Lock()

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.where = f"mooncake://{settings.master}"
        self._refs = 0
        self._lock = threading.Lock()
        self._client: Any = None
        self._setup: Future[Any] | None = None
        self._failed_at = 0.0
        self._error = ""
        self._closed = False
        self._busy = 0  # calls sent or running: the client is closed only once none is
        self._idle = threading.Condition(self._lock)
        # Set-up and close run on threads of their own: a set-up that waits for a master must
        # not hold a thread that calls are waiting for.
        self._setups = ThreadPoolExecutor(1, thread_name_prefix="kvstore-mooncake-setup")
        self.registrations = Registrations(self._register, self._unregister)

    # -- sharing --------------------------------------------------------------------------------
    @classmethod
    def shared(cls, config: MooncakeConfig) -> Connection:
        """This process's connection for ``config``'s settings (a new reference: ``release`` it)."""
        key = (os.getpid(), Settings.of(config))
        with cls._shared_lock:
            conn = cls._shared.get(key)
            if conn is None or conn._closed:
                conn = cls._shared[key] = Connection(key[1])
            conn._refs += 1
            return conn

    def release(self) -> None:
        """Drop a reference; the last one closes the client on a daemon thread."""
        with Connection._shared_lock:
            self._refs -= 1
            if self._refs > 0:
                return
            Connection._shared.pop((os.getpid(), self.settings), None)
        self._close()

    # -- set-up ---------------------------------------------------------------------------------
    def _start(self) -> None:
        """Start setting the client up in the background unless it is, or was a moment ago."""
        with self._lock:
            if self._client is not None or self._closed or (self._setup is not None and not self._setup.done()):
                return
            if self._failed_at and time.monotonic() - self._failed_at < _RETRY_SETUP:
                return
            self._setup = self._setups.submit(self._set_up)

    def _set_up(self) -> Any:
        s = self.settings
        host, _, port = s.master.rpartition(":")
        self._probe(host, int(port))
        me = s.host or local_address(host, int(port))
        client = MooncakeDistributedStore()
        # local_buffer_size 0: every call this package makes moves bytes between its own buffers
        # and the segments (zero-copy calls); the client's staging buffer would only hold memory.
        rc = client.setup(me, s.metadata, s.segment, 0, s.protocol, s.device, s.master)
        with self._lock:
            if rc != 0 or self._closed:
                self._failed_at = time.monotonic()
                self._error = "closed" if rc == 0 else (
                    f"set-up failed ({describe_code(rc)}): is mooncake_master running at {s.master}, with its "
                    f"metadata server at {s.metadata}?")
                threading.Thread(target=client.close, name="kvstore-mooncake-close", daemon=True).start()
                raise StoreUnavailableError(f"{self.where}: {self._error}")
            self._client = client
            self._failed_at = 0.0
        log.info("mooncake: client set up on %s (master %s, %s, segment %d bytes)", me, s.master, s.protocol,
                 s.segment)
        return client

    def _probe(self, host: str, port: int) -> None:
        """Whether the master answers at all, asked from Python before the client's ``setup``:
        that call holds the interpreter's lock while it retries a master that does not answer
        (about 90 s: every thread of the process stops). A TCP connect to the master's RPC port
        finds a dead one; an HTTP request to the metadata server (the master's own, usually) a
        frozen one, whose kernel still accepts connections."""
        try:
            socket.create_connection((host, port), timeout=_PROBE_TIMEOUT).close()
        except OSError as exc:
            self._failed(f"the master at {self.settings.master} does not answer ({exc})")
        try:
            urllib.request.urlopen(f"{self.settings.metadata}?key=kvstore-probe", timeout=_PROBE_TIMEOUT).close()
        except urllib.error.HTTPError:
            pass  # it answered (a missing key is a 404)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self._failed(f"the metadata server at {self.settings.metadata} does not answer ({exc})")

    def _failed(self, why: str) -> None:
        with self._lock:
            self._failed_at = time.monotonic()
            self._error = why
        raise StoreUnavailableError(f"{self.where}: {why}")

    def client(self, end: float) -> Any:
        """The set-up client, waiting for its set-up until ``end`` (``time.monotonic``) at most."""
        client = self._client
        if client is not None:
            return client
        if self._closed:
            raise StoreUnavailableError(f"{self.where}: closed")
        self._start()
        setup = self._setup
        if setup is None:
            raise StoreUnavailableError(f"{self.where}: {self._error or 'not set up'}")
        try:
            return setup.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:
            raise StoreTimeoutError(f"{self.where}: the client is not set up yet (is the master up?)") from None

    def enter(self) -> None:
        """A call is about to use the client (``StoreUnavailableError`` once it is closing)."""
        with self._lock:
            if self._closed:
                raise StoreUnavailableError(f"{self.where}: closed")
            self._busy += 1

    def leave(self) -> None:
        """That call has ended (or was cancelled before it ran)."""
        with self._lock:
            self._busy -= 1
            if not self._busy:
                self._idle.notify_all()

    def _register(self, address: int, size: int) -> int:
        client = self._client
        if client is None:
            return -600
        self.enter()
        try:
            return int(client.register_buffer(address, size))
        finally:
            self.leave()

    def _unregister(self, address: int) -> int:
        client = self._client
        if client is None:
            return 0
        try:
            self.enter()
        except StoreUnavailableError:
            return 0  # closing: the registration ends with the client
        try:
            return int(client.unregister_buffer(address))
        finally:
            self.leave()

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            setup = self._setup
        self.registrations.close()
        if setup is None and client is None:  # never used: nothing was set up
            self._setups.shutdown(wait=False)
            return

        def close() -> None:
            # Never under a running call: the library frees what the call still uses. Calls end
            # by the client's own timeouts; one that does not is left with its client, unclosed.
            with self._lock:
                if not self._idle.wait_for(lambda: self._busy == 0, timeout=_CLOSE_WAIT):
                    log.warning("mooncake: %d calls still running after %gs: the client is left open",
                                self._busy, _CLOSE_WAIT)
                    return
            if setup is not None and client is None:
                try:  # a set-up still running: close what it makes
                    made = setup.result()
                except Exception:  # noqa: BLE001 - it failed: nothing to close
                    return
                made.close()
            elif client is not None:
                client.close()

        self._setups.shutdown(wait=False)
        threading.Thread(target=close, name="kvstore-mooncake-close", daemon=True).start()


def outage(where: str, code: int, what: str) -> StoreUnavailableError:
    """The error for a call the master did not answer: ``StoreTimeoutError`` for its timeout."""
    cls = StoreTimeoutError if code == RPC_TIMEOUT else StoreUnavailableError
    return cls(f"{where}: {what} failed: {describe_code(code)}")


def is_outage(code: int) -> bool:
    """Whether a read's or lookup's code says the master (or the client) failed, not the object."""
    return code < 0 and code not in MISSES
