"""Loads of one prefix from each kind of tier, against memcpy and the raw client, in the same run
(issue 24): one redis-server, N client-side shards, the host-shared memory tier.

The KV is Llama-3-8B-shaped (32 layers, 8 KV heads, head size 128, bf16: 128 KiB per token) in a
paged cache of block size 16 whose blocks sit at random ids (``flash-2bnhd``), in chunks of
``--chunk`` tokens (256, the adapters' default: 32 MiB records; 64: 8 MiB). Two prefixes: 256
tokens (32 MiB) and 2,048 tokens (268 MB, the issue's break-even case). Each prefix is saved once into every store (untimed);
then each round loads it through every path in turn:

  memcpy                 ``np.copyto`` of the prefix's bytes between two resident buffers: the
                         ceiling of any load that copies once
  raw 1 server           the raw zero-copy client (one connection, GETs received with
                         ``recv_into`` into preallocated buffers; no verification, no scatter),
                         as many GETs requested ahead as kvstore keeps (``common.raw_window``)
  raw, all at once       the same client asking for every record at once (how the raw rows of
                         bench_peer_lmcache.py and bench_transfer.py asked before): the server
                         builds every reply before it sends one, at more CPU per GB
  redis x1               ``KVTransfer.load_sequence`` (lookup, records received into pooled
                         buffers, verified, scattered into the paged cache) over a RedisStore
  shards x2, x3          the same over ``redis+shards://`` of 2 and 3 redis-servers
  shm                    the same over ``shm://`` (/dev/shm): records verified and scattered
                         straight from their mapping
  cold shm over redis    a host tier that does not hold the prefix yet (``shm://`` over the one
                         redis-server, its records removed from the shm tier before each load):
                         each record lands in the blocks from Redis, then is promoted into the
                         shm tier from the blocks; "... leases" is the same with ``land=False``
                         (received into pooled buffers, verified, scattered, promoted from the
                         buffer): what a tier below the first cost before it could land
  scatter only           the copy alone of every chunk's KV bytes from resident buffers into
                         the paged cache (``kernels.host_copy``, one thread): what placing the
                         bytes costs before anything is read or verified

All redis-servers run on this machine: with 2 cores, 2 or 3 servers plus the client are bound by
the CPU, not by the servers' count (each server needs about a core per GB/s of GETs), so shards
here show the overhead of spreading a batch, not the scaling a host per server would give.

GB/s = 10^9 bytes of KV per second, median [min-max] of ``--reps`` rounds after a warm-up. CPU
s/GB: this process's user+system time (``getrusage``) and the redis-servers' (``/proc``, 10 ms
ticks), per GB of KV loaded.

The run's thread switch interval is the engine adapters' (0.5 ms; ``--switch-interval 5ms`` for
CPython's own): kvstore's threads hand the GIL to each other on every record (``bench_gil.py``).

    python benchmarks/bench_tiers.py [--reps 3] [--chunk 256] [--switch-interval 0.5ms] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import (
    apply_switch_interval,
    cpu_self,
    machine,
    memory_limits,
    raw_get_window,
    raw_window,
    switch_interval_arg,
)

from kvstore.keys import Namespace
from kvstore.paged import FlashLayout, KVTransfer, slots_from_block_table
from kvstore.paged.kernels import host_copy, host_layers
from kvstore.prefix_cache import PrefixCache
from kvstore.stores import TieredStore
from kvstore.stores.redis import RedisStore, ShardedRedisStore
from kvstore.stores.redis.raw import RawRedis
from kvstore.stores.shm import ShmStore

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 32, 8, 128, 16, 160
PREFIXES = (256, 2048)  # tokens: 32 MiB and 268 MB of KV
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD * 2


def paged_cache(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pid(server: servers.RedisServer) -> int:
    with server.client() as c:
        return int(c.info("server")["process_id"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk (a multiple of 16; 256 is the adapters' default)")
    parser.add_argument("--json", help="also write the figures as JSON here")
    switch_interval_arg(parser)
    args = parser.parse_args()
    print(machine(), flush=True)
    print(apply_switch_interval(args.switch_interval), flush=True)
    print(f"memory: {memory_limits()}", flush=True)
    reds = [servers.RedisServer() for _ in range(3)]
    shms: list[ShmStore] = []
    try:
        for name in ("", "-cold"):
            shms.append(ShmStore.from_url(f"shm://bench-tiers{name}-{os.getpid()}?max_bytes=2GiB"))
        run(reds, *shms, args)
    finally:
        import shutil

        for shm in shms:
            shm.close()
            shutil.rmtree(shm.root, ignore_errors=True)
        for s in reds:
            s.close()


def run(reds: list[servers.RedisServer], shm: ShmStore, cold_shm: ShmStore, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    tokens_all = rng.integers(0, 128000, max(PREFIXES), dtype=np.uint32)
    need = max(PREFIXES) // BLOCK
    src_blocks = rng.permutation(BLOCKS)[:need]
    dst_blocks = rng.permutation(BLOCKS)[:need]
    src, dst = paged_cache(1), paged_cache(2)
    ns = Namespace(model="bench-llama3-8b", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=BLOCK,
                   chunk_tokens=args.chunk, layer_end=LAYERS)
    ports = [s.port for s in reds]
    # A throughput benchmark, not a deadline test: with 3 servers and the client on 2 shared cores
    # a reply can take longer than the default 250 ms read deadline, which would end a load early.
    slow = "?timeout=5s"
    stores = {
        "redis x1": RedisStore.from_url(reds[0].url + slow),
        "shards x2": ShardedRedisStore.from_url("redis+shards://" + ",".join(f"127.0.0.1:{p}" for p in ports[:2]) + slow),
        "shards x3": ShardedRedisStore.from_url("redis+shards://" + ",".join(f"127.0.0.1:{p}" for p in ports) + slow),
        "shm": shm,
    }
    cold = TieredStore([cold_shm, RedisStore.from_url(reds[0].url + slow)])
    cold_paths = {"cold shm over redis x1": True, "cold shm over redis x1, leases": False}  # land
    pids = [server_pid(s) for s in reds]
    used = {"redis x1": pids[:1], "shards x2": pids[:2], "shards x3": pids, "shm": [], "scatter only": [],
            "raw 1 server": pids[:1], "raw 1 server, all at once": pids[:1], "memcpy": [],
            **{name: pids[:1] for name in cold_paths}}
    raw = RawRedis(port=reds[0].port)
    results: dict[str, dict] = {}
    for n_tokens in PREFIXES:
        tokens = tokens_all[:n_tokens]
        src_slots = slots_from_block_table(src_blocks[:n_tokens // BLOCK].tolist(), BLOCK, n_tokens)
        dst_slots = slots_from_block_table(dst_blocks[:n_tokens // BLOCK].tolist(), BLOCK, n_tokens)
        kv_bytes = n_tokens * TOKEN_BYTES
        loaders = {}
        for name, store in stores.items():
            saver = KVTransfer(PrefixCache(store, ns), src, FlashLayout())
            saver.save_sequence(tokens, src_slots)
            store.flush(60)
            loaders[name] = KVTransfer(PrefixCache(store, ns), dst, FlashLayout())
        for name, land in cold_paths.items():  # the records redis x1 holds
            loaders[name] = KVTransfer(PrefixCache(cold, ns), dst, FlashLayout(), land=land)
        keys = [k.key for k in loaders["redis x1"].cache.keys(tokens)]
        for name, loader in loaders.items():
            for d in dst:
                d.zero_()
            cold_shm.delete_many(keys)
            n, _ = loader.load_sequence(tokens, dst_slots)
            if name in cold_paths and not all(cold_shm.exists_many(keys)):
                raise SystemExit(f"{name}: the records were not promoted into the shm tier")
            ok = n == n_tokens and all(torch.equal(d[:, dst_blocks[:n_tokens // BLOCK]],
                                                   s[:, src_blocks[:n_tokens // BLOCK]]) for d, s in zip(dst, src))
            if not ok:
                raise SystemExit(f"{name}: loaded KV differs from the saved KV ({n} of {n_tokens} tokens)")
        records = stores["redis x1"].get_many(keys)
        buffers = [memoryview(np.ones(len(r), dtype=np.uint8)) for r in records]  # touched: resident
        window = raw_window(max(len(r) for r in records))
        a, b = np.ones(kv_bytes, dtype=np.uint8), np.ones(kv_bytes, dtype=np.uint8)
        print(f"\n{n_tokens} tokens: {kv_bytes / 1e6:.0f} MB of KV in {len(keys)} records of "
              f"{len(records[0]) / 2**20:.2f} MiB; every path's loaded KV equals the saved KV", flush=True)

        def load(name: str):
            def fn() -> None:
                n, _ = loaders[name].load_sequence(tokens, dst_slots)
                assert n == n_tokens, (name, n)
            return fn

        host = host_layers([FlashLayout().host_layer(d) for d in dst])
        chunks = loaders["shm"].keys(tokens)
        staged = [np.ones(c.num_tokens * TOKEN_BYTES, dtype=np.uint8) for c in chunks]  # touched: resident

        def scatter_only() -> None:
            for c, st in zip(chunks, staged):
                assert host_copy(host, dst_slots[c.start:c.end], st, True)

        paths = {"memcpy": lambda: np.copyto(b, a), "scatter only": scatter_only,
                 "raw 1 server": lambda: raw_get_window(raw, keys, buffers, window),
                 "raw 1 server, all at once": lambda: raw.get_many_into(keys, buffers),
                 **{name: load(name) for name in loaders}}
        times: dict[str, list[float]] = {p: [] for p in paths}
        cpu: dict[str, list[float]] = {p: [0.0, 0.0] for p in paths}  # client, servers
        loads = [os.getloadavg()[0]]
        for rep in range(args.reps + 1):
            for name, fn in paths.items():
                if name in cold_paths:
                    cold_shm.delete_many(keys)  # untimed: the host tier does not hold the prefix
                c0, s0 = cpu_self(), sum(cpu_of(p) for p in used[name])
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                c1, s1 = cpu_self(), sum(cpu_of(p) for p in used[name])
                if rep:
                    times[name].append(dt)
                    cpu[name][0] += c1 - c0
                    cpu[name][1] += s1 - s0
            loads.append(os.getloadavg()[0])
        gb = kv_bytes / 1e9
        rates = {p: sorted(gb / t for t in ts) for p, ts in times.items()}
        med = {p: statistics.median(r) for p, r in rates.items()}
        print(f"load average (1 min) while measuring: {min(loads):.2f}-{max(loads):.2f}; GB/s of KV, median "
              f"[min-max] of {args.reps}\n", flush=True)
        print("| path | GB/s | x memcpy | x redis x1 | client CPU s/GB | servers' CPU s/GB |")
        print("|---|---|---|---|---|---|")
        for p, r in rates.items():
            c, s = (v / (gb * args.reps) for v in cpu[p])
            print(f"| {p} | {med[p]:.2f} [{r[0]:.2f}-{r[-1]:.2f}] | {med[p] / med['memcpy']:.3f} | "
                  f"{med[p] / med['redis x1']:.2f} | {c:.2f} | {s:.2f} |", flush=True)
        results[str(n_tokens)] = {"kv_bytes": kv_bytes, "records": len(keys), "loads": loads, "rates": rates,
                                  "cpu_client_s": cpu, "medians": med}
    raw.close()
    cold.tiers[1].store.close()
    for name, store in stores.items():
        if name != "shm":
            store.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
