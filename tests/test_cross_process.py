"""Three processes share KV records through Redis and S3 (real records, real servers).

1. writes a prompt's chunks through the tiered store [memory, redis, s3] and closes it;
2. (own empty memory tier) finds the whole prefix in Redis and decodes every record;
3. after Redis is flushed, finds it in S3, and its hits are promoted back into Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore import FORMAT_VERSION

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys
import numpy as np
from kvstore.keys import Namespace, chunk_keys
from kvstore.record import decode_record, encode_record
from kvstore.stores import open_store

role, redis_url, s3_url = sys.argv[1:4]
ns = Namespace(model="cross-process", kv_dtype="bfloat16", layout="test", block_size=16, chunk_tokens=64)
tokens = np.random.default_rng(7).integers(0, 32000, 64 * 6 + 10).astype(np.uint32)
chunks = chunk_keys(ns, tokens)
shapes = [(2, 64, 4, 32)] * 4  # 4 layers of K,V x tokens x heads x head size


def kv_of(c):
    rng = np.random.default_rng(1000 + c.index)
    return rng.standard_normal(4 * 2 * c.num_tokens * 4 * 32).astype(np.float32).view(np.uint32) >> 16


store = open_store(["memory://?max_bytes=64MiB", redis_url, s3_url])
out = {"role": role}
if role == "write":
    for c in chunks:
        kv = kv_of(c).astype(np.uint16)
        shp = [(2, c.num_tokens, 4, 32)] * 4
        store.put(c.key, encode_record(namespace=ns, chunk=c, tokens=tokens[c.start:c.end], dtype="bfloat16",
                                       shapes=shp, kv=kv))
else:
    keys = [c.key for c in chunks]
    out["memory_prefix"] = store.tiers[0].store.longest_prefix(keys)
    out["redis_prefix"] = store.tiers[1].store.longest_prefix(keys)
    out["prefix"] = store.longest_prefix(keys)
    ok = 0
    for c, value in zip(chunks, store.get_many(keys)):
        rec = decode_record(value, namespace=ns, chunk=c, tokens=tokens[c.start:c.end], dtype="bfloat16")
        ok += bytes(rec.kv) == kv_of(c).astype(np.uint16).tobytes()
    out["verified"] = ok
out["flushed"] = store.flush(30)
store.close()
print(json.dumps(out))
'''


def run(role: str, redis_url: str, s3_url: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, role, redis_url, s3_url], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_three_processes_share_records_through_redis_and_s3(redis_server, s3_server):
    redis_server.flushall()
    s3_server.clear()
    s3_url = s3_server.url_for("cross")
    n = 7  # 6 full chunks and a partial one

    assert run("write", redis_server.url, s3_url)["flushed"]

    second = run("read", redis_server.url, s3_url)
    assert second == {"role": "read", "memory_prefix": 0, "redis_prefix": n, "prefix": n, "verified": n,
                      "flushed": True}

    redis_server.flushall()
    third = run("read", redis_server.url, s3_url)
    assert (third["redis_prefix"], third["prefix"], third["verified"]) == (0, n, n)
    with redis_server.client() as raw:  # promoted from S3 into Redis by the third process
        assert len([k for k in raw.scan_iter(f"kvs{FORMAT_VERSION}/*")]) == n
