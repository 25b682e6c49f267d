"""Deployment keys on real vLLM engines: records signed with different keys live in different
key spaces, so two deployments on one Redis never overwrite each other (issue 22)."""

from __future__ import annotations

import pytest
import vllm_model
from oracles import gen
from test_vllm_heal import _tokens_loaded
from vllm_engines import run_engine

from kvstore.record import read_header
from kvstore.record.auth import RecordAuth
from kvstore.stores import open_store

pytestmark = pytest.mark.vllm

K1, K2 = bytes(range(32)), bytes(range(32, 64))
PROMPT = vllm_model.prompt(41, 300)
STORED = 288


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama-keys")))


def _records(url: str) -> dict[str, bytes]:
    store = open_store(url)
    try:
        return {k: bytes(store.get(k)) for k in store.iter_keys()}
    finally:
        store.close()


def test_a_reader_with_another_key_loads_nothing_and_overwrites_nothing(model_dir, redis_server):
    pytest.importorskip("blake3")
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=keys:"
    conn = {"store": [url], "chunk_tokens": 64, "auth_key_env": "KVSTORE_TEST_DEPLOYMENT_KEY"}
    engine = {"disable_log_stats": False}

    def run(key: bytes, *extra: dict) -> dict:
        return run_engine({"model": model_dir, "connector": conn, "engine": engine,
                           "actions": [gen([PROMPT]), {"metrics": True}, *extra]},
                          env={"KVSTORE_TEST_DEPLOYMENT_KEY": key.hex()})

    # The writer runs the prompt again: after vLLM's own hit of what a reader loads, the reader's
    # tokens (tests/oracles.py, rule 1).
    writer = run(K1, gen([PROMPT]))
    tokens = writer["results"][0]["tokens"][0]
    warm = writer["results"][2]
    assert warm["cached"][0] == STORED
    k1_records = _records(url)
    assert len(k1_records) == 5 and {read_header(v).key_id for v in k1_records.values()} == {RecordAuth([K1]).key_id}

    other = run(K2)
    (out, metrics) = other["results"]
    assert out["tokens"][0] == tokens and out["cached"][0] == 0 and _tokens_loaded(metrics["metrics"]) == 0
    after = _records(url)
    assert {k: v for k, v in after.items() if k in k1_records} == k1_records  # K1's records untouched
    k2_records = {k: v for k, v in after.items() if k not in k1_records}
    assert len(k2_records) == 5 and {read_header(v).key_id for v in k2_records.values()} == {RecordAuth([K2]).key_id}

    again = run(K1)
    (out, metrics) = again["results"]
    assert out["tokens"][0] == warm["tokens"][0] and out["cached"][0] == STORED
    assert _tokens_loaded(metrics["metrics"]) == STORED
