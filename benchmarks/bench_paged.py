"""Paged KV gather/scatter throughput next to memcpy of the same bytes, in the same run.

A 2,048-token prompt in a Llama-3-8B-shaped cache: 32 layers, 8 KV heads, head size 128, bf16,
block size 16, the prompt's 128 blocks at random ids among 512. Per layout: gather (all 32
layers into one staging tensor, as KVTransfer does per chunk) and scatter (the reverse), GB/s
= 10^9 payload bytes/s, median [min-max] of ``--repeat`` runs, and the ratio to a memcpy of
the same total bytes into preallocated memory.

A second table measures the same prompt through ``KVTransfer``, per 256-token chunk as the
save and load paths run it: gather of all layers into the staging tensor, and scatter straight
from an encoded record's payload (read-only bytes at whatever alignment the header leaves).

    python benchmarks/bench_paged.py [--repeat 9] [--threads N]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import numpy as np
import torch

from kvstore.keys import Namespace
from kvstore.paged import BHNCLayout, CPUPackedLayout, FlashLayout, KVTransfer, MLALayout, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.record import decode_record, encode_record
from kvstore.stores.memory import MemoryStore

LAYERS, HEADS, HEAD, BLOCK, BLOCKS, TOKENS, CHUNK = 32, 8, 128, 16, 512, 2048, 256
NAMES = ("flash-2bnhd", "vllm-bhnc (GPU NHD view, strided)", "vllm-bhnc (HND, fallback path)",
         "vllm-cpu-vec (whole blocks)", "mla-bnl (latent 576)")


def caches(name: str) -> tuple[object, list[torch.Tensor]]:
    z = lambda *s: torch.randn(*s, dtype=torch.float32).to(torch.bfloat16)
    if name == "flash-2bnhd":
        return FlashLayout(), [z(2, BLOCKS, BLOCK, HEADS, HEAD) for _ in range(LAYERS)]
    if name == "vllm-bhnc (GPU NHD view, strided)":
        return BHNCLayout(), [z(BLOCKS, BLOCK, HEADS, 2 * HEAD).permute(0, 2, 1, 3) for _ in range(LAYERS)]
    if name == "vllm-bhnc (HND, fallback path)":
        return BHNCLayout(), [z(BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
    if name == "vllm-cpu-vec (whole blocks)":
        return CPUPackedLayout("vec"), [z(BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
    if name == "mla-bnl (latent 576)":
        return MLALayout(), [z(BLOCKS, BLOCK, 576) for _ in range(LAYERS)]
    raise KeyError(name)


def timeit(fn, repeat: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fmt(nbytes: int, times: list[float]) -> tuple[float, str]:
    rates = sorted(nbytes / t / 1e9 for t in times)
    med = statistics.median(rates)
    return med, f"{med:.1f} [{rates[0]:.1f}-{rates[-1]:.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(BLOCKS, generator=gen)[:TOKENS // BLOCK]
    slots = slots_from_block_table(block_ids, BLOCK, TOKENS)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {TOKENS} tokens, {LAYERS} layers, repeat {args.repeat}")
    print("| layout | MiB | memcpy GB/s | gather GB/s | gather/memcpy | scatter GB/s | scatter/memcpy |")
    print("|---|---|---|---|---|---|---|")
    for name in NAMES:
        layout, layers = caches(name)
        staging = torch.empty((LAYERS, *layout.chunk_shape(layers[0], TOKENS)), dtype=torch.bfloat16)
        nbytes = staging.numel() * staging.element_size()
        src = torch.randn(staging.shape).to(torch.bfloat16)
        dst = torch.empty_like(src)

        def gather() -> None:
            for i, c in enumerate(layers):
                layout.gather(c, slots, staging[i])

        def scatter() -> None:
            for i, c in enumerate(layers):
                layout.scatter(c, slots, staging[i])

        # Interleave: each round measures memcpy, gather and scatter back to back, so load from
        # other processes hits all three alike.
        mc, ga, sc = [], [], []
        for _ in range(args.repeat):
            mc += timeit(lambda: dst.copy_(src), 1)
            ga += timeit(gather, 1)
            sc += timeit(scatter, 1)
        m, ms = fmt(nbytes, mc)
        g, gs = fmt(nbytes, ga)
        s, ss = fmt(nbytes, sc)
        print(f"| {name} | {nbytes / 2**20:.0f} | {ms} | {gs} | {g / m:.2f} | {ss} | {s / m:.2f} |", flush=True)
        del layers, staging, src, dst
        gc.collect()

    print(f"\nPer {CHUNK}-token chunk through KVTransfer (save: gather into pooled staging; load: scatter"
          " from record bytes)")
    print("| layout | MiB | memcpy GB/s | gather GB/s | gather/memcpy | scatter GB/s | scatter/memcpy |")
    print("|---|---|---|---|---|---|---|")
    tokens = np.arange(TOKENS, dtype=np.uint32)
    for name in NAMES:
        layout, layers = caches(name)
        ns = Namespace(model="bench", kv_dtype="bfloat16", layout=layout.name, block_size=BLOCK,
                       chunk_tokens=CHUNK, layer_end=LAYERS)
        xfer = KVTransfer(PrefixCache(MemoryStore(), ns), layers, layout)
        chunks = xfer.keys(tokens)
        staging, lease = xfer._host_staging(CHUNK)
        payloads = []  # the KV bytes of each encoded record, where load_sequence's sink gets them
        for c in chunks:
            xfer._gather(slots[c.start:c.end], staging)
            kv = staging.reshape(-1).view(torch.uint8).numpy()
            rec = encode_record(namespace=ns, chunk=c, tokens=tokens[c.start:c.end], dtype="bfloat16",
                                shapes=xfer._shapes(c.num_tokens), kv=kv)
            payloads.append(decode_record(rec).kv)  # a view of the record's payload (raw codec)
        nbytes = sum(len(p) for p in payloads)
        src = torch.randn(nbytes // 2).to(torch.bfloat16)
        dst = torch.empty_like(src)

        def save_side() -> None:
            for c in chunks:
                xfer._gather(slots[c.start:c.end], staging)

        def load_side() -> None:
            for c, kv in zip(chunks, payloads):
                xfer._scatter(slots[c.start:c.end], kv)

        mc, ga, sc = [], [], []
        for _ in range(args.repeat):
            mc += timeit(lambda: dst.copy_(src), 1)
            ga += timeit(save_side, 1)
            sc += timeit(load_side, 1)
        m, ms = fmt(nbytes, mc)
        g, gs = fmt(nbytes, ga)
        sv, ss = fmt(nbytes, sc)
        print(f"| {name} | {nbytes / 2**20:.0f} | {ms} | {gs} | {g / m:.2f} | {ss} | {sv / m:.2f} |", flush=True)
        if lease is not None:
            lease.release()
        del layers, xfer, payloads, src, dst, staging
        gc.collect()

if __name__ == "__main__":
    main()
