"""Does hashing on a pool of threads run in parallel? xxh3-64 of 8 records of 32 MiB (a 2,048-token
Llama-3-8B prefix, 268 MB) on one thread, one after another, against the same hashes on a pool of
``--threads`` threads: through a streaming hasher's ``update`` (``kvstore.buffers.xxh3_digest``,
what kvstore uses: it releases the GIL in every xxhash release) and through the one-shot
``xxh3_64_digest`` (it held the GIL before xxhash 4.0, so on 3.x a pool hashed one record at a
time). A control, sha256 of the same records (compute-bound, and it releases the GIL), says whether
the machine has a second core to give at all: where it does not scale either, neither can xxh3.
Every configuration runs in every round (round-robin); median [min-max] of ``--reps``.

    python benchmarks/bench_hash_threads.py [--reps 7] [--threads 2] [--records 8] [--mib 32]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine

from kvstore.buffers import xxh3_digest


def _sha256(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    records = [memoryview(rng.integers(0, 255, args.mib << 20, dtype=np.uint8)) for _ in range(args.records)]
    nbytes = sum(len(r) for r in records)
    pool = ThreadPoolExecutor(args.threads)

    def serial(fn: Callable[[memoryview], bytes]) -> Callable[[], object]:
        return lambda: [fn(r) for r in records]

    def pooled(fn: Callable[[memoryview], bytes]) -> Callable[[], object]:
        return lambda: list(pool.map(fn, records))

    configs = {
        "1 thread, update() (xxh3_digest)": serial(xxh3_digest),
        f"{args.threads} threads, update() (xxh3_digest)": pooled(xxh3_digest),
        "1 thread, one-shot xxh3_64_digest": serial(xxhash.xxh3_64_digest),
        f"{args.threads} threads, one-shot xxh3_64_digest": pooled(xxhash.xxh3_64_digest),
        "control: 1 thread, sha256": serial(_sha256),
        f"control: {args.threads} threads, sha256": pooled(_sha256),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for fn in configs.values():
        fn()  # warm-up: pages and threads
    for _ in range(args.reps):
        for name, fn in configs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    pool.shutdown()
    print(f"{machine()}; xxhash {xxhash.VERSION}; {args.records} x {args.mib} MiB = {nbytes / 1e6:.0f} MB, "
          f"median [min-max] of {args.reps}, round-robin\n")
    print("| how | s | GB/s | x 1 thread, same function |\n|---|---|---|---|")
    names = list(configs)
    for i, name in enumerate(names):
        ts = sorted(times[name])
        base = sorted(times[names[i - i % 2]])
        ratio = f"{statistics.median(base) / statistics.median(ts):.2f}" if i % 2 else "1.00"
        print(f"| {name} | {statistics.median(ts):.4f} [{ts[0]:.4f}-{ts[-1]:.4f}] | "
              f"{nbytes / statistics.median(ts) / 1e9:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
