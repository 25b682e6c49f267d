"""Running decode streams while new requests with stored long prefixes arrive, on vLLM (CPU).

    python benchmarks/bench_vllm_mixed.py [--streams 4] [--arrivals 4] [--tokens 2048] [--runs 3]
        [--throttle-mbps 40] [--out benchmarks/results/vllm_mixed.md]

A Llama of ~100M parameters (the one of bench_vllm_ttft.py), ``--streams`` requests decoding
(short prompts, long outputs) and ``--arrivals`` requests of ``--tokens`` tokens whose prefix is
stored in Redis, arriving one every few engine steps, the same steps in every mode:

  (a) no connector: the arrivals are prefilled from scratch, interleaved with the decodes
  (b) connector, synchronous: the step that schedules an arrival loads its prefix first (every
      running stream waits for the load), saves gather inside the step
  (c) connector, asynchronous (the default): the arrival waits in WAITING_FOR_REMOTE_KVS while
      its prefix loads in the background and the streams keep decoding

Reported per mode, medians over ``--runs`` engine runs: the streams' inter-token latency p50/p99
while arrivals come in, total output tokens per second, and the arrivals' time to first token.
Each run prints its row as it completes. The arrivals are timed, so which requests share a step
differs between modes and runs, and bfloat16 rounds differently (on an AMX host a near tie then
flips a greedy token): the table counts the requests whose tokens equal the first run's of mode
(a), as information; correctness is the tests' (docs/testing.md, "oracles that hold on any host").

A second part checks the load-or-recompute decision: the same arrivals through a link throttled to
``--throttle-mbps`` (``kvstore.testing.proxy``) in front of the same Redis. The cost model measures
the link on the first load, then recomputes the rest (TTFT close to no connector); without the
throttle it keeps loading. The last line is
``itl_p99_ratio=<async/no-connector> ttft_ratio=<no-connector/async>``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import vllm_model
from bench_vllm_ttft import BENCH_CONFIG, machine, run
from servers import RedisServer

from kvstore.testing.proxy import ShapedProxy

ENGINE = {"max_model_len": 4096, "enable_prefix_caching": False, "kv_cache_memory_bytes": 1 << 30}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def measure(result: dict, streams: int, arrivals: int) -> dict[str, float]:
    times, added = result["token_times"], result["added"]
    first_arrival = min(added[f"arrival-{i}"] for i in range(arrivals))
    last_first_token = max(times[f"arrival-{i}"][0] for i in range(arrivals))
    itl: list[float] = []
    for s in range(streams):
        ts = times[f"stream-{s}"]
        itl += [b - a for a, b in itertools.pairwise(ts) if first_arrival <= b <= last_first_token + 0.5]
    ttft = [times[f"arrival-{i}"][0] - added[f"arrival-{i}"] for i in range(arrivals)]
    total = sum(len(v) for v in times.values())
    span = max(t[-1] for t in times.values() if t)
    return {"itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99), "ttft": statistics.median(ttft),
            "tokens_per_s": total / span}


def _rounded(inputs: list[dict]) -> dict[str, str]:
    """The scheduler's cost model inputs (``metrics_kvstore``), readable."""
    if not inputs:
        return {}
    rate = inputs[0].get("prefill_tokens_per_s")
    out = {"prefill tokens/s": "?" if rate is None else f"{rate:.0f}"}
    for tier, bw in (inputs[0].get("read_bytes_per_s") or {}).items():
        out[f"{tier} reads MB/s"] = f"{bw / 1e6:.2f}"
    return out


class _Done(Exception):
    """Only the mixed part was asked for."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--arrivals", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--throttle-mbps", type=float, default=40.0, help="the slow link, Mbit/s")
    parser.add_argument("--part", choices=["all", "mixed", "decision"], default="all",
                        help="both parts, or only the mixed streams, or only the load-or-recompute decision")
    parser.add_argument("--out", help="also write the markdown here (and JSON beside it)")
    args = parser.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kvstore-bench-mixed"
    model = vllm_model.write_model(work / "model", config=vllm_model.llama_config(**BENCH_CONFIG))
    streams = [vllm_model.prompt(100 + i, 64, vocab=4096) for i in range(args.streams)]
    arrivals = [vllm_model.prompt(200 + i, args.tokens, vocab=4096) for i in range(args.arrivals)]
    mixed = {"streams": streams, "stream_tokens": 400, "arrivals": arrivals, "arrival_tokens": 4,
             "first_arrival": 10, "every": 12}
    redis = RedisServer()
    lines = [f"Machine: {json.dumps(machine())}", ""]
    try:
        url = f"redis://127.0.0.1:{redis.port}/0?prefix=mixed:"
        base = {"store": [url], "chunk_tokens": 256}
        run({"model": str(model), "connector": base, "role": "kv_producer", "engine": ENGINE,
             "actions": [{"generate": [a], "max_tokens": 1} for a in arrivals]})
        modes = {"(a) no connector": None,
                 "(b) connector, sync": {**base, "load_mode": "sync", "save_mode": "sync", "load_policy": "always"},
                 "(c) connector, async": {**base, "load_policy": "always"}}
        results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        reference_tokens: dict[str, list[int]] = {}
        for run_index in range(args.runs if args.part != "decision" else 0):
            for name, conn in modes.items():  # interleaved: load from other work hits every mode alike
                out = run({"model": str(model), "connector": conn, "engine": ENGINE, "actions": [{"mixed": mixed}]})
                res = out["results"][0]
                reference_tokens = reference_tokens or res["tokens"]
                row = measure(res, args.streams, args.arrivals)
                row["identical"] = sum(res["tokens"].get(rid) == want for rid, want in reference_tokens.items())
                results[name].append(row)
                print(f"run {run_index + 1} {name}: ITL p50 {row['itl_p50'] * 1e3:.1f} ms, p99 {row['itl_p99'] * 1e3:.1f} ms, "
                      f"TTFT {row['ttft'] * 1e3:.0f} ms, {row['tokens_per_s']:.0f} tokens/s, "
                      f"{row['identical']:.0f}/{len(reference_tokens)} requests' tokens as (a)'s first run", flush=True)
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items() if rs}
        itl_ratio = ttft_ratio = float("nan")
        if med:
            lines += [f"{args.streams} decode streams (64-token prompts, 400 tokens out) while {args.arrivals} requests of "
                      f"{args.tokens} tokens with stored prefixes arrive one every {mixed['every']} steps; medians of "
                      f"{args.runs} runs (tokens: requests whose tokens equal the first run of (a), median; timed "
                      f"batches round differently in bfloat16).", "",
                      "| mode | stream ITL p50 ms | stream ITL p99 ms | arrivals' TTFT ms | output tokens/s | tokens as (a) |",
                      "|---|---|---|---|---|---|"]
            for m, v in med.items():
                lines.append(f"| {m} | {v['itl_p50'] * 1e3:.1f} | {v['itl_p99'] * 1e3:.1f} | {v['ttft'] * 1e3:.0f} | "
                             f"{v['tokens_per_s']:.0f} | {v['identical']:.0f}/{len(reference_tokens)} |")
            a, c = med["(a) no connector"], med["(c) connector, async"]
            itl_ratio, ttft_ratio = c["itl_p99"] / a["itl_p99"], a["ttft"] / c["ttft"]

        if args.part == "mixed":
            raise _Done
        # Load or recompute: the same arrivals through a slow link, cost model on ("auto"). The
        # proxy caps each connection: the slow store uses one, so the link is the cap.
        proxy = ShapedProxy(redis.port, rate=args.throttle_mbps * 1e6 / 8)
        try:
            slow = {"store": [f"redis://127.0.0.1:{proxy.port}/0?prefix=mixed:&timeout=30s&connections=1"],
                    "chunk_tokens": 256}
            fast = {**base}
            lines += ["", f"Load or recompute (load_policy auto), the arrivals alone, one at a time; TTFT ms, median of "
                      f"the last {args.arrivals - 1} (the first measures the link):", "",
                      "| store link | TTFT ms | decisions | cost model inputs at the end |", "|---|---|---|---|"]
            cost = {}
            throttled = f"Redis through {args.throttle_mbps:.0f} Mbit/s"
            for i, (label, conn) in enumerate((("no connector", None), ("Redis, direct", fast), (throttled, slow))):
                # A prompt nobody stored (each run its own: a run saves it) measures the prefill speed.
                miss = vllm_model.prompt(990 + i, args.tokens, vocab=4096)
                single = [{"generate": [p], "max_tokens": 1} for p in [miss, *arrivals]]
                out = run({"model": str(model), "connector": conn, "engine": ENGINE,
                           "actions": single + [{"metrics_kvstore": True}]})
                ttfts = [r["seconds"] for r in out["results"][2:-1]]
                cost[label] = statistics.median(ttfts)
                last = out["results"][-1]
                inputs = "; ".join(f"{k} {v}" for k, v in _rounded(last.get("cost_inputs") or []).items())
                lines.append(f"| {label} | {cost[label] * 1e3:.0f} | {last.get('kvstore') or '-'} | {inputs or '-'} |")
            lines += ["", f"throttled TTFT / no connector: {cost[throttled] / cost['no connector']:.2f}; "
                      f"direct TTFT / no connector: {cost['Redis, direct'] / cost['no connector']:.2f}"]
        finally:
            proxy.close()
    except _Done:
        pass
    finally:
        redis.close()
    lines += ["", f"itl_p99_ratio={itl_ratio:.2f} ttft_ratio={ttft_ratio:.2f}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps({"machine": machine(), "modes": med}, indent=1))


if __name__ == "__main__":
    main()
