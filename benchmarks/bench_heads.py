"""Records of KV head ranges (issue 46) against today's format, in one run: save and load at TP=1
and TP=2 through Redis, the cross-TP loads, and whether partial reads would pay.

The prefix is Llama-3-8B-shaped (32 layers, 8 KV heads, head size 128, bf16: 128 KiB per token),
1,024 tokens in 4 chunks of 256, in vLLM CPU's packed pages (``vllm-cpu-vec``, block size 16, the
blocks at random ids). A TP=2 engine's two ranks (4 heads each, 64 KiB per token) are run one
after the other in one process: the figures are the sum of both ranks' calls, the bytes every
rank's cache gets.

* **Today's format** (``base``): the library of the commit before format 3 (``--base``, taken
  with ``git archive`` into a temporary directory), records keyed by rank and TP size.
* **Format 3** (``new``): records keyed by head range; the same saves and loads at equal TP
  (each rank its own range's records: the path every equal-TP engine takes), then the cross-TP
  loads: a TP=1 reader joining a TP=2 writer's two ranges, and TP=2 ranks each slicing its heads
  out of a TP=1 writer's records (read amplification 2: each reads the whole record).

Each variant runs in a worker process of its own (its library on ``sys.path``), driven round by
round: per round, every case of base then new, so drifts of this shared machine hit both alike.
GB/s = 10^9 bytes of KV that reach the reader's (or leave the writer's) cache per second; median
[min-max] of ``--reps`` rounds after a warm-up; **each figure is a ratio to its same-run
baseline** (format 3 to base at equal TP; cross-TP loads to format 3's equal-TP load at the
reader's TP size). Each row prints as it completes.

**Partial reads.** A rank slicing a coarser record could instead read only its heads (Redis
``GETRANGE``, S3 ranged GET, a file offset), with a checksum per head range so that a slice is
verified alone. Measured on one record of the TP=1 writer (32 MiB) with the raw zero-copy client
(what kvstore's direct reads cost; no verification): ``GET`` of the whole record; ``GETRANGE`` of
its half as one range (what a head-major payload would allow); the half of today's layer-major
payload as it lies, one range per layer and block (32 x 16 = 512 ranges, pipelined); what a
head-major payload costs every equal-TP load (a ``GET`` landed in the cache's blocks: one piece per
layer and block today, one per head, layer and block head-major); and xxh3 of the half against
xxh3 of the whole (the verification a per-range checksum would save).

    python benchmarks/bench_heads.py [--reps 5] [--base COMMIT] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS, HEADS, HEAD, BLOCK, BLOCKS, TOKENS, CHUNK = 32, 8, 128, 16, 160, 1024, 256
#: The last commit of record format 2 (the parent of the commit that introduced format 3).
BASE = "96f5405"
EQUAL = ["save_tp1", "load_tp1", "save_tp2", "load_tp2"]
CROSS = {"load_tp1_from_tp2": "load_tp1", "load_tp2_from_tp1": "load_tp2"}


# -- the worker: one variant's library, one case per command ------------------------------------------
def worker(variant: str, port: int) -> None:
    import numpy as np
    import torch

    import kvstore.keys as keys
    from kvstore.paged import CPUPackedLayout, KVTransfer, slots_from_block_table
    from kvstore.prefix_cache import PrefixCache
    from kvstore.stores.redis import RedisStore

    torch.set_num_threads(1)
    heads_api = hasattr(keys, "HeadRange")
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0?prefix={variant}:&timeout=60s")
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(BLOCKS)[:TOKENS // BLOCK].tolist()
    dst_blocks = rng.permutation(BLOCKS)[:TOKENS // BLOCK].tolist()
    src_slots = slots_from_block_table(src_blocks, BLOCK, TOKENS)
    dst_slots = slots_from_block_table(dst_blocks, BLOCK, TOKENS)
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]

    def rank_heads(rank: int, tp: int) -> tuple[int, int]:
        per = HEADS // tp
        return rank * per, (rank + 1) * per

    def transfer(rank: int, tp: int, caches: list) -> KVTransfer:
        layout = CPUPackedLayout("vec")
        if heads_api:
            ns = keys.Namespace(model="bench-heads", kv_dtype="bfloat16", layout=layout.name, block_size=BLOCK,
                                chunk_tokens=CHUNK, layer_end=LAYERS)
            cache = PrefixCache(store, ns, heads=keys.HeadRange(*rank_heads(rank, tp), HEADS))
        else:
            ns = keys.Namespace(model="bench-heads", kv_dtype="bfloat16", layout=layout.name, block_size=BLOCK,
                                chunk_tokens=CHUNK, layer_end=LAYERS, tp_rank=rank, tp_size=tp)
            cache = PrefixCache(store, ns)
        return KVTransfer(cache, caches, layout)

    writers = {tp: [transfer(r, tp, [c[:, slice(*rank_heads(r, tp))].contiguous() for c in full]) for r in range(tp)]
               for tp in (1, 2)}
    readers = {tp: [transfer(r, tp, [torch.zeros(BLOCKS, HEADS // tp, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
                                     for _ in range(LAYERS)]) for r in range(tp)] for tp in (1, 2)}
    kv_bytes = TOKENS * LAYERS * HEADS * 2 * HEAD * 2
    prompts: dict[int, np.ndarray] = {}  # TP size -> the tokens its writer saved last

    def ranges(tp: int) -> list:
        return [keys.HeadRange(*rank_heads(r, tp), HEADS) for r in range(tp)]

    def check(tp: int) -> None:
        for r, reader in enumerate(readers[tp]):
            a, b = rank_heads(r, tp)
            for layer in (0, LAYERS - 1):
                got = reader.kv_caches[layer][dst_blocks]
                want = full[layer][src_blocks][:, a:b]
                if not torch.equal(got, want):
                    raise SystemExit(f"{variant}: TP={tp} rank {r} loaded other bytes than were saved")

    def run(case: str, rep: int) -> dict:
        tp = 1 if "tp1" in case.split("_from_")[0] else 2
        start = time.perf_counter()
        if case.startswith("save"):
            tokens = np.random.default_rng(1000 + rep).integers(0, 128000, TOKENS, dtype=np.uint32)
            prompts[tp] = tokens
            start = time.perf_counter()
            for w in writers[tp]:
                if w.save_sequence(tokens, src_slots) != TOKENS // CHUNK:
                    raise SystemExit(f"{variant}: {case} wrote short")
        elif "_from_" in case:
            other = 2 if tp == 1 else 1
            tokens = prompts[other]
            start = time.perf_counter()
            for reader in readers[tp]:
                got, _ = reader.load_sequence(tokens, dst_slots, sources=ranges(other))
                if got != TOKENS:
                    raise SystemExit(f"{variant}: {case} loaded {got} tokens")
        else:
            tokens = prompts[tp]
            start = time.perf_counter()
            for reader in readers[tp]:
                got, _ = reader.load_sequence(tokens, dst_slots)
                if got != TOKENS:
                    raise SystemExit(f"{variant}: {case} loaded {got} tokens")
        seconds = time.perf_counter() - start
        if case.startswith("load"):
            check(tp)
            for reader in readers[tp]:
                for c in reader.kv_caches:
                    c.zero_()
        return {"seconds": seconds, "bytes": kv_bytes}

    print(f"READY {keys.__file__}", flush=True)
    for line in sys.stdin:
        case, rep = line.split()
        print(json.dumps(run(case, int(rep))), flush=True)


# -- partial reads ---------------------------------------------------------------------------------
def partial_reads(port: int, reps: int) -> list[tuple[str, str, list[float], int]]:
    """``(what, baseline, seconds per rep, bytes)``: whole and partial reads of one TP=1 record's
    size with the raw zero-copy client (what kvstore's direct reads cost, no verification), into
    a destination laid out as a reader's cache, and the hashes a per-range checksum would change."""
    import numpy as np
    import xxhash
    from common import timeit

    from kvstore.stores.redis.raw import RawRedis

    raw = RawRedis(port=port)
    blocks = CHUNK // BLOCK
    page = BLOCK * 2 * HEAD * 2  # one head's page of one block: 8 KiB
    size = LAYERS * blocks * HEADS * page  # 32 MiB
    value = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    raw.set(b"partial", memoryview(value))
    # A reader's cache: [layers, blocks of the cache, heads, page], the chunk's blocks at random ids.
    cache = np.zeros((LAYERS, BLOCKS, HEADS, page), dtype=np.uint8)
    ids = np.random.default_rng(6).permutation(BLOCKS)[:blocks]
    flat = np.zeros(size, dtype=np.uint8)
    half = memoryview(flat)[:size // 2]

    def whole() -> None:
        assert raw.get_into(b"partial", flat) == size

    def one_range() -> None:
        raw._queue(b"GETRANGE", b"partial", b"0", str(size // 2 - 1).encode())
        raw._flush()
        assert raw._read_bulk_into(half) == size // 2

    per_layer = blocks * HEADS * page
    pieces = [(layer * per_layer + b * HEADS * page, HEADS // 2 * page)  # heads [0, 4) of each block
              for layer in range(LAYERS) for b in range(blocks)]

    def strided() -> None:
        for offset, n in pieces:
            raw._queue(b"GETRANGE", b"partial", str(offset).encode(), str(offset + n - 1).encode())
        raw._flush()
        for i, (_, n) in enumerate(pieces):
            assert raw._read_bulk_into(half[i * n:(i + 1) * n]) == n

    # GET straight into the cache's blocks (what a CPU load lands): today's layer-major payload is
    # one piece per layer and block (all heads of a block are adjacent); a head-major payload would
    # be one piece per head, layer and block.
    layer_major = [memoryview(cache[layer, b].reshape(-1)) for layer in range(LAYERS) for b in ids]
    head_major = [memoryview(cache[layer, b, h]) for h in range(HEADS) for layer in range(LAYERS) for b in ids]

    def into_blocks(targets: list[memoryview]) -> None:
        assert raw.get_many_into([b"partial"], [targets]) == [size]

    data = memoryview(value)
    cases = [
        ("GET whole record", "GET", whole, size),
        ("GETRANGE, half as one range (a head-major payload)", "GET", one_range, size // 2),
        (f"GETRANGE, half as {len(pieces)} ranges (today's layer-major payload)", "GET", strided, size // 2),
        (f"GET into the blocks, layer-major ({len(layer_major)} pieces of {HEADS * page >> 10} KiB)", "layer-major",
         lambda: into_blocks(layer_major), size),
        (f"GET into the blocks, head-major ({len(head_major)} pieces of {page >> 10} KiB)", "layer-major",
         lambda: into_blocks(head_major), size),
        ("xxh3 of the whole record", "xxh3", lambda: xxhash.xxh3_64_digest(data), size),
        ("xxh3 of half", "xxh3", lambda: xxhash.xxh3_64_digest(data[:size // 2]), size // 2),
    ]
    out = [(what, baseline, timeit(fn, reps=reps), nbytes) for what, baseline, fn, nbytes in cases]
    raw.delete(b"partial")
    raw.close()
    return out


# -- the driver ------------------------------------------------------------------------------------
def base_tree(commit: str) -> str:
    """The library of ``commit`` in a temporary directory (``git archive``: the repository untouched)."""
    directory = tempfile.mkdtemp(prefix="kvstore-base-")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "kvstore"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", directory], input=archive.stdout, check=True)
    return directory


class Worker:
    def __init__(self, variant: str, path: str, port: int) -> None:
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", variant, "--port", str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().split()
        # Each variant must run its own library (PYTHONPATH before the editable install's finder).
        assert ready[:1] == ["READY"] and ready[1].startswith(path), (variant, ready)

    def run(self, case: str, rep: int) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{case} {rep}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker ended: {case}")
        out: dict = json.loads(line)
        return out

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def fmt(rates: list[float]) -> str:
    return f"{statistics.median(rates):.2f} [{min(rates):.2f}-{max(rates):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--base", default=BASE, help="the commit of today's format (record format 2)")
    parser.add_argument("--json", help="also write the figures as JSON here")
    parser.add_argument("--aa", action="store_true",
                        help="run today's format in both workers (an A/A run: the harness's own noise and bias)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.port)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import servers
    from common import machine, memory_limits

    print(machine(), flush=True)
    print(f"memory: {memory_limits()}", flush=True)
    print(f"{TOKENS} tokens of Llama-3-8B-shaped KV ({TOKENS * LAYERS * HEADS * 2 * HEAD * 2 / 2**20:.0f} MiB, "
          f"bf16) in {TOKENS // CHUNK} chunks, vllm-cpu-vec pages of {BLOCK} tokens, Redis on loopback; base = "
          f"{args.base} (format 2), new = {'the same (an A/A run)' if args.aa else 'this tree (format 3)'}; "
          f"{args.reps} rounds after a warm-up, the two alternating which goes first", flush=True)
    server = servers.RedisServer()
    base = base_tree(args.base)
    new_tree = base if args.aa else str(ROOT)
    workers = {"base": Worker("base", base, server.port), "new": Worker("new", new_tree, server.port)}
    results: dict[str, dict[str, list[float]]] = {"base": {c: [] for c in EQUAL},
                                                   "new": {c: [] for c in [*EQUAL, *CROSS]}}
    try:
        for rep in range(args.reps + 1):  # round 0 warms up
            for case in EQUAL:  # base first in odd rounds, new first in even ones: no side pays for going first
                for variant in (("base", "new") if rep % 2 else ("new", "base")):
                    out = workers[variant].run(case, rep)
                    if rep:
                        results[variant][case].append(out["bytes"] / out["seconds"] / 1e9)
            for case in () if args.aa else CROSS:
                out = workers["new"].run(case, rep)
                if rep:
                    results["new"][case].append(out["bytes"] / out["seconds"] / 1e9)
            if rep:
                print(f"round {rep} done", flush=True)
        print("\nequal TP, format 3 against today's format (GB/s of KV, median [min-max]; ratio new/base of "
              "the medians, and the range of per-round ratios)", flush=True)
        table = []
        for case in EQUAL:
            b, n = results["base"][case], results["new"][case]
            ratios = [x / y for x, y in zip(n, b)]
            ratio = statistics.median(n) / statistics.median(b)
            row = {"case": case, "base": b, "new": n, "ratio": ratio, "round_ratios": ratios}
            table.append(row)
            print(f"  {case:<10} base {fmt(b)}  new {fmt(n)}  ratio {ratio:.3f} [{min(ratios):.2f}-{max(ratios):.2f}]",
                  flush=True)
        if args.aa:
            return
        print("\ncross TP (format 3), ratio to format 3's equal-TP load at the reader's TP size", flush=True)
        for case, same in CROSS.items():
            c, s = results["new"][case], results["new"][same]
            ratio = statistics.median(c) / statistics.median(s)
            amp = 2.0 if case == "load_tp2_from_tp1" else 1.0
            table.append({"case": case, "new": c, "baseline": same, "ratio": ratio, "read_amplification": amp})
            print(f"  {case:<18} {fmt(c)} GB/s  ratio to {same} {ratio:.3f}  read amplification {amp:.0f}x "
                  f"(bytes read / bytes the ranks need)", flush=True)
        print("\npartial reads of one TP=1 record (32 MiB; raw zero-copy client, no verification): time "
              "ratio to the whole GET, to the layer-major GET into the blocks, or to xxh3 of the whole", flush=True)
        partial = partial_reads(server.port, 3 * args.reps)
        bases = {"GET": statistics.median(partial[0][2]), "layer-major": statistics.median(partial[3][2]),
                 "xxh3": statistics.median(partial[5][2])}
        for what, baseline, times, nbytes in partial:
            t = statistics.median(times)
            row = {"case": what, "seconds": times, "bytes": nbytes, "ratio": t / bases[baseline]}
            table.append(row)
            print(f"  {what:<66} {t * 1e3:7.2f} ms  {nbytes / t / 1e9:5.2f} GB/s  time ratio {t / bases[baseline]:.3f}",
                  flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": table, "reps": args.reps, "base": args.base}, indent=1))
    finally:
        for w in workers.values():
            w.close()
        server.close()


if __name__ == "__main__":
    main()
