"""What the KV-event publisher costs a save: PrefixCache.save with and without announcing it.

    python benchmarks/bench_events.py [--rounds 11] [--prompts 4] [--tokens 4096] [--chunk 256]
                                      [--token-bytes 32768] [--store memory://?max_bytes=1GiB]

Rounds alternate in one run, one process, one store: ``off`` saves ``--prompts`` fresh prompts
(``PrefixCache.save``, every chunk written); ``on`` does the same with the cache announcing each save
(``PrefixCache.announce``: ``KVEventPublisher.stored`` after each save, as the connector runs it) while the publisher watches the
store's evictions, with a subscriber in another process receiving every batch (a router). Each
round's wall time (the saves and hooks) and this process's CPU time (the publisher's thread
included, up to a pause after the round that lets its last batch go) are measured; the figures
are medians over rounds, the cost is on/off - 1 of the medians, and the publishing thread's own
CPU time per on round is reported against an off round's CPU time.

``--redis`` saves into a redis-server started for the run instead (maxmemory, so it evicts, and
keyspace notifications on, so the watcher announces the evictions): a shared tier's speed.

The default shape is a Llama-3.2-1B-like KV (16 layers x 8 KV heads x 64 dims x K and V x 2
bytes = 32 KiB per token) in a memory store, the fastest save there is, so the publisher's share
is at its largest; slower stores (Redis, S3) make it smaller.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "tests")]

import numpy as np
from common import machine

from kvstore.events import EventsConfig, KVEventPublisher, medium_of
from kvstore.keys import Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.stores import open_store

_SUBSCRIBER = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(sys.argv[1])
print("ready", flush=True)
n = 0
while True:
    sock.recv_multipart()
    n += 1
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--token-bytes", type=int, default=32768)
    parser.add_argument("--store", default="memory://?max_bytes=1GiB")
    parser.add_argument("--redis", action="store_true",
                        help="save into a redis-server started here (maxmemory 1gb, allkeys-lru, keyspace "
                             "notifications on), its evictions watched; instead of --store")
    parser.add_argument("--batch-interval", type=float, default=EventsConfig.batch_interval,
                        help="the publisher's batch_interval, seconds")
    args = parser.parse_args()
    print(f"machine: {machine()}")

    server = None
    if args.redis:
        import servers

        server = servers.RedisServer("--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru",
                                     "--notify-keyspace-events", "Exe")
        args.store = server.url
    store = open_store(args.store)
    ns = Namespace(model="bench-events", kv_dtype="float16", layout="bench", block_size=16, chunk_tokens=args.chunk)
    cache = PrefixCache(store, ns)
    kv = np.zeros(args.chunk * args.token_bytes, dtype=np.uint8)
    elements = args.chunk * args.token_bytes // 2

    def payload(chunk) -> ChunkPayload:
        return ChunkPayload(shapes=[(elements,)], kv=kv)

    rng = np.random.default_rng(0)
    prompts = iter(rng.integers(0, 128_000, size=(2 * (args.rounds + 1) * args.prompts, args.tokens), dtype=np.uint32))
    medium = medium_of(store)
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-events-")
    pub = KVEventPublisher(EventsConfig(endpoint=f"ipc://{tmp}/pub.sock", replay_endpoint=f"ipc://{tmp}/replay.sock",
                                        batch_interval=args.batch_interval))
    sub = subprocess.Popen([sys.executable, "-c", _SUBSCRIBER, pub.endpoint], stdout=subprocess.PIPE, text=True)
    assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # past ZMQ's slow-joiner window: every batch below reaches the subscriber
    hook_seconds: list[float] = []

    class Timed:
        """The publisher, timing each announcement the save path makes (the engine thread's share)."""

        def stored(self, *args, **kwargs) -> int:
            t = time.perf_counter()
            try:
                return pub.stored(*args, **kwargs)
            finally:
                hook_seconds.append(time.perf_counter() - t)

    timed = Timed()

    def round_(on: bool) -> tuple[float, float]:
        stop = pub.watch(store, redis=args.redis) if on else None
        cache.announce(timed if on else None, [medium])  # the shipped hook: every save announces itself
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.prompts):
            tokens = next(prompts)
            cache.save(tokens, cache.keys(tokens), payload, from_token=0)
        wall = time.perf_counter() - wall
        # The publisher's last batch goes after the round's saves: wait (one sleep, alike in both
        # modes) so the round's CPU time holds all its work and none spills into the next round.
        time.sleep(max(0.03, 3 * pub.config.batch_interval))
        cpu = time.process_time() - cpu
        if stop is not None:
            stop()
        return wall, cpu

    try:
        round_(False)
        round_(True)  # warm-up: allocations, the subscriber's connection
        hook_seconds.clear()
        thread_cpu = pub.stats()["thread_cpu_us"]
        times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                times[on].append(round_(on))
        stats = pub.stats()
        thread_cpu = stats["thread_cpu_us"] - thread_cpu
    finally:
        pub.close()
        sub.kill()
        store.close()
        if server is not None:
            server.close()

    saved = args.prompts * (args.tokens // args.chunk) * args.chunk * args.token_bytes
    print(f"store {args.store}, {args.prompts} prompts x {args.tokens} tokens per round, chunk {args.chunk} tokens, "
          f"{args.token_bytes} B/token ({saved / 1e9:.2f} GB saved per round), {args.rounds} rounds each, alternating, "
          f"batch_interval {args.batch_interval * 1e3:g} ms")
    wall = {on: statistics.median(t for t, _ in times[on]) for on in times}
    cpu = {on: statistics.median(c for _, c in times[on]) for on in times}
    for on in (False, True):
        print(f"  {'on ' if on else 'off'}: round {wall[on] * 1e3:8.1f} ms median "
              f"[{min(t for t, _ in times[on]) * 1e3:.1f}-{max(t for t, _ in times[on]) * 1e3:.1f}], "
              f"save {saved / wall[on] / 1e9:6.2f} GB/s, CPU {cpu[on] * 1e3:8.1f} ms")
    print(f"  cost: wall {100 * (wall[True] / wall[False] - 1):+.2f}%, CPU {100 * (cpu[True] / cpu[False] - 1):+.2f}% "
          f"(medians); hook call {statistics.median(hook_seconds) * 1e6:.0f} us median per save of "
          f"{args.tokens // args.chunk} blocks")
    print(f"  publisher: {stats['batches']} batches, {stats['blocks_stored']} blocks stored, "
          f"{stats['blocks_removed']} removed, {stats['dropped']} dropped; its thread's CPU "
          f"{thread_cpu / 1e3 / args.rounds:.2f} ms per on round "
          f"({100 * thread_cpu / 1e6 / args.rounds / cpu[False]:.2f}% of an off round's CPU)")


if __name__ == "__main__":
    main()
