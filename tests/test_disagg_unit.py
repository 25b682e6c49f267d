"""Disaggregated prefill in the connector, without an engine (``kvstore.connectors.vllm.disagg``):
the promise's wire format and its checks, and the prefill -> params -> decode path over fake
requests, real paged tensors and a tiered store whose shared tier is written in the background
(a memory store that says it is shared, with a gate that holds its writes: a slow Redis)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from test_vllm_unit import alloc, facts, make_connector, paged, run_worker, step

from kvstore.connectors.vllm.disagg import BadPromise, Promise, read_promise, shared_tier, wait_for
from kvstore.metrics.catalog import PD_LOAD_FAILURES, PD_LOADED_TOKENS, PD_PROMISES, PD_VISIBLE, PD_WAIT
from kvstore.stores.memory import MemoryStore
from kvstore.stores.tiered import TieredStore
from kvstore.testing.damage import flip_byte

BS = 32
TOKENS = list(range(1000, 1300))  # 300 tokens: a hit may cover 288 (4 chunks of 64 and a partial one)
GOOD = Promise(namespace="ns1", tokens=288, chunks=5, digest="ab" * 32, tier="redis", deadline_s=2.0)


# -- the wire format ------------------------------------------------------------------------------
def test_a_promise_round_trips_through_its_params():
    params = GOOD.to_params()
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert read_promise(params, namespace="ns1", max_tokens=288, block_size=BS) == GOOD


@pytest.mark.parametrize("change, reason", [
    ({"v": 2}, "params"),
    ({"tokens": "288"}, "params"),
    ({"tokens": True}, "params"),
    ({"tokens": 0}, "params"),
    ({"chunks": -1}, "params"),
    ({"deadline_s": float("nan")}, "params"),
    ({"deadline_s": -1}, "params"),
    ({"deadline_s": 1e9}, "params"),
    ({"namespace": ""}, "params"),
    ({"digest": "x" * 500}, "params"),
    ({"tier": "red\nis"}, "params"),
    ({"namespace": "ns2"}, "mismatch"),
    ({"tokens": 320}, "mismatch"),  # more than this prompt can hit: another prompt
    ({"tokens": 100}, "mismatch"),  # not whole blocks
])
def test_a_bad_or_foreign_promise_is_refused_with_its_reason(change, reason):
    params = GOOD.to_params()
    params["kvstore"].update(change)
    with pytest.raises(BadPromise) as info:
        read_promise(params, namespace="ns1", max_tokens=288, block_size=BS)
    assert info.value.reason == reason


def test_params_without_an_object_are_refused():
    with pytest.raises(BadPromise):
        read_promise({"do_remote_prefill": True, "kvstore": [1]}, namespace="ns1", max_tokens=288, block_size=BS)


def test_the_shared_tier_is_the_first_one_other_engines_read():
    assert shared_tier([("memory", True), ("redis", False), ("s3", False)]) == "redis"
    assert shared_tier([("memory", True), ("shm", True)]) == "shm"
    assert shared_tier([("memory", True)]) is None


def test_wait_for_polls_until_enough_or_the_deadline_and_always_looks_once():
    now = [0.0]
    answers = iter([0, 3, 5, 9])
    assert wait_for(lambda: next(answers), 5, 10.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)) == 5
    calls = []
    assert wait_for(lambda: calls.append(1) or 0, 5, 0.0, clock=lambda: now[0]) == 0 and calls == [1]
    start = time.monotonic()
    assert wait_for(lambda: 0, 1, time.monotonic() + 0.05, clock=time.monotonic) == 0
    assert 0.04 <= time.monotonic() - start < 1.0


# -- prefill -> params -> decode ------------------------------------------------------------------
class SharedMemory(MemoryStore):
    """A memory store that says it is shared (the tiered store writes it in the background, as it
    writes Redis); while ``gate`` is clear its writes wait (a slow or frozen server)."""

    is_local = False

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def put(self, key, value):
        self.gate.wait(30)
        super().put(key, value)

    def put_many(self, items):
        self.gate.wait(30)
        super().put_many(items)


def engines(shared: SharedMemory, **opts):
    """A prefill engine (its own memory tier over ``shared``) and a decode engine (the same)."""
    f = facts()
    p_store, d_store = TieredStore([MemoryStore(), shared]), TieredStore([MemoryStore(), shared])
    p = make_connector("scheduler", p_store, f, **opts), make_connector("worker", p_store, f, **opts)
    d = make_connector("scheduler", d_store, f, kv_role="kv_consumer", **opts), \
        make_connector("worker", d_store, f, kv_role="kv_consumer", **opts)
    p[1].register_kv_caches(paged("cpu", seed=1))
    d[1].register_kv_caches(paged("cpu", seed=2))
    return p, d, (p_store, d_store)


def prefill(p, tokens=TOKENS, req_id="p1"):
    """The proxy's prefill request: max_tokens=1, do_remote_decode. Returns the response's params."""
    sched, work = p
    req = SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, cache_salt=None,
                          kv_transfer_params={"do_remote_decode": True}, status=SimpleNamespace(name="RUNNING"))
    assert sched.get_num_new_matched_tokens(req, 0) in ((0, False), (None, False))
    blocks = list(range(10))
    alloc(sched, req, blocks, 0)
    meta = step(sched, req, blocks, computed=0, scheduled=len(tokens), new=True)
    assert [s.promise for s in meta.saves] == [True]
    run_worker(work, meta)
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay_free, params = sched.request_finished(req, blocks)
    assert delay_free  # background saves: vLLM keeps the blocks until the worker gathered them
    run_worker(work, step(sched, req, blocks, computed=len(tokens), scheduled=0, new=False, waiting=True),
               finished={req_id})
    return params


def decode_ask(sched, req, local=0, timeout=10.0):
    """``get_num_new_matched_tokens`` every step until it answers; returns it and how many Nones came first."""
    nones, end = 0, time.monotonic() + timeout
    while time.monotonic() < end:
        answer = sched.get_num_new_matched_tokens(req, local)
        if answer[0] is not None:
            return answer, nones
        nones += 1
        time.sleep(0.002)
    raise AssertionError("the decode engine never answered")


def decode_request(params, tokens=TOKENS, req_id="d1"):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, cache_salt=None, kv_transfer_params=params)


def decode_load(d, req, blocks, ext):
    """Allocate, plan and run the background load; report it to the scheduler; the load errors."""
    sched, work = d
    alloc(sched, req, blocks, ext)
    meta = step(sched, req, blocks, computed=ext, scheduled=0, new=True, waiting=True)
    assert [(s.start, s.end, s.background) for s in meta.loads] == [(0, ext, True)]
    errors = run_worker(work, meta)
    sched.update_connector_output(SimpleNamespace(finished_recving=work.last_finished[1] or set(),
                                                  invalid_block_ids=errors))
    return errors


def test_the_decode_engine_waits_off_the_step_for_records_still_on_their_way_then_loads_them_all():
    shared = SharedMemory()
    p, d, (p_store, _) = engines(shared)
    shared.gate.clear()  # the shared tier is slow: nothing of the prefill is there yet
    visible_before = PD_VISIBLE.count()
    params = prefill(p)
    promise = params["kvstore"]
    assert (promise["tokens"], promise["chunks"], promise["tier"]) == (288, 5, "memory#2")
    assert not list(shared.iter_keys())
    loaded, waits = PD_LOADED_TOKENS.count(), PD_WAIT.count()
    req = decode_request(params)
    assert d[0].get_num_new_matched_tokens(req, 0) == (None, False)  # asks again: the step goes on
    threading.Timer(0.1, shared.gate.set).start()
    (ext, is_async), nones = decode_ask(d[0], req)
    assert (ext, is_async) == (288, True) and nones >= 5
    assert PD_WAIT.count() == waits + 1
    assert decode_load(d, req, list(range(10, 20)), 288) == set()
    assert PD_LOADED_TOKENS.count() == loaded + 1
    assert PD_LOADED_TOKENS.samples()[()][1] >= 288
    # The producer saw its records reach the shared tier (observed after the gate opened).
    assert p_store.flush(5)
    deadline = time.monotonic() + 5
    while PD_VISIBLE.count() == visible_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert PD_VISIBLE.count() == visible_before + 1
    # The same prompt later, without params: an ordinary prefix-cache hit on the same records.
    again = SimpleNamespace(request_id="d2", prompt_token_ids=TOKENS, cache_salt=None, kv_transfer_params=None)
    assert decode_ask(d[0], again)[0] == (288, True)


def test_records_not_visible_by_the_deadline_are_recomputed_and_counted():
    shared = SharedMemory()
    p, d, _ = engines(shared, pd_deadline=0.1)
    shared.gate.clear()  # frozen until the end of the test
    try:
        params = prefill(p)
        timeouts = PD_LOAD_FAILURES.value(reason="timeout")
        start = time.monotonic()
        (ext, _), _ = decode_ask(d[0], decode_request(params))
        assert ext == 0 and time.monotonic() - start < 2.0
        assert PD_LOAD_FAILURES.value(reason="timeout") == timeouts + 1
    finally:
        shared.gate.set()


def test_a_promise_for_another_prompt_or_deployment_is_a_plain_lookup():
    shared = SharedMemory()
    p, d, _ = engines(shared)
    params = prefill(p)
    # A mismatched promise is not waited on, so the records must already be in the shared tier
    # for the plain lookup to see them (the prefill writes them in the background).
    assert p[1].worker.store.flush(5)
    mismatches = PD_LOAD_FAILURES.value(reason="mismatch")
    other = TOKENS[:100] + [7] + TOKENS[101:]  # differs inside the promised prefix
    (ext, _), _ = decode_ask(d[0], decode_request(params, tokens=other, req_id="d3"))
    assert ext == 64  # the first chunk is shared: an ordinary hit
    foreign = {**params, "kvstore": {**params["kvstore"], "namespace": "0" * 16}}
    assert decode_ask(d[0], decode_request(foreign, req_id="d4"))[0] == (288, True)  # looked up: all there
    assert PD_LOAD_FAILURES.value(reason="mismatch") == mismatches + 2


def test_a_record_corrupted_between_prefill_and_decode_fails_the_load_and_is_counted():
    shared = SharedMemory()
    p, d, _ = engines(shared)
    params = prefill(p)
    assert p[1].worker.store.flush(5)
    keys = d[1].worker.transfer.keys(TOKENS[:288])
    flip_byte(shared, keys[2].key, offset=-5, mask=1)
    errors_before = PD_LOAD_FAILURES.value(reason="load_error")
    req = decode_request(params)
    assert decode_ask(d[0], req)[0] == (288, True)
    blocks = list(range(10, 20))
    assert decode_load(d, req, blocks, 288) == set(blocks[4:9])  # chunks 0-1 loaded, the rest recomputed
    assert PD_LOAD_FAILURES.value(reason="load_error") == errors_before + 1


def test_a_producer_promises_nothing_without_a_shared_tier_or_for_an_aborted_request():
    f = facts()
    store = TieredStore([MemoryStore()])
    sched = make_connector("scheduler", store, f)
    req = SimpleNamespace(request_id="x", prompt_token_ids=TOKENS, cache_salt=None,
                          kv_transfer_params={"do_remote_decode": True}, status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    none_before = PD_PROMISES.value(result="none")
    assert sched.request_finished(req, [])[1] is None
    shared = SharedMemory()
    p, _, _ = engines(shared)
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert p[0].request_finished(req, [])[1] is None
    assert PD_PROMISES.value(result="none") == none_before + 2


def test_http_port_serves_router_lookups_from_the_scheduler_process():
    import json
    import urllib.request

    from servers import free_port

    port = free_port()
    shared = SharedMemory()
    p, _, _ = engines(shared, http_port=port, http_ports=2)
    try:
        prefill(p)
        assert p[0].scheduler.http is not None and p[0].scheduler.http.port == port
        # The namespace named: engines of other tests in this process may still have theirs registered.
        body = {"tokens": TOKENS, "namespace": p[0].scheduler.caches[0].namespace.id}

        def answered() -> int:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/lookup", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())["tokens"]

        # The decode engine of this process registered the same namespace last, so its lookup
        # answers: over its store, which holds the prefill's records once the background write
        # reached the shared tier (within the promise's deadline).
        deadline = time.monotonic() + 10
        while answered() != 288 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert answered() == 288
    finally:
        p[0].scheduler.close()
    with pytest.raises(Exception, match="http_port"):
        from kvstore.connectors.vllm.options import parse_options

        parse_options({"store": "memory://", "http_port": 65535, "http_ports": 2})
