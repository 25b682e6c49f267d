"""Disaggregated prefill through the store against one colocated engine, on vLLM (CPU) OpenAI servers.

    flock /tmp/bench.lock python benchmarks/bench_disagg.py [--streams 4] [--arrivals 4] [--tokens 2048]
        [--every 4] [--runs 2] [--out benchmarks/results/disagg.md]

The same client workload in both modes: ``--streams`` streaming requests decode (64-token prompts,
long outputs); once they run, ``--arrivals`` streaming requests of ``--tokens`` tokens arrive, one
every ``--every`` seconds. Measured per mode: the streams' inter-token latency (ITL) p50/p99 while
the arrivals come in (from the first arrival to 0.5 s after the last one's first token), and each
arrival's time to first token (TTFT), client-side.

  (a) colocated: one server without a connector, on both cores (``taskset -c 0,1``, two OMP
      threads): vLLM interleaves each arrival's prefill with the streams' decode steps. The same
      hardware as (c).
  (b) colocated on one core (``taskset -c 0``): the same engine as each of (c)'s.
  (c) P/D: a prefill server (``kv_producer``, ``taskset -c 0``) and a decode server
      (``kv_consumer``, ``taskset -c 1``) over memory + one redis-server, behind ``kvstore proxy``
      (its own process): the decode server loads each arrival's prompt from Redis and computes
      its last block only.

Also reported for (b), from the servers' own metrics: the prefill engine's time in each step's
save hand-off against the time its saves took in the background (``kvstore_op_seconds``,
op=step_save / save), its prefill-to-visible time, the decode engine's wait and loaded tokens.
Arrivals' greedy tokens are compared across modes (float32, so rounding is the same in both).
The modes alternate run by run; medians over ``--runs``. Redis, the proxy and this client are not
pinned: on a 2-core machine they share the cores with the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import aiohttp
import vllm_model
from bench_vllm_ttft import machine
from servers import RedisServer, free_port, wait_until
from vllm_engines import OpenAIServer, ServerProcess, engine_env, total

#: ~45M parameters: a 2048-token prefill takes about a second on one core here, a decode step of four
#: streams tens of milliseconds, so three modes and two runs fit in ten minutes. float32: the batches
#: differ between modes, and bfloat16 rounding then flips near ties between tokens.
CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
              num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=4096)
DTYPE = "float32"


def server(model: str, cores: str, workdir: Path, name: str, role: str | None, conn: dict | None) -> OpenAIServer:
    """A vLLM OpenAI server pinned with taskset to ``cores`` (its OMP threads bound to them), vLLM's own
    prefix cache off."""
    return OpenAIServer(model, workdir, name=name, role=role or "kv_both", conn=conn, dtype=DTYPE, cores=cores,
                        taskset=True, kv_cache_gib=2, extra=("--no-enable-prefix-caching",))


def proxy_server(prefill: str, decode: str, workdir: Path) -> ServerProcess:
    """``kvstore proxy`` in its own process (not pinned)."""
    port = free_port()
    return ServerProcess("proxy", [sys.executable, "-m", "kvstore.cli", "proxy", "--prefill", prefill, "--decode",
                                   decode, "--port", str(port)], port, workdir, engine_env())


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def completion(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                     times: list[float], tokens: list[int]) -> None:
    """A streaming completion: the arrival time of every token (client clock) into ``times``."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[6:]).get("choices") or ():
                ids = choice.get("token_ids") or ()
                tokens.extend(ids)
                times.extend([now] * len(ids))


async def alone(urls: list[str], prompt: list[int]) -> list[float]:
    """One long prompt with nothing else running, timed by parts: colocated (one URL), the time to
    its first token; P/D (prefill URL, decode URL), the prefill request's time (``max_tokens=1``),
    then the decode request's time to first token with the prefill's params (wait, load, the tail)."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        parts, params = [], None
        if len(urls) == 2:
            t = time.perf_counter()
            body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}}
            async with session.post(urls[0] + "/v1/completions", json=body) as resp:
                params = (await resp.json())["kv_transfer_params"]
            parts.append(time.perf_counter() - t)
        times: list[float] = []
        t = time.perf_counter()
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True,
                **({"kv_transfer_params": params} if params else {})}
        async with session.post(urls[-1] + "/v1/completions", json=body) as resp:
            async for raw in resp.content:
                if raw.startswith(b"data: {"):
                    times.append(time.perf_counter())
        parts.append(times[0] - t)
        return parts


async def workload(url: str, args: argparse.Namespace, streams: list[list[int]],
                   arrivals: list[list[int]]) -> dict:
    """Streams decode; arrivals come one every ``args.every`` s once every stream has 8 tokens."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        s_times: list[list[float]] = [[] for _ in streams]
        s_tokens: list[list[int]] = [[] for _ in streams]
        running = [asyncio.create_task(completion(session, url, p, args.stream_tokens, t, k))
                   for p, t, k in zip(streams, s_times, s_tokens)]
        while min(len(t) for t in s_times) < 8:
            await asyncio.sleep(0.01)
        a_sent: list[float] = []
        a_times: list[list[float]] = [[] for _ in arrivals]
        a_tokens: list[list[int]] = [[] for _ in arrivals]
        tasks = []
        for i, p in enumerate(arrivals):
            if i:
                await asyncio.sleep(args.every)
            a_sent.append(time.perf_counter())
            tasks.append(asyncio.create_task(completion(session, url, p, args.arrival_tokens, a_times[i],
                                                        a_tokens[i])))
        await asyncio.gather(*tasks)
        first_tokens = [t[0] for t in a_times]
        await asyncio.gather(*running)
    window = (a_sent[0], max(first_tokens) + 0.5)
    itl = [b - a for ts in s_times for a, b in itertools.pairwise(ts) if window[0] <= b <= window[1]]
    return {"itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99), "itl_p999": percentile(itl, 0.999),
            "itl_max": max(itl, default=float("nan")), "itl_n": len(itl),
            "ttft": [f - s for f, s in zip(first_tokens, a_sent)], "arrival_tokens": a_tokens,
            "stream_tokens": s_tokens}


def run_mode(mode: str, model: str, args: argparse.Namespace, redis_url: str, workdir: Path, streams, arrivals,
             warm) -> dict:
    """Start the mode's servers, warm them with one long prompt, run the workload, stop them."""
    started: list[OpenAIServer] = []
    proxy = None
    try:
        if mode.startswith("colocated"):
            started.append(server(model, "0,1" if mode == "colocated" else "0", workdir, mode, None, None))
        else:
            conn = {"store": ["memory://?max_bytes=1GiB", redis_url], "chunk_tokens": 256}
            started.append(server(model, "0", workdir, "prefill", "kv_producer", conn))
            started.append(server(model, "1", workdir, "decode", "kv_consumer", conn))
        for s in started:
            wait_until(s.ready, 600, s.name)
        url = started[0].url
        if mode == "pd":
            proxy = proxy_server(started[0].url, started[1].url, workdir)
            wait_until(proxy.ready, 60, "kvstore proxy")
            url = proxy.url
        asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "every": 0.0, "stream_tokens": 16}),
                             [warm[:64]], [warm]))
        out = asyncio.run(workload(url, args, streams, arrivals))
        out["alone"] = asyncio.run(alone([s.url for s in started], warm[::-1]))
        if mode == "pd":
            time.sleep(1.0)  # the last stats travel with later steps: the streams' last tokens
            p, d = started[0].metrics(), started[1].metrics()
            out["prefill"] = {
                "step_save_ms_per_step": 1e3 * total(p, "vllm:kvstore_op_seconds_sum", op="step_save")
                / max(1.0, total(p, "vllm:kvstore_op_seconds_count", op="step_save")),
                "save_ms_per_save": 1e3 * total(p, "vllm:kvstore_op_seconds_sum", op="save")
                / max(1.0, total(p, "vllm:kvstore_op_seconds_count", op="save")),
                "visible_ms_mean": 1e3 * total(p, "vllm:kvstore_pd_prefill_to_visible_seconds_sum")
                / max(1.0, total(p, "vllm:kvstore_pd_prefill_to_visible_seconds_count")),
                "visible_n": total(p, "vllm:kvstore_pd_prefill_to_visible_seconds_count")}
            out["decode"] = {
                "wait_ms_mean": 1e3 * total(d, "vllm:kvstore_pd_wait_seconds_sum")
                / max(1.0, total(d, "vllm:kvstore_pd_wait_seconds_count")),
                "loaded_tokens": total(d, "vllm:kvstore_pd_loaded_tokens_sum"),
                "loads": total(d, "vllm:kvstore_pd_loaded_tokens_count"),
                "failures": total(d, "vllm:kvstore_pd_load_failures_total"),
                "load_ms_mean": 1e3 * total(d, "vllm:kvstore_op_seconds_sum", op="load")
                / max(1.0, total(d, "vllm:kvstore_op_seconds_count", op="load"))}
        return out
    finally:
        if proxy is not None:
            proxy.kill()
        for s in started:
            s.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=400, help="tokens each stream generates")
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--arrival-tokens", type=int, default=8, help="tokens each arrival generates")
    ap.add_argument("--tokens", type=int, default=2048, help="arrivals' prompt length")
    ap.add_argument("--every", type=float, default=4.0, help="seconds between arrivals")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", help="also write the markdown here (and JSON beside it)")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvstore-bench-disagg"))
    args = ap.parse_args()

    config = vllm_model.llama_config(**CONFIG)
    model = str(vllm_model.write_model(args.model_dir, config=config, seed=0))
    vocab = config["vocab_size"]
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-disagg-"))
    redis = RedisServer()
    modes = ("colocated", "colocated-1core", "pd")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        redis_url = f"redis://127.0.0.1:{redis.port}/0?prefix=disagg:"
        for run in range(args.runs):
            streams = [vllm_model.prompt(1000 * run + s, 64, vocab) for s in range(args.streams)]
            arrivals = [vllm_model.prompt(1000 * run + 100 + a, args.tokens, vocab) for a in range(args.arrivals)]
            warm = vllm_model.prompt(1000 * run + 999, args.tokens, vocab)
            for mode in (modes if run % 2 == 0 else modes[::-1]):
                t = time.perf_counter()
                results[mode].append(run_mode(mode, model, args, redis_url, workdir, streams, arrivals, warm))
                r = results[mode][-1]
                print(f"run {run} {mode}: ITL p50 {r['itl_p50'] * 1e3:.1f} ms p99 {r['itl_p99'] * 1e3:.1f} ms, TTFT "
                      f"{[round(x * 1e3) for x in r['ttft']]} ms ({time.perf_counter() - t:.0f}s)", flush=True)
    finally:
        redis.close()

    same = all(len({json.dumps(results[m][r]["arrival_tokens"]) for m in modes}) == 1 for r in range(args.runs))
    med = {m: {**{q: statistics.median(r[q] for r in rs) for q in ("itl_p50", "itl_p99", "itl_p999", "itl_max")},
               "ttft": [statistics.median(r["ttft"][i] for r in rs) for i in range(args.arrivals)],
               "alone": [statistics.median(r["alone"][i] for r in rs) for i in range(len(rs[0]["alone"]))]}
           for m, rs in results.items()}
    pd_extra = results["pd"][-1]
    lines = [f"Machine: {json.dumps(machine())}", "",
             f"{args.streams} decode streams (64-token prompts, {args.stream_tokens} tokens out) while {args.arrivals} "
             f"requests of {args.tokens} tokens arrive one every {args.every:g} s; medians of {args.runs} runs; "
             f"arrivals' tokens identical across modes: {same}.", "",
             "| mode | stream ITL p50 ms | p99 ms | p99.9 ms | max ms | TTFT per arrival ms |",
             "|---|---|---|---|---|---|"]
    labels = {"colocated": "(a) colocated, 1 engine, cores 0-1", "colocated-1core": "(b) colocated, 1 engine, core 0",
              "pd": "(c) P/D: prefill core 0, decode core 1"}
    for mode in modes:
        m = med[mode]
        lines.append(f"| {labels[mode]} | {m['itl_p50'] * 1e3:.1f} | {m['itl_p99'] * 1e3:.1f} | "
                     f"{m['itl_p999'] * 1e3:.1f} | {m['itl_max'] * 1e3:.1f} | "
                     f"{', '.join(f'{x * 1e3:.0f}' for x in m['ttft'])} |")
    c1, pdm = med["colocated-1core"]["alone"][0], med["pd"]["alone"]
    lines += ["", f"One {args.tokens}-token prompt alone (nothing else running), ms: colocated on cores 0-1, time to "
                  f"first token {med['colocated']['alone'][0] * 1e3:.0f}; on core 0, {c1 * 1e3:.0f}; P/D, the prefill "
                  f"request (max_tokens=1) {pdm[0] * 1e3:.0f} + the decode request's time to first token "
                  f"{pdm[1] * 1e3:.0f} = {(pdm[0] + pdm[1]) * 1e3:.0f}."]
    ratio_p99 = med["pd"]["itl_p999"] / med["colocated"]["itl_p999"]
    ratio_ttft = statistics.median(med["pd"]["ttft"]) / statistics.median(med["colocated"]["ttft"])
    lines += ["", f"P/D (last run): prefill {json.dumps({k: round(v, 2) for k, v in pd_extra['prefill'].items()})}; "
                  f"decode {json.dumps({k: round(v, 2) for k, v in pd_extra['decode'].items()})}", "",
              f"itl_p999_ratio={ratio_p99:.2f} (P/D / colocated) ttft_ratio={ratio_ttft:.2f} (P/D / colocated)"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"machine": machine(), "args": vars(args), "medians": med,
             "runs": {m: [{k: v for k, v in r.items() if not k.endswith("_tokens")} for r in rs]
                      for m, rs in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
