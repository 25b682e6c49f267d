"""Loads and saves of a 2,048-token Llama-3-8B-shaped prefix between a paged KV cache on the GPU
and every store a GPU host uses, each against its physical ceiling measured in the same run.

The prefix: 32 layers of ``[2, blocks, 16, 8, 128]`` bf16 (flash layout), its 128 blocks at
random ids, 268 MB in 8 records of 256 tokens. Rows, in GB/s of KV (10^9 bytes/s), median
[min-max] of ``--reps`` after a warm-up, synchronised with the device:

* ceilings: ``copy_`` of the same bytes host -> device from pinned and from pageable memory,
  device -> pinned host;
* loads (``KVTransfer.load_sequence``: lookup, records read where they lie, every one
  verified, DMA'd and scattered at other random blocks) from ``memory://``, ``shm://`` (its
  mappings registered) and ``shm://`` as a fresh process sees it (mapping and registering every
  record: the first load), against the pinned ``copy_``; from one redis-server and from
  ``redis+shards://`` of 4 and 8, against ``RawRedis`` reading the same records from the same
  servers into pinned memory (one connection per server, all at once), then DMA'd;
* saves (``save_sequence``: one gather pass, one D2H copy, records written, checksummed) into a
  store that keeps nothing, ``memory://``, ``shm://`` and one redis-server, against the D2H ``copy_``.

Every load is checked (the KV landed where it belongs) and its host copies counted
(``DeviceCopies.stats``: records DMA'd from pageable memory, or decompressed on the host).

    python benchmarks/bench_gpu.py [--reps 7] [--json out.json]         # a GPU host
    python benchmarks/bench_gpu.py --device cpu --layers 2 --reps 2     # a smoke run, anywhere
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from common import machine
from gpu_common import (
    Prefix,
    copy_ceilings,
    med,
    raw_redis_load,
    record_sizes,
    redis_servers,
    shards_url,
    shm_store,
    span,
    timed,
)

from kvstore.stores import open_store
from kvstore.stores.base import Store, WriteValue


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
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (device path, smoke run)"
    print(f"{machine()}; device: {name}", flush=True)
    prefix = Prefix(device, args.tokens, args.layers)
    rows: list[tuple[str, list[float], str, list[float]]] = []  # (what, seconds, baseline name, its seconds)
    notes: list[str] = []
    ceil = copy_ceilings(prefix.nbytes, args.reps, device)
    rows += [("copy_ pinned host -> device", ceil["h2d_pinned"], "", []),
             ("copy_ pageable host -> device", ceil["h2d_pageable"], "copy_ pinned host -> device", ceil["h2d_pinned"]),
             ("copy_ device -> pinned host", ceil["d2h_pinned"], "", [])]
    h2d, d2h = ("copy_ pinned H2D", ceil["h2d_pinned"]), ("copy_ D2H", ceil["d2h_pinned"])

    def load_row(label: str, store: Store, baseline: tuple[str, list[float]], fresh: bool = False,
                 url: str = "") -> None:
        loader = prefix.transfer(store, prefix.dst)

        def load() -> None:
            n, _ = loader.load_sequence(prefix.token_ids, prefix.dst_slots)
            assert n == args.tokens, f"{label}: loaded {n} of {args.tokens} tokens"
        if fresh:  # a fresh store object each time: every record mapped and registered anew
            holder: list = []

            def setup() -> None:
                nonlocal loader
                for old in holder:
                    old.close()
                holder[:] = [open_store(url)]
                loader = prefix.transfer(holder[0], prefix.dst)
                prefix.clear()
            ts = timed(load, args.reps, device, setup)
            for old in holder:
                old.close()
        else:
            ts = timed(load, args.reps, device, prefix.clear)
        if not prefix.loaded_right():
            raise SystemExit(f"{label}: the loaded KV differs from the saved KV")
        copies = {f"{op}/{memory}": n for (op, memory), n in loader.copies.stats.items()}
        if any(k != "load/pinned" for k in copies):
            notes.append(f"{label}: records not DMA'd from pinned memory: {copies}")
        rows.append((label, ts, baseline[0], baseline[1]))

    def save_row(label: str, store: Store) -> None:
        saver = prefix.transfer(store, prefix.src)
        ts = timed(lambda: saver.save_sequence(prefix.token_ids, prefix.src_slots, from_token=0), args.reps, device)
        rows.append((label, ts, *d2h))

    save_row("save: gather + D2H only (a store that keeps nothing)", NullStore())
    with open_store(f"memory://?max_bytes={4 * prefix.nbytes}") as memory:
        save_row("save into memory://", memory)
        load_row("load from memory://", memory, h2d)
    with shm_store("gpu", 4 * prefix.nbytes) as (shm, url):
        save_row("save into shm://", shm)
        load_row("load from shm:// (mappings registered)", shm, h2d)
        load_row("load from shm://, first in a process (map + register)", shm, h2d, fresh=True, url=url)
    sizes = [1, *(int(s) for s in args.shards.split(",") if s)]
    with redis_servers(max(sizes)) as started:
        if not started:
            notes.append("redis-server or redis-py is not installed here: the Redis rows are left out")
        for n in sizes if started else []:
            with open_store(shards_url(started[:n])) as store:
                for s in started[:n]:
                    s.flushall()
                label = "one redis-server" if n == 1 else f"redis+shards://, {n} servers"
                if n == 1:
                    save_row(f"save into {label} (sent before it returns)", store)
                prefix.transfer(store, prefix.src).save_sequence(prefix.token_ids, prefix.src_slots)
                keys = [k.key for k in prefix.transfer(store, prefix.src).keys(prefix.token_ids)]
                raw = raw_redis_load(started[:n], store, keys, record_sizes(store, keys), device)
                raw_ts = timed(raw, args.reps, device)
                rows.append((f"RawRedis + DMA, {label}", raw_ts, *h2d))
                load_row(f"load from {label}", store, (f"RawRedis + DMA, {label}", raw_ts))
    print_rows(prefix, rows, notes, args)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": machine(), "device": name, "tokens": args.tokens, "layers": args.layers, "kv_bytes": prefix.nbytes,
             "rows": [{"path": r[0], "seconds": r[1], "baseline": r[2], "baseline_seconds": r[3]} for r in rows],
             "notes": notes}, indent=1))


def print_rows(prefix: Prefix, rows: Sequence[tuple[str, list[float], str, list[float]]], notes: list[str],
               args: argparse.Namespace) -> None:
    print(f"\n{args.tokens} tokens x {args.layers} layers: {prefix.nbytes / 1e6:.0f} MB of KV; seconds and GB/s, "
          f"median [min-max] of {args.reps}\n")
    print("| path | s | GB/s | x baseline (same run) |\n|---|---|---|---|")
    for label, ts, base, base_ts in rows:
        ratio = f"{med(base_ts) / med(ts):.2f}x {base}" if base_ts else "-"
        print(f"| {label} | {span(ts)} | {prefix.nbytes / med(ts) / 1e9:.2f} | {ratio} |")
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
