"""Shared by the GPU benchmarks (``bench_gpu.py``, ``bench_breakeven.py``): a Llama-3-8B-shaped
paged KV cache on a device, the stores a GPU host loads from (``memory://``, ``shm://``, one
redis-server, ``redis+shards://`` of several), their raw ceilings, and timing synchronised with
the device. Every figure a script prints is compared with a baseline measured in the same run.

Runs on the CPU too (``--device cpu``, scaled down), where the transfers take the device path
(``KVTransfer(device_path=True)``) so that the scripts can be tried before a GPU is at hand.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kvstore.keys import Namespace
from kvstore.paged import FlashLayout, KVTransfer, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.stores import open_store
from kvstore.stores.base import Store

#: Llama-3-8B's KV: 8 KV heads of 128, bf16; flash layout, 16-token blocks; 256-token chunks.
KV_HEADS, HEAD, BLOCK, CHUNK = 8, 128, 16, 256


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], reps: int, device: torch.device, setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds of ``reps`` calls after one warm-up, each synchronised with the device; sorted."""
    if setup is not None:
        setup()
    fn()
    sync(device)
    out = []
    for _ in range(reps):
        if setup is not None:
            setup()
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return sorted(out)


def med(ts: Sequence[float]) -> float:
    return statistics.median(ts)


def span(ts: Sequence[float]) -> str:
    return f"{med(ts):.4f} [{ts[0]:.4f}-{ts[-1]:.4f}]"


class Prefix:
    """``tokens`` tokens of ``layers`` Llama-3-8B-shaped layers in a flash-layout paged cache on
    ``device`` (random KV at random blocks), and an empty cache of the same shape to load into."""

    def __init__(self, device: torch.device, tokens: int, layers: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.device, self.tokens, self.layers = device, tokens, layers
        blocks = tokens // BLOCK * 2
        g = torch.Generator(device=device).manual_seed(seed)
        self.src = [torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD, device=device, generator=g).to(torch.bfloat16)
                    for _ in range(layers)]
        self.dst = [torch.zeros_like(c) for c in self.src]
        self.token_ids = rng.integers(0, 128000, tokens, dtype=np.uint32)
        self.src_blocks = rng.permutation(blocks)[:tokens // BLOCK].tolist()
        self.dst_blocks = rng.permutation(blocks)[:tokens // BLOCK].tolist()
        self.src_slots = slots_from_block_table(self.src_blocks, BLOCK, tokens, device=device)
        self.dst_slots = slots_from_block_table(self.dst_blocks, BLOCK, tokens, device=device)
        self.nbytes = tokens * layers * 2 * KV_HEADS * HEAD * 2

    def namespace(self, model: str = "bench-gpu") -> Namespace:
        return Namespace(model=model, kv_dtype="bfloat16", layout="flash-2bnhd", block_size=BLOCK,
                         chunk_tokens=CHUNK, layer_end=self.layers)

    def transfer(self, store: Store, caches: list[torch.Tensor], model: str = "bench-gpu") -> KVTransfer:
        return KVTransfer(PrefixCache(store, self.namespace(model)), caches, FlashLayout(),
                          device_path=True)

    def loaded_right(self) -> bool:
        return all(torch.equal(d[:, self.dst_blocks], s[:, self.src_blocks]) for d, s in zip(self.dst, self.src))

    def clear(self) -> None:
        for d in self.dst:
            d.zero_()


def have_redis() -> bool:
    import servers

    return servers.find_binary("redis-server") is not None and importlib.util.find_spec("redis") is not None


@contextmanager
def redis_servers(n: int) -> Iterator[list]:
    """``n`` redis-servers on this host (none where redis-server or redis-py is missing)."""
    import servers

    started = [servers.RedisServer() for _ in range(n)] if n and have_redis() else []
    try:
        yield started
    finally:
        for s in started:
            s.close()


def shards_url(started: Sequence) -> str:
    if len(started) == 1:
        return started[0].url
    return "redis+shards://" + ",".join(f"127.0.0.1:{s.port}" for s in started)


@contextmanager
def shm_store(tag: str, max_bytes: int) -> Iterator[tuple[Store, str]]:
    name = f"bench-{tag}-{os.getpid()}"
    url = f"shm://{name}?max_bytes={max_bytes}"
    store = open_store(url)
    try:
        yield store, url
    finally:
        store.close()
        shutil.rmtree(f"/dev/shm/kvstore-{name}", ignore_errors=True)


def raw_redis_load(started: Sequence, store: Store, keys: Sequence[str], sizes: Sequence[int],
                   device: torch.device) -> Callable[[], None]:
    """The ceiling of a Redis load onto a device: kvstore's ``RawRedis`` (no checksum, no
    parsing), one connection per server reading that server's keys (as ``store`` placed them)
    into pinned host buffers with ``recv_into``, all servers at once, then the DMAs."""
    from kvstore.stores.redis.raw import RawRedis, store_window

    shard_of = getattr(store, "shard_of", None)
    if shard_of is None:
        inner = getattr(store, "tiers", ())
        shard_of = next((getattr(t.store, "shard_of", None) for t in inner if hasattr(t.store, "shard_of")), None)
    owner = [shard_of(k) if shard_of is not None else 0 for k in keys]
    pinned = device.type == "cuda"
    buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned) for n in sizes]
    staging = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    clients = [RawRedis("127.0.0.1", s.port) for s in started]

    def read(i: int) -> None:
        mine = [j for j, o in enumerate(owner) if o == i]
        if mine:
            got = clients[i].get_many_into([keys[j] for j in mine], [buffers[j].numpy() for j in mine],
                                           ahead=store_window(max(sizes), 1))
            assert all(g is not None for g in got)

    def load() -> None:
        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        offset = 0
        for b in buffers:
            staging[offset:offset + b.numel()].copy_(b, non_blocking=pinned)
            offset += b.numel()
    return load


def record_sizes(store: Store, keys: Sequence[str]) -> list[int]:
    sizes = store.size_many(list(keys))
    assert all(s is not None for s in sizes), "a record is missing"
    return [int(s) for s in sizes if s is not None]


def copy_ceilings(nbytes: int, reps: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds of ``copy_`` of ``nbytes`` host -> device from pinned and from pageable memory,
    and device -> pinned host: the physical ceilings of a load and a save."""
    pinned = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    pageable.fill_(1)
    return {
        "h2d_pinned": timed(lambda: dev.copy_(host, non_blocking=pinned), reps, device),
        "h2d_pageable": timed(lambda: dev.copy_(pageable), reps, device),
        "d2h_pinned": timed(lambda: host.copy_(dev, non_blocking=pinned), reps, device),
    }
