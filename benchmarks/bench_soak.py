"""Memory stays bounded: RSS over many save+load cycles through the buffer pool, in one process.

Each cycle saves a new 512-token prefix (Llama-shaped but small: 4 layers, 8 KV heads, head
size 128, bf16: 2 chunks of 4 MiB) from a paged cache through ``KVTransfer`` into a tiered store
(a 64 MiB memory tier over Redis: the memory tier evicts, Redis keeps everything with a TTL),
waits for the background write to Redis, then loads the prefix back into another paged cache
from Redis (the memory tier's copy is dropped first, so every load crosses the wire). RSS is
read after a warm-up and every 1,000 cycles; the pool's counters show that buffers were reused,
not allocated. (Saves faster than the shared tier can take them queue up to ``queue_bytes``,
by design: this benchmark waits for each write so that it measures the steady state.)

    python benchmarks/bench_soak.py [--cycles 10000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import machine

from kvstore.buffers import BufferPool
from kvstore.keys import Namespace
from kvstore.paged import FlashLayout, KVTransfer, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.stores import open_store

LAYERS, HEADS, HEAD, BLOCK, BLOCKS, TOKENS, CHUNK = 4, 8, 128, 16, 64, 512, 256


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=10000)
    parser.add_argument("--warmup", type=int, default=500)
    args = parser.parse_args()
    print(machine(), flush=True)
    server = servers.RedisServer()
    try:
        run(server, args)
    finally:
        server.close()


def run(server: servers.RedisServer, args: argparse.Namespace) -> None:
    ns = Namespace(model="soak", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=BLOCK, chunk_tokens=CHUNK,
                   layer_end=LAYERS)
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros_like(c) for c in src]
    pool = BufferPool(256 << 20)
    store = open_store(["memory://?max_bytes=64MiB", f"{server.url}?ttl=2m"])
    memory = store.tiers[0].store
    cache = PrefixCache(store, ns, pool=pool)
    save_x, load_x = KVTransfer(cache, src, FlashLayout()), KVTransfer(cache, dst, FlashLayout())
    rng = np.random.default_rng(0)
    slots = slots_from_block_table(rng.permutation(BLOCKS)[:TOKENS // BLOCK].tolist(), BLOCK, TOKENS)
    samples: list[tuple[int, float]] = []
    loaded = 0
    start = time.perf_counter()
    for cycle in range(args.warmup + args.cycles):
        tokens = rng.integers(0, 128000, TOKENS, dtype=np.uint32)  # a new prefix every cycle
        save_x.save_sequence(tokens, slots)
        store.flush(60)
        memory.delete_many([k.key for k in save_x.keys(tokens)])
        loaded += load_x.load_sequence(tokens, slots)[0] == TOKENS
        # Each cycle writes a new prefix: without this Redis would hold rate x ttl of records
        # (about 20 GiB on a fast host), which measures the server, not this process.
        store.delete_many([k.key for k in save_x.keys(tokens)])
        if cycle == args.warmup - 1 or (cycle + 1) % 1000 == 0:
            samples.append((cycle + 1, rss_mib()))
    elapsed = time.perf_counter() - start
    store.flush(60)
    stats = pool.stats()
    store.close()
    base = samples[0][1]
    end = samples[-1][1]
    print(f"{args.cycles} cycles after {args.warmup} warm-up, {elapsed:.1f} s, full loads {loaded}/"
          f"{args.warmup + args.cycles}")
    print("| cycle | RSS MiB |\n|---|---|")
    for cycle, rss in samples:
        print(f"| {cycle} | {rss:.0f} |")
    print(f"pool: {stats}")
    print(f"rss_growth_after_warmup={100 * (end - base) / base:.1f}%")


if __name__ == "__main__":
    main()
