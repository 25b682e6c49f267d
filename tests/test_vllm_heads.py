"""One cache for engines of different tensor-parallel sizes (issue 46), on real vLLM CPU servers.

Two OpenAI servers over memory + one redis-server, both ``kv_both``, float32: ``tp2`` at
``tensor_parallel_size=2`` (one rank per core) and ``tp1`` at TP=1. They start once for the module
and run ``tests/vllm_dump_connector``: every rank writes the KV bytes it saved and loaded, as they
lie in its cache. Records hold KV head ranges (the model has 2 KV heads): ``tp2``'s ranks write
heads [0, 1) and [1, 2), ``tp1`` writes [0, 2).

* **TP=2 writer, TP=2 reader**: with its prefix cache emptied (vLLM's dev endpoint), ``tp2`` loads
  its own ranges' records and computes exactly what it computed after its own prefix hit (rule 1).
* **TP=2 writer, TP=1 reader**: ``tp2`` computes a prompt; ``tp1`` hits every whole block, joining
  the two ranges' records; the bytes that land in its blocks are ``tp2``'s ranks' bytes, head by
  head. **TP=1 writer, TP=2 reader**: the reverse, each rank slicing its head out of ``tp1``'s
  records.
* **Oracle** (``tests/oracles.py``, rule 2): a reader computes after loading KV that an engine of
  another TP size computed (its all-reduces add in another order), so no run of vLLM alone has its
  arithmetic; float32, and the tokens continue vLLM's at the reader's TP up to the reference's
  first near tie, logprobs within tolerance. The reference is the reader server itself on the
  same prompt under another cache salt (nothing stored there: computed cold, one request at a
  time), ``cached_tokens`` 0.
* **The loaded KV is used, head range by head range**: validly encoded noise in the records of one
  head range changes the tokens, whichever TP size reads it; and a TP=2 reader's rank whose head
  is clean receives exactly the writer's bytes, while the other rank receives the noise.
* **P/D across TP sizes** through ``kvstore proxy``: prefill at TP=2, decode at TP=1, and the
  reverse; the decode server computes at most one block and loads the rest from the other TP
  size's records, with the reference's tokens.
"""

from __future__ import annotations

import json
import os
import urllib.request

import forge
import numpy as np
import pytest
import vllm_model
from oracles import assert_continuation
from servers import wait_until
from vllm_dump_connector import read_dump
from vllm_engines import OpenAIServer, total

from kvstore.connectors.vllm.plan import lookup_limit
from kvstore.record import read_header
from kvstore.stores import open_store

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel ranks need two cores")]
pytest.importorskip("aiohttp")

from kvstore.proxy.app import RunningProxy
from kvstore.proxy.pools import ProxyConfig

BS = vllm_model.BLOCK_SIZE
DTYPE = "float32"
MAX_TOKENS = 12
N = 300
STORED = lookup_limit(N, BS)  # 288: every whole block but the one holding the last token
CHUNKS = -(-STORED // 64)  # 4 chunks of 64 tokens and one of 32
P1, P2, Q1A, Q1B, Q2A, Q2B, PA, PB = (vllm_model.prompt(460 + i, N) for i in range(8))


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(url: str, prompt: list[int], **extra) -> dict:
    """A greedy completion: ``{"tokens", "cached", "logprobs"}`` (the top two per token, best first)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 2, "return_tokens_as_token_ids": True, **extra}
    answer = post(url + "/v1/completions", body)
    choice = answer["choices"][0]
    tops = [sorted(([int(t.split(":")[1]), lp] for t, lp in top.items()), key=lambda c: -c[1])
            for top in choice["logprobs"]["top_logprobs"]]
    return {"tokens": choice["token_ids"], "cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            "logprobs": tops, "kv_transfer_params": answer.get("kv_transfer_params")}


def reference(server: OpenAIServer, prompt: list[int]) -> dict:
    """vLLM's arithmetic at ``server``'s TP size: the prompt under a salt nothing is stored under."""
    out = complete(server.url, prompt, cache_salt="reference")
    assert out["cached"] == 0
    return out


def continues(got: dict, ref: dict, what: str) -> None:
    assert_continuation(got["tokens"], ref["tokens"], ref["logprobs"], dtype=DTYPE, got_logprobs=got["logprobs"],
                        what=what)


def records(store, prompt: list[int]) -> dict[tuple[int, tuple[int, int, int]], str]:
    """``(chunk start, heads) -> key`` of every record of ``prompt``'s prefix in ``store``."""
    out = {}
    for key in store.iter_keys():
        value = store.get(key)
        if value is None:
            continue
        h = read_header(value)
        if np.array_equal(h.token_ids, prompt[h.start:h.start + h.num_tokens]):
            out[(h.start, h.heads)] = key
    return out


def wait_records(store, prompt: list[int], ranges: list[tuple[int, int, int]]) -> dict:
    """The prompt's records once every chunk of the stored prefix is there for every range."""
    want = {(start, r) for start in range(0, STORED, 64) for r in ranges}
    found: dict = {}

    def ready() -> bool:
        found.update(records(store, prompt))
        return want <= found.keys()

    wait_until(ready, 60, f"the records of {ranges} in Redis")
    return {k: v for k, v in found.items() if k in want}


def add_noise(store, key: str, head: int | None, seed: int) -> None:
    """Replace the KV of ``head`` (None: all) in the record at ``key`` by noise of the KV's own
    scale, the record re-encoded validly (its checksum agrees)."""
    data = bytes(store.get(key))
    header, payload, _ = forge.split(data)
    kv = np.frombuffer(payload, dtype=np.float32).copy().reshape(len(header["shapes"]), *header["shapes"][0])
    rng = np.random.default_rng(seed)
    part = kv[:, :, head:head + 1] if head is not None else kv  # [layers, blocks, heads, block_size, 2*head_size]
    part[...] = rng.standard_normal(part.shape).astype(np.float32) * float(kv.std())
    store.put(key, forge.reframe(header, kv.tobytes()))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, redis_server):
    workdir = tmp_path_factory.mktemp("heads")
    dumps = workdir / "dumps"
    dumps.mkdir()
    model = str(vllm_model.write_model(workdir / "model"))
    redis_url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=heads:&timeout=30s"
    # Deadlines relaxed and every hit loaded: the two servers' three engine processes share two
    # cores, and this module is about which records serve which heads, not about the cost model.
    conn = {"store": ["memory://?max_bytes=256MiB", redis_url], "chunk_tokens": 64, "load_policy": "always",
            "lookup_timeout": "30s", "pd_deadline": "30s"}
    common = dict(conn=conn, dtype=DTYPE, block_size=BS, connector_module="tests.vllm_dump_connector",
                  env={"KVSTORE_TEST_DUMP_DIR": str(dumps), "VLLM_SERVER_DEV_MODE": "1"})
    tp2 = OpenAIServer(model, workdir, name="tp2", cores="0|1", extra=("--tensor-parallel-size", "2"), **common)
    tp1 = OpenAIServer(model, workdir, name="tp1", cores="1", **common)
    store = open_store(redis_url)
    try:
        for server in (tp2, tp1):
            wait_until(server.ready, 400, f"vLLM OpenAI server {server.name}")
        yield {"tp2": tp2, "tp1": tp1, "store": store, "dumps": dumps}
    finally:
        store.close()
        for server in (tp2, tp1):
            server.kill()


def test_a_tp1_reader_joins_what_a_tp2_writer_stored(fleet):
    tp2, tp1, store = fleet["tp2"], fleet["tp1"], fleet["store"]
    ref = reference(tp1, P1)
    wrote = complete(tp2.url, P1)
    assert wrote["cached"] == 0
    halves = [(0, 1, 2), (1, 2, 2)]
    assert len(wait_records(store, P1, halves)) == 2 * CHUNKS  # each head stored once, by its rank
    # At the writer's own TP size, the same arithmetic (rule 1): vLLM's own prefix hit, then with
    # its prefix cache emptied, a load of its own ranges' records gives exactly its tokens.
    warm = complete(tp2.url, P1)
    assert warm["cached"] == STORED
    wait_until(lambda: post(tp2.url + "/reset_prefix_cache", {}, timeout=30)["success"], 30, "an empty prefix cache")
    again = complete(tp2.url, P1)
    assert again["cached"] == STORED and again["tokens"] == warm["tokens"]
    got = complete(tp1.url, P1)
    assert got["cached"] == STORED, tp1.log[-6000:]
    continues(got, ref, "TP=1 reader of a TP=2 writer")
    # The bytes in the reader's blocks are the writer's ranks' bytes, head by head.
    saved = [read_dump(fleet["dumps"], "save", 2, r, P1[:STORED]) for r in range(2)]
    loaded = read_dump(fleet["dumps"], "load", 1, 0, P1[:STORED])
    assert loaded.shape[2] == 2 and all(s.shape[2] == 1 for s in saved)  # [layers, blocks, heads, ...]
    assert np.array_equal(loaded, np.concatenate(saved, axis=2))


def test_a_tp2_reader_slices_what_a_tp1_writer_stored(fleet):
    tp2, tp1, store = fleet["tp2"], fleet["tp1"], fleet["store"]
    ref = reference(tp2, P2)
    assert complete(tp1.url, P2)["cached"] == 0
    assert len(wait_records(store, P2, [(0, 2, 2)])) == CHUNKS
    got = complete(tp2.url, P2)
    assert got["cached"] == STORED, tp2.log[-6000:]
    continues(got, ref, "TP=2 reader of a TP=1 writer")
    saved = read_dump(fleet["dumps"], "save", 1, 0, P2[:STORED])
    for rank in range(2):
        loaded = read_dump(fleet["dumps"], "load", 2, rank, P2[:STORED])
        assert np.array_equal(loaded, saved[:, :, rank:rank + 1]), rank


def test_noise_in_one_head_range_changes_the_tokens_of_whichever_tp_size_reads_it(fleet):
    """Each head range's records are used: noise in either of a TP=2 writer's ranges changes a TP=1
    reader's tokens, and noise in either head of a TP=1 writer's records changes a TP=2 reader's;
    there, the rank whose head is clean receives exactly the writer's bytes."""
    tp2, tp1, store = fleet["tp2"], fleet["tp1"], fleet["store"]
    for prompt in (Q1A, Q1B):
        complete(tp2.url, prompt)
    for prompt in (Q2A, Q2B):
        complete(tp1.url, prompt)
    for seed, (prompt, writer_ranges, head_range, head) in enumerate([
            (Q1A, [(0, 1, 2), (1, 2, 2)], (0, 1, 2), None), (Q1B, [(0, 1, 2), (1, 2, 2)], (1, 2, 2), None),
            (Q2A, [(0, 2, 2)], (0, 2, 2), 0), (Q2B, [(0, 2, 2)], (0, 2, 2), 1)]):
        found = wait_records(store, prompt, writer_ranges)
        for (start, heads), key in found.items():
            if heads == head_range:
                add_noise(store, key, head, seed * 100 + start)
    for prompt, reader, what in [(Q1A, tp1, "heads [0, 1) of TP=2's records"),
                                 (Q1B, tp1, "heads [1, 2) of TP=2's records"),
                                 (Q2A, tp2, "head 0 of TP=1's records"), (Q2B, tp2, "head 1 of TP=1's records")]:
        clean = reference(reader, prompt)
        noisy = complete(reader.url, prompt)
        assert noisy["cached"] == STORED, what
        differ = sum(a != b for a, b in zip(noisy["tokens"], clean["tokens"]))
        assert differ >= MAX_TOKENS // 2, (what, noisy["tokens"], clean["tokens"])
    for prompt, noisy_rank in ((Q2A, 0), (Q2B, 1)):
        saved = read_dump(fleet["dumps"], "save", 1, 0, prompt[:STORED])
        for rank in range(2):
            loaded = read_dump(fleet["dumps"], "load", 2, rank, prompt[:STORED])
            assert np.array_equal(loaded, saved[:, :, rank:rank + 1]) == (rank != noisy_rank), (rank, noisy_rank)


@pytest.mark.parametrize("direction", ["tp2-prefill-tp1-decode", "tp1-prefill-tp2-decode"])
def test_pd_across_tp_sizes_through_the_proxy(fleet, direction):
    """P/D through ``kvstore proxy`` whose prefill and decode servers run different TP sizes: the
    promise names the prompt's prefix, not its writer's ranks, and the decode server waits until
    every head of it is covered, then loads it (joined or sliced) and computes only the tail."""
    prefill, decode = (fleet["tp2"], fleet["tp1"]) if direction.startswith("tp2") else (fleet["tp1"], fleet["tp2"])
    prompt = PA if direction.startswith("tp2") else PB
    ref = reference(decode, prompt)
    before = decode.metrics()
    proxy = RunningProxy(ProxyConfig(prefill=(prefill.url,), decode=(decode.url,), health_interval=0.5))
    try:
        got = complete(proxy.url, prompt)
        assert proxy.proxy.stats.prefilled == 1 and proxy.proxy.stats.fallbacks == 0
    finally:
        proxy.close()
    assert len(prompt) - BS <= got["cached"] < len(prompt), got["cached"]
    continues(got, ref, direction)
    after = decode.metrics()
    loaded = total(after, "vllm:kvstore_pd_loaded_tokens_sum") - total(before, "vllm:kvstore_pd_loaded_tokens_sum")
    assert loaded == STORED
    assert total(after, "vllm:kvstore_pd_load_failures_total") == total(before, "vllm:kvstore_pd_load_failures_total")
