"""Healing on real vLLM engines: after a reader met damaged records, every damaged chunk of the
prefix is replaced, not only the first, so the next reader hits all of it (issue 22).

One writer fills a Redis with two prompts; for each load mode the records are copied under a
fresh prefix and every chunk of both prompts is damaged: prompt 1 by a flipped payload byte
(the checksum fails), prompt 2 by giving every key its neighbour's valid record (the key and
token check fails). Reader 1 detects it, recomputes (tokens identical to the writer's first run,
which computed everything itself) and saves; reader 2, a fresh process, loads every stored token
(tokens identical to the writer's second run, after vLLM's own hit of the same length:
``tests/oracles.py``, rule 1).
vLLM CPU's blocks take each record as it arrives (``land_in_cache``): prompt 1's records fail
their checksum after their KV landed, and those blocks are recomputed.
"""

from __future__ import annotations

import pytest
import vllm_model
from oracles import gen
from vllm_engines import run_engine

from kvstore.keys import key_heads, split_key
from kvstore.record import decode_record, read_header
from kvstore.stores import open_store
from kvstore.testing.damage import flip_byte

pytestmark = pytest.mark.vllm

P_1 = vllm_model.prompt(31, 300)
P_2 = vllm_model.prompt(32, 330)
#: Tokens stored of each prompt: its lookup limit (whole 32-token blocks leaving one to compute).
STORED = [288, 320]
CHUNK = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama-heal")))


@pytest.fixture(scope="module")
def written(model_dir, redis_server) -> dict:
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=heal-src:"
    out = run_engine({"model": model_dir, "connector": {"store": [url], "chunk_tokens": CHUNK}, "role": "kv_producer",
                      "actions": [gen([P_1]), gen([P_1]), gen([P_2]), gen([P_2])]})
    store = open_store(url)
    records = {k: bytes(store.get(k)) for k in store.iter_keys()}
    store.close()
    cold, warm = out["results"][0::2], out["results"][1::2]
    assert [r["cached"][0] for r in warm] == STORED  # vLLM's own hit: what a reader loads
    return {"tokens": [r["tokens"][0] for r in cold], "warm": [r["tokens"][0] for r in warm], "records": records}


def _chunks_of(records: dict[str, bytes], prompt: list[int]) -> list[str]:
    """The keys of ``prompt``'s records, in chunk order."""
    mine = []
    for key, value in records.items():
        h = read_header(value)
        if list(h.token_ids) == prompt[h.start:h.start + h.num_tokens]:
            mine.append((h.start, h.num_tokens, key))
    return [key for *_, key in sorted(mine)]


def _sound(value: bytes | None, key: str) -> bool:
    """Whether ``value`` is a valid record of ``key`` (checksum, and the prefix and heads it names)."""
    if value is None:
        return False
    try:
        record = decode_record(value)
    except ValueError:
        return False
    heads = key_heads(key)
    return split_key(key)[2] == record.header.key.hex() and record.header.heads == (heads and heads.as_tuple())


def _tokens_loaded(metrics: dict) -> float:
    return sum(v for name, v in metrics.items() if name.startswith("vllm:kvstore_tokens_loaded"))


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_every_damaged_chunk_is_healed_and_the_next_reader_loads_all(model_dir, written, redis_server, load_mode):
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=heal-{load_mode}:"
    store = open_store(url)
    store.put_many(written["records"].items())
    keys_1 = _chunks_of(written["records"], P_1)
    keys_2 = _chunks_of(written["records"], P_2)
    assert len(keys_1) == len(keys_2) == 5  # P_1: four whole chunks and a partial one to 288; P_2: five whole
    for key in keys_1:
        flip_byte(store, key, offset=-7)
    for key, neighbour in zip(keys_2, keys_2[1:] + keys_2[:1]):
        store.put(key, written["records"][neighbour])
    assert not any(_sound(store.get(k), k) for k in keys_1 + keys_2)

    conn = {"store": [url], "chunk_tokens": CHUNK, "load_mode": load_mode}
    engine = {"disable_log_stats": False}
    first = run_engine({"model": model_dir, "connector": conn, "engine": engine,
                        "actions": [gen([P_1]), gen([P_2]), {"metrics": True}]})
    r1, r2, m1 = first["results"]
    # vLLM CPU's blocks take records as they arrive: P_1's damaged checksums were met after landing.
    assert "(landing in the blocks)" in first["log"]
    assert [r1["tokens"][0], r2["tokens"][0]] == written["tokens"]
    assert _tokens_loaded(m1["metrics"]) == 0
    # Every damaged chunk was replaced by the recompute's saves, not only the first of each prompt.
    assert [k for k in keys_1 + keys_2 if not _sound(store.get(k), k)] == []

    second = run_engine({"model": model_dir, "connector": conn, "engine": engine,
                         "actions": [gen([P_1]), gen([P_2]), {"metrics": True}]})
    s1, s2, m2 = second["results"]
    assert [s1["tokens"][0], s2["tokens"][0]] == written["warm"]
    assert [s1["cached"][0], s2["cached"][0]] == STORED
    assert _tokens_loaded(m2["metrics"]) == sum(STORED), {k: v for k, v in m2["metrics"].items() if "kvstore" in k}
    assert "loaded" not in "".join(ln for ln in second["log"].splitlines(True) if "KVStoreConnector: request" in ln)
    store.close()
