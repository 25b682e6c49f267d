"""Loads that land records straight in a CPU cache's blocks (``record.land_record``), on a real
redis-server (and Redis Cluster, shards, files): the KV is what was saved, on every layout with whole-block items; a record that
fails its header checks never writes a byte in its blocks; one that fails its checksum or tag
after landing is a miss, counted and deleted, and the next save heals it; blocks before
``skip_tokens`` are never written; records that cannot land load as before."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch
import xxhash

from kvstore.keys import Namespace
from kvstore.metrics.catalog import CORRUPT
from kvstore.paged import BHNCLayout, CPUPackedLayout, FlashLayout, KVTransfer, dtype_name, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.record import RecordAuth
from kvstore.stores import open_store

B, N, H, D = 24, 4, 2, 8  # blocks, block size, heads, head size
CHUNK = 8  # tokens: two blocks


def _cache(case: str) -> tuple:
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    if case == "cpu":
        return CPUPackedLayout("vec"), [r(B, H, N, 2 * D) for _ in range(3)]
    if case == "flash":
        return FlashLayout(), [r(2, B, N, H, D) for _ in range(3)]
    return BHNCLayout(), [r(B, N, H, 2 * D).permute(0, 2, 1, 3) for _ in range(3)]


@pytest.fixture
def store(redis_server):
    redis_server.flushall()
    with open_store(redis_server.url) as s:
        yield s


def _xfer(store, layout, caches, *, codec="raw", auth=None, model="m"):
    ns = Namespace(model=model, model_fingerprint="f", kv_dtype=dtype_name(caches[0].dtype), layout=layout.name,
                   block_size=N, chunk_tokens=CHUNK, layer_end=len(caches))
    return KVTransfer(PrefixCache(store, ns, codec=codec, auth=auth), caches, layout)


def _landed(xfer, tokens, slots, **kw):
    """Load into ``xfer``; (tokens present, how many chunks landed in place)."""
    landed = []
    n, _ = xfer.load_sequence(tokens, slots, before_place=lambda c, r: landed.append(r.landed), **kw)
    return n, sum(landed)


def _same(layout, src, src_slots, dst, dst_slots):
    a = torch.empty(layout.chunk_shape(src[0], len(src_slots)), dtype=src[0].dtype)
    b = torch.empty_like(a)
    return all(torch.equal(layout.gather(s, src_slots, a), layout.gather(d, dst_slots, b)) for s, d in zip(src, dst))


TOKENS = list(range(500, 532))  # 4 chunks
SAVED = slots_from_block_table([9, 2, 5, 11, 0, 7, 3, 1], N, 32)


@pytest.mark.parametrize("case", ["cpu", "flash", "bhnc"])
@pytest.mark.parametrize("table", [[12, 13, 14, 15, 16, 17, 18, 19], [20, 4, 6, 8, 10, 1, 22, 21]])
def test_records_land_in_the_blocks_and_hold_the_saved_kv(store, case, table):
    layout, caches = _cache(case)
    assert _xfer(store, layout, caches).save_sequence(TOKENS, SAVED) == 4
    fresh = [torch.zeros_like(c) for c in caches]
    slots = slots_from_block_table(table, N, 32)  # consecutive blocks (one buffer per layer), then scattered
    assert _landed(_xfer(store, layout, fresh), TOKENS, slots) == (32, 4)
    assert _same(layout, caches, SAVED, fresh, slots)


def test_signed_records_land_and_a_forged_tag_is_a_miss(store):
    layout, caches = _cache("cpu")
    auth = RecordAuth([os.urandom(32)])
    assert _xfer(store, layout, caches, auth=auth).save_sequence(TOKENS, SAVED) == 4
    fresh = [torch.zeros_like(c) for c in caches]
    slots = slots_from_block_table(list(range(12, 20)), N, 32)
    assert _landed(_xfer(store, layout, fresh, auth=auth), TOKENS, slots) == (32, 4)
    assert _same(layout, caches, SAVED, fresh, slots)
    # A forger without the key: other KV under a checksum that matches it, the tag left as it was.
    key = _keys(_xfer(store, layout, caches, auth=auth))[1]
    value = bytearray(store.get(key))
    value[len(value) // 2] ^= 0xFF
    value[-8:] = xxhash.xxh3_64_digest(bytes(value[:-8]))
    store.put(key, bytes(value))
    before = CORRUPT.value(reason="auth")
    n, landed = _landed(_xfer(store, layout, [torch.zeros_like(c) for c in caches], auth=auth), TOKENS, slots)
    assert (n, landed) == (8, 1) and CORRUPT.value(reason="auth") == before + 1 and not store.exists(key)


def _keys(xfer):
    return [k.key for k in xfer.keys(TOKENS)]


def _save_with_a_bad_payload(store, layout, caches) -> tuple:
    """Save the 4 chunks into ``store``, then flip a byte in chunk 2's KV, after a header that
    passes every check; (the writer's transfer, chunk 2's key)."""
    writer = _xfer(store, layout, caches)
    writer.save_sequence(TOKENS, SAVED)
    key = _keys(writer)[2]
    value = bytearray(store.get(key))
    value[len(value) // 2] ^= 0xFF
    store.put(key, bytes(value))
    return writer, key


def test_a_payload_that_fails_its_checksum_is_a_miss_counted_deleted_and_healed(store):
    layout, caches = _cache("cpu")
    _, key = _save_with_a_bad_payload(store, layout, caches)
    before = CORRUPT.value(reason="checksum")
    fresh = [torch.zeros_like(c) for c in caches]
    slots = slots_from_block_table(list(range(12, 20)), N, 32)
    reader = _xfer(store, layout, fresh)
    n, landed = _landed(reader, TOKENS, slots)
    assert n == 16 and landed == 2  # the chunks before it; its own bytes are past the loaded prefix
    assert CORRUPT.value(reason="checksum") == before + 1 and not store.exists(key)
    staged = torch.empty(layout.chunk_shape(caches[0], 32), dtype=caches[0].dtype)
    for src, dst in zip(caches, fresh):  # the reader's engine recomputes tokens 16-31 (all, here)
        layout.scatter(dst, slots, layout.gather(src, SAVED, staged))
    assert reader.save_sequence(TOKENS, slots, from_token=32) == 2  # and its save heals the record
    again = [torch.zeros_like(c) for c in caches]
    assert _landed(_xfer(store, layout, again), TOKENS, slots) == (32, 4)
    assert _same(layout, caches, SAVED, again, slots)


def test_a_bad_record_landed_from_a_lower_tier_is_deleted_from_the_tier_it_was_promoted_into(redis_server):
    """A record from Redis below a memory tier lands, is promoted into the memory tier from the
    blocks, then fails its checksum: a miss, and neither tier keeps it, so the next reader does
    not hit the bad copy in the tier above."""
    redis_server.flushall()
    layout, caches = _cache("cpu")
    with open_store(["memory://", redis_server.url]) as tiered:
        memory, redis_tier = (t.store for t in tiered.tiers)
        writer, key = _save_with_a_bad_payload(redis_tier, layout, caches)
        fresh = [torch.zeros_like(c) for c in caches]
        slots = slots_from_block_table(list(range(12, 20)), N, 32)
        assert _landed(_xfer(tiered, layout, fresh), TOKENS, slots) == (16, 2)
        assert tiered.flush(10)
        assert not memory.exists(key) and not redis_tier.exists(key)
        assert all(memory.exists_many(_keys(writer)[:2]))  # the good ones were promoted


@pytest.mark.parametrize("damage", ["foreign", "truncated", "header", "tokens"])
def test_a_record_failing_its_header_checks_never_writes_a_byte(store, damage):
    layout, caches = _cache("cpu")
    writer = _xfer(store, layout, caches)
    writer.save_sequence(TOKENS, SAVED)
    key = _keys(writer)[0]
    value = bytearray(store.get(key))
    if damage == "foreign":  # another model's record of these tokens, under this key
        other = _xfer(store, layout, caches, model="other")
        other.save_sequence(TOKENS, SAVED)
        value = bytearray(store.get(_keys(other)[0]))
    elif damage == "truncated":
        value = value[:-100]
    elif damage == "header":
        value[20] ^= 0xFF  # inside the header: its crc fails
    else:
        reader_tokens = TOKENS[:3] + [7] + TOKENS[4:]
        key = _keys(writer)[0]
        store.put(_xfer(store, layout, caches).keys(reader_tokens)[0].key, bytes(value))
    store.put(key, bytes(value))
    sentinel = [torch.full_like(c, 7.0) for c in caches]
    slots = slots_from_block_table(list(range(12, 20)), N, 32)
    asked = reader_tokens if damage == "tokens" else TOKENS
    assert _landed(_xfer(store, layout, sentinel), asked, slots) == (0, 0)
    # Its blocks (12, 13) kept what they held; later chunks may have landed (past the prefix).
    assert all(bool((c[12:14] == 7.0).all()) for c in sentinel)


def test_blocks_before_skip_tokens_are_never_written(store):
    layout, caches = _cache("cpu")
    _xfer(store, layout, caches).save_sequence(TOKENS, SAVED)
    fresh = [torch.full_like(c, 7.0) for c in caches]
    table = [12, 13, 14, 15, 16, 17, 18, 19]
    slots = slots_from_block_table(table, N, 32)
    n, landed = _landed(_xfer(store, layout, fresh), TOKENS, slots, skip_tokens=12)  # into chunk 1 (tokens 8-15)
    assert n == 32 and landed == 2  # chunks 2 and 3; chunk 1 is placed from its lease, after its skipped block
    assert all(bool((c[12:15] == 7.0).all()) for c in fresh)  # blocks of tokens 0-11
    assert _same(layout, caches, SAVED[12:], fresh, slots[12:])


def test_compressed_records_load_from_their_lease(store):
    layout, caches = _cache("cpu")
    _xfer(store, layout, caches, codec="shuffle-lz4").save_sequence(TOKENS, SAVED)
    fresh = [torch.zeros_like(c) for c in caches]
    slots = slots_from_block_table(list(range(12, 20)), N, 32)
    assert _landed(_xfer(store, layout, fresh), TOKENS, slots) == (32, 0)
    assert _same(layout, caches, SAVED, fresh, slots)


@pytest.fixture(scope="module")
def shard_servers(redis_server_factory):
    return [redis_server_factory() for _ in range(2)]


@pytest.mark.parametrize("kind", ["cluster", "shards", "tiered", "tiered, memory first", "file"])
def test_every_redis_form_and_files_land_and_so_do_tiers_below_the_first(kind, request, redis_server, tmp_path):
    if kind == "file":
        url: str | list[str] = f"file://{tmp_path}/kv"
    elif kind == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        url = cluster.url
    elif kind == "shards":
        shards = request.getfixturevalue("shard_servers")
        for s in shards:
            s.flushall()
        url = "redis+shards://" + ",".join(f"127.0.0.1:{s.port}" for s in shards)
    else:
        redis_server.flushall()
        url = [redis_server.url] if kind == "tiered" else ["memory://", redis_server.url]
    layout, caches = _cache("cpu")
    with open_store(url) as writer_store:
        _xfer(writer_store, layout, caches).save_sequence(TOKENS, SAVED)
        if hasattr(writer_store, "flush"):
            writer_store.flush(10)
    with open_store(url) as s:  # a fresh process's view: its memory tier (if any) is empty
        fresh = [torch.zeros_like(c) for c in caches]
        slots = slots_from_block_table(list(range(12, 20)), N, 32)
        # Below a memory tier too: the hit is promoted from the blocks it landed in.
        assert _landed(_xfer(s, layout, fresh), TOKENS, slots) == (32, 4)
        assert _same(layout, caches, SAVED, fresh, slots)


@pytest.mark.parametrize("land", [True, False])
def test_the_adapters_land_in_cache_option(land):
    from kvstore.connectors.agent import KVStoreAgent
    from kvstore.connectors.vllm.options import parse_options

    assert parse_options({"store": "memory://", "land_in_cache": land}).land_in_cache is land
    caches = [torch.zeros(2, B, N, H, D, dtype=torch.bfloat16) for _ in range(2)]
    agent = KVStoreAgent({"store": "memory://", "model": "m", "model_fingerprint": "f", "land_in_cache": land})
    try:
        xfer = agent.transfer(object(), caches)
        assert xfer.lands_in_cache is land
    finally:
        agent.close()


def test_a_store_whose_get_into_predates_place_loads_from_its_leases():
    from kvstore.stores.memory import MemoryStore

    class Older(MemoryStore):
        def get_into(self, keys, pool):  # the contract before ``place``
            return super().get_into(keys, pool)

    layout, caches = _cache("cpu")
    store = Older()
    _xfer(store, layout, caches).save_sequence(TOKENS, SAVED)
    fresh = [torch.zeros_like(c) for c in caches]
    slots = slots_from_block_table(list(range(12, 20)), N, 32)
    assert _landed(_xfer(store, layout, fresh), TOKENS, slots) == (32, 0)
    assert _same(layout, caches, SAVED, fresh, slots)


def test_a_tiered_or_wrapped_store_over_an_older_store_loads_from_its_leases():
    from kvstore.stores import TieredStore
    from kvstore.stores.base import WrapperStore
    from kvstore.stores.memory import MemoryStore

    class Older(MemoryStore):
        def get_into(self, keys, pool):
            return super().get_into(keys, pool)

    layout, caches = _cache("cpu")
    for store in (TieredStore([Older()]), WrapperStore(Older())):
        _xfer(store, layout, caches).save_sequence(TOKENS, SAVED)
        fresh = [torch.zeros_like(c) for c in caches]
        slots = slots_from_block_table(list(range(12, 20)), N, 32)
        assert _landed(_xfer(store, layout, fresh), TOKENS, slots) == (32, 0)
        assert _same(layout, caches, SAVED, fresh, slots)


@pytest.mark.parametrize("below", ["redis", "shm"])
def test_a_tier_failing_mid_record_leaves_no_landing_for_the_tier_below(store, below):
    """The first tier lands a record's header and then garbage KV and fails; the tier below has
    the record. A real redis-server lands it afresh (a run of its own); a shm tier ignores
    ``place`` and hands a mapped lease with a valid arrival digest, which must be decoded and
    scattered, not taken as the landed record (whose checksum it would pass)."""
    from kvstore.buffers import lease_or_fresh
    from kvstore.errors import StoreUnavailableError
    from kvstore.stores import TieredStore
    from kvstore.stores.memory import MemoryStore

    class FailsMidRecord(MemoryStore):
        is_local = False

        def get_into(self, keys, pool, place=None):
            for i, key in enumerate(keys):
                value = self.get(key)
                if value is None or place is None:
                    yield None
                    continue
                lease = lease_or_fresh(pool, len(value), 0)
                at = 0
                for buffers in place(i, lease.view):
                    for b in buffers:
                        if len(buffers) > 1:  # the KV, landing in the cache: garbage, then the link drops
                            b[:] = b"\xff" * len(b)
                            lease.release()
                            raise StoreUnavailableError("connection lost mid-record")
                        b[:] = value[at:at + len(b)]
                        at += len(b)

    layout, caches = _cache("cpu")
    name = f"landing-{uuid.uuid4().hex[:12]}"
    lower = store if below == "redis" else open_store(f"shm://{name}?max_bytes=16MiB")
    try:
        tiered = TieredStore([FailsMidRecord(), lower])
        _xfer(tiered, layout, caches).save_sequence(TOKENS, SAVED)
        assert tiered.flush(10)
        fresh = [torch.zeros_like(c) for c in caches]
        slots = slots_from_block_table(list(range(12, 20)), N, 32)
        n, landed = _landed(_xfer(tiered, layout, fresh), TOKENS, slots)
        assert (n, landed) == (32, 4 if below == "redis" else 0)
        assert _same(layout, caches, SAVED, fresh, slots)
    finally:
        if below == "shm":
            lower.close()
            shutil.rmtree(f"/dev/shm/kvstore-{name}", ignore_errors=True)


@pytest.mark.parametrize("above", ["memory", "redis"])
def test_a_hit_landed_from_a_lower_tier_is_promoted_whole_from_the_blocks(redis_server, tmp_path, above):
    """A record found only in the lower tier lands in the blocks, and the tier above gets the
    same record bytes: a memory tier copies them at once; a Redis tier's write queue takes its
    own copy, so blocks overwritten right after the load do not reach it."""
    redis_server.flushall()
    lower_url = f"file://{tmp_path}/kv"
    url = ["memory://", lower_url] if above == "memory" else [redis_server.url, lower_url]
    layout, caches = _cache("cpu")
    with open_store(lower_url) as lower:
        _xfer(lower, layout, caches).save_sequence(TOKENS, SAVED)
        keys = [k.key for k in _xfer(lower, layout, caches).keys(TOKENS)]
        stored = [bytes(v) for v in lower.get_many(keys)]
    with open_store(url) as tiered:
        upper = tiered.tiers[0].store
        assert not any(upper.exists_many(keys))
        fresh = [torch.zeros_like(c) for c in caches]
        slots = slots_from_block_table(list(range(12, 20)), N, 32)
        assert _landed(_xfer(tiered, layout, fresh), TOKENS, slots) == (32, 4)
        assert _same(layout, caches, SAVED, fresh, slots)
        for c in fresh:  # the engine reuses the blocks
            c.fill_(7)
        assert tiered.flush(10)
        assert [bytes(v) for v in upper.get_many(keys)] == stored
        again = [torch.zeros_like(c) for c in caches]  # and the tier above now serves the prefix
        assert _xfer(tiered, layout, again).load_sequence(TOKENS, slots)[0] == 32
        assert _same(layout, caches, SAVED, again, slots)


def test_a_landing_counts_only_for_the_view_its_last_run_landed_in():
    """A store that retries a value on a fresh buffer runs ``place`` again: what the abandoned
    run landed no longer counts, and a value that then lands whole in its view is decoded."""
    from kvstore.record import Landing, decode_record, land_record
    from kvstore.stores.memory import MemoryStore

    layout, caches = _cache("cpu")
    mem = MemoryStore()
    _xfer(mem, layout, caches).save_sequence(TOKENS, SAVED)
    value = bytes(mem.get(next(mem.iter_keys())))
    kv = memoryview(bytearray(len(decode_record(value).kv)))
    landing = Landing()

    def run(view, destination):
        at = 0
        for buffers in land_record(view, landing, destination):
            for b in buffers:
                b[:] = value[at:at + len(b)]
                at += len(b)

    first, second = memoryview(bytearray(len(value))), memoryview(bytearray(len(value)))
    run(first, lambda: [kv])
    assert landing.landed_in(first) and not landing.landed_in(second)
    run(second, lambda: None)  # the retry, on a fresh buffer, lands whole in its view
    assert not landing.landed_in(first) and not landing.landed_in(second)
    assert decode_record(second).kv == kv
