"""A loopback TCP proxy that adds distance: a one-way delay and a bandwidth cap per connection.

``ShapedProxy(target_port, delay=0.002, rate=100e6)`` listens on a free loopback port and
forwards every connection to ``127.0.0.1:target_port``. Each direction of each connection
delivers a byte no sooner than ``delay`` seconds after it arrived and no faster than ``rate``
bytes per second, so a request/response costs one round trip of ``2 * delay`` plus its bytes
over the cap, like a real network link (and unlike a proxy that sleeps per packet, which would
also cut throughput). For tests and benchmarks; loopback only.
"""

from __future__ import annotations

import collections
import socket
import threading
import time


class _Pipe:
    """One direction of one connection: a reader that timestamps chunks, a writer that delivers them."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float, rate: float) -> None:
        self.src, self.dst, self.delay, self.rate = src, dst, delay, rate
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.carried = 0  # bytes read from ``src`` so far
        self.cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        due = 0.0
        try:
            while chunk := self.src.recv(1 << 16):
                now = time.monotonic()
                due = max(now + self.delay, due + len(chunk) / self.rate)
                self.carried += len(chunk)
                with self.cond:
                    self.queue.append((due, chunk))
                    self.cond.notify()
        except OSError:
            pass
        with self.cond:
            self.closed = True
            self.cond.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait()
                    if not self.queue:
                        break
                    due, chunk = self.queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(chunk)
        except OSError:
            pass
        for s in (self.dst, self.src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ShapedProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target_port`` with ``delay`` and ``rate`` per direction."""

    def __init__(self, target_port: int, *, delay: float = 0.0, rate: float = 1e12) -> None:
        self.target_port, self.delay, self.rate = target_port, delay, rate
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open = True
        self._upstream: list[_Pipe] = []  # client to server, one per connection, in accept order
        self._downstream: list[_Pipe] = []  # server to client, likewise
        threading.Thread(target=self._accept, daemon=True).start()

    def shape(self, *, delay: float, rate: float) -> None:
        """Shape connections accepted from now on with ``delay`` and ``rate`` (open ones keep theirs)."""
        self.delay, self.rate = delay, rate

    def bytes_sent(self) -> list[int]:
        """Bytes each connection has sent towards the server so far, in the order they connected."""
        return [pipe.carried for pipe in self._upstream]

    def bytes_received(self) -> list[int]:
        """Bytes each connection has carried back from the server so far, in the order they connected."""
        return [pipe.carried for pipe in self._downstream]

    def _accept(self) -> None:
        while self._open:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the server is gone (a test stopped it): the client sees a dead link
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._upstream.append(_Pipe(client, server, self.delay, self.rate))
            self._downstream.append(_Pipe(server, client, self.delay, self.rate))

    def close(self) -> None:
        self._open = False
        self._listener.close()
