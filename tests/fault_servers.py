"""Fault helpers on loopback: a server that accepts and never answers, a proxy that holds
uploads, and a store wrapper that counts the calls reaching a tier (who made them, how they
ended). They let fault tests assert counts instead of wall-clock times."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

from kvstore.errors import StoreTimeoutError, StoreUnavailableError
from kvstore.stores.base import WrapperStore


class BlackHole:
    """Listens on a loopback port, accepts every connection, reads and never answers (a frozen
    server that the kernel still accepts connections for). ``connections`` counts attempts."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.connections = 0
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            self._open.append(conn)  # kept open, never read back to: the client waits for a reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for conn in self._open:
            conn.close()
        self._sock.close()


class HoldingProxy:
    """Forwards TCP to ``target_port``; a connection that sends bytes containing ``marker``
    (``b"PUT "`` for S3 uploads, ``b"$3\\r\\nSET\\r\\n"`` for Redis SETs) is held from then on,
    unanswered, until ``release()``. ``held`` counts held connections."""

    def __init__(self, target_port: int, marker: bytes) -> None:
        self.target_port, self.marker = target_port, marker
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.held = 0
        self._released = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self._sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                conn.close()
                continue
            threading.Thread(target=self._pump, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        holding = False
        try:
            while data := src.recv(1 << 16):
                if from_client and not holding and self.marker in data and not self._released.is_set():
                    holding = True
                    with self._lock:
                        self.held += 1
                    self._released.wait(60)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self.release()
        self._stop.set()
        self._sock.close()


@dataclass
class CallLog:
    """What a ``Counting`` store saw: ``(op, thread name, outcome)`` per call, in the order the
    calls started (``outcome`` is ``pending`` until the call returns)."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, op: str) -> int:
        with self.lock:
            self.calls.append((op, threading.current_thread().name, "pending"))
            return len(self.calls) - 1

    def finish(self, index: int, outcome: str) -> None:
        with self.lock:
            op, thread, _ = self.calls[index]
            self.calls[index] = (op, thread, outcome)

    def count(self, *, thread: str | None = None, outcome: str | None = None, since: int = 0) -> int:
        with self.lock:
            return sum(1 for _, t, o in self.calls[since:]
                       if (thread is None or t == thread or t.startswith(thread + "-"))
                       and (outcome is None or o == outcome))

    def summary(self, since: int = 0) -> Counter[tuple[str, str, str]]:
        with self.lock:
            return Counter(self.calls[since:])

    def __len__(self) -> int:
        return len(self.calls)


class Counting(WrapperStore):
    """Forwards to ``inner`` and logs every call that reached it: thread and outcome
    (``ok``, ``timeout`` for ``StoreTimeoutError``, ``unavailable``, ``error``)."""

    _OPS = ("get", "put", "delete", "exists", "exists_many", "get_many", "put_many", "delete_many",
            "longest_prefix", "size_many")

    def __init__(self, inner, log: CallLog | None = None) -> None:
        super().__init__(inner)
        self.log = log if log is not None else CallLog()
        for op in self._OPS:
            setattr(self, op, self._counted(op, getattr(inner, op)))
        self.get_into = self._counted_stream(inner.get_into)

    def _counted(self, op, method):
        def call(*args, **kwargs):
            index = self.log.start(op)
            try:
                result = method(*args, **kwargs)
            except StoreTimeoutError:
                self.log.finish(index, "timeout")
                raise
            except StoreUnavailableError:
                self.log.finish(index, "unavailable")
                raise
            except Exception:
                self.log.finish(index, "error")
                raise
            self.log.finish(index, "ok")
            return result

        return call

    def _counted_stream(self, method):
        """``get_into`` is a generator: the call is logged when its stream has run (or failed)."""
        counted = self._counted("get_into", lambda *args: list(method(*args)))

        def call(keys, pool, place=None):
            leases = counted(keys, pool) if place is None else counted(keys, pool, place)
            try:
                while leases:
                    yield leases.pop(0)
            finally:
                for lease in leases:  # the consumer stopped early: what it never took goes back
                    if lease is not None:
                        lease.release()

        return call
