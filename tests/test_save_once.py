"""The save path does its work once: the chain hashed once for every end of a plan, and a save
told where to start pays no lookup round trip."""

from __future__ import annotations

import random

import pytest

from kvstore.keys import Namespace, chunk_keys, prefix_keys
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.stores import WrapperStore
from kvstore.stores.memory import MemoryStore

NS = Namespace(model="m", kv_dtype="float16", layout="test", block_size=4, chunk_tokens=16)


@pytest.mark.parametrize("ends", [[16], [12], [32, 44], [44, 48], [40, 44, 48], [48, 60], [8, 64], [100]])
def test_prefix_keys_are_every_prefix_s_chunk_keys(ends):
    tokens = [random.randrange(50_000) for _ in range(64)]
    want = {k.key: k for e in ends for k in chunk_keys(NS, tokens[:e])}
    got = prefix_keys(NS, tokens, ends)
    assert len(got) == len({k.key for k in got}) == len(want)
    assert {k.key: k for k in got} == want
    assert [k.end for k in got] == sorted(k.end for k in got)


class CountingStore(WrapperStore):
    """Counts the calls that cost a round trip to answer which keys are stored."""

    def __init__(self, inner):
        super().__init__(inner)
        self.lookups = 0

    def longest_prefix(self, keys):
        self.lookups += 1
        return super().longest_prefix(keys)

    def longest_prefix_by_tier(self, keys):
        self.lookups += 1
        return super().longest_prefix_by_tier(keys)

    def exists_many(self, keys):
        self.lookups += 1
        return super().exists_many(keys)


def _payload(chunk):
    return ChunkPayload(shapes=[(chunk.num_tokens, 2)], kv=bytes(chunk.num_tokens * 2 * 2))


def test_a_save_told_where_to_start_makes_no_lookup():
    store = CountingStore(MemoryStore())
    cache = PrefixCache(store, NS)
    tokens = list(range(64))
    keys = cache.keys(tokens)
    assert cache.save(tokens, keys[:2], _payload) == 2  # no start: one counted pre-check
    assert store.lookups == 1
    built = []

    def payload(chunk):
        built.append(chunk.index)
        return _payload(chunk)

    # The first two chunks are stored and the plan says so: the rest is written, nothing asked.
    assert cache.save(tokens, keys, payload, from_token=32) == 2
    assert store.lookups == 1 and built == [2, 3]
    assert cache.lookup(keys) == 4
    # A start before what is stored rewrites from there (what healing a bad record needs).
    built.clear()
    assert cache.save(tokens, keys, payload, from_token=16) == 3
    assert built == [1, 2, 3]


def test_a_worker_saving_a_plan_asks_the_store_nothing():
    """The vLLM worker saves what the scheduler planned (``SaveSpec.start``) without a lookup:
    neither a plan's first save nor the next one, which starts where the first ended."""
    pytest.importorskip("vllm")
    from test_vllm_unit import facts, make_connector, paged

    from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, SaveSpec

    store = CountingStore(MemoryStore())
    worker = make_connector("worker", store, facts(), save_mode="sync")
    worker.register_kv_caches(paged("cpu"))
    tokens = list(range(500, 800))
    blocks = [list(range(1, 10))]
    for spec in (SaveSpec("r", tokens[:128], blocks, [128], start=0),
                 SaveSpec("r", tokens[:288], blocks, [256, 288], start=128)):
        worker.bind_connector_metadata(KVStoreConnectorMetadata(saves=[spec]))
        worker.wait_for_save()
        worker.clear_connector_metadata()
    assert len(list(store.iter_keys())) == 5 and store.lookups == 0
