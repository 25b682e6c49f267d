"""Record encode/decode throughput per codec, against memcpy of the same bytes in the same run.

A 32 MiB bf16 chunk: 32 layers x K,V x 256 tokens x 8 KV heads x 128 head size. Values are
normal random bf16, which compress like real KV (MEASUREMENTS.md section 4). Also times the
prefix-chained hashing of 128k tokens.

    python benchmarks/bench_codec.py [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from common import fmt, gbps, machine, timeit

from kvstore import Namespace, chunk_keys, decode_record, encode_record
from kvstore.record.codecs import resolve_chain

LAYERS, HEADS, HEAD, TOKENS = 32, 8, 128, 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--codecs", default="raw,lz4,shuffle-lz4,shuffle-zstd")
    args = parser.parse_args()
    torch.manual_seed(0)
    kv = torch.randn(LAYERS, 2, TOKENS, HEADS, HEAD).to(torch.bfloat16)
    raw = kv.view(torch.uint8).numpy().reshape(-1)
    nbytes = raw.nbytes
    ns = Namespace(model="bench", kv_dtype="bfloat16", layout="bench", block_size=16, chunk_tokens=TOKENS, layer_end=LAYERS)
    tokens = np.arange(TOKENS)
    chunk = chunk_keys(ns, tokens)[0]
    shapes = [(2, TOKENS, HEADS, HEAD)] * LAYERS

    print(f"machine: {machine()}")
    print(f"chunk: {nbytes / 2**20:.0f} MiB bf16 ({LAYERS} layers x 2 x {TOKENS} tokens x {HEADS} heads x {HEAD}); "
          f"GB/s median [min-max] of {args.reps}\n")
    dst = np.empty_like(raw)
    memcpy = gbps(nbytes, timeit(lambda: np.copyto(dst, raw), reps=args.reps))
    print(f"{'memcpy (copyto, preallocated)':34s} {fmt(memcpy)}")
    out_buf = bytearray()
    print(f"\n{'codec':14s} {'ratio':>6s}  {'encode GB/s':>22s}  {'decode GB/s':>22s}  {'decode into buffer':>22s}  enc/memcpy dec/memcpy")
    for name in args.codecs.split(","):
        chain = resolve_chain(name, 2)
        enc = lambda: encode_record(namespace=ns, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=shapes,
                                    kv=raw, chain=chain, out=out_buf)
        record = bytes(enc())
        e = gbps(nbytes, timeit(enc, reps=args.reps))
        d = gbps(nbytes, timeit(lambda: decode_record(record, namespace=ns, chunk=chunk, tokens=tokens), reps=args.reps))
        target = memoryview(bytearray(nbytes))
        di = gbps(nbytes, timeit(lambda: decode_record(record, out=target), reps=args.reps))
        assert bytes(target) == raw.tobytes()
        print(f"{name:14s} {nbytes / len(record):6.3f}  {fmt(e):>22s}  {fmt(d):>22s}  {fmt(di):>22s}  "
              f"{e[0] / memcpy[0]:9.2f} {di[0] / memcpy[0]:9.2f}")

    many = np.random.default_rng(0).integers(0, 128_000, 131_072)
    hash_ms = statistics.median(timeit(lambda: chunk_keys(ns, many), reps=args.reps)) * 1e3
    kv_bytes = 131_072 * 32 * 2 * 8 * 128 * 2
    print(f"\nhashing 128k tokens (512 chunk keys): {hash_ms:.2f} ms median; moving their KV "
          f"({kv_bytes / 2**30:.0f} GiB) at memcpy speed takes {kv_bytes / memcpy[0] / 1e6:.0f} ms")


if __name__ == "__main__":
    main()
