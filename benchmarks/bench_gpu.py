"""Loads and saves of a 2,048-token Llama-3-8B-shaped prefix between a paged KV cache on the GPU
and every store a GPU host uses, each against its physical ceiling measured in the same run.

The prefix: 32 layers of ``[2, blocks, 16, 8, 128]`` bf16 (flash layout), its 128 blocks at
random ids, 268 MB in 8 records of 256 tokens. Rows, in GB/s of KV (10^9 bytes/s), median
[min-max] of ``--reps`` after a warm-up, synchronised with the device; each row is printed (and
the JSON rewritten) as soon as it is measured, and a row that fails becomes a note:

* ceilings: ``copy_`` of the same bytes host -> device from pinned memory (also from an odd
  address: a record's payload starts at byte 1,473 or so), from pageable memory, device -> pinned
  host; xxh3 of the records' bytes on 1..N threads (a verified load's CPU ceiling);
* saves (``save_sequence``: one gather pass, D2H copies, records written, checksummed) into a
  store that keeps nothing, ``memory://`` and ``shm://``, against the D2H ``copy_``;
* loads (``KVTransfer.load_sequence``: lookup, records read where they lie, every one verified,
  DMA'd and scattered at other random blocks) from ``memory://`` and ``shm://``, with slots on
  the device and on the host (as vLLM's connector passes them), ``shm://`` through fresh store
  objects (every record mapped and registered) and in a fresh process (its first load: mappings,
  registrations, thread pools, pinned memory all cold), against the pinned ``copy_``;
* beside a busy compute stream (``--busy-ms`` of matmuls queued, as a forward): a load from a
  loader thread and from the engine's thread, with host-side slots, must return in about its
  idle time (its DMAs and hashes run during the forward, only its scatter waits); a save must
  wait for the forward (it reads what the forward wrote);
* candidates, measured, none of them the product's path yet: one window's scatter as 32 torch
  launches, as one captured CUDA graph and as one Triton kernel (``kvstore.paged.triton_copy``,
  where Triton is installed); one reduction pass over the staged bytes (the floor of a
  device-side checksum); ``cudaHostRegister`` of 8 record mappings on one thread and on 8, and
  ``cudaHostUnregister`` idle and beside a busy stream (does it wait for the device?);
* Redis: one redis-server and ``redis+shards://`` of 4 and 8, against ``RawRedis`` reading the
  same records from the same servers into pinned memory (one connection per server), then DMA'd.

Every load is checked (the KV landed where it belongs) and its host copies counted
(``DeviceCopies.stats``: records DMA'd from pageable memory, or decompressed on the host).

    python benchmarks/bench_gpu.py [--reps 7] [--json out.json]         # a GPU host
    python benchmarks/bench_gpu.py --device cpu --layers 2 --tokens 512 --reps 1   # plumbing, anywhere
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash
from common import machine
from gpu_common import (
    Busy,
    Prefix,
    Rows,
    copy_ceilings,
    med,
    raw_redis_load,
    record_sizes,
    redis_servers,
    shards_url,
    shm_store,
    sync,
    timed,
)

from kvstore.buffers import xxh3_digest
from kvstore.paged import FlashLayout
from kvstore.stores import open_store
from kvstore.stores.base import Store, WriteValue

ODD = 1473  # where a 256-token record's payload starts (its header's length): a DMA's source address


class NullStore(Store):
    """Takes every write and keeps nothing: a save measures the gather and the copy alone."""

    def get(self, key: str) -> None:
        return None

    def put(self, key: str, value: WriteValue) -> None:
        pass

    def delete(self, key: str) -> bool:
        return False

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        return iter(())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--shards", default="4,8", help="redis+shards sizes to measure besides one server")
    parser.add_argument("--no-redis", action="store_true", help="leave the Redis rows out")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--busy-ms", type=float, default=200.0, help="the busy compute stream's work per row")
    parser.add_argument("--threads", default="1,2,4,8,16", help="thread counts of the xxh3 ceiling")
    parser.add_argument("--json", help="also write the figures as JSON here (rewritten after every row)")
    parser.add_argument("--first-load-child", help=argparse.SUPPRESS)  # internal: the fresh process's side
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.first_load_child:
        first_load_child(args, device)
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (device path, plumbing run)"
    print(f"{machine()}; device: {name}; xxhash {xxhash.VERSION}", flush=True)
    prefix = Prefix(device, args.tokens, args.layers)
    print(f"{args.tokens} tokens x {args.layers} layers: {prefix.nbytes / 1e6:.0f} MB of KV; seconds and GB/s, "
          f"median [min-max] of {args.reps}", flush=True)
    rows = Rows(prefix.nbytes, args.json, {"machine": machine(), "device": name, "tokens": args.tokens,
                                           "layers": args.layers, "kv_bytes": prefix.nbytes,
                                           "xxhash": xxhash.VERSION})
    bench = Bench(args, device, prefix, rows)
    bench.run()
    if device.type == "cuda":
        from kvstore.pinned import cuda_pinner

        pinner = cuda_pinner(device)
        if pinner is not None:
            print(f"\npinner: {pinner.stats()}; HostRegisterReadOnlySupported: {pinner.read_only_supported()}",
                  flush=True)


class Bench:
    """The rows, in order; each group a method run under ``Rows.run`` (a failure is a note)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, prefix: Prefix, rows: Rows) -> None:
        self.args, self.device, self.prefix, self.rows = args, device, prefix, rows
        self.reps = args.reps
        self.h2d: list[float] = []
        self.d2h: list[float] = []
        self.idle: dict[str, list[float]] = {}

    def run(self) -> None:
        run, p = self.rows.run, self.prefix
        run("copy_ ceilings", self.ceilings)
        run("save into a store that keeps nothing", lambda: self.save_row(
            "save: gather + D2H only (a store that keeps nothing)", NullStore()))
        with open_store(f"memory://?max_bytes={4 * p.nbytes}") as memory:
            run("memory://", lambda: self.store_rows("memory://", memory))
        with shm_store("gpu", 4 * p.nbytes) as (shm, url):
            run("shm://", lambda: self.store_rows("shm://", shm))
            run("xxh3 ceiling", lambda: self.hash_ceiling(shm))
            run("shm:// fresh objects", lambda: self.fresh_objects(url))
            run("shm:// fresh process", lambda: self.fresh_process(url))
            run("busy compute stream", lambda: self.busy_rows(shm))
            run("registration", lambda: self.registration(shm))
        run("scatter candidates", self.scatter_candidates)
        run("device-side checksum", self.device_checksum)
        if not self.args.no_redis:
            run("Redis", self.redis_rows)

    # -- ceilings ----------------------------------------------------------------------------
    def ceilings(self) -> None:
        p, rows = self.prefix, self.rows
        ceil = copy_ceilings(p.nbytes, self.reps, self.device)
        self.h2d, self.d2h = ceil["h2d_pinned"], ceil["d2h_pinned"]
        rows.add("copy_ pinned host -> device", self.h2d)
        rows.add("copy_ pageable host -> device", ceil["h2d_pageable"], "copy_ pinned H2D", self.h2d)
        rows.add("copy_ device -> pinned host", self.d2h)
        pinned = self.device.type == "cuda"
        host = torch.empty(p.nbytes + 8192, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        dev = torch.empty(p.nbytes, dtype=torch.uint8, device=self.device)
        for offset, label in ((ODD, f"copy_ pinned H2D from an odd address (+{ODD} B)"),
                              (4096, "copy_ pinned H2D from a page-aligned offset (+4096 B)")):
            src = host[offset:offset + p.nbytes]
            rows.add(label, timed(lambda src=src: dev.copy_(src, non_blocking=pinned), self.reps, self.device),
                     "copy_ pinned H2D", self.h2d)

    def hash_ceiling(self, store: Store) -> None:
        """xxh3 of the records' own bytes (their mappings) on N threads: a verified load cannot
        beat the CPU's hash rate."""
        p = self.prefix
        keys = [k.key for k in p.transfer(store, p.src).keys(p.token_ids)]
        views = [memoryview(store.get(k)) for k in keys]  # type: ignore[arg-type]
        nbytes = sum(len(v) for v in views)
        one: list[float] = []
        for n in sorted({int(t) for t in self.args.threads.split(",") if t} | {os.cpu_count() or 1}):
            with ThreadPoolExecutor(n) as pool:
                ts = timed(lambda pool=pool: list(pool.map(xxh3_digest, views)), self.reps, self.device)
            one = one or ts
            self.rows.add(f"xxh3 of the {len(views)} records, {n} thread{'s' * (n > 1)} (a verified load's ceiling)",
                          ts, "1 thread" if n > 1 else "", one if n > 1 else [], nbytes=nbytes)

    # -- saves and loads ---------------------------------------------------------------------
    def save_row(self, label: str, store: Store) -> list[float]:
        p = self.prefix
        saver = p.transfer(store, p.src)
        ts = timed(lambda: saver.save_sequence(p.token_ids, p.src_slots, from_token=0), self.reps, self.device)
        self.rows.add(label, ts, "copy_ D2H", self.d2h)
        return ts

    def load_row(self, label: str, store: Store, *, host_slots: bool = False,
                 baseline: tuple[str, list[float]] | None = None) -> list[float]:
        p = self.prefix
        loader = p.transfer(store, p.dst)
        slots = p.dst_slots_host if host_slots else p.dst_slots

        def load() -> None:
            n, _ = loader.load_sequence(p.token_ids, slots)
            assert n == p.tokens, f"{label}: loaded {n} of {p.tokens} tokens"
        ts = timed(load, self.reps, self.device, p.clear)
        self.check(label, loader)
        self.rows.add(label, ts, *(baseline or ("copy_ pinned H2D", self.h2d)))
        return ts

    def check(self, label: str, loader: object) -> None:
        if not self.prefix.loaded_right():
            raise RuntimeError(f"{label}: the loaded KV differs from the saved KV")
        copies = {f"{op}/{memory}": n for (op, memory), n in loader.copies.stats.items()}  # type: ignore[attr-defined]
        if self.device.type == "cuda" and any(k != "load/pinned" for k in copies):  # on the CPU nothing is pinned
            self.rows.note(f"{label}: records not DMA'd from pinned memory: {copies}")

    def store_rows(self, name: str, store: Store) -> None:
        self.save_row(f"save into {name}", store)
        self.idle[name] = self.load_row(f"load from {name}, slots on the device", store)
        self.idle[name + " host"] = self.load_row(f"load from {name}, slots on the host (as vLLM passes them)", store,
                                                  host_slots=True)

    def fresh_objects(self, url: str) -> None:
        """Every load through a new store object: each record mapped and registered anew."""
        p = self.prefix
        holder: list[Store] = []
        loader = p.transfer(open_store(url), p.dst)

        def setup() -> None:
            nonlocal loader
            for old in holder:
                old.close()
            holder[:] = [open_store(url)]
            loader = p.transfer(holder[0], p.dst)
            p.clear()

        def load() -> None:
            assert loader.load_sequence(p.token_ids, p.dst_slots_host)[0] == p.tokens
        try:
            ts = timed(load, self.reps, self.device, setup)
            self.check("fresh objects", loader)
        finally:
            for old in holder:
                old.close()
        self.rows.add("load from shm://, a fresh store object each time (map + register every record)", ts,
                      "copy_ pinned H2D", self.h2d)

    def fresh_process(self, url: str) -> None:
        """A new Python process's first load (its CUDA context made first, untimed): mappings,
        registrations, thread pools and pinned memory all cold; then its second."""
        a = self.args
        cmd = [sys.executable, __file__, "--first-load-child", url, "--device", a.device, "--tokens", str(a.tokens),
               "--layers", str(a.layers)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            raise RuntimeError(f"the child exited {out.returncode}: {out.stderr.strip().splitlines()[-1:] or ''}")
        got = json.loads(lines[-1])
        self.rows.add("load from shm://, the first in a fresh process (host slots)", [got["first"]],
                      "its second load", [got["second"]])
        self.rows.add("load from shm://, that process's second load", [got["second"]], "copy_ pinned H2D", self.h2d)

    def busy_rows(self, store: Store) -> None:
        """A load and a save beside a busy compute stream. Each row's seconds: from the forward's
        queueing (its kernels launched, running) to the call's return, against the call alone;
        the forward's own time noted."""
        p, device = self.prefix, self.device
        busy = Busy(device, self.args.busy_ms)
        self.rows.note(f"the busy stream: {busy.n} chained matmuls, {med(busy.seconds) * 1e3:.0f} ms alone")
        loader = p.transfer(store, p.dst)
        saver = p.transfer(store, p.src)

        def load() -> None:
            assert loader.load_sequence(p.token_ids, p.dst_slots_host)[0] == p.tokens

        def save() -> None:
            saver.save_sequence(p.token_ids, p.src_slots, from_token=0)

        def beside(fn: Callable[[], None], thread: bool) -> list[float]:
            out = []
            for _ in range(self.reps):
                p.clear()
                sync(device)
                busy.queue()  # the engine's forward, queued on its stream
                start = time.perf_counter()
                if thread:
                    worker = threading.Thread(target=fn)
                    worker.start()
                    worker.join()
                else:
                    fn()
                out.append(time.perf_counter() - start)
                sync(device)
            return sorted(out)
        idle_load = self.idle.get("shm:// host") or timed(load, self.reps, device, p.clear)
        for label, fn, thread, idle in (
                ("load from shm:// on a loader thread, host slots, beside a busy forward (returns at)", load, True,
                 idle_load),
                ("load from shm:// on the engine's thread, host slots, beside a busy forward (returns at)", load,
                 False, idle_load),
                ("save into shm:// on a saver thread beside a busy forward (waits for it by design)", save, True, [])):
            ts = beside(fn, thread)
            if fn is load:
                self.check(label, loader)
            self.rows.add(label, ts, "the call alone" if idle else "the forward alone", idle or busy.seconds,
                          busy_s=busy.seconds)

    # -- candidates --------------------------------------------------------------------------
    def scatter_candidates(self) -> None:
        """One window's records (staged on the device) into the cache: 32 layers' torch launches,
        one captured graph of them, one Triton kernel."""
        p, device, layout = self.prefix, self.device, FlashLayout()
        k, n = p.tokens // 256, 256
        records = torch.randn(k, p.layers, 2, n, 8, 128, device=device).to(torch.bfloat16)
        slots = p.dst_slots

        def torch_path() -> None:
            for layer, cache in enumerate(p.dst):
                layout.scatter_chunks(cache, slots, records[:, layer])
        base = timed(torch_path, self.reps, device)
        self.rows.add(f"scatter of {k} records x {p.layers} layers: torch, one launch per layer", base)
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch_path()  # warm-up on a side stream, as capture requires
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                torch_path()
            self.rows.add("the same, one captured CUDA graph replayed", timed(graph.replay, self.reps, device),
                          "torch", base)
        else:
            self.rows.note("captured CUDA graph: needs CUDA")
        try:
            from kvstore.paged import triton_copy
        except ImportError as exc:
            self.rows.note(f"Triton kernel: not importable here ({exc})")
            return
        if not triton_copy.available(device):
            self.rows.note("Triton kernel: Triton is not installed (or no CUDA)")
            return
        scatter = triton_copy.LayerScatter(p.dst, layout)
        self.rows.add("the same, one Triton kernel over a table of layer pointers",
                      timed(lambda: scatter(slots, records), self.reps, device), "torch", base)

    def device_checksum(self) -> None:
        staged = torch.randint(0, 255, (self.prefix.nbytes,), dtype=torch.uint8, device=self.device)
        words = staged.view(torch.int64)
        self.rows.add("one reduction pass over the staged bytes on the device (a device checksum's floor)",
                      timed(words.sum, self.reps, self.device), "copy_ pinned H2D", self.h2d)

    def registration(self, store: Store) -> None:
        """``cudaHostRegister`` of the records' files, mapped afresh, on one thread and on 8;
        ``cudaHostUnregister`` idle and beside a busy stream (a wait for the device shows)."""
        if self.device.type != "cuda":
            self.rows.note("registration rows: need CUDA")
            return
        from kvstore.pinned import cuda_pinner

        pinner = cuda_pinner(self.device)
        if pinner is None:
            raise RuntimeError("the CUDA runtime torch uses was not found")
        rt = pinner._rt
        p = self.prefix
        paths = [store._file(k.key) for k in p.transfer(store, p.src).keys(p.token_ids)]  # type: ignore[attr-defined]

        def mapped() -> list[np.ndarray]:
            out = []
            for path in paths:
                with open(path, "rb") as f:
                    out.append(np.frombuffer(mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ),
                                             dtype=np.uint8))
            return out

        def register(a: np.ndarray) -> None:
            rc = rt.cudaHostRegister(ctypes.c_void_p(a.ctypes.data), a.nbytes, 0x01 | 0x08)
            if rc:
                rt.cudaGetLastError()
                raise RuntimeError(f"cudaHostRegister failed: {rc}")

        def unregister(arrays: list[np.ndarray]) -> None:
            for a in arrays:
                rt.cudaHostUnregister(ctypes.c_void_p(a.ctypes.data))

        nbytes = sum(os.path.getsize(x) for x in paths)
        for threads in (1, min(8, len(paths))):
            ts = []
            for _ in range(self.reps):
                arrays = mapped()
                start = time.perf_counter()
                if threads == 1:
                    for a in arrays:
                        register(a)
                else:
                    with ThreadPoolExecutor(threads) as pool:
                        list(pool.map(register, arrays))
                ts.append(time.perf_counter() - start)
                unregister(arrays)
            self.rows.add(f"cudaHostRegister of {len(paths)} record mappings, {threads} thread(s)", sorted(ts),
                          nbytes=nbytes)
        busy = Busy(self.device, self.args.busy_ms)
        for label, busy_first in (("idle", False), ("beside a busy stream", True)):
            ts = []
            for _ in range(self.reps):
                arrays = mapped()[:1]
                register(arrays[0])
                sync(self.device)
                if busy_first:
                    busy.queue()
                start = time.perf_counter()
                unregister(arrays)
                ts.append(time.perf_counter() - start)
                sync(self.device)
            self.rows.add(f"cudaHostUnregister of one record mapping, {label}", sorted(ts),
                          "the busy stream alone" if busy_first else "", busy.seconds if busy_first else [],
                          nbytes=arrays[0].nbytes)

    # -- Redis -------------------------------------------------------------------------------
    def redis_rows(self) -> None:
        p, rows = self.prefix, self.rows
        sizes = [1, *(int(s) for s in self.args.shards.split(",") if s)]
        with redis_servers(max(sizes)) as started:
            if not started:
                rows.note("redis-server or redis-py is not installed here: the Redis rows are left out")
                return
            for n in sizes:
                with open_store(shards_url(started[:n])) as store:
                    for s in started[:n]:
                        s.flushall()
                    label = "one redis-server" if n == 1 else f"redis+shards://, {n} servers"
                    if n == 1:
                        self.save_row(f"save into {label} (sent before it returns)", store)
                    p.transfer(store, p.src).save_sequence(p.token_ids, p.src_slots)
                    keys = [k.key for k in p.transfer(store, p.src).keys(p.token_ids)]
                    raw = raw_redis_load(started[:n], store, keys, record_sizes(store, keys), self.device)
                    raw_ts = timed(raw, self.reps, self.device)
                    rows.add(f"RawRedis + DMA, {label}", raw_ts, "copy_ pinned H2D", self.h2d)
                    self.load_row(f"load from {label}, slots on the host", store, host_slots=True,
                                  baseline=(f"RawRedis + DMA, {label}", raw_ts))


def first_load_child(args: argparse.Namespace, device: torch.device) -> None:
    """The fresh process's side of ``Bench.fresh_process``: one JSON line, the first and second
    load's seconds."""
    prefix = Prefix(device, args.tokens, args.layers)  # the same seed: the parent's tokens, blocks and KV
    sync(device)
    store = open_store(args.first_load_child)
    try:
        loader = prefix.transfer(store, prefix.dst)
        times = []
        for _ in range(2):
            prefix.clear()
            sync(device)
            start = time.perf_counter()
            n, _ = loader.load_sequence(prefix.token_ids, prefix.dst_slots_host)
            sync(device)
            times.append(time.perf_counter() - start)
            if n != prefix.tokens or not prefix.loaded_right():
                raise SystemExit(f"the fresh process loaded {n} of {prefix.tokens} tokens, or other KV")
    finally:
        store.close()
    print(json.dumps({"first": times[0], "second": times[1]}), flush=True)


if __name__ == "__main__":
    main()
