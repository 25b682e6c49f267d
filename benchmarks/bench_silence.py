"""How long a socket of a ``get_into`` batch waits without a byte, by connection count.

Redis builds the reply of every command it has read before it sends any of it, so the bytes a
batch has requested ahead are bytes the server copies while the client's sockets hear nothing.
That wait is what a read deadline (the Redis store's ``timeout``) must outlast. This script
times every ``recv`` of ``get_into`` batches of 16 values and prints, per connection count,
the median and the maximum over the batches of each batch's longest wait, with the batch's
GB/s. The deadline is raised to 10 s here, so that nothing fails while measuring.

    python benchmarks/bench_silence.py [--mib 32] [--batches 8] [--connections 1,2,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import machine

from kvstore.buffers import BufferPool
from kvstore.stores.redis import RedisStore, hooks

N = 16
waits: list[float] = []


class _TimedSocket:
    """The two receive calls ``DirectReplies`` makes, timed."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def _timed(self, call: Any, arg: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(arg)
        finally:
            waits.append(time.perf_counter() - t0)

    def recv(self, n: int) -> bytes:
        data: bytes = self._timed(self._sock.recv, n)
        return data

    def recv_into(self, view: memoryview) -> int:
        got: int = self._timed(self._sock.recv_into, view)
        return got


class _TimedReplies(hooks.DirectReplies):
    def __init__(self, sock: Any) -> None:
        super().__init__(_TimedSocket(sock))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=32, help="value size, MiB")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--connections", default="1,2,4,8")
    args = parser.parse_args()
    size = args.mib << 20
    hooks.DirectReplies = _TimedReplies  # type: ignore[misc]  # the store builds its readers from here
    print(machine())
    print(f"{N} values of {args.mib} MiB per batch, {args.batches} batches per row\n")
    print("| connections | longest wait per batch, ms: median / max | GB/s, median |\n|---|---|---|")
    server = servers.RedisServer()
    try:
        values = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(N)]
        pool = BufferPool(max_bytes=N * size + (64 << 20))
        for n in (int(c) for c in args.connections.split(",")):
            store = RedisStore.from_url(f"redis://127.0.0.1:{server.port}/0?connections={n}&timeout=10s")
            try:
                store.put_many([(f"silence/{i}", v) for i, v in enumerate(values)])
                longest, rates = [], []
                for _ in range(args.batches + 1):  # the first batch sizes the waves: not counted
                    waits.clear()
                    t0 = time.perf_counter()
                    for lease in store.get_into([f"silence/{i}" for i in range(N)], pool):
                        lease.release()
                    rates.append(N * size / (time.perf_counter() - t0) / 1e9)
                    longest.append(max(waits))
                longest, rates = longest[1:], rates[1:]
                print(f"| {n} | {1000 * statistics.median(longest):.0f} / {1000 * max(longest):.0f} "
                      f"| {statistics.median(rates):.2f} |", flush=True)
            finally:
                store.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
