"""The cost of authenticated records: sign and verify per record size, and end-to-end loads,
each as a ratio to the unauthenticated path measured in the same run, interleaved.

Per record size (bf16 KV, raw codec): ``encode_record`` into a reused buffer without and with a
tag (keyed BLAKE3 over header and payload), ``decode_record`` (full verification) without and
with the key, and ``PrefixCache.load`` of 16 chunks (verify + copy each into a preallocated
destination, as a scatter would) from a memory store and from a local redis-server, without
and with the key. Each rep times the plain and the keyed variant back to back (alternating which
goes first); the ratio is
taken per rep (noise on this shared VM cancels) and its median reported. Also the keyed-hash
candidates alone at each size (HMAC-SHA256, keyed BLAKE2b, keyed BLAKE3), against xxh3-64.

    python benchmarks/bench_auth.py [--reps 9] [--sizes 64KiB,1MiB,4MiB,16MiB,32MiB] [--no-redis]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash
from common import machine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kvstore import Namespace, chunk_keys, decode_record, encode_record
from kvstore.config import parse_size
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record.auth import RecordAuth
from kvstore.stores.base import Store
from kvstore.stores.memory import MemoryConfig, MemoryStore

KEY = bytes(range(32))
CHUNKS = 16


def paired(plain: Callable[[], object], keyed: Callable[[], object], reps: int) -> tuple[float, float, float]:
    """(median plain seconds, median keyed seconds, median per-rep ratio keyed/plain)."""
    plain(), keyed()  # warm up
    tp, tk, ratios = [], [], []
    for i in range(reps):
        order = (plain, keyed) if i % 2 == 0 else (keyed, plain)
        times = {}
        for fn in order:
            t = time.perf_counter()
            fn()
            times[fn] = time.perf_counter() - t
        tp.append(times[plain])
        tk.append(times[keyed])
        ratios.append(times[keyed] / times[plain])
    return statistics.median(tp), statistics.median(tk), statistics.median(ratios)


def hashes(size: int, reps: int) -> str:
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    import blake3

    cands = {
        "xxh3-64 (checksum)": lambda: xxhash.xxh3_64_digest(data),
        "hmac-sha256": lambda: hmac.digest(KEY, data, "sha256"),
        "keyed blake2b-256": lambda: hashlib.blake2b(data, key=KEY, digest_size=32).digest(),
        "keyed blake3 (used)": lambda: blake3.blake3(data, key=KEY).digest(),
    }
    try:  # a one-time-key MAC, for comparison (needs a per-record key; not used)
        from cryptography.hazmat.primitives.poly1305 import Poly1305

        cands["poly1305 (one-time key)"] = lambda: Poly1305.generate_tag(KEY, data)
    except ImportError:
        pass
    cells = []
    for name, fn in cands.items():
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        cells.append(f"{name} {size / statistics.median(times) / 1e9:.2f}")
    return ", ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB,16MiB,32MiB")
    parser.add_argument("--no-redis", action="store_true")
    args = parser.parse_args()
    auth = RecordAuth([KEY])
    redis_server = None
    if not args.no_redis:
        import servers

        if servers.find_binary("redis-server"):
            redis_server = servers.RedisServer()
    print(f"machine: {machine()}")
    print(f"ratios keyed/plain of seconds per operation (1.00 = free), median of {args.reps} interleaved reps; "
          f"GB/s of KV bytes\n")
    print(f"{'record':>8s}  {'sign (encode)':>26s}  {'verify (decode)':>26s}  {'load 16, memory':>26s}  "
          f"{'load 16, redis':>26s}")
    try:
        for text in args.sizes.split(","):
            size = parse_size(text)
            tokens_per_chunk = 64
            per_token = size // tokens_per_chunk
            heads_x_dim = per_token // 2 // 2  # K and V, bf16
            ns = Namespace(model="bench-auth", kv_dtype="bfloat16", layout="bench", block_size=16,
                           chunk_tokens=tokens_per_chunk, layer_end=1)
            tokens = np.arange(tokens_per_chunk * CHUNKS)
            keys = chunk_keys(ns, tokens)
            shapes = [(2, tokens_per_chunk, heads_x_dim)]
            kv = np.random.default_rng(0).integers(0, 2**16, size // 2, dtype=np.uint16)
            tag_keys = auth.for_salt("")
            buf_p, buf_k = bytearray(), bytearray()

            def enc(keys_, buf):
                return lambda: encode_record(namespace=ns, chunk=keys[0], tokens=tokens[:tokens_per_chunk],
                                             dtype="bfloat16", shapes=shapes, kv=kv, out=buf, auth=keys_)

            sign = paired(enc(None, buf_p), enc(tag_keys, buf_k), args.reps)
            plain_rec, keyed_rec = bytes(enc(None, buf_p)()), bytes(enc(tag_keys, buf_k)())
            verify = paired(lambda: decode_record(plain_rec, namespace=ns, chunk=keys[0]),
                            lambda: decode_record(keyed_rec, namespace=ns, chunk=keys[0], auth=tag_keys), args.reps)
            cells: list[tuple[float, float, float] | None] = [sign, verify]
            dest = np.empty(size, np.uint8)

            def sink(chunk, record):
                np.copyto(dest, np.frombuffer(record.kv, np.uint8))  # a scatter's worth of copying

            for kind in ("memory", "redis"):
                if kind == "redis" and redis_server is None:
                    cells.append(None)
                    continue
                from kvstore.stores import open_store

                store: Store = (MemoryStore(MemoryConfig(max_bytes=4 * CHUNKS * size + (64 << 20))) if kind == "memory"
                                else open_store(redis_server.url + "?timeout=5s"))
                caches = {name: PrefixCache(store, ns.with_salt(name), auth=a)
                          for name, a in (("plain", None), ("keyed", auth))}
                for cache in caches.values():
                    cache.save(tokens, cache.keys(tokens), lambda c: ChunkPayload(shapes=shapes, kv=kv),
                               skip_stored=False)

                def load(cache):
                    ckeys = cache.keys(tokens)
                    return lambda: cache.load(tokens, ckeys, sink, shapes=lambda c: shapes)

                for cache in caches.values():  # both really load every chunk (nothing evicted)
                    result = load(cache)()
                    assert result.num_chunks == CHUNKS, result
                cells.append(paired(load(caches["plain"]), load(caches["keyed"]), args.reps))
                store.close()
            row = [f"{text:>8s}"]
            for i, cell in enumerate(cells):
                if cell is None:
                    row.append(f"{'-':>26s}")
                    continue
                nbytes = size * (CHUNKS if i >= 2 else 1)
                row.append(f"{cell[2]:5.2f} ({nbytes / cell[0] / 1e9:5.2f} -> {nbytes / cell[1] / 1e9:5.2f} GB/s)")
            print("  ".join(row))
        print("\nkeyed-hash candidates alone, GB/s (median):")
        for text in args.sizes.split(","):
            print(f"  {text:>6s}: {hashes(parse_size(text), args.reps)}")
    finally:
        if redis_server is not None:
            redis_server.close()


if __name__ == "__main__":
    main()
