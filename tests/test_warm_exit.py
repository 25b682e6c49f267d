"""``kvstore warm`` loses nothing at exit (issue 22): a warm run over tiers memory + Redis + S3,
whose shared tiers are written in the background, leaves every record of every prompt in every
shared tier when its process exits right after its last prompt.

The reference engine here, with S3 behind a slow link so that its writes are still queued when
the last prompt returns; ``tests/test_vllm_exit.py`` holds the vLLM engine's case, with the
connector's background saves in front of the same writers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvstore.stores import open_store
from kvstore.testing.proxy import ShapedProxy
from kvstore.warm.reference import ReferenceWarmEngine

CHUNK = 64


def warm_argv(prompts: list[list[int]], tmp_path: Path, urls: list[str], *engine: str) -> list[str]:
    """``kvstore warm`` over ``prompts`` (written as JSON lines) into ``urls``, summary as JSON."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    stores = [arg for url in urls for arg in ("--store", url)]
    return [sys.executable, "-m", "kvstore.cli", "warm", str(path), *engine, *stores, "--json"]


def stored_keys(url: str) -> set[str]:
    store = open_store(url)
    try:
        return set(store.iter_keys())
    finally:
        store.close()


def test_reference_warm_exiting_after_its_last_prompt_leaves_every_record_in_every_tier(
        tmp_path, redis_server, s3_server):
    prompts = [[(seed * 7 + i * 13) % 256 for i in range(2000 + 37 * seed)] for seed in range(12)]
    urls = ["memory://?max_bytes=256MiB", f"redis://127.0.0.1:{redis_server.port}/0?prefix=warm-exit:",
            s3_server.url_for("warm-exit")]
    # ~13 MiB of records over two 1 MB/s connections: S3 is seconds behind the last prompt.
    proxy = ShapedProxy(s3_server.port, rate=1e6)
    slow = [*urls[:2], urls[2].replace(s3_server.endpoint_url, f"http://127.0.0.1:{proxy.port}") + "&max_workers=2"]
    argv = warm_argv(prompts, tmp_path, slow, "--engine", "reference", "--chunk-tokens", str(CHUNK))
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["warmed"] == len(prompts)
    keys = ReferenceWarmEngine("memory://", chunk_tokens=CHUNK)
    try:
        want = {k.key for p in prompts for k in keys.keys(p)}
    finally:
        keys.close()
    redis_keys, s3_keys = stored_keys(urls[1]), stored_keys(urls[2])
    assert (len(redis_keys), len(s3_keys)) == (len(want), len(want)), proc.stderr[-3000:]
    assert redis_keys == s3_keys == want
