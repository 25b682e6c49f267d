"""The GPU break-even (issue 24, item 5): loading a 2,048-token Llama-3-8B-shaped prefix into a
paged KV cache on the device, from the host-shared memory tier and from Redis, against the
prefill of those tokens by a Llama-3-8B-shaped model on the same device, in the same run.

Load: ``KVTransfer.load_sequence`` (lookup, records read, verified, copied to the device and
scattered into blocks at random ids; ``flash-2bnhd``, block size 16, chunks of ``--chunk``
tokens) from ``shm://`` (/dev/shm) and, where ``redis-server`` is installed, from one
redis-server and from ``redis+shards://`` of ``--shards`` servers on this host. Each store holds
the prefix (saved once, untimed).

Prefill: the forward pass of ``--tokens`` tokens through ``--layers`` Llama-3-8B-shaped decoder
layers (hidden 4,096, 32 query heads and 8 KV heads of 128, MLP 14,336, RMSNorm, causal
``scaled_dot_product_attention``), bf16 weights drawn at random. To keep memory and set-up time
small every layer applies the same weights: the FLOPs and the weight bytes read per layer are an
8B model's, and the weights (436 MB per layer) do not fit in any cache, so reuse saves no
traffic. Rotary embeddings, the embedding lookup and the last token's logits are left out (under
1% of the FLOPs). This is a model-shaped stand-in, not an engine: a real engine's prefill adds
its own scheduling and kernels (usually faster attention), so compare with an engine's measured
prefill where one is at hand.

Every time is a median [min-max] of ``--reps`` after a warm-up, synchronised with the device.
The verdict divides each load's time by the prefill's: below 1, loading wins.

On a GPU host (``scripts/gpu_check`` runs it):
    python benchmarks/bench_breakeven.py [--reps 5]
Here, on the CPU, scaled down so a prefill finishes (``--device cpu --layers 2 --tokens 256``):
    python benchmarks/bench_breakeven.py --device cpu --layers 2 --tokens 256 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import machine

from kvstore.keys import Namespace
from kvstore.paged import FlashLayout, KVTransfer, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.stores import open_store
from kvstore.stores.base import Store

HIDDEN, Q_HEADS, KV_HEADS, HEAD, MLP, BLOCK = 4096, 32, 8, 128, 14336, 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> list[float]:
    fn()
    sync(device)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return sorted(out)


class Layer:
    """One Llama-3-8B-shaped decoder layer's weights (random, bf16) and its forward pass."""

    def __init__(self, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)

        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16) * cols ** -0.5)

        self.qkv = w((Q_HEADS + 2 * KV_HEADS) * HEAD, HIDDEN)
        self.o = w(HIDDEN, Q_HEADS * HEAD)
        self.gate_up = w(2 * MLP, HIDDEN)
        self.down = w(HIDDEN, MLP)
        self.norm1 = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
        self.norm2 = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = F.rms_norm(x, (HIDDEN,), self.norm1)
        q, k, v = (h @ self.qkv.T).split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        q = q.view(n, Q_HEADS, HEAD).transpose(0, 1)
        k = k.view(n, KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, dim=0)
        v = v.view(n, KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, dim=0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, Q_HEADS * HEAD)
        x = x + a @ self.o.T
        h = F.rms_norm(x, (HIDDEN,), self.norm2)
        gate, up = (h @ self.gate_up.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down.T


def prefill_flops(tokens: int, layers: int) -> float:
    """Matmul FLOPs of the forward pass (2 per multiply-add), attention's causal half included."""
    weights = HIDDEN * (Q_HEADS + 2 * KV_HEADS) * HEAD + Q_HEADS * HEAD * HIDDEN + 3 * HIDDEN * MLP
    attention = 2 * Q_HEADS * HEAD * tokens * tokens / 2  # QK^T and PV over the causal half
    return layers * (2 * tokens * weights + 2 * attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk (a multiple of 16)")
    parser.add_argument("--shards", type=int, default=2, help="redis-servers of the sharded store (0: none)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{machine()}; device: {name}", flush=True)
    if args.tokens % BLOCK or args.chunk % BLOCK or args.tokens % args.chunk:
        raise SystemExit("--tokens must be a multiple of --chunk, and both of 16")
    rng = np.random.default_rng(0)
    blocks_total = args.tokens // BLOCK * 2
    kv = [torch.randn(2, blocks_total, BLOCK, KV_HEADS, HEAD, device=device).to(torch.bfloat16)
          for _ in range(args.layers)]
    dst = [torch.zeros_like(c) for c in kv]
    tokens = rng.integers(0, 128000, args.tokens, dtype=np.uint32)
    src_blocks = rng.permutation(blocks_total)[:args.tokens // BLOCK].tolist()
    dst_blocks = rng.permutation(blocks_total)[:args.tokens // BLOCK].tolist()
    src_slots = slots_from_block_table(src_blocks, BLOCK, args.tokens, device=device)
    dst_slots = slots_from_block_table(dst_blocks, BLOCK, args.tokens, device=device)
    kv_bytes = args.tokens * args.layers * 2 * KV_HEADS * HEAD * 2
    ns = Namespace(model="bench-breakeven", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=BLOCK,
                   chunk_tokens=args.chunk, layer_end=args.layers)

    stores: dict[str, Store] = {}
    redis_servers: list = []
    shm_name = f"bench-breakeven-{os.getpid()}"
    stores["shm://"] = open_store(f"shm://{shm_name}?max_bytes={max(1 << 30, 2 * kv_bytes)}")
    try:
        import importlib.util

        import servers

        if servers.find_binary("redis-server") is None or importlib.util.find_spec("redis") is None:
            print("redis-server or redis-py is not installed here: the Redis rows are left out", flush=True)
        else:
            redis_servers = [servers.RedisServer() for _ in range(max(1, args.shards))]
            stores["redis, 1 server"] = open_store(redis_servers[0].url)
            if args.shards > 1:
                stores[f"redis+shards, {args.shards} servers"] = open_store(
                    "redis+shards://" + ",".join(f"127.0.0.1:{s.port}" for s in redis_servers))
        results = run(args, device, stores, kv, dst, tokens, src_slots, dst_slots, dst_blocks, src_blocks, kv_bytes, ns)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "device": name, **results}, indent=1))
    finally:
        for store in stores.values():
            store.close()
        shutil.rmtree(f"/dev/shm/kvstore-{shm_name}", ignore_errors=True)
        for s in redis_servers:
            s.close()


def run(args, device, stores, kv, dst, tokens, src_slots, dst_slots, dst_blocks, src_blocks, kv_bytes, ns) -> dict:
    loads: dict[str, list[float]] = {}
    for label, store in stores.items():
        KVTransfer(PrefixCache(store, ns), kv, FlashLayout()).save_sequence(tokens, src_slots)
        store.flush(60)
        loader = KVTransfer(PrefixCache(store, ns), dst, FlashLayout())
        for d in dst:
            d.zero_()

        def load(loader=loader) -> None:
            n, _ = loader.load_sequence(tokens, dst_slots)
            assert n == args.tokens, n
        loads[label] = timed(load, args.reps, device)
        if not all(torch.equal(d[:, dst_blocks], s[:, src_blocks]) for d, s in zip(dst, kv)):
            raise SystemExit(f"{label}: the loaded KV differs from the saved KV")
    layer = Layer(device)
    x = torch.randn(args.tokens, HIDDEN, device=device, dtype=torch.bfloat16)

    @torch.inference_mode()
    def prefill() -> None:
        h = x
        for _ in range(args.layers):
            h = layer(h)
    pre = timed(prefill, args.reps, device)
    flops = prefill_flops(args.tokens, args.layers)
    med_pre = statistics.median(pre)
    print(f"\n{args.tokens} tokens x {args.layers} layers: {kv_bytes / 1e6:.0f} MB of KV in chunks of {args.chunk} "
          f"tokens; prefill {flops / 1e12:.1f} TFLOP; seconds, median [min-max] of {args.reps}\n")
    print("| path | s | GB/s of KV | x prefill (below 1: loading wins) |\n|---|---|---|---|")
    print(f"| prefill (model-shaped, random weights) | {med_pre:.4f} [{pre[0]:.4f}-{pre[-1]:.4f}] | - | 1.00 "
          f"({flops / med_pre / 1e12:.1f} TFLOP/s) |")
    out = {"tokens": args.tokens, "layers": args.layers, "kv_bytes": kv_bytes, "prefill_s": pre,
           "prefill_flops": flops, "loads_s": loads}
    for label, ts in loads.items():
        m = statistics.median(ts)
        print(f"| load from {label} | {m:.4f} [{ts[0]:.4f}-{ts[-1]:.4f}] | {kv_bytes / m / 1e9:.2f} | {m / med_pre:.2f} |")
    return out


if __name__ == "__main__":
    main()
