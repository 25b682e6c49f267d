"""End to end into a paged cache: ``KVTransfer`` saving and loading a 2,048-token prefix through
Redis, against the raw zero-copy client moving the same record bytes, in the same run.

The prefix is Llama-3-8B-shaped: 32 layers, 8 KV heads, head size 128, bf16, 128 KiB per token,
256 MiB in 8 chunks of 256 tokens, in a paged cache of block size 16 whose 128 blocks sit at
random ids (``--layout``: ``flash-2bnhd``, K and V apart, or vLLM CPU's ``vllm-cpu-vec``, one
item per block). Paths, interleaved per round:

  raw zero-copy      pipelined SETs of the 8 encoded records / GETs into preallocated buffers
  raw + xxh3         the same with one xxh3 pass over each record (before its SET, after its
                     GET): the least CPU a client that checksums what it stores spends
  raw from/into      the same records' bytes sent from the source cache's blocks (header,
  the blocks         blocks, trailer: ``sendmsg``, many per call) / received into the destination
                     cache's blocks (``recvmsg_into``), no checksum: what the paged layout itself
                     costs a zero-copy client (32 KiB pieces at random places, not 32 MiB runs)
  kvstore save       ``save_sequence`` into a RedisStore: lookup, then each chunk's header and its
                     blocks sent straight from the paged cache (``sendmsg``), checksummed as
                     they leave
  ... gathered       the same with ``save_from_blocks=False``: each chunk gathered from the paged
                     cache into a pooled buffer first, then sent (what a queueing store gets)
  kvstore load       ``load_sequence`` into another paged cache: each record's header received
                     and checked, its KV landed straight in the cache's blocks, its checksum
                     checked as its last byte arrives, while the next ones arrive
  ... from leases    the same with ``land=False``: records received into pooled buffers, each
                     verified there, then scattered into the cache
  engine-visible     ``save_sequence`` into a TieredStore over the same Redis: what the engine
  save               waits for (the background writer sends afterwards; its flush is not timed)

GB/s = 10^9 bytes of KV per second; median [min-max] of ``--reps`` rounds after a warm-up. CPU
s/GB: this process's user+system time (``getrusage(RUSAGE_SELF)``, every thread) over the timed
calls, per GB of KV (the redis-server's is not counted). The last line prints the ratios to the
raw client, and the CPU ratios to the raw client plus one xxh3 pass and to the raw client
from or into the blocks.

    python benchmarks/bench_transfer.py [--reps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import cpu_self, machine, memory_limits

from kvstore.buffers import SELF_CHECK_BYTES
from kvstore.keys import Namespace
from kvstore.paged import CPUPackedLayout, FlashLayout, KVTransfer, slots_from_block_table
from kvstore.paged.kernels import BlockBytes, host_layers
from kvstore.prefix_cache import PrefixCache
from kvstore.stores import TieredStore
from kvstore.stores.redis import RedisStore
from kvstore.stores.redis.raw import RawRedis

LAYERS, HEADS, HEAD, BLOCK, BLOCKS, TOKENS, CHUNK = 32, 8, 128, 16, 256, 2048, 256
RAW_BLOCKS_SET = "raw SET from the blocks (sendmsg)"
RAW_BLOCKS_GET = "raw GET into the blocks (recvmsg_into)"


LAYOUTS = {"flash-2bnhd": (FlashLayout, (2, BLOCKS, BLOCK, HEADS, HEAD)),
           "vllm-cpu-vec": (lambda: CPUPackedLayout("vec"), (BLOCKS, HEADS, BLOCK, 2 * HEAD))}


def paged_cache(seed: int, layout: str = "flash-2bnhd") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = LAYOUTS[layout][1]
    return [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="also write the figures as JSON here")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="flash-2bnhd",
                        help="the paged cache's layout: flash-2bnhd (K and V apart, 32 KiB items) or vLLM CPU's "
                             "vllm-cpu-vec (one 64 KiB item per block)")
    args = parser.parse_args()
    print(machine(), flush=True)
    print(f"memory: {memory_limits()}", flush=True)
    server = servers.RedisServer()
    try:
        run(server, args)
    finally:
        server.close()


def run(server: servers.RedisServer, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    make_layout = LAYOUTS[args.layout][0]
    ns = Namespace(model="bench-llama3-8b", kv_dtype="bfloat16", layout=make_layout().name, block_size=BLOCK,
                   chunk_tokens=CHUNK, layer_end=LAYERS)
    tokens = rng.integers(0, 128000, TOKENS, dtype=np.uint32)
    src_blocks = rng.permutation(BLOCKS)[:TOKENS // BLOCK]
    dst_blocks = rng.permutation(BLOCKS)[:TOKENS // BLOCK]
    src, dst = paged_cache(1, args.layout), paged_cache(2, args.layout)
    src_slots = slots_from_block_table(src_blocks.tolist(), BLOCK, TOKENS)
    dst_slots = slots_from_block_table(dst_blocks.tolist(), BLOCK, TOKENS)
    store = RedisStore.from_url(server.url)
    tiered = TieredStore([RedisStore.from_url(server.url)])
    save_x = KVTransfer(PrefixCache(store, ns), src, make_layout())
    gather_x = KVTransfer(PrefixCache(store, ns), src, make_layout(), save_from_blocks=False)
    tiered_x = KVTransfer(PrefixCache(tiered, ns), src, make_layout())
    load_x = KVTransfer(PrefixCache(store, ns), dst, make_layout())
    lease_x = KVTransfer(PrefixCache(store, ns), dst, make_layout(), land=False)
    kv_bytes = TOKENS * LAYERS * 2 * HEADS * HEAD * 2

    raw = RawRedis(port=server.port)
    raw.flushall()
    assert save_x.save_sequence(tokens, src_slots) == TOKENS // CHUNK
    keys = [k.key for k in save_x.keys(tokens)]
    records = store.get_many(keys)
    items = [(k.encode(), memoryview(bytes(v))) for k, v in zip(keys, records)]
    record_bytes = sum(len(v) for _, v in items)
    buffers = [memoryview(np.ones(len(v), dtype=np.uint8)) for _, v in items]
    axis = 1 if args.layout == "flash-2bnhd" else 0  # the block axis

    def landed() -> bool:
        """The destination cache's blocks hold the source's KV."""
        pick = [torch.from_numpy(b) for b in (dst_blocks, src_blocks)]
        return all(torch.equal(d.index_select(axis, pick[0]), s.index_select(axis, pick[1])) for d, s in zip(dst, src))

    assert load_x.load_sequence(tokens, dst_slots)[0] == TOKENS
    ok = landed()
    print(f"{TOKENS} tokens, {kv_bytes / 2**20:.0f} MiB of KV in {len(items)} records "
          f"({record_bytes / 2**20:.2f} MiB); loaded KV identical to the saved: {ok}", flush=True)
    if not ok:
        raise SystemExit("loaded KV differs from the saved KV")

    # The records as the blocks hold them: header, the chunk's blocks in record order, trailer.
    chunks = save_x.keys(tokens)
    kv_len = kv_bytes // len(chunks)
    src_blocks_b = BlockBytes(host_layers([make_layout().host_layer(c) for c in src]) or [])
    dst_blocks_b = BlockBytes(host_layers([make_layout().host_layer(c) for c in dst]) or [])
    scattered_src, scattered_dst = [], []
    for chunk, (key, record) in zip(chunks, items):
        cut = len(record) - SELF_CHECK_BYTES  # an unsigned record's trailer is its checksum alone
        head, tail = record[:cut - kv_len], record[cut:]
        source = src_blocks_b.targets(src_slots[chunk.start:chunk.end])
        target = dst_blocks_b.targets(dst_slots[chunk.start:chunk.end])
        assert source is not None and target is not None, "the bench caches are whole-block viewable"
        scattered_src.append((key, (head, *source, tail)))
        scattered_dst.append([memoryview(bytearray(len(head))), *target, memoryview(bytearray(len(tail)))])

    def raw_put() -> None:
        raw.set_many(items)

    def raw_put_blocks() -> None:
        raw.set_many(scattered_src, scatter=True)

    def raw_get_blocks() -> None:
        raw.get_many_into([k for k, _ in items], scattered_dst)

    # The raw client's scattered paths move the very records kvstore wrote.
    raw.flushall()
    raw_put_blocks()
    assert [bytes(v) for v in store.get_many(keys)] == [bytes(v) for _, v in items], "raw SET from the blocks"
    for d in dst:
        d.zero_()
    raw_get_blocks()
    assert landed(), "raw GET into the blocks"

    def raw_get() -> None:
        raw.get_many_into([k for k, _ in items], buffers)

    def raw_put_hashed() -> None:
        for _, v in items:
            xxhash.xxh3_64_digest(v)
        raw.set_many(items)

    def raw_get_hashed() -> None:
        raw.get_many_into([k for k, _ in items], buffers)
        for b in buffers:
            xxhash.xxh3_64_digest(b)

    def saving(x: KVTransfer) -> Callable[[], None]:
        def save() -> None:
            n = x.save_sequence(tokens, src_slots)
            assert n == TOKENS // CHUNK, n
        return save

    def kv_load() -> None:
        n, _ = load_x.load_sequence(tokens, dst_slots)
        assert n == TOKENS, n

    def lease_load() -> None:
        n, _ = lease_x.load_sequence(tokens, dst_slots)
        assert n == TOKENS, n

    paths = {"raw zero-copy SET": (raw.flushall, raw_put), "raw SET + xxh3": (raw.flushall, raw_put_hashed),
             RAW_BLOCKS_SET: (raw.flushall, raw_put_blocks),
             "kvstore save (sync RedisStore)": (raw.flushall, saving(save_x)),
             "kvstore save, gathered first (save_from_blocks=False)": (raw.flushall, saving(gather_x)),
             "engine-visible save (tiered write-behind)": (raw.flushall, saving(tiered_x)),
             "raw zero-copy GET": (None, raw_get), "raw GET + xxh3": (None, raw_get_hashed),
             RAW_BLOCKS_GET: (None, raw_get_blocks),
             "kvstore load": (None, kv_load),
             "kvstore load, from leases (land=False)": (None, lease_load)}
    times: dict[str, list[float]] = {p: [] for p in paths}
    cpu: dict[str, float] = {p: 0.0 for p in paths}
    loads = [os.getloadavg()[0]]
    for rep in range(args.reps + 1):
        for name, (setup, fn) in paths.items():
            if setup is not None:
                setup()
                tiered.flush(60)
            if setup is None:
                raw_put()  # a read path: the records are there to be read
            c = cpu_self()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            dc = cpu_self() - c
            if name.startswith("engine-visible"):
                tiered.flush(60)  # untimed: the background writer's part
            if rep:
                times[name].append(dt)
                cpu[name] += dc
        loads.append(os.getloadavg()[0])
    raw.close()
    tiered.close()
    store.close()

    rates = {p: sorted(kv_bytes / t / 1e9 for t in ts) for p, ts in times.items()}
    med = {p: statistics.median(r) for p, r in rates.items()}
    print(f"\nLoad average while measuring: {min(loads):.2f}-{max(loads):.2f}; GB/s of KV, median [min-max] "
          f"of {args.reps}\n")
    cpu_gb = {p: c / (args.reps * kv_bytes / 1e9) for p, c in cpu.items()}
    print("| path | GB/s | ratio to raw | CPU s/GB | CPU ratio to raw |")
    print("|---|---|---|---|---|")
    for p, r in rates.items():
        base = "raw zero-copy GET" if "load" in p or "GET" in p else "raw zero-copy SET"
        print(f"| {p} | {med[p]:.2f} [{r[0]:.2f}-{r[-1]:.2f}] | {med[p] / med[base]:.2f} | {cpu_gb[p]:.3f} | "
              f"{cpu_gb[p] / cpu_gb[base]:.2f} |")
    save_ratio = med["kvstore save (sync RedisStore)"] / med["raw zero-copy SET"]
    load_ratio = med["kvstore load"] / med["raw zero-copy GET"]
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "loads": loads, "kv_bytes": kv_bytes,
                                               "rates": rates, "cpu_s_per_gb": cpu_gb}, indent=1))
    print(f"\nratio_to_raw save={save_ratio:.2f} load={load_ratio:.2f}; CPU per GB ratio to raw "
          f"save={cpu_gb['kvstore save (sync RedisStore)'] / cpu_gb['raw zero-copy SET']:.2f} "
          f"load={cpu_gb['kvstore load'] / cpu_gb['raw zero-copy GET']:.2f}; CPU per GB ratio to raw + xxh3 "
          f"save={cpu_gb['kvstore save (sync RedisStore)'] / cpu_gb['raw SET + xxh3']:.2f} "
          f"load={cpu_gb['kvstore load'] / cpu_gb['raw GET + xxh3']:.2f}; CPU per GB ratio to raw from/into the "
          f"blocks save={cpu_gb['kvstore save (sync RedisStore)'] / cpu_gb[RAW_BLOCKS_SET]:.2f} "
          f"load={cpu_gb['kvstore load'] / cpu_gb[RAW_BLOCKS_GET]:.2f}; throughput ratio to it "
          f"save={med['kvstore save (sync RedisStore)'] / med[RAW_BLOCKS_SET]:.2f} "
          f"load={load_ratio * med['raw zero-copy GET'] / med[RAW_BLOCKS_GET]:.2f}")


if __name__ == "__main__":
    main()
