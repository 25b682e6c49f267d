"""Loads and saves beside a busy Python thread, at CPython's thread switch interval and at
kvstore's (the adapters' ``switch_interval`` option, ``kvstore.connectors.gil``).

An engine's own thread runs Python most of the time (scheduling, preparing inputs, sampling);
kvstore's transfers run on threads beside it, and every system call they make gives the GIL up
and must take it back. This measures what that costs, in one process, in the same rounds:

  alone                 the transfer with no other Python thread running
  busy thread           the same while another thread counts in a Python loop (the worst case
                        of an engine thread: pure Python, never waiting)

each at a switch interval of 5 ms (CPython's default) and 0.5 ms (kvstore's), for a
``KVTransfer`` load and save of one Llama-3-8B-shaped prefix (32 layers, 8 KV heads, head size
128, bf16; ``--tokens`` tokens in chunks of ``--chunk``) through one redis-server and through
``shm://``. It also prints how fast the busy thread counted during the transfers, against the
same thread alone just before (0.2 s, same interval): what the engine's thread gives up.

GB/s = 10^9 bytes of KV per second, median [min-max] of ``--reps`` rounds after a warm-up.

    python benchmarks/bench_gil.py [--reps 5] [--tokens 1024] [--chunk 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import machine

from kvstore.connectors.gil import DEFAULT_SWITCH_INTERVAL
from kvstore.keys import Namespace
from kvstore.paged import FlashLayout, KVTransfer, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.stores.redis import RedisStore
from kvstore.stores.shm import ShmStore

LAYERS, HEADS, HEAD, BLOCK = 32, 8, 128, 16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD * 2
INTERVALS = {"5 ms (CPython)": 0.005, f"{DEFAULT_SWITCH_INTERVAL * 1e3:g} ms (kvstore)": DEFAULT_SWITCH_INTERVAL}


class Busy:
    """A thread counting in a Python loop until stopped; ``rate`` is its count per second."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.count = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.count += 1

    def __enter__(self) -> Busy:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rate = self.count / (time.perf_counter() - self._start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    print(machine())
    before = sys.getswitchinterval()
    server = servers.RedisServer()
    shm = ShmStore.from_url(f"shm://bench-gil-{os.getpid()}?max_bytes=2GiB")
    try:
        run(args, {"redis": RedisStore.from_url(server.url + "?timeout=5s"), "shm": shm})
    finally:
        sys.setswitchinterval(before)
        shm.close()
        shutil.rmtree(shm.root, ignore_errors=True)
        server.stop()


def run(args: argparse.Namespace, stores: dict) -> None:
    n = args.tokens
    blocks = 2 * n // BLOCK
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128000, n, dtype=np.uint32)
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(2, blocks, BLOCK, HEADS, HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros_like(c) for c in src]
    src_slots = slots_from_block_table(rng.permutation(blocks)[:n // BLOCK].tolist(), BLOCK, n)
    dst_slots = slots_from_block_table(rng.permutation(blocks)[:n // BLOCK].tolist(), BLOCK, n)
    ns = Namespace(model="bench-gil", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=BLOCK,
                   chunk_tokens=args.chunk, layer_end=LAYERS)
    gb = n * TOKEN_BYTES / 1e9
    print(f"\n{n} tokens: {gb * 1e3:.0f} MB of KV in records of {args.chunk} tokens\n")
    print("| tier | op | switch interval | alone GB/s | beside a busy thread GB/s | x alone | busy thread's speed meanwhile |")
    print("|---|---|---|---|---|---|---|")
    for name, store in stores.items():
        saver = KVTransfer(PrefixCache(store, ns), src, FlashLayout())
        loader = KVTransfer(PrefixCache(store, ns), dst, FlashLayout())

        def save() -> None:
            assert saver.save_sequence(tokens, src_slots, from_token=0) > 0
            store.flush(60)

        def load() -> None:
            assert loader.load_sequence(tokens, dst_slots)[0] == n

        save()
        ops = {"load": load, "save": save}
        times = {(op, iv, busy): [] for op in ops for iv in INTERVALS for busy in (False, True)}
        speed = {(op, iv): [] for op in ops for iv in INTERVALS}
        for rep in range(args.reps + 1):
            for (op, iv, busy), ts in times.items():
                sys.setswitchinterval(INTERVALS[iv])
                if busy:  # the busy thread's own speed now, alone, as the reference for this round
                    with Busy() as ref:
                        time.sleep(0.2)
                if busy:
                    with Busy() as b:
                        t = time.perf_counter()
                        ops[op]()
                        dt = time.perf_counter() - t
                else:
                    t = time.perf_counter()
                    ops[op]()
                    dt = time.perf_counter() - t
                if rep:
                    ts.append(dt)
                    if busy:
                        speed[op, iv].append(b.rate / ref.rate)
        for op in ops:
            for iv in INTERVALS:
                a = sorted(gb / t for t in times[op, iv, False])
                w = sorted(gb / t for t in times[op, iv, True])
                ma, mw = statistics.median(a), statistics.median(w)
                print(f"| {name} | {op} | {iv} | {ma:.2f} [{a[0]:.2f}-{a[-1]:.2f}] | {mw:.2f} [{w[0]:.2f}-{w[-1]:.2f}] | "
                      f"{mw / ma:.2f} | {statistics.median(speed[op, iv]):.2f} of alone |", flush=True)


if __name__ == "__main__":
    main()
