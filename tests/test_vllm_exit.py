"""Nothing queued is lost at exit (issue 22): with tiers memory + Redis + S3 and background
saves, every record reaches every shared tier when
- an offline engine exits as soon as ``generate()`` returns (in vLLM's multi-process mode, its
  engine core spawned: a run costs that process's import of vLLM, 10-20 s here, so the race this
  guards against, which lost one record in some runs only, is run for once);
- an OpenAI server gets SIGTERM as soon as its responses return;
- ``kvstore warm --engine vllm`` exits after its last prompt.
The last two write S3 over a slow link, so records are still on their way at the exit."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import vllm_model
from oracles import gen
from servers import wait_until
from test_vllm_connector import store_urls
from test_warm_exit import warm_argv
from vllm_engines import OpenAIServer, engine_env, run_engine

from kvstore.stores import open_store
from kvstore.testing.proxy import ShapedProxy

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


def test_an_engine_that_exits_right_after_generate_leaves_every_record_in_every_tier(
        model_dir, redis_server, s3_server):
    urls = store_urls(redis_server, s3_server, "exit-offline")
    conn = {"store": urls, "chunk_tokens": 256, "save_mode": "async"}
    out = run_engine({"model": model_dir, "connector": conn, "actions": [gen(PROMPTS, max_tokens=2)]},
                     multiprocess=True, timeout=400)
    assert len(out["results"][0]["tokens"]) == len(PROMPTS)
    redis_keys, s3_keys = _keys(urls[1]), _keys(urls[2])
    assert (len(redis_keys), len(s3_keys)) == (RECORDS, RECORDS), out["log"][-3000:]
    assert redis_keys == s3_keys


# -- an OpenAI server stopped with SIGTERM ---------------------------------------------------------
SERVER_PROMPTS = [vllm_model.prompt(80 + i, 2000) for i in range(4)]
SERVER_RECORDS = 4 * 8


class _OpenAIServer(OpenAIServer):
    def complete(self, prompt: list[int]) -> dict:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())


def _slow_s3(urls: list[str], s3_server) -> tuple[ShapedProxy, list[str]]:
    """``urls`` with S3 behind two 1 MB/s connections: of the 16 MiB a run stores, the last
    prompt's records are still on their way when the last response returns."""
    proxy = ShapedProxy(s3_server.port, rate=1e6)
    s3 = urls[2].replace(s3_server.endpoint_url, f"http://127.0.0.1:{proxy.port}") + "&max_workers=2"
    return proxy, [*urls[:2], s3]


def test_an_openai_server_stopped_with_sigterm_right_after_its_responses_leaves_every_record_in_every_tier(
        model_dir, redis_server, s3_server, tmp_path):
    """With ``--shutdown-timeout`` (docs/vllm.md): vLLM's default, 0, SIGKILLs the engine core and
    its worker as soon as the server gets SIGTERM, before any drain (measured: S3 held 14 of 32)."""
    urls = store_urls(redis_server, s3_server, "exit-server")
    proxy, slow = _slow_s3(urls, s3_server)
    server = _OpenAIServer(model_dir, tmp_path, conn={"store": slow, "chunk_tokens": 256, "save_mode": "async"},
                           extra=("--shutdown-timeout", "30"))
    try:
        wait_until(server.ready, 300, "vLLM OpenAI server")
        with ThreadPoolExecutor(len(SERVER_PROMPTS)) as pool:
            answers = list(pool.map(server.complete, SERVER_PROMPTS))
        rc = server.terminate(120)
    finally:
        server.kill()
        proxy.close()
    assert [len(a["choices"]) for a in answers] == [1] * len(SERVER_PROMPTS)
    assert rc == 0, server.log[-3000:]
    redis_keys, s3_keys = _keys(urls[1]), _keys(urls[2])
    assert (len(redis_keys), len(s3_keys)) == (SERVER_RECORDS, SERVER_RECORDS), server.log[-3000:]
    assert redis_keys == s3_keys


# -- kvstore warm --engine vllm --------------------------------------------------------------------
def test_vllm_warm_exiting_after_its_last_prompt_leaves_every_record_in_every_tier(
        model_dir, redis_server, s3_server, tmp_path):
    """``kvstore warm`` waits for the connector's background saves (``wait_saved``), then for the
    stores' writers, before it exits: with S3 behind a slow link, every record still lands. A
    fresh vLLM engine with the connector then hits every whole block of every warmed prompt, and
    warming the same prompts again skips them all."""
    urls = store_urls(redis_server, s3_server, "exit-warm")
    proxy, slow = _slow_s3(urls, s3_server)
    engine_args = {k: v for k, v in vllm_model.engine_kwargs(model_dir).items() if k != "model"}
    engine = ["--engine", "vllm", "--model", model_dir, "--chunk-tokens", "256", "--kv-config",
              json.dumps({"save_mode": "async"}), "--engine-args", json.dumps(engine_args)]
    argv = warm_argv(SERVER_PROMPTS, tmp_path, slow, *engine)
    try:
        proc = subprocess.run(argv, env=engine_env(), cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["warmed"] == len(SERVER_PROMPTS)
    redis_keys, s3_keys = _keys(urls[1]), _keys(urls[2])
    assert (len(redis_keys), len(s3_keys)) == (SERVER_RECORDS, SERVER_RECORDS), proc.stderr[-3000:]
    assert redis_keys == s3_keys
    fresh = run_engine({"model": model_dir, "connector": {"store": urls, "chunk_tokens": 256},
                        "actions": [gen([p], max_tokens=2) for p in SERVER_PROMPTS]})
    block = vllm_model.BLOCK_SIZE
    assert [r["cached"][0] for r in fresh["results"]] == [(len(p) - 1) // block * block for p in SERVER_PROMPTS]
    again = subprocess.run(warm_argv(SERVER_PROMPTS, tmp_path, urls, *engine), env=engine_env(), cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and json.loads(again.stdout)["skipped"] == len(SERVER_PROMPTS), again.stderr[-3000:]
