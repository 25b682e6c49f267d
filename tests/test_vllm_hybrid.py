"""Model families with several KV cache groups on real vLLM CPU engines (tiny random-weight
checkpoints of each family: tests/vllm_families.py).

For each family: vLLM alone, a writer with the connector and a fresh reader with the connector,
each in its own process over one file store. The connector must keep every KV cache group vLLM
makes without it (the hybrid allocator stays on, the KV cache holds as many blocks), the reader
must produce the writer's tokens, and:

* attention hybrids (sliding windows beside full attention): the reader loads the whole stored
  prefix, every group of it; each sliding-window group stores about a window per prompt, each
  full-attention group every chunk;
* recurrent-state hybrids (linear attention beside full attention): nothing is loaded or saved,
  every request is counted as bypassed, and the tokens are vLLM's own.
"""

from __future__ import annotations

from collections import Counter

import pytest
import vllm_families
import vllm_model
from test_vllm_connector import gen
from vllm_engines import run_engine

from kvstore.connectors.vllm.plan import lookup_limit, window_chunks
from kvstore.stores import open_store

pytestmark = pytest.mark.vllm

CHUNK = 64
INFO = {"engine_info": True}
#: Sliding windows beside full attention, and recurrent state (gated delta net) beside it.
ATTENTION_HYBRIDS = ["gemma2", "gemma3", "gpt-oss"]
STATE_HYBRIDS = ["qwen3-next"]


def _prompt(family: str, seed: int, length: int) -> list[int]:
    return vllm_model.prompt(seed, length, vocab=vllm_families.VOCAB)


def _run(model: str, connector: dict | None, prompts: list[list[int]], block_size: int = 32) -> dict:
    out = run_engine({"model": model, "connector": connector,
                      "engine": {"max_model_len": 1024, "block_size": block_size},
                      "actions": [gen(prompts), INFO]})
    generated, info = out["results"]
    return {"tokens": generated["tokens"], **info}


def _records_by_namespace(url: str) -> Counter[str]:
    with open_store(url) as store:
        return Counter(key.split("/")[1] for key in store.iter_keys())


@pytest.mark.parametrize("family", ATTENTION_HYBRIDS)
def test_attention_hybrids_keep_their_groups_and_load_every_group(family, tmp_path_factory):
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family)))
    prompts = [_prompt(family, 41, 300), _prompt(family, 42, 200)]
    url = f"file://{tmp_path_factory.mktemp(family + '-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK}
    alone = _run(model, None, prompts)
    writer = _run(model, connector, prompts)
    reader = _run(model, connector, prompts)
    groups = alone["kv_cache_groups"]
    assert len(groups) > 1 and any(kind == "SlidingWindowSpec" for kind, _, _ in groups), groups
    assert writer["kv_cache_groups"] == reader["kv_cache_groups"] == groups  # the hybrid allocator stays on
    assert writer["num_blocks"] == alone["num_blocks"]  # and the KV cache holds as much
    assert writer["tokens"] == reader["tokens"] == alone["tokens"]
    stored = [lookup_limit(len(p), vllm_model.BLOCK_SIZE) for p in prompts]
    assert writer["kvstore"]["tokens_loaded"] == 0
    assert reader["kvstore"]["tokens_loaded"] == sum(stored)  # every stored token, in every group
    # One namespace per group; a full group stores every chunk, a sliding one about a window.
    counts = sorted(_records_by_namespace(url).values())
    full_chunks = sum(-(-n // CHUNK) for n in stored)
    windows = [w for kind, w, _ in groups if kind == "SlidingWindowSpec"]
    window_records = [sum(len(window_chunks(n, w, vllm_model.BLOCK_SIZE, CHUNK)) for n in stored) for w in windows]
    assert len(counts) == len(groups)
    assert counts == sorted([full_chunks] * (len(groups) - len(windows)) + window_records), counts
    assert max(window_records) < full_chunks


@pytest.mark.parametrize("family", STATE_HYBRIDS)
def test_recurrent_state_hybrids_start_and_compute_every_prompt(family, tmp_path_factory):
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family)))
    prompts = [_prompt(family, 43, 300)]
    url = f"file://{tmp_path_factory.mktemp(family + '-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK}
    alone = _run(model, None, prompts)
    writer = _run(model, connector, prompts)
    reader = _run(model, connector, prompts)
    assert writer["kv_cache_groups"] == alone["kv_cache_groups"] and len(alone["kv_cache_groups"]) > 1
    assert writer["tokens"] == reader["tokens"] == alone["tokens"]
    # The state groups are recomputed, so is everything: nothing stored, nothing loaded, counted.
    assert reader["kvstore"]["tokens_loaded"] == writer["kvstore"]["tokens_saved"] == 0
    assert reader["kvstore"]["bypassed"] == len(prompts)
    assert not _records_by_namespace(url)


def test_mla_latents_load_with_identical_tokens(tmp_path_factory):
    """DeepSeek-V2's MLA on vLLM CPU (its reference MLA backend: 576 latent dims, block size 16,
    vLLM's own prefix caching off): a fresh reader loads the whole stored prefix."""
    family = "deepseek-v2"
    block = vllm_families.family_block_size(family)
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family)))
    prompts = [_prompt(family, 44, 300)]
    url = f"file://{tmp_path_factory.mktemp(family + '-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK}
    alone = _run(model, None, prompts, block)
    writer = _run(model, connector, prompts, block)
    reader = _run(model, connector, prompts, block)
    assert [kind for kind, _, _ in alone["kv_cache_groups"]] == ["MLAAttentionSpec"]
    assert writer["tokens"] == reader["tokens"] == alone["tokens"]
    stored = lookup_limit(len(prompts[0]), block)
    assert reader["kvstore"]["tokens_loaded"] == stored
    assert sum(_records_by_namespace(url).values()) == -(-stored // CHUNK)


def test_tensor_parallel_hybrid_stores_every_group_of_every_rank(tmp_path_factory):
    """Gemma 2 at TP=2: each rank stores its shard of each group (4 namespaces) and a TP=2 reader
    loads every group of every rank, with the TP=2 writer's tokens (TP changes bf16 rounding, so
    compare within one TP size). Deadlines are relaxed: this test is about the shards."""
    family = "gemma2"
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family + "-tp")))
    prompt = _prompt(family, 45, 300)
    url = f"file://{tmp_path_factory.mktemp(family + '-tp-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK, "load_policy": "always", "lookup_timeout": "30s"}
    tp2 = {"tensor_parallel_size": 2, "enable_prefix_caching": False, "max_model_len": 1024}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    write = run_engine({"model": model, "connector": connector, "engine": tp2, "actions": [gen([prompt])]},
                       multiprocess=True, env=env, timeout=300)
    assert len(_records_by_namespace(url)) == 4  # 2 groups x 2 ranks
    read = run_engine({"model": model, "connector": connector, "engine": tp2, "actions": [gen([prompt])]},
                      multiprocess=True, env=env, timeout=300)
    assert write["results"][0]["cached"][0] == 0
    assert read["results"][0]["cached"][0] == lookup_limit(len(prompt), vllm_model.BLOCK_SIZE)
    assert read["results"][0]["tokens"] == write["results"][0]["tokens"]
