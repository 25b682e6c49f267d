"""KV events for routers (kvstore.events), read with vLLM's own decoder classes.

Subscribers decode with ``vllm.distributed.kv_events.KVEventBatch`` (msgspec): vLLM 0.32 in
this process, vLLM 0.33 in a subprocess of its own venv (``$VLLM033_VENV``, default ``.venv-vllm033`` in the checkout, skipped where
absent). vLLM up to 0.23 encoded events positionally (``array_like``); no installed vLLM does,
so that form is read with vLLM's own field list in an ``array_like`` struct (``_legacy_decoder``).
Removals come from real evictions: a file store's LRU, a memory store's LRU and a
``redis-server`` with ``maxmemory`` and keyspace notifications.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from kvstore.errors import ConfigError
from kvstore.events import END_SEQ, EventsConfig, KVEventPublisher, encode_batch, medium_of, mediums
from kvstore.events.publisher import _binds, _offset_port
from kvstore.events.redis_watch import RedisRemovalWatcher, watch_store
from kvstore.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, block_digests, block_hash
from kvstore.keys import Namespace, chunk_keys, prefix_keys
from kvstore.metrics.catalog import KV_EVENT_DROPS, KV_EVENTS
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.stores import open_store
from kvstore.stores.file import FileConfig, FileStore
from kvstore.stores.memory import MemoryConfig, MemoryStore
from kvstore.stores.redis import RedisStore
from kvstore.stores.tiered import TieredStore

NS = Namespace(model="events-test", kv_dtype="float16", layout="test", block_size=16, chunk_tokens=32)
VLLM033 = Path(os.environ.get("VLLM033_VENV", Path(__file__).resolve().parents[1] / ".venv-vllm033")) / "bin" / "python"


def vllm_batch_decoder() -> Any:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    return msgspec.msgpack.Decoder(kv_events.KVEventBatch)


def _legacy_decoder() -> Any:
    """A decoder of vLLM <= 0.23's positional events: vLLM's own field declarations (this vLLM's
    classes, in their order) in structs with ``array_like=True`` as those versions declared."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")

    Event = msgspec.defstruct("Event", [], array_like=True, omit_defaults=True, tag=True)

    def legacy(cls: type, base: type) -> type:
        fields = [(f.name, f.type) if f.default is msgspec.NODEFAULT else (f.name, f.type, f.default)
                  for f in msgspec.structs.fields(cls)]
        return msgspec.defstruct(cls.__name__, fields, bases=(base,), tag=True, array_like=True, omit_defaults=True)

    stored = legacy(kv_events.BlockStored, Event)
    removed = legacy(kv_events.BlockRemoved, Event)
    cleared = legacy(kv_events.AllBlocksCleared, Event)

    batch = msgspec.defstruct("Batch", [("ts", float), ("events", list[stored | removed | cleared]),  # type: ignore[valid-type]
                                        ("data_parallel_rank", int | None, None)], array_like=True, omit_defaults=True)
    return msgspec.msgpack.Decoder(batch)


def _payload(chunk) -> ChunkPayload:
    return ChunkPayload(shapes=[(chunk.num_tokens, 2)], kv=bytes(chunk.num_tokens * 2 * 2))


def _config(tmp_path: Path, **options: Any) -> EventsConfig:
    return EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock", replay_endpoint=f"ipc://{tmp_path}/replay.sock",
                        **options)


class Subscriber:
    """A SUB socket on a publisher, past ZMQ's slow-joiner window (probes until one arrives)."""

    def __init__(self, publisher: KVEventPublisher, decoder: Any = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(publisher.endpoint)
        self.decoder = decoder or vllm_batch_decoder()
        self.seqs: list[int] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # PUB drops what it sends before the SUB has joined
            publisher.cleared()
            if self.sock.poll(100):
                self.drain()
                return
        raise TimeoutError("the subscriber never joined")

    def drain(self, wait: float = 0.0) -> list[Any]:
        """Every event received (waiting at most ``wait`` for the first), probes left out."""
        events: list[Any] = []
        while self.sock.poll(int(wait * 1000) if not events else 50):
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = self.decoder.decode(payload)
            events += [e for e in batch.events if type(e).__name__ != "AllBlocksCleared"]
        return events

    def until(self, check, timeout: float = 10.0) -> list[Any]:
        """Events until ``check(events)`` holds (``TimeoutError`` after ``timeout``)."""
        events: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events += self.drain(wait=0.2)
            if check(events):
                return events
        raise TimeoutError(f"events seen: {events}")

    def close(self) -> None:
        self.sock.close(linger=0)


# -- wire ---------------------------------------------------------------------------------------
def _sample_events() -> list[Any]:
    return [BlockStored([block_hash(b"\x01" * 16, "int"), 7], None, [1, 2, 3, 4], 2, "REDIS"),
            BlockStored([b"\x02" * 16], b"\x01" * 16, [5, 6], 2, "CPU", extra_keys=[("tenant",)]),
            BlockRemoved([7], "DISK"), AllBlocksCleared()]


def test_map_form_is_vllms_own():
    batch = vllm_batch_decoder().decode(encode_batch(12.5, _sample_events(), 3, encoding="map"))
    assert (batch.ts, batch.data_parallel_rank) == (12.5, 3)
    s0, s1, r, c = batch.events
    assert type(s0).__name__ == "BlockStored" and s0.block_hashes == [int.from_bytes(b"\x01" * 8, "big"), 7]
    assert (s0.parent_block_hash, s0.token_ids, s0.block_size, s0.medium, s0.lora_id) == (None, [1, 2, 3, 4], 2, "REDIS", None)
    assert s1.block_hashes == [b"\x02" * 16] and s1.parent_block_hash == b"\x01" * 16
    assert s1.extra_keys == [("tenant",)]
    assert (type(r).__name__, r.block_hashes, r.medium) == ("BlockRemoved", [7], "DISK")
    assert type(c).__name__ == "AllBlocksCleared"
    # vLLM's own encoder writes the same bytes (the field order and omitted defaults match)
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    theirs = kv_events.KVEventBatch(ts=1.0, events=[kv_events.BlockStored(
        block_hashes=[5], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None, medium="CPU",
        lora_name=None), kv_events.BlockRemoved(block_hashes=[5], medium="CPU"), kv_events.AllBlocksCleared()],
        data_parallel_rank=0)
    ours = encode_batch(1.0, [BlockStored([5], None, [1, 2], 2, "CPU"), BlockRemoved([5], "CPU"), AllBlocksCleared()],
                        0, encoding="map")
    assert vllm_batch_decoder().decode(ours) == theirs
    # the same fields in the same order, left out alike: only integer widths may differ
    assert msgpack.unpackb(ours) == msgpack.unpackb(msgspec.msgpack.encode(theirs))


def test_array_form_is_the_positional_one():
    batch = _legacy_decoder().decode(encode_batch(2.0, _sample_events(), 0, encoding="array"))
    s0, s1, r, c = batch.events
    assert (s0.block_hashes, s0.token_ids, s0.block_size, s0.medium) == (
        [int.from_bytes(b"\x01" * 8, "big"), 7], [1, 2, 3, 4], 2, "REDIS")
    assert s1.extra_keys is None  # the positional form stops after lora_name
    assert (r.block_hashes, r.medium) == ([7], "DISK") and type(c).__name__ == "AllBlocksCleared"
    with pytest.raises(msgspec.ValidationError):  # the two forms are not interchangeable: the option matters
        vllm_batch_decoder().decode(encode_batch(2.0, _sample_events(), 0, encoding="array"))


@pytest.mark.skipif(not VLLM033.exists(), reason=f"no vLLM 0.33 venv at {VLLM033.parent.parent} (scripts/vllm033_check builds it)")
def test_map_form_decodes_with_vllm_033(tmp_path):
    path = tmp_path / "batch.bin"
    path.write_bytes(encode_batch(3.0, _sample_events(), 1, encoding="map"))
    script = (
        "import json, sys, msgspec, vllm\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "b = msgspec.msgpack.Decoder(KVEventBatch).decode(open(sys.argv[1], 'rb').read())\n"
        "print(json.dumps({'version': vllm.__version__, 'rank': b.data_parallel_rank, 'events': "
        "[[type(e).__name__, getattr(e, 'medium', None), getattr(e, 'token_ids', None), "
        "getattr(e, 'lookahead_token_ids', 'absent')] for e in b.events]}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run([str(VLLM033), "-c", script, str(path)], capture_output=True, text=True, timeout=240,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"].startswith("0.33") and got["rank"] == 1
    assert got["events"] == [["BlockStored", "REDIS", [1, 2, 3, 4], None], ["BlockStored", "CPU", [5, 6], None],
                             ["BlockRemoved", "DISK", None, "absent"], ["AllBlocksCleared", None, None, "absent"]]


# -- options ------------------------------------------------------------------------------------
def test_options_are_checked():
    with pytest.raises(ConfigError, match=r"buffer_steps=0.*accepted: 1 to 1000000"):
        EventsConfig(buffer_steps=0)
    with pytest.raises(ConfigError, match=r"encoding=.json.*map, array"):
        EventsConfig.from_options({"encoding": "json"})
    with pytest.raises(ConfigError, match="endpoint='http://x'"):
        EventsConfig(endpoint="http://x")
    with pytest.raises(ConfigError, match="data_parallel_rank=-1"):
        EventsConfig(data_parallel_rank=-1)
    assert EventsConfig.from_options({"hash_format": "bytes", "buffer_steps": "5"}).buffer_steps == 5


def test_endpoints_follow_vllms_rules():
    assert _offset_port("tcp://*:5557", 2) == "tcp://*:5559" and _offset_port("tcp://*:0", 3) == "tcp://*:0"
    assert _offset_port("inproc://ev", 1) == "inproc://ev_dp1" and _offset_port("tcp://h:5557", 0) == "tcp://h:5557"
    assert _binds("tcp://*:5557") and _binds("ipc:///tmp/x") and not _binds("tcp://10.0.0.1:5557")


def test_a_busy_address_fails_at_start():
    with KVEventPublisher(EventsConfig(endpoint="tcp://*:0")) as first:
        port = first.endpoint.rsplit(":", 1)[1]
        with pytest.raises(ConfigError, match=f"cannot bind KV-event socket 'tcp://\\*:{port}'"):
            KVEventPublisher(EventsConfig(endpoint=f"tcp://*:{port}"))


def test_mediums_name_the_tiers(tmp_path):
    memory, files = MemoryStore(), FileStore(FileConfig(path=str(tmp_path / "f")))
    assert (medium_of(memory), medium_of(files)) == ("CPU", "DISK")
    with TieredStore([MemoryStore(), FileStore(FileConfig(path=str(tmp_path / "g")))]) as tiered:
        assert mediums(tiered) == ["CPU", "DISK"]


# -- stored ---------------------------------------------------------------------------------------
def test_a_save_is_announced_with_tokens_and_parents(tmp_path):
    tokens = np.arange(1000, 1000 + 100, dtype=np.uint32)  # 3 full chunks of 32 and a partial one
    store = MemoryStore()
    cache = PrefixCache(store, NS)
    keys = cache.keys(tokens)
    with KVEventPublisher(_config(tmp_path)) as pub:
        sub = Subscriber(pub)
        published = KV_EVENTS.value(event="BlockStored")
        cache.announce(pub, mediums(store))  # each save announces the chunks it wrote
        assert cache.save(tokens, keys[:2], _payload) == 2
        assert cache.save(tokens, keys, _payload) == 2  # chunk 2 and the partial one (not announced)
        events = sub.until(lambda ev: len(ev) >= 2)
        assert KV_EVENTS.value(event="BlockStored") == published + 2  # counted for the dashboard
        cache.announce(None)
        assert cache.save(tokens[:96], cache.keys(tokens[:96]), _payload, skip_stored=False) == 3
        assert sub.drain(wait=0.3) == []  # no longer announced
        sub.close()
    first, second = events
    assert first.block_hashes == [block_hash(k.digest, "int") for k in keys[:2]]
    assert (first.parent_block_hash, first.block_size, first.medium) == (None, 32, "CPU")
    assert first.token_ids == tokens[:64].tolist()
    assert second.block_hashes == [block_hash(keys[2].digest, "int")]
    assert second.parent_block_hash == first.block_hashes[-1] and second.token_ids == tokens[64:96].tolist()


def test_a_sink_that_fails_never_fails_a_save(caplog):
    class Broken:
        def stored(self, *args: Any, **kwargs: Any) -> int:
            raise RuntimeError("sink down")

    store = MemoryStore()
    cache = PrefixCache(store, NS)
    cache.announce(Broken(), ["CPU"])
    tokens = list(range(64))
    assert cache.save(tokens, cache.keys(tokens), _payload) == 2 and len(list(store.iter_keys())) == 2
    assert "announcing a save" in caplog.text


def test_a_prompt_with_an_image_is_announced_up_to_the_image(tmp_path):
    from kvstore.keys import InputSpan

    tokens = list(range(128))
    image = InputSpan(70, 20, "image-a", "image")
    store = MemoryStore()
    cache = PrefixCache(store, NS)
    with KVEventPublisher(_config(tmp_path)) as pub:
        sub = Subscriber(pub)
        cache.announce(pub, ["CPU"])
        keys = cache.keys(tokens, spans=[image])
        assert cache.save(tokens, keys, _payload, spans=[image]) == 4
        (event,) = sub.until(lambda ev: len(ev) >= 1)
        sub.close()
    assert event.block_hashes == [block_hash(k.digest, "int") for k in keys[:2]]  # chunks 0-1 end by 64 <= 70


def test_announcements_stop_before_a_non_text_input_and_carry_the_salt(tmp_path):
    tokens = list(range(128))
    keys = chunk_keys(NS.with_salt("tenant-a"), tokens)
    with KVEventPublisher(_config(tmp_path, hash_format="bytes")) as pub:
        sub = Subscriber(pub)
        assert pub.stored(keys, tokens, "REDIS", until=70, cache_salt="tenant-a") == 2
        (event,) = sub.until(lambda ev: len(ev) >= 1)
        sub.close()
    assert event.block_hashes == [k.digest for k in keys[:2]] and event.extra_keys == [("tenant-a",), None]
    with pytest.raises(ValueError, match="lack chunk 0"):
        pub.stored(keys[1:], tokens, "REDIS")


def test_prefix_keys_with_partial_chunks_between(tmp_path):
    tokens = list(range(100))
    keys = prefix_keys(NS, tokens, [10, 40, 64, 90])  # P(0:10) F(0:32) P(32:40) F(32:64) P(64:90)
    assert [k.partial for k in keys] == [True, False, True, False, True]
    with KVEventPublisher(_config(tmp_path)) as pub:
        sub = Subscriber(pub)
        assert pub.stored(keys, tokens, "CPU", first=2) == 1  # F(32:64), its parent F(0:32)
        (event,) = sub.until(lambda ev: len(ev) >= 1)
        sub.close()
    assert event.parent_block_hash == block_hash(keys[1].digest, "int")
    assert event.block_hashes == [block_hash(keys[3].digest, "int")] and event.token_ids == tokens[32:64]


def test_chunks_as_engine_blocks(tmp_path):
    """blocks_per_chunk=2: each 32-token chunk is two 16-token blocks (the engine's block_size),
    the last named by the chunk's digest; a removal names both."""
    tokens = list(range(64))
    keys = chunk_keys(NS, tokens)
    store = MemoryStore(MemoryConfig(max_bytes=3_000))
    with KVEventPublisher(_config(tmp_path, blocks_per_chunk=2)) as pub:
        pub.watch(store)
        sub = Subscriber(pub)
        assert pub.stored(keys, tokens, "CPU") == 4
        (event,) = sub.until(lambda ev: len(ev) >= 1)
        store.put(keys[0].key, bytes(2_000))
        store.put(keys[1].key, bytes(2_000))  # evicts chunk 0
        (removed,) = sub.until(lambda ev: len(ev) >= 1)
        sub.close()
    names = [block_hash(b, "int") for k in keys for b in block_digests(k.digest, 2)]
    assert event.block_size == 16 and event.block_hashes == names and event.token_ids == tokens
    assert names[1] == block_hash(keys[0].digest, "int") and names[3] == block_hash(keys[1].digest, "int")
    assert removed.block_hashes == names[:2]
    with pytest.raises(ConfigError, match="blocks_per_chunk=0"):
        EventsConfig(blocks_per_chunk=0)
    with KVEventPublisher(_config(tmp_path, blocks_per_chunk=3)) as pub, \
            pytest.raises(ValueError, match="do not split into blocks_per_chunk=3"):
        pub.stored(keys, tokens, "CPU")


def test_the_array_form_on_the_wire(tmp_path):
    tokens = list(range(64))
    keys = chunk_keys(NS, tokens)
    with KVEventPublisher(_config(tmp_path, encoding="array")) as pub:
        sub = Subscriber(pub, _legacy_decoder())
        pub.stored(keys, tokens, "CPU_SHARED")
        (event,) = sub.until(lambda ev: len(ev) >= 1)
        sub.close()
    assert event.block_hashes == [block_hash(k.digest, "int") for k in keys] and event.medium == "CPU_SHARED"


# -- removals -------------------------------------------------------------------------------------
def _record_keys(n: int, salt: str) -> list[str]:
    return [k.key for k in chunk_keys(NS.with_salt(salt), list(range(32 * n)))]


def _hashes(events: list[Any]) -> list[Any]:
    """The block hashes of ``events`` in order (adjacent removals share one event)."""
    return [h for e in events for h in e.block_hashes]


def test_file_store_lru_is_announced(tmp_path):
    store = FileStore(FileConfig(path=str(tmp_path / "files"), max_bytes=40_000, low_water=0.5))
    keys = _record_keys(12, "file")
    with KVEventPublisher(_config(tmp_path)) as pub:
        pub.watch(store)
        sub = Subscriber(pub)
        for key in keys:
            store.put(key, bytes(5_000))
        events = sub.until(lambda ev: any(e.medium == "DISK" for e in ev))
        sub.close()
    removed = {h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}
    gone = {block_hash(bytes.fromhex(k.rsplit("/", 1)[1]), "int") for k in keys if not store.exists(k)}
    assert removed and removed == gone
    assert all(e.medium == "DISK" for e in events)


def test_shm_store_lru_is_announced(tmp_path):
    name = f"test-events-{uuid.uuid4().hex[:12]}"
    keys = _record_keys(10, "shm")
    try:
        with open_store(f"shm://{name}?max_bytes=4MiB&low_water=0.5") as store, \
                KVEventPublisher(_config(tmp_path)) as pub:
            assert medium_of(store) == "CPU_SHARED"
            pub.watch(store)
            sub = Subscriber(pub)
            for key in keys:
                store.put(key, bytes(1 << 20))
            events = sub.until(lambda ev: len(_hashes(ev)) >= 1)
            sub.close()
            gone = {block_hash(bytes.fromhex(k[-32:]), "int") for k in keys if not store.exists(k)}
        assert set(_hashes(events)) <= gone and {e.medium for e in events} == {"CPU_SHARED"}
    finally:
        shutil.rmtree(f"/dev/shm/kvstore-{name}", ignore_errors=True)


def test_memory_store_lru_is_announced_and_unwatch_stops_it(tmp_path):
    store = MemoryStore(MemoryConfig(max_bytes=10_000))
    keys = _record_keys(4, "memory")
    with KVEventPublisher(_config(tmp_path)) as pub:
        stop = pub.watch(store)
        sub = Subscriber(pub)
        for key in keys:
            store.put(key, bytes(4_000))
        events = sub.until(lambda ev: len(_hashes(ev)) >= 2)
        assert _hashes(events) == [block_hash(bytes.fromhex(k[-32:]), "int") for k in keys[:2]]
        assert {e.medium for e in events} == {"CPU"}
        stop()
        store.put(_record_keys(5, "memory")[-1], bytes(4_000))
        assert sub.drain(wait=0.3) == []
        sub.close()
    assert pub.stats()["blocks_removed"] == 2


def test_redis_evictions_and_expiries_are_announced(tmp_path, redis_server_factory):
    server = redis_server_factory("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru",
                                  "--notify-keyspace-events", "Exe")
    store = RedisStore.from_url(f"{server.url}?prefix=app/")
    keys = _record_keys(40, "redis")
    try:
        with KVEventPublisher(_config(tmp_path)) as pub:
            pub.watch(store, redis=True)
            sub = Subscriber(pub)
            assert pub.redis_watchers and all(w.subscribed.wait(10) for w in pub.redis_watchers)
            for key in keys:
                store.put(key, bytes(200_000))  # 8 MB into 4 MB: Redis evicts
            events = sub.until(lambda ev: len(_hashes(ev)) >= 5)
            with server.client() as c:
                assert c.config_get("notify-keyspace-events")
            evicted = {h for e in events for h in e.block_hashes}
            gone = {block_hash(bytes.fromhex(k[-32:]), "int") for k in keys if not store.exists(k)}
            assert evicted and evicted <= gone and {e.medium for e in events} == {"REDIS"}
            with server.client() as c:  # an expiry, as ?ttl= makes them
                c.set("app/" + _record_keys(41, "redis")[-1], b"x", px=50)
            expired = block_hash(bytes.fromhex(_record_keys(41, "redis")[-1][-32:]), "int")
            sub.until(lambda ev: any(expired in e.block_hashes for e in ev))
            sub.close()
    finally:
        store.close()


def test_the_watcher_names_missing_notification_flags(redis_server, caplog):
    class Sink:
        def removed(self, keys, medium):
            return 0

    watcher = RedisRemovalWatcher.from_url(redis_server.url, Sink())
    try:
        assert watcher.subscribed.wait(10)
        assert set(watcher.missing_flags) == set("Exe")
    finally:
        watcher.close()
    assert "notify-keyspace-events" in caplog.text


# -- replay ---------------------------------------------------------------------------------------
def replayed(sock: Any, start: int, topic: bytes = b"kvstore") -> list[tuple[int, Any]]:
    """A replay asked on the DEALER ``sock`` from sequence ``start``: ``(seq, batch)`` decoded by
    vLLM's own classes, up to the end marker (vLLM's framing checked on every message)."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        assert sock.poll(10_000), "no replay answer"
        empty, got_topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            assert (empty, got_topic, payload) == (b"", b"", b"")
            return got
        assert (empty, got_topic) == (b"", topic)
        got.append((int.from_bytes(seq, "big"), vllm_batch_decoder().decode(payload)))


def test_missed_batches_are_replayed(tmp_path):
    tokens = list(range(32 * 5))
    keys = chunk_keys(NS, tokens)
    with KVEventPublisher(_config(tmp_path, buffer_steps=4)) as pub:
        for i in range(5):  # five batches nobody hears: one call each, each sent before the next
            pub.stored(keys[:i + 1], tokens, "REDIS", first=i)
            deadline = time.monotonic() + 10
            while pub.stats()["batches"] < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        replay = zmq.Context.instance().socket(zmq.DEALER)
        replay.connect(pub.replay_endpoint)
        got = replayed(replay, 2)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])  # older than the buffer: what is kept
        oldest = replay.recv_multipart()[2]
        replay.close(linger=0)
    assert [seq for seq, _ in got] == [2, 3, 4]
    assert [b.events[0].block_hashes for _, b in got] == [[block_hash(keys[i].digest, "int")] for i in (2, 3, 4)]
    assert int.from_bytes(oldest, "big") == 1  # buffer_steps=4 keeps batches 1..4


def test_the_vllm_connector_announces_its_saves_in_engine_blocks(tmp_path):
    """kv_events_endpoint: TP rank 0's worker publishes what it saves, each chunk of 64 tokens as
    two of the engine's 32-token blocks, and closes the publisher with the worker."""
    pytest.importorskip("vllm")
    from test_vllm_unit import BS, SYNC, alloc, ask, facts, fake_request, make_connector, paged, run_worker, step

    store, f = MemoryStore(), facts()
    events = {"kv_events_endpoint": f"ipc://{tmp_path}/engine.sock", **SYNC}
    sched, work = make_connector("scheduler", store, f, **events), make_connector("worker", store, f, **events)
    work.register_kv_caches(paged("cpu"))
    publisher = work.worker.events
    assert publisher is not None and publisher.config.blocks_per_chunk == 64 // BS
    sub = Subscriber(publisher)
    tokens = list(range(1000, 1300))
    req = fake_request("a", tokens)
    assert ask(sched, req, 0) == (0, False)
    blocks = list(range(10))
    alloc(sched, req, blocks, 0)
    run_worker(work, step(sched, req, blocks, computed=0, scheduled=300, new=True))
    stored = sub.until(lambda ev: sum(len(e.block_hashes) for e in ev) >= 8)  # 4 whole chunks of 64
    sub.close()
    assert all(e.block_size == BS and e.medium == "CPU" for e in stored)
    assert [t for e in stored for t in e.token_ids] == tokens[:256]
    work.worker.close()
    assert publisher._closed


def test_a_full_queue_drops_announcements_and_counts_them(tmp_path):
    """The engine's thread never waits on the publisher: past ``max_queue_size`` queued calls an
    announcement is dropped, counted for the dashboard."""
    key = chunk_keys(NS, list(range(32)))[0].key
    with KVEventPublisher(_config(tmp_path, max_queue_size=1, batch_interval=1.0)) as pub:
        pub.cleared()  # sent at once; the next batch may go only a second later
        deadline = time.monotonic() + 10
        while pub.stats()["batches"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        dropped = KV_EVENT_DROPS.total()
        assert pub.removed([key], "CPU") == 1  # queued: the thread waits out the interval
        assert pub.removed([key], "CPU") == 0  # the queue is full: dropped, not waited for
        assert KV_EVENT_DROPS.total() == dropped + 1 and pub.stats()["dropped"] == 1


def test_every_primary_of_a_redis_cluster_is_watched(redis_cluster):
    """Keyspace notifications are a node's own: one watcher per primary, each announcing the
    expiries of the keys its node holds."""
    redis_cluster.flushall()
    removed: list[str] = []

    class Sink:
        def removed(self, keys, medium):
            removed.extend(keys)
            return len(keys)

    store = open_store(redis_cluster.url)
    watchers = watch_store(store, Sink())
    try:
        assert sorted(w.config.hosts[0][1] for w in watchers) == sorted(redis_cluster.ports)
        assert all(w.subscribed.wait(10) for w in watchers)
        for node in redis_cluster.nodes:
            with node.client() as c:
                c.config_set("notify-keyspace-events", "Ex")
        keys = _record_keys(12, "cluster")
        for key in keys:
            store.put(key, b"x")
        held = []
        for node in redis_cluster.nodes:
            with node.client() as c:
                held.append(c.dbsize())
        assert sum(held) == len(keys) and sum(1 for n in held if n) >= 2  # spread over the primaries
        client = store._redis  # expire them where they live (kvstore itself sets no TTL here)
        for key in keys:
            client.pexpire(key, 50)
        deadline = time.monotonic() + 10
        while set(removed) != set(keys) and time.monotonic() < deadline:
            for key in keys:
                client.exists(key)  # an access deletes an expired key at once
            time.sleep(0.1)
        assert set(removed) == set(keys)
    finally:
        for w in watchers:
            w.close()
        store.close()
