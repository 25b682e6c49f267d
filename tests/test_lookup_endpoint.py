"""The router lookup endpoint (``POST /v1/lookup``, ``GET /v1/namespaces``) over real stores.

Counts per tier against a memory tier over a real redis-server (each tier filled directly, so
either may hold the longer prefix), salts, TP shards, bad requests (400/404/411/413), no write
path (405, and the store's keys unchanged), and a SIGSTOPped redis-server: a lookup costs at
most the tier's deadline, and the next one nothing.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from servers import freeze, thaw

from kvstore.errors import ConfigError
from kvstore.keys import InputSpan, Namespace
from kvstore.lookup_service import PrefixLookup, register_prefix_lookup
from kvstore.metrics.catalog import LOOKUP_TOKENS, LOOKUPS, ROUTER_LOOKUPS
from kvstore.metrics.lookup import LookupRegistry, max_body_bytes
from kvstore.metrics.server import MAX_CONCURRENT_LOOKUPS, MetricsServer, start_metrics_server
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.stores import open_store
from kvstore.stores.base import Store
from kvstore.stores.memory import MemoryStore
from kvstore.stores.tiered import TieredStore

CHUNK = 32


def _ns(**kw: Any) -> Namespace:
    return Namespace(model=kw.pop("model", f"lookup-{uuid.uuid4().hex[:8]}"), kv_dtype="float16", layout="t",
                     block_size=16, chunk_tokens=CHUNK, layer_end=1, **kw)


def _fill(store: Store, ns: Namespace, tokens: list[int], salt: str = "") -> None:
    """Store every chunk of ``tokens`` in ``store`` (not through a tiered store: one tier alone)."""
    cache = PrefixCache(store, ns)
    keys = cache.keys(tokens, namespace=cache.namespace.with_salt(salt))
    cache.save(tokens, keys, lambda c: ChunkPayload(shapes=[(c.num_tokens, 4)],
                                                    kv=np.zeros((c.num_tokens, 4), np.float16)),
               namespace=cache.namespace.with_salt(salt), skip_stored=False)


class Client:
    def __init__(self, server: MetricsServer) -> None:
        self.host, self.port = server.host, server.port

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            raw = resp.read()
            ctype = resp.getheader("Content-Type", "")
            doc = json.loads(raw) if ctype.startswith("application/json") else raw
            return resp.status, dict(resp.getheaders()), doc
        finally:
            conn.close()

    def lookup(self, tokens: Any, **fields: Any) -> tuple[int, Any]:
        status, _, doc = self.request("POST", "/v1/lookup", json.dumps({"tokens": tokens, **fields}).encode(),
                                      {"Content-Type": "application/json"})
        return status, doc

    def namespaces(self) -> Any:
        status, _, doc = self.request("GET", "/v1/namespaces")
        assert status == 200
        return doc


@pytest.fixture
def registry() -> LookupRegistry:
    return LookupRegistry()


@pytest.fixture
def client(registry: LookupRegistry) -> Iterator[Client]:
    server = start_metrics_server(0, lookups=registry)
    yield Client(server)
    server.close()


def _tiers(doc: dict[str, Any]) -> dict[str, int | None]:
    return {t["name"]: t["tokens"] for t in doc["tiers"]}


# -- counts per tier ----------------------------------------------------------------------------------
def test_counts_per_tier_memory_over_redis(client, registry, redis_server):
    mem, red = MemoryStore(), open_store(redis_server.url)
    store = TieredStore([mem, red])
    ns = _ns()
    prompt = list(range(1000, 1000 + 5 * CHUNK + 7))  # five whole chunks and a partial one
    try:
        registry.register(PrefixLookup([PrefixCache(store, ns)]))
        before = (LOOKUPS.total(), LOOKUP_TOKENS.total())
        status, doc = client.lookup(prompt)
        assert status == 200, doc
        assert doc == {"namespace": ns.id, "chunk_tokens": CHUNK, "asked_tokens": len(prompt),
                       "tiers": [{"name": "memory", "tokens": 0}, {"name": "redis", "tokens": 0}], "tokens": 0}

        _fill(red, ns, prompt[:4 * CHUNK])  # redis: four chunks
        _fill(mem, ns, prompt[:2 * CHUNK])  # memory: two
        status, doc = client.lookup(prompt)
        assert status == 200 and _tiers(doc) == {"memory": 2 * CHUNK, "redis": 4 * CHUNK}
        assert doc["tokens"] == 4 * CHUNK  # a load takes the first two from memory, the rest from redis

        # Only the lower tier holds a prefix.
        other = list(range(5000, 5000 + 3 * CHUNK))
        _fill(red, ns, other)
        status, doc = client.lookup(other + [1, 2, 3])
        assert _tiers(doc) == {"memory": 0, "redis": 3 * CHUNK} and doc["tokens"] == 3 * CHUNK

        # Memory holds the whole prompt (partial chunk included): redis is not asked (null).
        _fill(mem, ns, prompt)
        status, doc = client.lookup(prompt)
        assert _tiers(doc) == {"memory": len(prompt), "redis": None} and doc["tokens"] == len(prompt)

        # A lookup of a prefix of the stored prompt, and an empty one.
        assert client.lookup(prompt[:CHUNK + 3])[1]["tokens"] == CHUNK  # its partial second chunk is not stored
        assert client.lookup(prompt[:2 * CHUNK])[1]["tokens"] == 2 * CHUNK
        status, doc = client.lookup([])
        assert status == 200 and doc["tokens"] == 0 and doc["asked_tokens"] == 0
        # Router lookups are not engine lookups: the engines' lookup counters did not move.
        assert (LOOKUPS.total(), LOOKUP_TOKENS.total()) == before
    finally:
        store.close()


def test_a_prompt_with_an_image_is_asked_with_its_inputs(client, registry):
    """The engine keys the chunks that overlap (or follow) an image by its identity: a router
    names the prompt's inputs as vLLM's MultiModalFeatureSpec has them."""
    store, ns = MemoryStore(), _ns()
    prompt = list(range(100, 100 + 4 * CHUNK))
    image = InputSpan(40, 30, "image-a", "image")  # chunk 1 and 2
    cache = PrefixCache(store, ns)
    cache.save(prompt, cache.keys(prompt, spans=[image]),
               lambda c: ChunkPayload(shapes=[(c.num_tokens, 4)], kv=np.zeros((c.num_tokens, 4), np.float16)),
               skip_stored=False)
    registry.register(PrefixLookup([cache]))
    named = {"offset": 40, "length": 30, "identity": "image-a", "modality": "image"}
    assert client.lookup(prompt, inputs=[named])[1]["tokens"] == 4 * CHUNK
    assert client.lookup(prompt, inputs=[{**named, "identity": "image-b"}])[1]["tokens"] == CHUNK
    assert client.lookup(prompt)[1]["tokens"] == CHUNK  # the text before the image only


def test_salt_limit_and_tp_shards(client, registry, redis_server):
    red = open_store(redis_server.url)
    fingerprint = uuid.uuid4().hex  # a fresh deployment on the shared server
    ranks = [_ns(model="lookup-tp", tp_rank=r, tp_size=2, model_fingerprint=fingerprint) for r in range(2)]
    prompt = list(range(7, 7 + 4 * CHUNK))
    _fill(red, ranks[0], prompt)
    _fill(red, ranks[1], prompt[:2 * CHUNK])  # rank 1 holds only two chunks: a load gets two
    _fill(red, ranks[0], prompt, salt="tenant-a")
    _fill(red, ranks[1], prompt, salt="tenant-a")
    try:
        # vLLM leaves the last token to compute: with that limit the fourth chunk is never asked.
        registry.register(PrefixLookup([PrefixCache(red, ns) for ns in ranks], limit=lambda n: n - 1))
        status, doc = client.lookup(prompt)
        assert status == 200 and doc["namespace"] == ranks[0].id and doc["asked_tokens"] == len(prompt) - 1
        assert _tiers(doc) == {"redis": 2 * CHUNK} and doc["tokens"] == 2 * CHUNK
        doc = client.lookup(prompt, cache_salt="tenant-a")[1]
        assert doc["tokens"] == 3 * CHUNK  # the partial fourth chunk (prompt minus one token) is not stored
        assert client.lookup(prompt + [9], cache_salt="tenant-a")[1]["tokens"] == 4 * CHUNK
        assert client.lookup(prompt, cache_salt="tenant-b")[1]["tokens"] == 0
        listed = client.namespaces()
        assert listed["namespaces"] == [{"namespace": ranks[0].id, "model": "lookup-tp", "chunk_tokens": CHUNK,
                                         "block_size": 16, "kv_dtype": "float16", "layout": "t", "tp_size": 2,
                                         "shards": 2, "tiers": ["redis"]}]
        assert listed["max_tokens"] >= 1 << 16
    finally:
        red.close()


def test_choosing_a_namespace(client, registry):
    store = MemoryStore()
    a, b = _ns(model="model-a"), _ns(model="model-b")
    _fill(store, a, list(range(CHUNK)))
    unregister_a = register_prefix_lookup([PrefixCache(store, a)], registry=registry)
    assert client.lookup(list(range(CHUNK)))[1]["tokens"] == CHUNK  # the only one: no name needed
    register_prefix_lookup([PrefixCache(store, b)], registry=registry)
    status, doc = client.lookup(list(range(CHUNK)))
    assert status == 400 and "2 namespaces" in doc["error"]
    assert client.lookup(list(range(CHUNK)), namespace=a.id.upper())[1]["tokens"] == CHUNK
    assert client.lookup(list(range(CHUNK)), namespace=b.id)[1]["tokens"] == 0
    assert client.lookup(list(range(CHUNK)), model="model-a")[1]["namespace"] == a.id
    status, doc = client.lookup([1], namespace="0123456789abcdef")
    assert status == 404 and "0123456789abcdef" in doc["error"] and a.id in doc["error"]
    status, doc = client.lookup([1], model="nope")
    assert status == 404 and "'nope'" in doc["error"]
    unregister_a()
    assert [n["namespace"] for n in client.namespaces()["namespaces"]] == [b.id]
    assert client.lookup([1], namespace=a.id)[0] == 404


# -- who registers ----------------------------------------------------------------------------------
def test_the_reference_warm_engine_answers_while_open():
    from kvstore.warm.reference import ReferenceWarmEngine

    server = start_metrics_server(0)  # the process's registry, as `kvstore warm --metrics-port` serves it
    client = Client(server)
    engine = ReferenceWarmEngine("memory://", chunk_tokens=16)
    ns = engine.transfer.cache.namespace.id
    prompt = list(range(3, 3 + 40))
    try:
        assert client.lookup(prompt, namespace=ns)[1]["tokens"] == 0
        engine.prefill(prompt)
        engine.flush()
        status, doc = client.lookup(prompt, namespace=ns)
        assert status == 200 and doc["tokens"] == engine.keys(prompt)[-1].end > 0
        assert ns in [n["namespace"] for n in client.namespaces()["namespaces"]]
    finally:
        engine.close()
        assert client.lookup(prompt, namespace=ns)[0] == 404  # closed: unregistered
        server.close()


def test_the_vllm_scheduler_answers_for_its_namespace_while_open():
    """A TP=2 scheduler side registers every rank's shard with the process's metrics server."""
    pytest.importorskip("vllm")
    from kvstore.connectors.vllm.facts import EngineFacts, model_fingerprint
    from kvstore.connectors.vllm.options import parse_options
    from kvstore.connectors.vllm.plan import lookup_limit
    from kvstore.connectors.vllm.scheduler import SchedulerSide

    hf = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "_name_or_path": uuid.uuid4().hex}
    facts = EngineFacts(model="tiny", fingerprint=model_fingerprint(hf, dtype="bfloat16", revision=uuid.uuid4().hex,
                                                                    quantization=None),
                        kv_dtype="bfloat16", block_size=16, num_layers=4, device_type="cpu", isa="vec",
                        backend="CPU_ATTN", kv_cache_layout="LBHNC", tp_size=2)
    store = MemoryStore()
    side = SchedulerSide(store, facts, parse_options({"store": "memory://", "chunk_tokens": 32}), loads=True,
                         saves=True, block_ids=lambda _: ([],))
    server = start_metrics_server(0)  # the process's lookups (other tests' schedulers may be there too)
    client = Client(server)
    namespace = side.caches[0].namespace.id
    try:
        shards = [c for i in side._full for c in side.group_caches[i]]  # what a hit needs: every rank's shard
        assert len(shards) == 2
        prompt = list(range(100, 100 + 3 * 32 + 5))
        for rank, cache in enumerate(shards):
            _fill(store, cache.namespace, prompt[:(3 - rank) * 32])  # rank 1 holds one chunk less
        status, doc = client.lookup(prompt, namespace=namespace)
        assert status == 200 and doc["namespace"] == namespace
        assert doc["asked_tokens"] == lookup_limit(len(prompt), 16) and doc["tokens"] == 2 * 32
        side.close()
        assert client.lookup(prompt, namespace=namespace)[0] == 404
    finally:
        side.close()
        server.close()


# -- bad requests -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "status", "says"), [
    (b"{not json", 400, "not JSON"),
    (b"\xff\xfe", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"tokens": "1 2 3"}', 400, "list of token ids"),
    (b'{"token": [1]}', 400, "unknown field(s) 'token'"),
    (b'{"tokens": [1, -1]}', 400, "tokens[1]=-1"),
    (b'{"tokens": [4294967296]}', 400, "tokens[0]=4294967296"),
    (b'{"tokens": [4294967295, true]}', 400, "tokens[1]=true"),
    (b'{"tokens": [1.5]}', 400, "tokens[0]=1.5"),
    (b'{"tokens": [[1]]}', 400, "tokens[0]=[1]"),
    (b'{"tokens": [1], "namespace": "xyz"}', 400, "not a namespace id"),
    (b'{"tokens": [1], "cache_salt": 5}', 400, "cache_salt"),
    (b'{"tokens": [1], "model": 5}', 400, "model"),
    (b'{"tokens": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "nested"),
    (b'{"tokens": [1], "inputs": {}}', 400, "\"inputs\" must be a list"),
    (b'{"tokens": [1], "inputs": [{"offset": 0, "length": 4}]}', 400, "inputs[0].identity"),
    (b'{"tokens": [1], "inputs": [{"offset": -1, "length": 4, "identity": "a"}]}', 400, "inputs[0] needs"),
    (b'{"tokens": [1], "inputs": [{"offset": 0, "length": 0, "identity": "a"}]}', 400, "inputs[0] needs"),
    (b'{"tokens": [1], "inputs": [{"offset": 0, "length": 1, "identity": "a", "hash": 1}]}', 400, "inputs[0] must"),
    (b'{"tokens": [1], "inputs": [{"offset": 0, "length": 1, "identity": "a", "modality": 3}]}', 400, "modality"),
])
def test_bad_requests_are_one_line_400s(client, registry, body, status, says):
    registry.register(PrefixLookup([PrefixCache(MemoryStore(), _ns())]))
    counted = ROUTER_LOOKUPS.value(status=str(status))
    got, headers, doc = client.request("POST", "/v1/lookup", body)
    assert got == status and headers["Content-Type"] == "application/json", doc
    assert says in doc["error"] and "\n" not in doc["error"]
    assert ROUTER_LOOKUPS.value(status=str(status)) == counted + 1


def test_bounds_on_size(registry):
    server = start_metrics_server(0, lookups=registry, lookup_max_tokens=100)
    client = Client(server)
    try:
        registry.register(PrefixLookup([PrefixCache(MemoryStore(), _ns())]))
        assert client.lookup(list(range(100)))[0] == 200
        status, doc = client.lookup(list(range(101)))
        assert status == 400 and "101 tokens" in doc["error"] and "(100)" in doc["error"]
        # A body over the bound is refused unread (413), with the connection closed.
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.putrequest("POST", "/v1/lookup")
        conn.putheader("Content-Length", str(max_body_bytes(100) + 1))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and resp.getheader("Connection") == "close"
        assert "over the" in json.loads(resp.read())["error"]
        conn.close()
        # No length: 411.
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.putrequest("POST", "/v1/lookup")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]
        conn.close()
    finally:
        server.close()
    with pytest.raises(ConfigError, match=r"lookup_max_tokens=0 is not in 1\.\."):
        start_metrics_server(0, lookups=registry, lookup_max_tokens=0)


def test_what_http_server_answers_itself_is_json_too(client):
    """A request http.server refuses never reaches a handler (here a header over its 64 KiB):
    it answers itself, in the JSON of every other error."""
    import socket

    with socket.create_connection((client.host, client.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n")
        head, _, body = sock.makefile("rb").read().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 431 ") and b"Content-Type: application/json" in head, head
    assert json.loads(body) == {"error": "Line too long"}


# -- no write path ------------------------------------------------------------------------------------
def test_read_only(client, registry, redis_server):
    red = open_store(redis_server.url)
    ns = _ns()
    prompt = list(range(3 * CHUNK))
    _fill(red, ns, prompt[:CHUNK])
    registry.register(PrefixLookup([PrefixCache(red, ns)]))
    stored = sorted(red.iter_keys(ns.key_prefix))
    try:
        for method in ("PUT", "DELETE", "PATCH"):
            for path in ("/v1/lookup", "/v1/namespaces", "/metrics"):
                status, headers, doc = client.request(method, path, json.dumps({"tokens": prompt}).encode())
                assert status == 405 and "read-only" in doc["error"], (method, path)
                assert "PUT" not in headers["Allow"] and "DELETE" not in headers["Allow"]
        assert client.request("GET", "/v1/lookup")[0] == 405
        for method in ("OPTIONS", "TRACE", "BREW"):  # no handler: http.server's 501, in our JSON
            status, headers, doc = client.request(method, "/v1/lookup")
            assert status == 501 and headers["Content-Type"] == "application/json", (method, doc)
            assert doc == {"error": f"{method} is not a method this server answers (GET, HEAD, POST); "
                                    "the endpoint is read-only"}
        assert client.request("POST", "/metrics", b"{}")[0] == 405
        assert client.request("POST", "/v1/nope", b"{}")[0] == 404
        for _ in range(3):
            assert client.lookup(prompt)[1]["tokens"] == CHUNK
        assert sorted(red.iter_keys(ns.key_prefix)) == stored  # lookups wrote nothing
    finally:
        red.close()


def test_lookups_off(registry):
    server = start_metrics_server(0, lookups=None)
    client = Client(server)
    try:
        assert client.request("POST", "/v1/lookup", b'{"tokens": []}')[0] == 404
        assert client.request("GET", "/v1/namespaces")[0] == 404
        assert client.request("GET", "/metrics")[0] == 200
    finally:
        server.close()


# -- a provider that fails or is slow -----------------------------------------------------------------
class _Stub:
    namespace_id = "00000000000000aa"

    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.gate, self.fail = gate, fail
        self.entered = 0
        self._lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return {"model": "stub"}

    def lookup(self, tokens: Any, cache_salt: str, inputs: Any = ()) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("boom")
        with self._lock:
            self.entered += 1
        if self.gate is not None:
            self.gate.wait(30)
        return {"tokens": 0}


def test_a_failing_provider_is_a_500(client, registry):
    registry.register(_Stub(fail=True))
    status, doc = client.lookup([1])
    assert status == 500 and doc == {"error": "lookup failed: RuntimeError: boom"}


def test_lookups_in_flight_are_bounded(client, registry):
    gate = threading.Event()
    stub = _Stub(gate)
    registry.register(stub)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(client.lookup([1])[0]))
               for _ in range(MAX_CONCURRENT_LOOKUPS)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while stub.entered < MAX_CONCURRENT_LOOKUPS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stub.entered == MAX_CONCURRENT_LOOKUPS
        status, headers, doc = client.request("POST", "/v1/lookup", b'{"tokens": [1]}')
        assert status == 503 and headers["Retry-After"] == "1" and "in flight" in doc["error"]
        assert client.request("GET", "/metrics")[0] == 200  # scrapes are not held up
    finally:
        gate.set()
        for t in threads:
            t.join(30)
    assert results == [200] * MAX_CONCURRENT_LOOKUPS
    assert client.lookup([1])[0] == 200  # the slots are free again


# -- a frozen tier ------------------------------------------------------------------------------------
def test_a_frozen_redis_costs_one_deadline(client, registry, redis_server_factory):
    server = redis_server_factory()
    pid = server._proc.proc.pid
    mem = MemoryStore()
    red = open_store(server.url + "?timeout=200ms&connect_timeout=200ms")
    store = TieredStore([mem, red], breaker_failures=3, breaker_cooldown="30s")
    alone = open_store(server.url + "?timeout=200ms&connect_timeout=200ms")  # not tiered: fails as a whole
    ns, solo = _ns(), _ns()
    prompt = list(range(4 * CHUNK))
    _fill(mem, ns, prompt[:CHUNK])
    _fill(red, ns, prompt)
    _fill(alone, solo, prompt)
    registry.register(PrefixLookup([PrefixCache(store, ns)]))
    registry.register(PrefixLookup([PrefixCache(alone, solo)]))
    bound = store.deadline
    assert bound is not None and bound <= 0.5
    try:
        assert _tiers(client.lookup(prompt, namespace=ns.id)[1]) == {"memory": CHUNK, "redis": 4 * CHUNK}
        freeze(pid)
        timings = []
        for _ in range(3):
            start = time.monotonic()
            status, doc = client.lookup(prompt, namespace=ns.id)
            timings.append(time.monotonic() - start)
            # The frozen tier is a miss; the memory tier still answers.
            assert status == 200 and _tiers(doc) == {"memory": CHUNK, "redis": 0} and doc["tokens"] == CHUNK
        # The first lookup pays at most the tier's deadline (plus a shared machine's slack); the
        # breaker then skips the tier: later lookups do not wait for it.
        assert 0.15 < timings[0] < bound + 1.0, timings  # it did ask the frozen server, and gave up in time
        assert max(timings[1:]) < 0.15, timings
        assert store.tiers[1].breaker.state != "closed"
        start = time.monotonic()
        status, doc = client.lookup(prompt, namespace=solo.id)
        assert time.monotonic() - start < alone.deadline + 1.0
        assert status == 200 and doc["tokens"] == 0 and _tiers(doc) == {"redis": 0}
    finally:
        thaw(pid)
        store.close()
        alone.close()
