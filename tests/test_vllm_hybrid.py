"""Model families with several KV cache groups on real vLLM CPU engines (tiny random-weight
checkpoints of each family: tests/vllm_families.py).

For each family: vLLM alone, a writer with the connector and a fresh reader with the connector,
each in its own process over one file store, one prompt per ``generate`` call. The connector must
keep every KV cache group vLLM makes without it (the hybrid allocator stays on, the KV cache holds
as many blocks); the writer must produce vLLM's tokens of a cold run, and the reader vLLM's tokens
after its own prefix-cache hit of the length the reader loaded (``tests/oracles.py``, rule 1); and:

* attention hybrids (sliding windows or Llama 4's chunked local attention beside full
  attention): the reader loads the whole stored prefix, every group of it; each windowed group
  stores about a window per prompt, each full-attention group every chunk;
* recurrent-state hybrids (Qwen3-Next's gated delta nets beside full attention): the reader
  loads the whole stored prefix and the state at its end; each state group stores one state per
  prompt; a corrupt state is a shorter hit, healed for the next reader; validly encoded noise in
  the state changes the tokens (the loaded state is used);
* a Mamba2 hybrid (NemotronH) runs on vLLM CPU only with prefix caching off (its align mode fails
  in vLLM's own Mamba2 prefill checkpoint, connector or not): vLLM then keeps no state a later
  prompt could resume from, and every request is served without the cache, counted.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import vllm_families
import vllm_model
from oracles import assert_continuation, gen
from vllm_engines import run_engine

from kvstore.connectors.vllm.plan import lookup_limit, window_chunks
from kvstore.keys import ChunkKey
from kvstore.record import decode_record, encode_record, read_header
from kvstore.stores import open_store
from kvstore.testing.damage import flip_byte

pytestmark = pytest.mark.vllm

CHUNK = 64
INFO = {"engine_info": True}
#: Sliding windows (or chunked local attention: Llama 4) beside full attention.
ATTENTION_HYBRIDS = ["gemma2", "gemma3", "gpt-oss", "llama4"]
WINDOWED = {"SlidingWindowSpec": False, "ChunkedLocalAttentionSpec": True}  # kind -> local


def _prompt(family: str, seed: int, length: int) -> list[int]:
    return vllm_model.prompt(seed, length, vocab=vllm_families.VOCAB)


def _run(model: str, connector: dict | None, prompts: list[list[int]], block_size: int = 32, *,
         twice: bool = False, **engine) -> dict:
    """One engine, each prompt in its own ``generate`` call: ``tokens`` and ``cached`` per prompt,
    and with ``twice`` each prompt run again right after (``warm``, ``warm_cached``: after vLLM's own
    prefix-cache hit), then the engine's info."""
    runs = 2 if twice else 1
    out = run_engine({"model": model, "connector": connector,
                      "engine": {"max_model_len": 1024, "block_size": block_size, **engine},
                      "actions": [gen([p], logprobs=2) for p in prompts for _ in range(runs)] + [INFO]})
    *generated, info = out["results"]
    first, again = generated[0::runs], generated[1::runs] if twice else []
    return {"tokens": [g["tokens"][0] for g in first], "cached": [g["cached"][0] for g in first],
            "logprobs": [g["logprobs"][0] for g in first],
            "warm": [g["tokens"][0] for g in again], "warm_cached": [g["cached"][0] for g in again],
            "warm_logprobs": [g["logprobs"][0] for g in again], **info}


def _records_by_namespace(url: str) -> Counter[str]:
    with open_store(url) as store:
        return Counter(key.split("/")[1] for key in store.iter_keys())


@pytest.mark.parametrize("family", ATTENTION_HYBRIDS)
def test_attention_hybrids_keep_their_groups_and_load_every_group(family, tmp_path_factory):
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family)))
    prompts = [_prompt(family, 41, 300), _prompt(family, 42, 200)]
    url = f"file://{tmp_path_factory.mktemp(family + '-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK}
    alone = _run(model, None, prompts, twice=True)
    writer = _run(model, connector, prompts)
    reader = _run(model, connector, prompts)
    groups = alone["kv_cache_groups"]
    assert len(groups) > 1 and any(kind in WINDOWED for kind, _, _ in groups), groups
    assert writer["kv_cache_groups"] == reader["kv_cache_groups"] == groups  # the hybrid allocator stays on
    assert writer["num_blocks"] == alone["num_blocks"]  # and the KV cache holds as much
    stored = [lookup_limit(len(p), vllm_model.BLOCK_SIZE) for p in prompts]
    assert writer["tokens"] == alone["tokens"]
    assert reader["cached"] == alone["warm_cached"] == stored and reader["tokens"] == alone["warm"]
    assert writer["kvstore"]["tokens_loaded"] == 0
    assert reader["kvstore"]["tokens_loaded"] == sum(stored)  # every stored token, in every group
    # One namespace per group; a full group stores every chunk, a windowed one about a window.
    counts = sorted(_records_by_namespace(url).values())
    full_chunks = sum(-(-n // CHUNK) for n in stored)
    windows = [(w, WINDOWED[kind]) for kind, w, _ in groups if kind in WINDOWED]
    window_records = [sum(len(window_chunks(n, w, vllm_model.BLOCK_SIZE, CHUNK, local=local)) for n in stored)
                      for w, local in windows]
    assert len(counts) == len(groups)
    assert counts == sorted([full_chunks] * (len(groups) - len(windows)) + window_records), counts
    assert max(window_records) < full_chunks


def _state_records(url: str, prompt: list[int]) -> dict[str, bytes]:
    """The state records (dtype uint8) of the chunk that ends ``prompt``'s stored prefix."""
    out = {}
    with open_store(url) as store:
        for key in store.iter_keys():
            value = bytes(store.get(key))
            h = read_header(value)
            if h.dtype == "uint8" and list(h.token_ids) == prompt[h.start:h.start + h.num_tokens]:
                out[key] = value
    return out


def test_recurrent_state_hybrid_loads_the_state_at_the_hits_end(tmp_path_factory):
    """Qwen3-Next (3 gated-delta-net groups, 1 full-attention group; vLLM's align mode)."""
    family = "qwen3-next"
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family)))
    prompts = [_prompt(family, 43, 300), _prompt(family, 42, 200)]
    url = f"file://{tmp_path_factory.mktemp(family + '-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK}
    alone = _run(model, None, prompts, twice=True)
    writer = _run(model, connector, prompts)
    reader = _run(model, connector, prompts)
    groups = alone["kv_cache_groups"]
    assert [kind for kind, _, _ in groups] == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    assert writer["kv_cache_groups"] == reader["kv_cache_groups"] == groups  # the hybrid allocator stays on
    assert writer["num_blocks"] == alone["num_blocks"]
    stored = [lookup_limit(len(p), vllm_model.BLOCK_SIZE) for p in prompts]
    assert writer["tokens"] == alone["tokens"]
    assert reader["cached"] == alone["warm_cached"] == stored and reader["tokens"] == alone["warm"]
    assert reader["kvstore"]["tokens_loaded"] == sum(stored)
    assert writer["kvstore"]["bypassed"] == reader["kvstore"]["bypassed"] == 0
    # Each state group stores one state per prompt (at its end: the prompts are shorter than
    # window_interval), the full group every chunk.
    counts = sorted(_records_by_namespace(url).values())
    assert counts == [len(prompts)] * 3 + [sum(-(-n // CHUNK) for n in stored)], counts
    states = _state_records(url, prompts[0])
    assert len(states) == 3 and all(3 * 192 * 2 + 64 * 64 * 4 < len(v) < 20_000 for v in states.values())

    # A corrupt state: that prompt is recomputed (a shorter hit: none), the other still hits,
    # the tokens are vLLM's; the recompute rewrites the state and the next reader hits fully.
    with open_store(url) as store:
        flip_byte(store, next(iter(states)), offset=-100, mask=1)
    damaged = _run(model, connector, prompts)
    assert damaged["tokens"] == [alone["tokens"][0], alone["warm"][1]]
    assert damaged["cached"] == [0, stored[1]] and damaged["kvstore"]["corrupt"] == 1
    healed = _run(model, connector, prompts)
    assert healed["cached"] == stored and healed["tokens"] == alone["warm"] and healed["kvstore"]["corrupt"] == 0

    # Validly encoded noise in the states (the SSM part, at its own scale): loaded, and the tokens change.
    rng = np.random.default_rng(0)
    with open_store(url) as store:
        for key, value in _state_records(url, prompts[0]).items():
            h = read_header(value)
            page = np.frombuffer(decode_record(value).kv, dtype=np.uint8).copy()
            ssm = page[h.shapes[0][0]:].view(np.float32)
            ssm += rng.standard_normal(ssm.size).astype(np.float32) * ssm.std()
            chunk = ChunkKey(0, h.start, h.start + h.num_tokens, h.key, h.partial, key)
            store.put(key, encode_record(namespace=SimpleNamespace(digest=h.namespace, format_version=h.version),
                                         chunk=chunk, tokens=h.token_ids, dtype=h.dtype, shapes=h.shapes,
                                         kv=page.tobytes(), chain=h.codecs))
    noisy = _run(model, connector, prompts)
    assert noisy["cached"] == stored and noisy["tokens"][1] == alone["warm"][1]
    changed = sum(x != y for x, y in zip(noisy["tokens"][0], alone["warm"][0]))
    assert changed >= len(alone["warm"][0]) // 2, (noisy["tokens"][0], alone["warm"][0])


def test_a_hybrid_whose_blocks_vllm_raises_starts_with_chunks_that_fit(tmp_path_factory):
    """Qwen3-Next with 4 value heads and 2 KV heads: vLLM's align mode raises every block to 160
    tokens (one attention page must hold a layer's state). A connector given no chunk_tokens starts
    with chunks of 320, the smallest multiple of 160 that is at least 256, and logs it; a fresh
    reader loads the whole stored prefix with vLLM's tokens after its own hit. A chunk_tokens the
    user set that does not fit stops the engine at start-up, naming both numbers."""
    family = "qwen3-next"
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family + "-raised"),
                                                 num_key_value_heads=2, linear_num_value_heads=4))
    prompts = [_prompt(family, 47, 700)]
    url = f"file://{tmp_path_factory.mktemp(family + '-raised-kv')}"
    alone = _run(model, None, prompts, twice=True)
    block = alone["block_size"]
    assert block == 160 and [kind for kind, _, _ in alone["kv_cache_groups"]][-1] == "FullAttentionSpec"
    writer = run_engine({"model": model, "connector": {"store": [url]}, "engine": {"max_model_len": 1024},
                         "actions": [gen(prompts)]})
    assert "chunk_tokens=320 (not set" in writer["log"]
    reader = _run(model, {"store": [url]}, prompts)
    stored = lookup_limit(len(prompts[0]), block)
    assert writer["results"][0]["tokens"] == alone["tokens"]
    assert reader["cached"] == alone["warm_cached"] == [stored] and reader["tokens"] == alone["warm"]
    refused = run_engine({"model": model, "connector": {"store": [url], "chunk_tokens": 256},
                          "engine": {"max_model_len": 1024}, "actions": []}, check=False)
    assert refused["returncode"] != 0
    assert "chunk_tokens=256 cannot line up with vLLM's mamba block size 160" in refused["log"]


def test_a_mamba2_hybrid_without_prefix_caching_is_served_without_the_cache(tmp_path_factory):
    """NemotronH (Mamba2): vLLM CPU runs it only with prefix caching off, where it keeps no state
    at block boundaries: the connector starts, stores nothing, and counts every request."""
    family = "nemotron-h"
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family)))
    prompts = [_prompt(family, 46, 300)]
    url = f"file://{tmp_path_factory.mktemp(family + '-kv')}"
    alone = _run(model, None, prompts, enable_prefix_caching=False)
    served = _run(model, {"store": [url], "chunk_tokens": CHUNK}, prompts, enable_prefix_caching=False)
    assert "MambaSpec" in [kind for kind, _, _ in alone["kv_cache_groups"]]
    assert served["kv_cache_groups"] == alone["kv_cache_groups"] and served["tokens"] == alone["tokens"]
    assert served["kvstore"]["bypassed"] == len(prompts) and served["kvstore"]["tokens_saved"] == 0
    assert not _records_by_namespace(url)


def _host_has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def test_mla_latents_load_with_identical_tokens(tmp_path_factory):
    """DeepSeek-V2's MLA (576 latent dims): a fresh reader loads the whole stored prefix.

    The host decides vLLM's MLA backend (tests/vllm_families.py), and with it what the connector
    does. With AMX tiles: block size 32 and vLLM's own prefix cache, so the reader's tokens equal
    vLLM's after its own hit of the same length (``tests/oracles.py``, rule 1). Without: vLLM's
    reference MLA backend (block size 16) cannot compute a prompt over cached latents, and vLLM
    turns its own prefix cache off for it. Loaded latents gave tokens near vLLM's, not equal (on an
    AMD host, float32 logprobs 5e-3 to 1e-2 apart from the first token on), so the connector serves
    such an engine without the cache: nothing stored or loaded, each request counted as bypassed,
    and the tokens are vLLM's alone (the same arithmetic: one prompt per call, computed cold)."""
    family = "deepseek-v2"
    amx = _host_has_amx()
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family)))
    prompts = [_prompt(family, 44, 300)]
    url = f"file://{tmp_path_factory.mktemp(family + '-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK}
    alone = _run(model, None, prompts, twice=True, dtype="bfloat16")
    writer = _run(model, connector, prompts, dtype="bfloat16")
    reader = _run(model, connector, prompts, dtype="bfloat16")
    assert [kind for kind, _, _ in alone["kv_cache_groups"]] == ["MLAAttentionSpec"]
    assert alone["block_size"] == (32 if amx else 16)
    assert writer["tokens"] == alone["tokens"]
    if amx:
        stored = lookup_limit(len(prompts[0]), alone["block_size"])
        assert reader["cached"] == [stored] and reader["kvstore"]["tokens_loaded"] == stored
        assert alone["warm_cached"] == [stored] and reader["tokens"] == alone["warm"]
        assert sum(_records_by_namespace(url).values()) == -(-stored // CHUNK)
    else:
        assert alone["warm_cached"] == [0]  # vLLM's own prefix cache is off on this backend
        assert reader["cached"] == [0] and reader["tokens"] == alone["tokens"]
        for run in (writer, reader):
            assert run["kvstore"]["bypassed"] == len(prompts) and run["kvstore"]["tokens_saved"] == 0
            assert run["kvstore"]["tokens_loaded"] == 0
        assert not _records_by_namespace(url)


def test_a_tensor_parallel_hybrids_records_serve_another_tp_size(tmp_path_factory):
    """Gemma 2 at TP=2: each rank stores its KV head of each group (2 namespaces, one per group,
    each holding both heads' records); a TP=1 reader loads every group of the stored prefix,
    joining the two heads' records, windows included. Its KV was computed at TP=2, whose
    all-reduces round otherwise: float32, and the tokens continue vLLM alone at TP=1 after its own
    hit up to its first near tie (rule 2 of tests/oracles.py; tests/test_vllm_heads.py holds the
    other directions and the byte-for-byte checks). Deadlines are relaxed: this test is about the heads."""
    family, dtype = "gemma2", "float32"
    model = str(vllm_families.write_family_model(family, tmp_path_factory.mktemp(family + "-tp")))
    prompt = _prompt(family, 45, 300)
    url = f"file://{tmp_path_factory.mktemp(family + '-tp-kv')}"
    connector = {"store": [url], "chunk_tokens": CHUNK, "load_policy": "always", "lookup_timeout": "30s"}
    write = run_engine({"model": model, "connector": connector,
                        "engine": {"tensor_parallel_size": 2, "max_model_len": 1024, "dtype": dtype},
                        "actions": [gen([prompt])]}, multiprocess=True, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                       timeout=300)
    assert write["results"][0]["cached"] == [0]
    with open_store(url) as store:
        keys = list(store.iter_keys())
    assert len({k.split("/")[1] for k in keys}) == 2  # one namespace per group, none per rank
    assert {k.rsplit("/", 1)[1] for k in keys} == {"h0-1of2", "h1-2of2"}
    alone = _run(model, None, [prompt], twice=True, dtype=dtype)
    reader = _run(model, connector, [prompt], dtype=dtype)
    stored = lookup_limit(len(prompt), vllm_model.BLOCK_SIZE)
    assert alone["warm_cached"] == reader["cached"] == [stored]
    assert reader["kvstore"]["tokens_loaded"] == stored  # every group, both heads
    assert_continuation(reader["tokens"][0], alone["warm"][0], alone["warm_logprobs"][0], dtype=dtype,
                        got_logprobs=reader["logprobs"][0], what="TP=1 reader of a TP=2 Gemma 2")
