"""Device-to-host and host-to-device through kvstore's pinned pool, next to a plain ``copy_``.

A 2,048-token Llama-3-8B-shaped prefix on the GPU (32 layers of ``[2, 256 blocks, 16, 8, 128]``
bf16, the prompt's 128 blocks at random ids, 256 MiB): ``KVTransfer.save_sequence`` (gather on
the device, copy into pinned pool buffers on a side stream, checksum; into a store that keeps
nothing) and ``load_sequence`` (records in host memory, verified, copied to the device and
scattered), against ``copy_`` of 256 MiB between a contiguous device tensor and pinned host
memory, in the same run. GB/s = 10^9 bytes/s, median [min-max] of ``--reps``.

    python benchmarks/bench_gpu.py [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine

from kvstore.keys import Namespace
from kvstore.paged import FlashLayout, KVTransfer, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.stores.base import Store, WriteValue
from kvstore.stores.memory import MemoryStore

LAYERS, HEADS, HEAD, BLOCK, BLOCKS, TOKENS, CHUNK = 32, 8, 128, 16, 256, 2048, 256


class NullStore(Store):
    """Takes every write and keeps nothing: a save measures the copy path alone."""

    def get(self, key: str) -> None:
        return None

    def put(self, key: str, value: WriteValue) -> None:
        pass

    def delete(self, key: str) -> bool:
        return False

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        return iter(())


def rate(nbytes: int, fn, reps: int) -> tuple[float, float, float]:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(nbytes / (time.perf_counter() - t) / 1e9)
    out.sort()
    return statistics.median(out), out[0], out[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(machine(), torch.cuda.get_device_name(), flush=True)
    rng = np.random.default_rng(0)
    ns = Namespace(model="bench-gpu", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=BLOCK, chunk_tokens=CHUNK,
                   layer_end=LAYERS)
    src = [torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros_like(c) for c in src]
    tokens = rng.integers(0, 128000, TOKENS, dtype=np.uint32)
    blocks = rng.permutation(BLOCKS)[:TOKENS // BLOCK].tolist()
    slots = slots_from_block_table(blocks, BLOCK, TOKENS, device="cuda")
    nbytes = TOKENS * LAYERS * 2 * HEADS * HEAD * 2
    saver = KVTransfer(PrefixCache(NullStore(), ns), src, FlashLayout())
    memory = MemoryStore(MemoryStore.Config(max_bytes=1 << 30))
    KVTransfer(PrefixCache(memory, ns), src, FlashLayout()).save_sequence(tokens, slots)
    loader = KVTransfer(PrefixCache(memory, ns), dst, FlashLayout())
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rows = {
        "copy_ device -> pinned host (ceiling)": rate(nbytes, lambda: host.copy_(dev, non_blocking=True), args.reps),
        "KVTransfer save (gather, D2H into the pool, checksum)": rate(
            nbytes, lambda: saver.save_sequence(tokens, slots), args.reps),
        "copy_ pinned host -> device (ceiling)": rate(nbytes, lambda: dev.copy_(host, non_blocking=True), args.reps),
        "KVTransfer load (verify, H2D, scatter)": rate(nbytes, lambda: loader.load_sequence(tokens, slots), args.reps),
    }
    ok = all(torch.equal(d[:, blocks], s[:, blocks]) for d, s in zip(dst, src))
    print(f"\n{TOKENS} tokens, {nbytes / 2**20:.0f} MiB; GB/s, median [min-max] of {args.reps}; loads correct: {ok}\n")
    print("| path | GB/s | ratio to copy_ |\n|---|---|---|")
    d2h, h2d = rows["copy_ device -> pinned host (ceiling)"][0], rows["copy_ pinned host -> device (ceiling)"][0]
    for name, (m, lo, hi) in rows.items():
        base = d2h if "save" in name or "device ->" in name else h2d
        print(f"| {name} | {m:.2f} [{lo:.2f}-{hi:.2f}] | {m / base:.2f} |")


if __name__ == "__main__":
    main()
