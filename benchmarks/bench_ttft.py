"""Time to first token of the reference engine, with a cache hit vs a miss, in the same run.

The ``bench`` reference model (about 230 MB of fp32 weights, 8 layers) serves a 2,048-token
prompt through the agent API. A *miss* computes the whole prefill (and stores its KV); a *hit*
loads the stored prefix and skips the model. Each round uses a fresh cache salt, so its miss
is a real miss; rounds alternate miss and hit so load from other processes hits both alike.
Reports median [min-max] of ``--repeat`` rounds and the ratio of medians, per prompt length
(``--tokens 512,1024,2048``: one table row each); ``--json PATH`` also writes them for
``benchmarks/report.py`` (schema in its docstring).

    python benchmarks/bench_ttft.py [--tokens 2048] [--repeat 5] [--store URL ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import uuid

import torch

from kvstore.connectors.agent import KVStoreAgent
from kvstore.reference import PRESETS, ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048", help="prompt length, or a comma-separated list of lengths")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--store", action="append", help="store URL (repeat for tiers); default a temp file:// store")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (for benchmarks/report.py)")
    args = ap.parse_args()
    rows = [measure(args, int(n)) for n in str(args.tokens).split(",")]
    if args.json:
        from common import machine

        with open(args.json, "w") as f:
            json.dump({"benchmark": "ttft", "engine": "reference", "model": args.model, "machine": machine(),
                       "threads": torch.get_num_threads(), "repeat": args.repeat, "loadavg": os.getloadavg()[0],
                       "rows": rows}, f, indent=2)
            f.write("\n")


def measure(args: argparse.Namespace, tokens: int) -> dict:
    args = argparse.Namespace(**{**vars(args), "tokens": tokens})
    tmp = None
    urls = args.store
    if not urls:
        tmp = tempfile.mkdtemp(prefix="kvstore-bench-ttft-")
        urls = [f"file://{tmp}"]
    cfg = PRESETS[args.model]
    cfg = cfg.with_(num_blocks=-(-(args.tokens + 8) // cfg.block_size) + 4)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=gen).tolist()
    runner = ModelRunner(cfg)
    runner.generate([prompt[:64]], 1)  # warm-up without the cache
    miss, hit, same = [], [], True
    try:
        for _ in range(args.repeat):
            agent = KVStoreAgent(dict(store=urls, model=cfg.name, model_fingerprint=cfg.fingerprint,
                                      chunk_tokens=256, cache_salt=uuid.uuid4().hex))
            runner.agent = agent
            a = runner.generate([prompt], 1)
            agent.flush()
            b = runner.generate([prompt], 1)
            assert a.tokens_loaded == 0 and b.bypassed and b.tokens_loaded == args.tokens
            same = same and a.tokens == b.tokens
            miss.append(a.ttft_s)
            hit.append(b.ttft_s)
            agent.close()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    m, h = statistics.median(miss), statistics.median(hit)
    kv_mib = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * args.tokens / 2**20
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; model "
          f"'{args.model}' {cfg.num_params() / 1e6:.0f}M params ({cfg.num_params() * 4 / 1e6:.0f} MB fp32), "
          f"prompt {args.tokens} tokens ({kv_mib:.0f} MiB of KV), store {' -> '.join(urls) if not tmp else 'file:// (temp dir)'}")
    print("| | median ms | min-max ms |")
    print("|---|---|---|")
    print(f"| miss (full prefill) | {m * 1e3:.0f} | {min(miss) * 1e3:.0f}-{max(miss) * 1e3:.0f} |")
    print(f"| hit (load, model bypassed) | {h * 1e3:.0f} | {min(hit) * 1e3:.0f}-{max(hit) * 1e3:.0f} |")
    print(f"| ratio miss/hit | {m / h:.1f}x | |")
    print(f"identical first tokens: {same}")
    return {"tokens": args.tokens, "miss_ms": [m * 1e3, min(miss) * 1e3, max(miss) * 1e3],
            "hit_ms": [h * 1e3, min(hit) * 1e3, max(hit) * 1e3], "identical": same}


if __name__ == "__main__":
    main()
