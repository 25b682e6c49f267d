"""Drive kvstore's connector under vLLM's own V1 ``Scheduler`` (no engine, no GPU, no model).

Run by ``scripts/vllm033_check`` in the vLLM 0.33 venv (it also runs under 0.32 as a baseline):

* the connector's own vLLM-version check must accept the running vLLM (0.32 and 0.33 are
  supported: ``kvstore.connectors.vllm.facts.VLLM_MINORS``);
* a real ``Scheduler`` builds the SCHEDULER-role ``KVStoreConnector`` from ``kv_transfer_config``
  (``kv_connector_module_path="kvstore.connectors.vllm.connector"``); a WORKER-role one is built
  by vLLM's ``KVConnectorFactory`` over CPU tensors shaped like the tiny Llama's paged KV;
* phase "cold": one request is scheduled to the end; the connector's lookup misses, its plan
  saves the prompt's chunks, ``request_finished`` is called; the records reach the store;
* phase "warm": a fresh scheduler (empty prefix cache) gets the same prompt; the lookup hits,
  ``update_state_after_alloc`` gets the external tokens, the plan carries a load, the worker
  loads in the background and reports it, the request runs to the end, and the loaded blocks
  hold the bytes saved in the cold phase.

Every connector call from the scheduler is recorded; every failure is printed with its
traceback, and the run goes on where it can. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: kvstore

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)
    return bool(ok)


def failure(name: str, exc: BaseException) -> None:
    RESULTS.append((name, False, f"{type(exc).__name__}: {exc}"))
    print(f"[FAIL] {name}: {type(exc).__name__}: {exc}", flush=True)
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    sys.stdout.flush()
    sys.stderr.flush()


def stage(name: str) -> Callable:
    """Run the decorated function at once; a raise is reported (with traceback) as a failure."""
    def run(fn: Callable) -> Any:
        print(f"--- {name}", flush=True)
        try:
            return fn()
        except Exception as exc:
            failure(name, exc)
            return None
    return run


def version_accepted() -> None:
    """The connector's start-up check accepts the running vLLM (a check, not a patch)."""
    import vllm

    from kvstore.connectors.vllm import facts

    try:
        facts.check_vllm_version(vllm.__version__)
        check(f"the connector's version check accepts vLLM {vllm.__version__}", True)
    except Exception as exc:
        check(f"the connector's version check accepts vLLM {vllm.__version__}", False, f"{type(exc).__name__}: {exc}")


def multimodal_features() -> None:
    """vLLM's MultiModalFeatureSpec reads as the key spans the connector hashes (identifier and
    mm_position), and its renderer still skips content hashing only with both caches off."""
    import inspect

    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.renderers import base as renderers

    from kvstore.connectors.vllm.facts import input_spans
    from kvstore.keys import InputSpan

    feature = MultiModalFeatureSpec(data=None, modality="image", identifier="img-a",
                                    mm_position=PlaceholderRange(offset=40, length=67))
    spans = input_spans(type("R", (), {"mm_features": [feature]})())
    check("a MultiModalFeatureSpec reads as a key span", spans == (InputSpan(40, 67, "img-a", "image"),), str(spans))
    source = inspect.getsource(renderers.BaseRenderer._process_mm_uuids) if hasattr(
        renderers, "BaseRenderer") else inspect.getsource(renderers)
    check("the renderer skips content hashing only with mm_processor_cache_gb == 0 and no prefix caching",
          "mm_processor_cache_gb == 0" in source and "enable_prefix_caching" in source)


class Spy:
    """Records the scheduler's calls into the connector (arguments and answers)."""

    NAMES = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
             "update_connector_output", "request_finished", "request_finished_all_groups",
             "get_loaded_kv_cache_group_ids", "get_external_cache_hit_sources", "on_new_request",
             "register_finished_partial_tail", "has_pending_block_frees", "take_events")

    def __init__(self, connector: Any) -> None:
        self.calls: list[tuple[str, tuple, Any]] = []
        for name in self.NAMES:
            fn = getattr(connector, name, None)
            if fn is not None:
                setattr(connector, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            self.calls.append((name, args, result))
            return result
        return wrapper

    def count(self) -> Counter:
        return Counter(name for name, _, _ in self.calls)

    def of(self, name: str) -> list[tuple[tuple, Any]]:
        return [(a, r) for n, a, r in self.calls if n == name]


def make_worker(vllm_config: Any, kv_cache_config: Any, num_blocks: int, block_size: int) -> tuple[Any, dict]:
    import sched_utils as su
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    worker = KVConnectorFactory.create_connector(config=vllm_config, role=KVConnectorRole.WORKER,
                                                 kv_cache_config=kv_cache_config)
    g = torch.Generator().manual_seed(0)
    caches = {name: torch.randn(num_blocks, su.NUM_KV_HEADS, block_size, 2 * su.HEAD_SIZE, generator=g)
              .to(su.KV_DTYPE) for name in su.LAYERS}
    worker.register_kv_caches(caches)
    return worker, caches


def worker_step(worker: Any, scheduler_output: Any) -> Any:
    """What the model runner does with the connector around one step (sync loads before the
    forward, saves after, then the transfer results)."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = scheduler_output.kv_connector_metadata
    if worker is None or meta is None:
        return None
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results(scheduler_output.finished_req_ids)
    out = KVConnectorOutput(
        finished_sending=results.finished_sending or None,
        finished_recving=results.finished_recving or None,
        failed_recving=results.failed_recving or set(),
        invalid_block_ids=worker.get_block_ids_with_load_errors(),
        kv_connector_stats=worker.get_kv_connector_stats(),
    )
    worker.clear_connector_metadata()
    return out


def drive(scheduler: Any, worker: Any, *, max_steps: int = 300, log: list | None = None) -> int:
    """Step ``scheduler`` until nothing is unfinished; returns the number of steps."""
    import sched_utils as su

    steps = 0
    while scheduler.get_num_unfinished_requests() or scheduler.has_finished_requests():
        if steps >= max_steps:
            raise AssertionError(f"requests still unfinished after {max_steps} steps: "
                                 f"{[(r.request_id, str(r.status)) for r in scheduler.requests.values()]}")
        so = scheduler.schedule()
        steps += 1
        kv_out = worker_step(worker, so)
        req_ids = list(so.num_scheduled_tokens)
        sampled = {}
        for req_id in req_ids:
            req = scheduler.requests[req_id]
            if req.num_computed_tokens >= req.num_tokens:  # the step ends its prefill, or decodes
                sampled[req_id] = [7]
        if log is not None:
            log.append((steps, dict(so.num_scheduled_tokens), sorted(so.finished_req_ids),
                        {r: str(x.status) for r, x in scheduler.requests.items()}))
        mro = su.create_model_runner_output(req_ids, sampled=sampled, kv_connector_output=kv_out)
        scheduler.update_from_output(so, mro)
        if not req_ids:
            time.sleep(0.002)  # a lookup or a background load is running
    # The step after the last finish carries finished_req_ids to the worker (async saves end there).
    for _ in range(3):
        so = scheduler.schedule()
        kv_out = worker_step(worker, so)
        scheduler.update_from_output(so, su.create_model_runner_output([], kv_connector_output=kv_out))
    return steps


def run_flow(store_url: str, prompt_len: int, block_size: int, chunk: int) -> None:
    import sched_utils as su
    import torch

    print(f"\n===== store {store_url}: prompt {prompt_len} tokens, block {block_size}, chunk {chunk}", flush=True)
    extra = {"store": store_url, "chunk_tokens": chunk, "load_policy": "always", "pool_bytes": 64 << 20,
             "lookup_wait": 0.05}
    model = su.model_dir()
    num_blocks = 64
    prompt = [(i * 7 + 3) % 1000 + 10 for i in range(prompt_len)]
    expect_hit = (prompt_len - 1) // block_size * block_size  # lookup_limit: whole blocks, one token left
    expect_hit -= expect_hit % block_size

    state: dict[str, Any] = {}

    @stage("config + Scheduler(...) builds the SCHEDULER-role KVStoreConnector")
    def _():
        cfg = su.create_vllm_config(model, block_size=block_size, kv_connector_extra_config=dict(extra))
        state["cfg"] = cfg
        sched = su.create_scheduler(cfg, num_blocks=num_blocks)
        state["sched"] = sched
        conn = sched.connector
        check("scheduler.connector is KVStoreConnector", type(conn).__name__ == "KVStoreConnector",
              f"{type(conn).__module__}.{type(conn).__name__}, role={conn.role}")
        state["spy"] = Spy(conn)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

        check("SupportsHMA kept (hybrid allocator not turned off)", isinstance(conn, SupportsHMA))
        check("kv_load_failure_policy forced to recompute by the connector",
              cfg.kv_transfer_config.kv_load_failure_policy == "recompute" and sched.recompute_kv_load_failures,
              str(cfg.kv_transfer_config.kv_load_failure_policy))
        if hasattr(type(conn), "supports_sleep_mode"):
            print(f"supports_sleep_mode (0.33 classmethod, inherited default) -> "
                  f"{type(conn).supports_sleep_mode(cfg.kv_transfer_config)}", flush=True)

    if "sched" not in state:
        return
    sched, spy, cfg = state["sched"], state["spy"], state["cfg"]

    @stage("WORKER-role KVStoreConnector from KVConnectorFactory + register_kv_caches")
    def _():
        worker, caches = make_worker(cfg, sched.kv_cache_config, num_blocks, block_size)
        state["worker"], state["caches"] = worker, caches
        check("worker connector registered the paged caches", worker.worker is not None
              and bool(worker.worker.transfers), f"layout {worker.worker.transfers[0].layout.name}")

    worker = state.get("worker")
    caches = state.get("caches")

    @stage("cold phase: miss, saves, request_finished")
    def _():
        req = su.create_request(prompt, request_id="cold-1", max_tokens=2, block_size=block_size)
        sched.add_request(req)
        log: list = []
        steps = drive(sched, worker, log=log)
        counts = spy.count()
        print(f"cold: {steps} steps; connector calls {dict(counts)}", flush=True)
        asks = spy.of("get_num_new_matched_tokens")
        check("lookups answered (get_num_new_matched_tokens)", bool(asks) and asks[-1][1] is not None
              and asks[-1][1][0] == 0, f"answers {[r for _, r in asks]}")
        allocs = spy.of("update_state_after_alloc")
        check("update_state_after_alloc called once with 0 external tokens",
              len(allocs) == 1 and allocs[0][0][2] == 0, f"{[(a[0].request_id, a[2]) for a, _ in allocs]}")
        metas = [r for _, r in spy.of("build_connector_meta")]
        saves = [s for m in metas for s in getattr(m, "saves", [])]
        check("build_connector_meta planned saves of the prompt's chunks", bool(saves),
              f"{len(metas)} metas, save ends {[s.ends for s in saves]}")
        fin = spy.of("request_finished_all_groups") + spy.of("request_finished")
        check("request_finished(_all_groups) called once at finish", len(fin) == 1,
              f"{[(a[0].request_id, r) for a, r in fin]}")
        state["cold_blocks"] = list(fin[0][0][1][0]) if fin else []
        check("scheduler empty after the cold request", not sched.requests and not sched.running
              and not sched.waiting)
        if worker is not None:
            assert worker.worker.wait_idle(10)
            store = sched.connector.store
            keys = sched.connector.scheduler.chunk_keys(prompt)
            present = store.exists_many([k.key for k in keys])
            check("the saved chunks are in the store", keys and all(present),
                  f"{sum(present)}/{len(keys)} chunk records")
            used = state["cold_blocks"][: expect_hit // block_size]
            state["snapshot"] = {n: c[used].clone() for n, c in caches.items()}
            for c in caches.values():  # so that a load is visible
                c.zero_()

    if worker is None:
        print("no worker connector: the warm phase needs saved records; skipped", flush=True)
        return

    @stage("warm phase: fresh scheduler, hit, async load, finish")
    def _():
        sched2 = su.create_scheduler(su.create_vllm_config(model, block_size=block_size,
                                                           kv_connector_extra_config=dict(extra)),
                                     num_blocks=num_blocks)
        spy2 = Spy(sched2.connector)
        req = su.create_request(prompt, request_id="warm-1", max_tokens=2, block_size=block_size)
        sched2.add_request(req)
        log: list = []
        steps = drive(sched2, worker, log=log)
        print(f"warm: {steps} steps; connector calls {dict(spy2.count())}", flush=True)
        for entry in log[:8]:
            print("  step", entry, flush=True)
        asks = spy2.of("get_num_new_matched_tokens")
        answers = [r for _, r in asks]
        check("lookup answered with the stored prefix (async)", bool(asks) and answers[-1] == (expect_hit, True),
              f"answers {answers}, expected ({expect_hit}, True)")
        allocs = spy2.of("update_state_after_alloc")
        check("update_state_after_alloc got the external tokens",
              any(a[2] == expect_hit for a, _ in allocs), f"{[(a[0].request_id, a[2]) for a, _ in allocs]}")
        metas = [r for _, r in spy2.of("build_connector_meta")]
        loads = [s for m in metas for s in getattr(m, "loads", [])]
        check("build_connector_meta carried the load", len(loads) == 1 and loads[0].end == expect_hit,
              f"{[(s.req_id, s.start, s.end, s.background) for s in loads]}")
        outs = [a[0] for a, _ in spy2.of("update_connector_output")]
        recv = [o.finished_recving for o in outs if o.finished_recving]
        check("the worker reported the load done (finished_recving -> update_connector_output)",
              any("warm-1" in r for r in recv), f"{recv}")
        fin = spy2.of("request_finished_all_groups") + spy2.of("request_finished")
        check("request_finished(_all_groups) called once", len(fin) == 1, f"{[(a[0].request_id, r) for a, r in fin]}")
        if loads and state.get("snapshot") is not None:
            used = loads[0].block_ids[0][: expect_hit // block_size]
            same = all(torch.equal(caches[n][used], state["snapshot"][n]) for n in caches)
            check("loaded blocks hold the bytes saved in the cold phase", same, f"blocks {used}")
        check("scheduler empty after the warm request", not sched2.requests and not sched2.running
              and not sched2.waiting)
        sched2.connector.shutdown()

    @stage("shutdown")
    def _():
        sched.connector.shutdown()
        worker.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", action="append", help="store URL (default: memory:// and a file:// temp dir)")
    parser.add_argument("--prompt-len", type=int, default=200)
    args = parser.parse_args()
    t0 = time.monotonic()
    import torch
    import vllm

    print(f"python {sys.version.split()[0]}, vllm {vllm.__version__} ({Path(vllm.__file__).parent}), "
          f"torch {torch.__version__}; import {time.monotonic() - t0:.1f}s", flush=True)
    from vllm.platforms import current_platform

    check("vLLM platform is CPU", current_platform.device_type == "cpu", type(current_platform).__name__)
    version_accepted()
    stage("multimodal features")(multimodal_features)
    tmp = tempfile.mkdtemp(prefix="kvstore-vllm033-store-")
    atexit.register(shutil.rmtree, tmp, True)
    stores = args.store or ["memory://", f"file://{tmp}"]
    for url in stores:
        run_flow(url, args.prompt_len, block_size=32, chunk=64)
    failed = [r for r in RESULTS if not r[1]]
    print(f"\n===== {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed, vllm {vllm.__version__}, "
          f"{time.monotonic() - t0:.1f}s", flush=True)
    for name, _, detail in failed:
        print(f"FAILED: {name}: {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.exit(main())
