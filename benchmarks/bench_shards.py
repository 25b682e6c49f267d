"""Batch loads and saves over N client-side shards (``redis+shards://``), each redis-server behind
its own capped link, against the link model RTT + bytes / (N x cap) (issue 24, item 2).

For N = 1, 2, 4: N real redis-servers, each behind its own ``kvstore.testing.proxy.ShapedProxy``
(one-way delay ``--delay``, ``--rate`` bytes/s per connection and direction). The store is opened
with ``?connections=N``: ``RedisStoreBase`` shares a batch's connections out over its servers
(at least one each), so every server's part of a batch goes over exactly one connection, one
capped link per server. The lookups and the replies' small parts use other pooled connections
(each shaped too, carrying a few bytes). The proxies run in a child process: their threads'
CPU and GIL are not the client's, and at these caps (a few percent of a core) the Python proxy
is not the limit.

A batch is ``--records`` values of ``--value`` bytes each (default 1,024 x 64 KiB = 64 MiB), keys
placed by the store's rendezvous hash, so a server holds its hash's share, not exactly 1/N.
Two models, both printed:

  model (even)   2 * delay + bytes / (N x rate): the issue's model, a perfectly even split
  model (split)  2 * delay + (bytes of the server with the most) / rate: the same link model
                 for this batch's actual placement

``get_into`` (receive into pooled buffers) is the load; ``put_many`` the save. GB/s = 10^9 bytes
per second; times are the median [min-max] of ``--reps`` rounds after one warm-up round. CPU
s/GB is this process's user+system time (``getrusage``, all threads) per GB moved.

    python benchmarks/bench_shards.py [--reps 5] [--delay 0.005] [--rate 20e6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import cpu_self, machine

from kvstore.buffers import BufferPool
from kvstore.stores.redis import ShardedRedisStore

SHARDS = (1, 2, 4)

# The child process: one ShapedProxy per target port, their ports on one line, then it serves
# until its stdin closes.
_PROXIES = """
import sys
from kvstore.testing.proxy import ShapedProxy
delay, rate, *targets = sys.argv[1:]
proxies = [ShapedProxy(int(t), delay=float(delay), rate=float(rate)) for t in targets]
print(" ".join(str(p.port) for p in proxies), flush=True)
sys.stdin.read()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.005, help="one-way delay of each link, seconds")
    parser.add_argument("--rate", type=float, default=20e6, help="cap of each link, bytes per second per direction")
    parser.add_argument("--records", type=int, default=1024)
    parser.add_argument("--value", type=int, default=64 << 10, help="bytes per value")
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()
    print(machine(), flush=True)
    reds = [servers.RedisServer() for _ in range(max(SHARDS))]
    proxies = subprocess.Popen([sys.executable, "-c", _PROXIES, str(args.delay), str(args.rate),
                                *(str(s.port) for s in reds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        assert proxies.stdout is not None
        ports = [int(p) for p in proxies.stdout.readline().split()]
        if len(ports) != len(reds):
            raise SystemExit("the proxies did not start")
        run(reds, ports, args)
    finally:
        if proxies.stdin is not None:
            proxies.stdin.close()
        proxies.wait(10)
        for s in reds:
            s.close()


def run(reds: list[servers.RedisServer], ports: list[int], args: argparse.Namespace) -> None:
    rtt = 2 * args.delay
    values = [os.urandom(args.value) for _ in range(8)]
    total = args.records * args.value
    print(f"links: one-way delay {args.delay * 1e3:g} ms (RTT {rtt * 1e3:g} ms), cap {args.rate / 1e6:g} MB/s "
          f"per link and direction; batch: {args.records} values of {args.value >> 10} KiB = {total / 1e6:.1f} MB; "
          f"{args.reps} rounds after a warm-up\n", flush=True)
    rows = []
    for n in SHARDS:
        for s in reds:
            s.flushall()
        url = "redis+shards://" + ",".join(f"127.0.0.1:{p}" for p in ports[:n]) + f"?connections={n}&timeout=30s"
        store = ShardedRedisStore.from_url(url)
        keys = [f"kv/bench-shards/{n}/{i:06d}" for i in range(args.records)]
        items = [(k, values[i % len(values)]) for i, k in enumerate(keys)]
        per_shard = [0] * n
        for k in keys:
            per_shard[store.shard_of(k)] += args.value
        pool = BufferPool(2 * total)

        def save() -> None:
            store.put_many(items)

        def load() -> None:
            for lease in store.get_into(keys, pool):
                assert lease is not None
                lease.release()

        save()  # the values exist before the first load; both warm their connections below
        got = [bytes(lease.view) for lease in store.get_into(keys[:8], pool)]
        if got != [v for _, v in items[:8]]:
            raise SystemExit("loaded values differ from the saved ones")
        model_even = rtt + total / (n * args.rate)
        model_split = rtt + max(per_shard) / args.rate
        for op, fn in (("save", save), ("load", load)):
            times, cpu = [], 0.0
            for rep in range(args.reps + 1):
                c0 = cpu_self()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if rep:
                    times.append(dt)
                    cpu += cpu_self() - c0
            med = statistics.median(times)
            row = {"servers": n, "op": op, "median_s": med, "min_s": min(times), "max_s": max(times),
                   "model_even_s": model_even, "model_split_s": model_split, "share_max": max(per_shard) / total,
                   "gbps": total / med / 1e9, "cpu_s_per_gb": cpu / (args.reps * total / 1e9)}
            rows.append(row)
            print(f"N={n} {op}: {med:.3f} s [{min(times):.3f}-{max(times):.3f}], model even {model_even:.3f} s, "
                  f"split {model_split:.3f} s (largest share {max(per_shard) / total:.3f})", flush=True)
        store.close()
    print("\n| servers | op | time s, median [min-max] | model (even) s | x model (even) | largest share | "
          "model (split) s | x model (split) | GB/s | client CPU s/GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['servers']} | {r['op']} | {r['median_s']:.3f} [{r['min_s']:.3f}-{r['max_s']:.3f}] | "
              f"{r['model_even_s']:.3f} | {r['median_s'] / r['model_even_s']:.3f} | {r['share_max']:.3f} | "
              f"{r['model_split_s']:.3f} | {r['median_s'] / r['model_split_s']:.3f} | {r['gbps']:.4f} | "
              f"{r['cpu_s_per_gb']:.2f} |")
    by = {(r["servers"], r["op"]): r["median_s"] for r in rows}
    print("\nspeed-up over 1 server, same run: " + "; ".join(
        f"{op} x{n}: {by[(1, op)] / by[(n, op)]:.2f}" for op in ("load", "save") for n in SHARDS[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "delay": args.delay, "rate": args.rate,
                                               "records": args.records, "value": args.value, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
