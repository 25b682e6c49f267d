"""``kvstore demo``: two replicas of the reference engine share one store; the second loads
the prefix the first computed.

Each replica is a separate process (spawn) running the reference engine behind the agent API
(``kvstore.connectors.agent.KVStoreAgent``). Replica 1 sees the prompt first: it computes the whole
prefill and stores the KV. Replica 2 gets the same prompt: it loads the stored KV, skips the
prefill, and must produce the same tokens. The default store is a fresh ``file://`` store in a
temporary directory (removed after); ``--store URL`` (repeatable, fastest tier first) uses
Redis or S3 instead, under a per-run cache salt so a previous run never turns replica 1's miss
into a hit.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import shutil
import tempfile
import time
import uuid
from typing import Any

from kvstore.cli.common import add_store_option, number


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="two engine replicas share a store: the second loads what the first computed")
    add_store_option(p)
    p.set_defaults(store=None)
    p.add_argument("--tokens", type=number(int, 1, 32768), default=1024, help="prompt length (default 1024)")
    p.add_argument("--new-tokens", type=number(int, 1, 4096), default=16, help="tokens to generate (default 16)")
    p.add_argument("--model", default="small", help="reference model size: tiny, small, bench (default small)")
    p.set_defaults(func=run)


def _replica(name: str, urls: list[str], salt: str, preset: str, prompt: list[int], new_tokens: int,
             out: Any) -> None:
    """One engine process: warm up, serve the prompt through the agent, report."""
    try:
        import torch

        from kvstore.connectors.agent import KVStoreAgent
        from kvstore.reference import PRESETS, ModelRunner

        torch.manual_seed(0)
        cfg = PRESETS[preset]
        need = -(-(len(prompt) + new_tokens) // cfg.block_size) + 8
        cfg = cfg.with_(num_blocks=max(need, 64))
        agent = KVStoreAgent(dict(store=urls, model=cfg.name, model_fingerprint=cfg.fingerprint,
                                  chunk_tokens=256, cache_salt=salt))
        runner = ModelRunner(cfg, agent)
        runner.agent = None  # warm-up (first-call costs) outside the cache
        runner.generate([prompt[:32]], 2)
        runner.agent = agent
        res = runner.generate([prompt], new_tokens)
        t0 = time.perf_counter()
        agent.close()  # waits for background writes to remote tiers
        out.put(dict(name=name, ok=True, tokens=res.tokens[0], loaded=res.tokens_loaded, computed=res.tokens_computed,
                     ttft=res.ttft_s, bypassed=res.bypassed, flush=time.perf_counter() - t0))
    except BaseException as exc:  # noqa: BLE001 - report, so the parent can print one clear line
        out.put(dict(name=name, ok=False, error=f"{type(exc).__name__}: {exc}"))


def run(args: argparse.Namespace) -> int:
    tmp = None
    urls = args.store
    if not urls:
        tmp = tempfile.mkdtemp(prefix="kvstore-demo-")
        urls = [f"file://{tmp}"]
    salt = uuid.uuid4().hex  # a fresh namespace: replica 1 always starts cold
    rng = random.Random(1234)
    from kvstore.reference import PRESETS

    if args.model not in PRESETS:
        print(f"kvstore demo: error: --model {args.model!r}; accepted: {', '.join(PRESETS)}")
        return 2
    vocab = PRESETS[args.model].vocab_size
    prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
    ctx = mp.get_context("spawn")
    results = []
    print(f"store:   {' -> '.join(urls)}")
    print(f"model:   reference Llama '{args.model}' ({PRESETS[args.model].num_params() / 1e6:.0f}M params), "
          f"prompt {args.tokens} tokens, {args.new_tokens} new tokens")
    try:
        for name in ("replica-1", "replica-2"):
            q = ctx.Queue()
            proc = ctx.Process(target=_replica, args=(name, urls, salt, args.model, prompt, args.new_tokens, q))
            t0 = time.perf_counter()
            proc.start()
            res = q.get(timeout=300)
            proc.join(60)
            if not res["ok"]:
                print(f"kvstore demo: error: {name} failed: {res['error']}")
                return 1
            res["wall"] = time.perf_counter() - t0
            results.append(res)
            print(f"{name}: loaded {res['loaded']:5d} tokens, computed {res['computed']:5d}, "
                  f"time to first token {res['ttft'] * 1e3:8.1f} ms{' (model bypassed)' if res['bypassed'] else ''}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    r1, r2 = results
    same = r1["tokens"] == r2["tokens"]
    print(f"TTFT without cache {r1['ttft'] * 1e3:.1f} ms, with cache {r2['ttft'] * 1e3:.1f} ms: "
          f"{r1['ttft'] / max(r2['ttft'], 1e-9):.1f}x faster")
    print(f"output identical: {same} ({len(r1['tokens'])} tokens: {r1['tokens'][:8]}...)")
    ok = same and r1["loaded"] == 0 and r2["loaded"] == args.tokens
    print("demo: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1
