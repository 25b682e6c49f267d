"""``kvstore selftest``: save and load a synthetic KV prefix through a store and report.

A quick check that a store URL works end to end: keys, records, writes, the longest-prefix
lookup, verified reads, and that a corrupted record is detected and becomes a miss.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from kvstore.cli.common import add_store_option, number, store_urls
from kvstore.keys import ChunkKey, Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record import Record
from kvstore.stores import open_store
from kvstore.types import array_view

#: The largest synthetic prompt (4 KiB of KV per token and layer: 8 layers x 128k tokens = 4 GiB).
MAX_TOKENS = 131072
MAX_LAYERS = 128


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("selftest", help="save and load a synthetic KV prefix through a store")
    add_store_option(p)
    p.add_argument("--tokens", type=number(int, 1, MAX_TOKENS), default=1000, help=f"prompt length, 1-{MAX_TOKENS} (default 1000)")
    p.add_argument("--layers", type=number(int, 1, MAX_LAYERS), default=8, help=f"layers, 1-{MAX_LAYERS} (default 8)")
    p.add_argument("--codec", default="raw", help="raw, lz4, shuffle-lz4, zstd, shuffle-zstd")
    p.set_defaults(func=run)


class _DropDiscardOf(logging.Filter):
    """Drops the prefix cache's log line about the one record the selftest damages on purpose."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def filter(self, record: logging.LogRecord) -> bool:
        return self.key not in record.getMessage()


def run(args: argparse.Namespace) -> int:
    heads, head_size, chunk = 8, 128, 256
    ns = Namespace(model="kvstore-selftest", kv_dtype="float16", layout="selftest", block_size=16,
                   chunk_tokens=chunk, layer_end=args.layers, model_fingerprint=str(time.time_ns()))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, args.tokens, dtype=np.uint32)
    kv = rng.standard_normal((args.layers, 2, args.tokens, heads, head_size), dtype=np.float32).astype(np.float16)
    store = open_store(store_urls(args))
    cache = PrefixCache(store, ns, codec=args.codec)
    keys = cache.keys(tokens)
    try:
        def payload(c: ChunkKey) -> ChunkPayload:
            part = np.ascontiguousarray(kv[:, :, c.start:c.end])
            return ChunkPayload(shapes=[part.shape[1:]] * args.layers, kv=array_view(part))

        t0 = time.perf_counter()
        written = cache.save(tokens, keys, payload)
        if hasattr(store, "flush"):
            store.flush()
        t1 = time.perf_counter()
        found = cache.lookup_tokens(keys)
        out = np.zeros_like(kv)

        def sink(c: ChunkKey, record: Record) -> None:
            out[:, :, c.start:c.end] = np.frombuffer(record.kv, np.float16).reshape(out[:, :, c.start:c.end].shape)

        t2 = time.perf_counter()
        loaded = cache.load(tokens, keys, sink)
        t3 = time.perf_counter()
        ok = loaded.num_tokens == args.tokens and np.array_equal(out, kv)
        print(f"store:     {store!r}")
        print(f"prompt:    {args.tokens} tokens -> {len(keys)} chunks of {chunk} ({kv.nbytes / 2**20:.1f} MiB of KV)")
        print(f"saved:     {written} chunks in {(t1 - t0) * 1e3:.1f} ms")
        print(f"lookup:    {found}/{args.tokens} tokens stored")
        print(f"loaded:    {loaded.num_tokens} tokens in {(t3 - t2) * 1e3:.1f} ms, bytes identical: {ok}")
        # A damaged record must be detected and become a miss. The prefix cache logs a warning for
        # every record it discards; this one is damaged on purpose, so its warning is not shown.
        first = store.get(keys[0].key)
        if first is not None:
            damaged = bytearray(first)
            damaged[-1] ^= 0xFF
            store.put(keys[0].key, damaged)
            print("corrupt:   one byte of the first record flipped; a load must reject it, load nothing, remove it")
            quiet = _DropDiscardOf(keys[0].key)
            logging.getLogger("kvstore.prefix_cache").addFilter(quiet)
            try:
                again = cache.load(tokens, keys, lambda c, r: None)
            finally:
                logging.getLogger("kvstore.prefix_cache").removeFilter(quiet)
            removed = store.get(keys[0].key) is None
            print(f"rejected:  {again.num_tokens} tokens loaded ({again.reason}), record removed: {removed}")
            ok = ok and again.num_tokens == 0 and removed
        print("selftest: " + ("OK" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        store.delete_many([k.key for k in keys])
        store.close()
