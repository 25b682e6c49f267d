"""The physical ceiling of one redis-server here: a raw zero-copy RESP client.

Preallocated (touched) buffers, ``sendall`` of memoryviews for SET values, ``recv_into`` the
caller's buffers for GET replies, one pipelined batch per call, one connection. No validation, no
copies, no allocation on the hot path: what kvstore's paths are quoted against
(``ratio to raw``). Benchmarks only; it trusts the server completely.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence


class RawRedis:
    """One TCP connection to ``host:port``, speaking just enough RESP for SET and GET."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    # -- replies ------------------------------------------------------------------------------
    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def _bulk_into(self, out: memoryview) -> int | None:
        line = self._line()
        if line == b"$-1":
            return None
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        size = int(line[1:])
        have = min(size, len(self._buf))
        out[:have] = self._buf[:have]
        del self._buf[:have]
        while have < size:
            n = self.sock.recv_into(out[have:size])
            if not n:
                raise ConnectionError("server closed the connection mid-value")
            have += n
        while len(self._buf) < 2:
            self._buf += self.sock.recv(2)
        del self._buf[:2]
        return size

    # -- commands -----------------------------------------------------------------------------
    def set_many(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Pipelined SETs: each value sent straight from the caller's buffer."""
        for key, value in items:
            self.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value)))
            self.sock.sendall(value)
            self.sock.sendall(b"\r\n")
        for _ in items:
            line = self._line()
            if line != b"+OK":
                raise ConnectionError(f"SET failed: {line!r}")

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int | None]:
        """Pipelined GETs, each reply received into the matching preallocated buffer."""
        self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        return [self._bulk_into(buf) for buf in buffers]

    def flushall(self) -> None:
        self.sock.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
        self._line()
