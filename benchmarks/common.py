"""Shared helpers for the benchmarks: timing with medians, machine description, tables."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable


def cpu_self() -> float:
    """This process's CPU seconds so far, user + system, every thread (``getrusage``): the
    benchmarks' CPU per GB is its difference around the timed calls."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine() -> str:
    """One line describing this machine and the library versions that matter."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    # The vector ISA moves figures by up to 10x (bf16 GEMM without AVX-512: ~1 GFLOPS), and a
    # VM's host can change between runs: always say which one a run had.
    return (f"{cpu}, {os.cpu_count()} cores, ISA {torch.backends.cpu.get_cpu_capability()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, {platform.system()} {platform.release()}")


def timeit(fn: Callable[[], object], *, reps: int = 7, warmup: int = 1, setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call for ``reps`` calls after ``warmup`` calls (``setup`` runs untimed before each)."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def gbps(nbytes: int, times: list[float]) -> tuple[float, float, float]:
    """(median, min, max) GB/s (10^9 bytes per second) for ``nbytes`` moved per call."""
    rates = sorted(nbytes / t / 1e9 for t in times)
    return statistics.median(rates), rates[0], rates[-1]


def fmt(rate: tuple[float, float, float]) -> str:
    return f"{rate[0]:6.2f} [{rate[1]:.2f}-{rate[2]:.2f}]"


def memory_limits(nbytes: int = 128 << 20, reps: int = 5) -> str:
    """One line of this machine's memory limits now, measured in a second: a copy between two
    resident buffers and the record checksum (xxh3) over bytes in memory and in the CPU's cache.
    A VM's host can change under it (the copy has measured from 5 to 23 GB/s): a path that
    copies or hashes is only comparable to another measured on the same host."""
    import numpy as np
    import xxhash

    src, dst = np.ones(nbytes, dtype=np.uint8), np.ones(nbytes, dtype=np.uint8)
    hot = src[:256 << 10]
    copy = gbps(nbytes, timeit(lambda: np.copyto(dst, src), reps=reps))
    cold = gbps(nbytes, timeit(lambda: xxhash.xxh3_64_digest(src), reps=reps))
    cached = gbps(len(hot) * 64, timeit(lambda: [xxhash.xxh3_64_digest(hot) for _ in range(64)], reps=reps))
    return (f"copy {copy[0]:.1f} GB/s, xxh3 from memory {cold[0]:.1f} GB/s, "
            f"xxh3 in cache {cached[0]:.1f} GB/s (medians of {reps}, {nbytes >> 20} MiB)")


def raw_window(size: int, connections: int = 1) -> int:
    """GETs the raw client keeps requested ahead per connection: kvstore's own window
    (``kvstore.stores.redis.raw.store_window``: a ceiling with a deeper one is no ceiling)."""
    from kvstore.stores.redis.raw import store_window

    return store_window(size, connections)


def raw_get_window(client, keys, buffers, window: int) -> None:
    """Pipelined GETs of ``keys`` into ``buffers`` with the raw zero-copy client (``RawRedis``),
    keeping ``window`` of them requested ahead of the one being received
    (``get_many_into(ahead=)``: its docstring says why); a missing key raises ``KeyError``."""
    sizes = client.get_many_into(keys, buffers, ahead=window)
    if None in sizes:
        raise KeyError(keys[sizes.index(None)])


def switch_interval_arg(parser) -> None:
    """``--switch-interval``: the interpreter's thread switch interval for the run. Its default is
    what the engine adapters set at start-up (their ``switch_interval`` option), so a benchmark of
    the data path runs as an engine's process does; ``5ms`` is CPython's own."""
    from kvstore.config import parse_duration
    from kvstore.connectors.gil import DEFAULT_SWITCH_INTERVAL as default

    parser.add_argument("--switch-interval", type=lambda v: parse_duration(v, name="--switch-interval"),
                        default=default, help=f"thread switch interval (default {default * 1e3:g}ms, the "
                        "adapters'; 5ms is CPython's)")


def apply_switch_interval(seconds: float) -> str:
    """Set the run's switch interval; a line saying so, for the benchmark's header."""
    sys.setswitchinterval(seconds)
    return f"thread switch interval {seconds * 1e3:g} ms"


def report(text: str, out: str | None) -> None:
    """Print a benchmark's markdown at its end, and write it to ``out`` where one was given."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
