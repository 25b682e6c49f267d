"""Shared by the GPU benchmarks (``bench_gpu.py``, ``bench_breakeven.py``): a Llama-3-8B-shaped
paged KV cache on a device, the stores a GPU host loads from (``memory://``, ``shm://``, one
redis-server, ``redis+shards://`` of several), their raw ceilings, and timing synchronised with
the device. Every figure a script prints is compared with a baseline measured in the same run.

Runs on the CPU too (``--device cpu``, scaled down), where the transfers take the device path
(``KVTransfer(device_path=True)``) so that the scripts can be tried before a GPU is at hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
        #: The same slots on the host, as vLLM's connector passes them (its block tables are host lists).
        self.dst_slots_host = slots_from_block_table(self.dst_blocks, BLOCK, tokens)
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


class Busy:
    """About ``ms`` milliseconds of matmuls queued on the calling thread's current stream (a
    forward the engine has launched); calibrated once. A few hundred long kernels on CUDA, well
    under the launch queue's depth (a full queue would block the host instead). Synchronous on
    the CPU."""

    def __init__(self, device: torch.device, ms: float) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.a = torch.randn(*(2 * (8192 if cuda else 256,)), device=device, dtype=torch.bfloat16 if cuda else torch.float32)
        self.n = 1
        one = timed(self.queue, 3, device)
        self.n = max(1, int(ms / 1e3 / max(med(one), 1e-6)))
        self.seconds = timed(self.queue, 3, device)

    def queue(self) -> None:
        x = self.a
        for _ in range(self.n):
            x = self.a @ x  # each waits for the last: one long forward
        self.out = x


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


def memory_root(needed: int) -> tuple[str, str]:
    """A directory with ``needed`` bytes free for an ``shm://`` tier: /dev/shm where it has room
    (a container's default is 64 MB), else another tmpfs, else the system's temporary directory
    (its pages stay cached once written); and a note saying which, when not /dev/shm."""
    from kvstore.testing.shm import memory_root as find

    return find(needed)


@contextmanager
def shm_store(tag: str, max_bytes: int) -> Iterator[tuple[Store, str]]:
    """An ``shm://`` tier of ``max_bytes`` under ``memory_root``'s directory (its note printed
    once, when not /dev/shm), removed afterwards."""
    root, note = memory_root(max_bytes)
    if note:
        print(f"note: {note}", flush=True)
    name = f"bench-{tag}-{os.getpid()}"
    url = f"shm://{name}?max_bytes={max_bytes}&root={root}"
    store = open_store(url)
    try:
        yield store, url
    finally:
        store.close()
        shutil.rmtree(os.path.join(root, f"kvstore-{name}"), ignore_errors=True)


def noted(label: str, fn: Callable[[], object], note: Callable[[str], None]) -> object:
    """``fn()``, or None where it raised: its failure goes to ``note`` (the exception's type and
    first line; the traceback to stderr), so that one failing row never ends a benchmark."""
    try:
        return fn()
    except Exception as exc:
        note(f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        traceback.print_exc(file=sys.stderr)
        return None


class Rows:
    """A benchmark's table, printed and written as it grows: each row is printed (and flushed)
    the moment it is measured and the JSON file (``path``) rewritten, so that a row that fails,
    or a run cut short, loses no row before it. ``run(label, fn)`` turns a failure into a
    note row (the exception's type and message) and goes on."""

    def __init__(self, nbytes: int, path: str | None, meta: dict[str, Any]) -> None:
        self.nbytes = nbytes
        self.path = path
        self.meta = meta
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._header = False

    def _print_header(self) -> None:
        if not self._header:
            print("\n| path | s | GB/s | x baseline (same run) |\n|---|---|---|---|", flush=True)
            self._header = True

    def add(self, label: str, seconds: Sequence[float], baseline: str = "", baseline_seconds: Sequence[float] = (),
            nbytes: int | None = None, **extra: Any) -> None:
        """A row of ``seconds`` (sorted), GB/s of ``nbytes`` (default: the table's), and its
        ratio to a baseline of the same run (its rate over the baseline's)."""
        self._print_header()
        n = self.nbytes if nbytes is None else nbytes
        ratio = f"{med(baseline_seconds) / med(seconds):.2f}x {baseline}" if baseline_seconds else "-"
        rate = f"{n / med(seconds) / 1e9:.2f}" if n else "-"
        print(f"| {label} | {span(seconds)} | {rate} | {ratio} |", flush=True)
        self.rows.append({"path": label, "seconds": list(seconds), "nbytes": n, "baseline": baseline,
                          "baseline_seconds": list(baseline_seconds), **extra})
        self.write()

    def note(self, text: str) -> None:
        self._print_header()
        print(f"| {text} | - | - | - |", flush=True)
        self.notes.append(text)
        self.write()

    def run(self, label: str, fn: Callable[[], object]) -> bool:
        """``fn()`` (which adds rows), its failure a note; whether it succeeded."""
        def call() -> bool:
            fn()
            return True
        return noted(label, call, self.note) is True

    def write(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps({**self.meta, "rows": self.rows, "notes": self.notes}, indent=1))


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
