"""Nothing queued is lost at exit (issue 22): an engine with tiers memory + Redis + S3 and
background saves that exits as soon as ``generate()`` returns leaves every record in every
shared tier. Run three times: the race it guards against lost one record in some runs only."""

from __future__ import annotations

import pytest
import vllm_model
from test_vllm_connector import gen, store_urls
from vllm_engines import run_engine

from kvstore.stores import open_store

pytestmark = pytest.mark.vllm

PROMPTS = [vllm_model.prompt(60 + i, 2000) for i in range(8)]
#: Per prompt: seven whole 256-token chunks and the partial one to the lookup limit (1984).
RECORDS = 8 * 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama-exit")))


def _keys(url: str) -> set[str]:
    store = open_store(url)
    try:
        return set(store.iter_keys())
    finally:
        store.close()


@pytest.mark.parametrize("run", range(3))
def test_an_engine_that_exits_right_after_generate_leaves_every_record_in_every_tier(
        model_dir, redis_server, s3_server, run):
    urls = store_urls(redis_server, s3_server, f"exit-{run}")
    conn = {"store": urls, "chunk_tokens": 256, "save_mode": "async"}
    out = run_engine({"model": model_dir, "connector": conn, "actions": [gen(PROMPTS, max_tokens=2)]},
                     multiprocess=True, timeout=400)
    assert len(out["results"][0]["tokens"]) == len(PROMPTS)
    redis_keys, s3_keys = _keys(urls[1]), _keys(urls[2])
    assert (len(redis_keys), len(s3_keys)) == (RECORDS, RECORDS), out["log"][-3000:]
    assert redis_keys == s3_keys
