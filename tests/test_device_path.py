"""The accelerator's copy path (``kvstore.paged.device``), run on the CPU: what a CUDA load and
save do, but with plain copies and ``CountingPinner`` in place of ``cudaHostRegister``.

* Loads take every record from where it lies: registered (pinned) memory of every store —
  memory://'s arena, shm:// mappings, Redis and file records received into the pinned pool —
  with no host copy (``DeviceCopies.stats`` and ``kvstore_device_copies_total`` count them).
* Verification runs on several threads while records are staged, never on the loading thread,
  and nothing is scattered before every verdict is in: a record that fails its checksum or tag,
  and every record after it, never reaches the paged cache, though it was staged.
* Registrations last exactly as long as the memory: a mapping is registered once, and ends when
  the store drops it and no reader holds it.
* Saves gather every chunk in one pass and copy it out once; windows split large loads and
  saves; a cancellation (``before_place``) stops a load where it is raised.

CUDA streams, real DMAs and their ordering against the compute stream are ``tests/test_gpu.py``'s
(``scripts/gpu_check`` on a GPU machine).
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
import uuid

import pytest
import torch
import xxhash

import kvstore.prefix_cache as prefix_cache
from kvstore.keys import Namespace
from kvstore.metrics.catalog import CORRUPT, DEVICE_COPIES
from kvstore.paged import FlashLayout, KVTransfer, dtype_name, slots_from_block_table
from kvstore.pinned import flush_unpins
from kvstore.prefix_cache import PrefixCache
from kvstore.record import RecordAuth
from kvstore.stores import open_store
from kvstore.testing.damage import flip_byte
from kvstore.testing.pinner import CountingPinner, SlowPinner
from kvstore.testing.streams import install

B, N, H, D, L = 40, 16, 4, 64, 2  # blocks, block size, KV heads, head size, layers
CHUNK = 32  # tokens: 2 blocks, a 128 KiB record
TOKENS = 192  # six chunks


def _caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, B, N, H, D, generator=g).bfloat16() for _ in range(L)]


def _namespace(model: str = "device-path") -> Namespace:
    return Namespace(model=model, model_fingerprint="f", kv_dtype="bfloat16", layout="flash-2bnhd",
                     block_size=N, chunk_tokens=CHUNK, layer_end=L)


def _transfer(store, caches, *, pinner=None, auth=None, codec="raw", **kw) -> KVTransfer:
    cache = PrefixCache(store, _namespace(), auth=auth, codec=codec)
    return KVTransfer(cache, caches, FlashLayout(), device_path=True, pinner=pinner, **kw)


TOKEN_IDS = list(range(1000, 1000 + TOKENS))
SRC_BLOCKS = [3, 17, 8, 22, 5, 30, 1, 12, 27, 9, 14, 36]
DST_BLOCKS = [11, 2, 25, 7, 19, 33, 4, 28, 15, 38, 6, 21]


def _slots(blocks: list[int]) -> torch.Tensor:
    return slots_from_block_table(blocks, N, TOKENS)


def _loaded_blocks(src: list[torch.Tensor], dst: list[torch.Tensor], chunks: int) -> list[bool]:
    """Per chunk: whether ``dst`` holds ``src``'s KV for it (both block lists, 2 blocks a chunk)."""
    out = []
    for c in range(TOKENS // CHUNK):
        s, d = SRC_BLOCKS[2 * c:2 * c + 2], DST_BLOCKS[2 * c:2 * c + 2]
        out.append(all(torch.equal(x[:, d], y[:, s]) for x, y in zip(dst, src)))
    return out


def _untouched(dst: list[torch.Tensor], first_chunk: int) -> bool:
    """The destination blocks of chunks from ``first_chunk`` on still hold zeros."""
    blocks = DST_BLOCKS[2 * first_chunk:]
    return all(not c[:, blocks].any() for c in dst)


@pytest.fixture
def shm_url():
    name = f"devpath-{uuid.uuid4().hex[:8]}"
    yield f"shm://{name}?max_bytes=64MiB&map_bytes=4096"
    shutil.rmtree(f"/dev/shm/kvstore-{name}", ignore_errors=True)


@pytest.fixture(params=["memory", "shm", "redis", "file", "memory+redis"])
def store(request, redis_server, shm_url, tmp_path):
    redis_server.flushall()
    urls = {"memory": ["memory://?max_bytes=64MiB"], "shm": [shm_url], "redis": [redis_server.url],
            "file": [f"file://{tmp_path}/kv"], "memory+redis": ["memory://?max_bytes=64MiB", redis_server.url]}
    with open_store(urls[request.param]) as s:
        yield s


def test_loads_and_saves_take_every_record_from_pinned_memory_without_a_host_copy(store):
    pinner = CountingPinner()
    src = _caches(1)
    saver = _transfer(store, src, pinner=pinner)
    assert saver.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS)) == 6
    store.flush(10)
    before = {m: DEVICE_COPIES.value(op="load", memory=m) for m in ("pinned", "pageable", "decoded")}
    dst = [torch.zeros_like(c) for c in src]
    loader = _transfer(store, dst, pinner=pinner)
    assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
    assert all(_loaded_blocks(src, dst, 6))
    assert dict(saver.copies.stats) == {("save", "pinned"): 6}
    assert dict(loader.copies.stats) == {("load", "pinned"): 6}  # no pageable DMA, no host copy
    assert DEVICE_COPIES.value(op="load", memory="pinned") - before["pinned"] == 6
    assert DEVICE_COPIES.value(op="load", memory="pageable") == before["pageable"]
    assert DEVICE_COPIES.value(op="load", memory="decoded") == before["decoded"]
    assert pinner.stats()["pinned"] >= 1 and pinner.stats()["failed"] == 0


def test_without_registration_the_copies_are_counted_as_pageable(redis_server, shm_url):
    redis_server.flushall()
    with open_store([shm_url]) as store:
        src = _caches(2)
        _transfer(store, src, pinner=CountingPinner()).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner(refuse=True))
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert all(_loaded_blocks(src, dst, 6))
        assert dict(loader.copies.stats) == {("load", "pageable"): 6}


def test_compressed_records_are_decoded_on_the_host_then_staged(redis_server):
    redis_server.flushall()
    with open_store(redis_server.url) as store:
        src = _caches(3)
        _transfer(store, src, codec="lz4").save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner(), codec="lz4")
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert all(_loaded_blocks(src, dst, 6))
        assert dict(loader.copies.stats) == {("load", "decoded"): 6}


@pytest.mark.parametrize("where", ["payload", "trailer", "header"])
def test_a_record_that_fails_is_never_scattered_nor_is_any_after_it(where, redis_server):
    """Record 2 of 6 damaged: its payload (checksum), its trailer (checksum) or its header (fails
    before it is staged). Records 2.. never reach the cache; chunks 0-1 load; counted; healed."""
    redis_server.flushall()
    with open_store(redis_server.url) as store:
        src = _caches(4)
        saver = _transfer(store, src)
        saver.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        keys = saver.keys(TOKEN_IDS)
        offset = {"payload": -5000, "trailer": -1, "header": 40}[where]
        flip_byte(store, keys[2].key, offset)
        corrupt = sum(CORRUPT.value(reason=r) for r in ("checksum", "header", "namespace", "key", "tokens", "shape"))
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner())
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == 2 * CHUNK
        assert _loaded_blocks(src, dst, 6)[:2] == [True, True]
        assert _untouched(dst, 2)  # staged (payload, trailer) or not, nothing of 2.. in the cache
        staged = loader.copies.stats["load", "pinned"]
        assert staged == (2 if where == "header" else 6)
        assert sum(CORRUPT.value(reason=r) for r in ("checksum", "header", "namespace", "key", "tokens", "shape")) \
            == corrupt + 1
        assert store.get(keys[2].key) is None  # discarded
        loader.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))  # what an engine does after recomputing: heals
        fresh = [torch.zeros_like(c) for c in src]
        assert _transfer(store, fresh).load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS


def test_a_forged_record_is_never_scattered(redis_server):
    """A forger without the key: other KV under a checksum that matches it, the tag as it was."""
    redis_server.flushall()
    with open_store(redis_server.url) as store:
        src = _caches(5)
        auth = RecordAuth([os.urandom(32)])
        saver = _transfer(store, src, auth=auth)
        saver.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        key = saver.keys(TOKEN_IDS)[3].key
        value = bytearray(store.get(key))
        value[len(value) // 2] ^= 0xFF
        value[-8:] = xxhash.xxh3_64_digest(bytes(value[:-8]))
        store.put(key, bytes(value))
        dst = [torch.zeros_like(c) for c in src]
        before = CORRUPT.value(reason="auth")
        assert _transfer(store, dst, auth=auth, pinner=CountingPinner()).load_sequence(
            TOKEN_IDS, _slots(DST_BLOCKS))[0] == 3 * CHUNK
        assert CORRUPT.value(reason="auth") == before + 1 and not store.exists(key)
        assert _loaded_blocks(src, dst, 6)[:3] == [True] * 3 and _untouched(dst, 3)


def test_verification_runs_on_several_threads_while_records_are_staged(monkeypatch, redis_server):
    redis_server.flushall()
    with open_store("memory://") as store:
        src = _caches(6)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        events: list[tuple[str, float, float]] = []
        staged: list[float] = []
        real = prefix_cache.verify_record

        def slow_verify(*args, **kwargs):
            start = time.perf_counter()
            time.sleep(0.2)  # long enough that verdicts overlap, and staging overtakes them, on a busy machine too
            real(*args, **kwargs)
            events.append((threading.current_thread().name, start, time.perf_counter()))

        monkeypatch.setattr(prefix_cache, "verify_record", slow_verify)
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner())
        from kvstore.paged import device

        real_stage = device._Staging.stage

        def stage(self, *args, **kwargs):
            staged.append(time.perf_counter())
            return real_stage(self, *args, **kwargs)

        monkeypatch.setattr(device._Staging, "stage", stage)
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert all(_loaded_blocks(src, dst, 6))
        assert len(events) == 6 and all(name.startswith("kvstore-verify") for name, _, _ in events)
        assert threading.current_thread().name not in {name for name, _, _ in events}
        overlap = max(sum(1 for _, s, e in events if s <= t < e) for _, t, _ in events)
        assert overlap >= 2  # several records verified at once
        assert max(staged) < min(end for _, _, end in events)  # every record staged before the first verdict


def test_shm_mappings_are_registered_once_and_unregistered_when_gone(shm_url):
    pinner = CountingPinner()
    with open_store(shm_url) as store:
        src = _caches(7)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=pinner)
        for _ in range(3):
            assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert pinner.read_only == 6  # six mappings, each registered once over three loads
        assert pinner.stats()["unpinned"] == 0
        keys = loader.keys(TOKEN_IDS)
        store.delete(keys[0].key)
        gc.collect()
        assert flush_unpins() and pinner.stats()["unpinned"] == 1  # dropped from the mapping cache: it ends
    gc.collect()
    assert flush_unpins() and pinner.stats()["unpinned"] == 6


def test_cold_shm_mappings_are_registered_ahead_on_threads_of_their_own(shm_url):
    """Registering a mapping is a driver call (about 1 ms per 33 MB): a cold load's are made on
    the register pool, several at once, never on the loading thread, and every record is still
    DMA'd from registered memory."""
    pinner = SlowPinner(pin_s=0.1)
    with open_store(shm_url) as store:
        src = _caches(14)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=pinner)
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert all(_loaded_blocks(src, dst, 6))
        assert dict(loader.copies.stats) == {("load", "pinned"): 6}
        assert {name.rsplit("_", 1)[0] for name, _, _ in pinner.pins} == {"kvstore-register"}
        assert len(pinner.pins) == 6 and pinner.most_at_once() >= 2


def test_a_reader_that_meets_a_registration_in_flight_waits_for_it(shm_url):
    """Two readers load the same cold prefix at once: each mapping is registered once, and the
    reader that finds another's registration running waits for it instead of DMA-ing from
    pageable memory."""
    pinner = SlowPinner(pin_s=0.2)
    with open_store(shm_url) as store:
        src = _caches(15)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        loaders = [_transfer(store, [torch.zeros_like(c) for c in src], pinner=pinner) for _ in range(2)]
        got: list[int] = []
        threads = [threading.Thread(target=lambda t=t: got.append(t.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0]))
                   for t in loaders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got == [TOKENS, TOKENS]
        assert [dict(t.copies.stats) for t in loaders] == [{("load", "pinned"): 6}] * 2
        assert len(pinner.pins) == 6  # once each


def test_a_dropped_mapping_ends_its_registration_off_the_thread_that_dropped_it(shm_url):
    pinner = SlowPinner(unpin_s=0.5)
    with open_store(shm_url) as store:
        src = _caches(16)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        loader = _transfer(store, [torch.zeros_like(c) for c in src], pinner=pinner)
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        store.delete(loader.keys(TOKEN_IDS)[0].key)  # the mapping leaves the cache: its last reference
        gc.collect()
        # The unregistration ran on the unpin thread, not on the thread that dropped the mapping (a
        # wall-clock comparison with the dropping thread's return is not this: a starved CI core
        # can hold that thread past the pinner's 0.5 s).
        assert flush_unpins() and [name for name, _, _ in pinner.unpins] == ["kvstore-unpin"]


def test_a_load_from_memory_verifies_its_bytes_once_not_per_load(monkeypatch):
    """memory:// keeps the checksum a record's seal computed as the record was copied in (or
    hashes a value put otherwise for its first reader): later loads compare digests and hash
    nothing, yet a damaged record still fails."""
    from kvstore.testing.hashes import count_hashes

    hashed = count_hashes(monkeypatch)
    record = CHUNK * L * 2 * H * D * 2
    with open_store("memory://?max_bytes=64MiB") as store:
        src = _caches(17)
        _transfer(store, src, pinner=CountingPinner()).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        loader = _transfer(store, [torch.zeros_like(c) for c in src], pinner=CountingPinner())
        hashed.clear()
        for _ in range(2):
            assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert not [n for n in hashed if n >= record]  # the seal's checksums, kept at the put
        keys = loader.keys(TOKEN_IDS)
        value = bytes(store.get(keys[1].key))
        store.put(keys[1].key, value)  # put as plain bytes: no seal, hashed for its first reader only
        hashed.clear()
        for _ in range(3):
            assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert len([n for n in hashed if n >= record]) == 1
        damaged = bytearray(value)
        damaged[-5000] ^= 1
        store.put(keys[1].key, bytes(damaged))
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == CHUNK


def test_the_memory_arena_keeps_a_readers_value_until_it_is_released():
    pinner = CountingPinner()
    with open_store("memory://?max_bytes=300KiB") as store:
        store.pin_host_memory(pinner)
        first = bytes(range(256)) * 512  # 128 KiB: in the arena
        store.put("a", first)
        (lease,) = list(store.get_into(["a"], None))
        assert lease.pinned and bytes(lease.view) == first
        store.put("b", b"\1" * len(first))
        store.put("c", b"\2" * len(first))  # evicts "a"
        assert store.get("a") is None
        store.put("d", b"\3" * len(first))  # must not reuse a's buffer while a reader holds it
        assert bytes(lease.view) == first
        lease.release()
        assert store.get("d") == b"\3" * len(first)


def test_windows_split_large_loads_and_saves(redis_server):
    redis_server.flushall()
    with open_store(redis_server.url) as store:
        src = _caches(8)
        record = CHUNK * L * 2 * H * D * 2
        saver = _transfer(store, src, pinner=CountingPinner(), staging_bytes=2 * record)
        assert saver.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS)) == 6
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner(), staging_bytes=2 * record + 1)
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert all(_loaded_blocks(src, dst, 6))
        flip_byte(store, saver.keys(TOKEN_IDS)[3].key, -100)  # window two's second record
        for c in dst:
            c.zero_()
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == 3 * CHUNK
        assert _loaded_blocks(src, dst, 6)[:3] == [True] * 3 and _untouched(dst, 3)


def test_a_cancellation_stops_the_load_where_it_is_raised():
    class Cancelled(Exception):
        pass

    with open_store("memory://") as store:
        src = _caches(9)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        seen = []

        def check(chunk, record):
            seen.append(chunk.end)
            if len(seen) == 4:
                raise Cancelled

        with pytest.raises(Cancelled):
            _transfer(store, dst, pinner=CountingPinner()).load_sequence(TOKEN_IDS, _slots(DST_BLOCKS),
                                                                        before_place=check)
        assert _loaded_blocks(src, dst, 6)[:3] == [True] * 3 and _untouched(dst, 3)


@pytest.mark.parametrize("skip", [16, 32, 48])
def test_a_local_hit_is_never_written(skip):
    with open_store("memory://") as store:
        src = _caches(10)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        got, _ = _transfer(store, dst, pinner=CountingPinner()).load_sequence(
            TOKEN_IDS, _slots(DST_BLOCKS), skip_tokens=skip)
        assert got == TOKENS
        kept = DST_BLOCKS[:skip // N]
        assert all(not c[:, kept].any() for c in dst)
        rest_dst, rest_src = DST_BLOCKS[skip // N:TOKENS // N], SRC_BLOCKS[skip // N:TOKENS // N]
        assert all(torch.equal(d[:, rest_dst], s[:, rest_src]) for d, s in zip(dst, src))


def test_a_partial_last_chunk_and_a_hidden_state_load_as_on_the_host_path():
    with open_store("memory://") as store:
        tokens = TOKEN_IDS[:CHUNK * 2 + N]  # two chunks and one block
        slots = slots_from_block_table(SRC_BLOCKS, N, len(tokens))
        src = _caches(11)
        hidden = torch.randn(len(tokens), 8)
        _transfer(store, src).save_sequence(tokens, slots, hidden_states=hidden)
        dst = [torch.zeros_like(c) for c in src]
        got, h = _transfer(store, dst, pinner=CountingPinner()).load_sequence(
            tokens, slots_from_block_table(DST_BLOCKS, N, len(tokens)))
        assert got == len(tokens) and h is not None and torch.equal(h, hidden[-1])
        assert all(torch.equal(d[:, DST_BLOCKS[:5]], s[:, SRC_BLOCKS[:5]]) for d, s in zip(dst, src))


def test_the_device_path_is_refused_a_nonsense_staging_budget():
    from kvstore.errors import ConfigError

    with open_store("memory://") as store, pytest.raises(ConfigError, match="staging_bytes=0"):
        _transfer(store, _caches(12), staging_bytes=0)


def test_the_namespace_names_the_layout_of_both_paths():
    ns = _namespace()
    assert ns.layout == FlashLayout().name and ns.kv_dtype == dtype_name(torch.bfloat16)


def test_slots_out_of_range_are_refused_on_the_host_before_any_copy():
    """On a GPU an out-of-range slot would fail the indexed copy with a device-side assert, which
    ends the process's use of the device: the device path checks the slots it will touch on the
    host first (an IndexError: a failed load or save, a recompute). Slots of skipped tokens may
    hold anything."""
    with open_store("memory://") as store:
        src = _caches(13)
        saver = _transfer(store, src)
        bad = _slots(SRC_BLOCKS).clone()
        bad[TOKENS - 1] = B * N  # one past the cache
        with pytest.raises(IndexError, match=f"slot {B * N} is out of range for a cache of {B * N} slots"):
            saver.save_sequence(TOKEN_IDS, bad)
        assert saver.copies.stats == {} and not list(store.iter_keys())
        assert saver.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS)) == 6
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst)
        bad = _slots(DST_BLOCKS).clone()
        bad[0] = -1
        with pytest.raises(IndexError, match="slot -1 is out of range"):
            loader.load_sequence(TOKEN_IDS, bad)
        assert loader.copies.stats == {} and all(bool((c == 0).all()) for c in dst)
        # The same slot among tokens the caller already holds (skip_tokens) is never touched.
        assert loader.load_sequence(TOKEN_IDS, bad, skip_tokens=CHUNK)[0] == TOKENS
        assert _loaded_blocks(src, dst, 6)[1:] == [True] * 5


# -- the order of device work (kvstore.paged.streams), recorded on the CPU ----------------------
RECORD = CHUNK * L * 2 * H * D * 2  # one record's KV bytes


def _marks(streams, name):
    return [detail for n, detail in streams.calls if n == name]


def test_a_load_with_host_slots_never_waits_for_the_forward_but_its_scatter_does():
    """vLLM passes slots on the host: they go to the device for the side stream (pinned,
    non-blocking: no copy on the caller's stream, which waits for every queued forward). The
    DMAs are issued before anything waits for the compute stream; the scatter waits for them and
    for the compute stream; the compute stream waits for the scatter; the host waits for the
    DMAs only."""
    with open_store("memory://?max_bytes=64MiB") as store:
        src = _caches(18)
        _transfer(store, src, pinner=CountingPinner()).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner())
        streams = install(loader)
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert all(_loaded_blocks(src, dst, 6))
        names = streams.names()
        assert names[0] == "slots" and _marks(streams, "slots") == ["side"]
        assert _marks(streams, "h2d") == ["copy, pinned"] * 6
        last_dma = max(i for i, n in enumerate(names) if n == "h2d")
        assert last_dma < names.index("side_waits_for_compute")  # no DMA waits for the forward
        (dmas,) = _marks(streams, "copies_done")
        assert streams.calls.index(("side_waits", dmas)) < names.index("side")  # the scatter after the DMAs
        assert names.index("side_waits_for_compute") < names.index("side")
        assert names.index("side") < names.index("compute_waits_for_side")  # the forward after the scatter
        assert _marks(streams, "host_waits") == [dmas]  # the host waits for the DMAs, not the scatter
        assert _marks(streams, "side") == ["enter", "exit"]  # one scatter pass, on the side stream


def test_windows_take_the_staging_halves_in_turn_so_one_is_filled_while_the_other_is_scattered():
    """A load larger than the staging runs in windows of half of it: window i's DMAs wait for
    the side stream's last use of its half (window i-2's scatter), not for window i-1's scatter
    (which waits for the forward)."""
    with open_store("memory://?max_bytes=64MiB") as store:
        src = _caches(19)
        _transfer(store, src).save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner(), staging_bytes=2 * RECORD)
        streams = install(loader)
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == TOKENS
        assert all(_loaded_blocks(src, dst, 6))
        waits, used = _marks(streams, "copy_waits"), _marks(streams, "side_done")
        assert len(waits) == len(used) == 6  # six windows of one record
        assert waits[:2] == [None, None]  # each half's first use
        assert waits[2:] == used[:4]  # window i waits for window i-2's scatter, never for i-1's


def test_a_save_hands_each_record_to_the_store_once_its_own_copy_is_done():
    """Saves copy record by record from the device: the store takes record i after the host
    waited for record i's copy alone, while later records (and the next window) still copy."""
    from kvstore.stores.memory import MemoryStore

    class Noting(MemoryStore):
        def put_many(self, items):
            def noted():
                for key, value in items:
                    streams.note("put", key)
                    yield key, value
            super().put_many(noted())

    for staging in (None, 2 * RECORD):  # one window; six windows of one record, in two halves
        store = Noting()
        kw = {} if staging is None else {"staging_bytes": staging}
        saver = _transfer(store, _caches(20), pinner=CountingPinner(), **kw)
        streams = install(saver)
        assert saver.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS)) == 6
        copies, keys = _marks(streams, "d2h"), [k.key for k in saver.keys(TOKEN_IDS)]
        assert len(copies) == 6
        calls = streams.calls
        for i, key in enumerate(keys):
            put = calls.index(("put", key))
            assert calls.index(("host_waits", copies[i])) < put  # its own copy is in
            assert all(calls.index(("host_waits", c)) > put for c in copies[i + 1:])  # not the later ones'
            if i + 1 < len(keys):
                assert calls.index(("d2h", copies[i + 1])) < put  # the next record copies meanwhile
        assert calls[-1] == ("host_waits", copies[-1])  # nothing still copies into a lease given back
        assert streams.names().index("side_waits_for_compute") < streams.names().index("side")
        fresh = [torch.zeros_like(c) for c in saver.kv_caches]
        assert _transfer(store, fresh).load_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))[0] == TOKENS
        assert all(torch.equal(a[:, SRC_BLOCKS], b[:, SRC_BLOCKS]) for a, b in zip(fresh, saver.kv_caches))


def test_the_triton_kernel_is_asked_for_by_name_and_the_torch_path_stays_where_it_cannot_run(caplog):
    from kvstore.paged.device import DeviceCopies

    with open_store("memory://") as store:
        src = _caches(21)
        cache = PrefixCache(store, _namespace())
        with pytest.raises(ValueError, match="kernel='cuda'; accepted: torch, triton"):
            DeviceCopies(cache, src, FlashLayout(), kernel="cuda")
        copies = DeviceCopies(cache, src, FlashLayout(), pinner=CountingPinner(), kernel="triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            assert copies._layer_copies is None and "the torch path copies" in caplog.text


def test_a_failed_load_returns_without_waiting_for_the_verdicts_after_it(monkeypatch, redis_server):
    """Record 1 of 6 fails its checksum while the verdicts of 2.. still run (slowly): the load
    returns with one chunk at once, and their pool leases go back when those verdicts end (a
    verifier never reads a lease handed out again)."""
    redis_server.flushall()
    with open_store(redis_server.url) as store:
        src = _caches(22)
        saver = _transfer(store, src)
        saver.save_sequence(TOKEN_IDS, _slots(SRC_BLOCKS))
        flip_byte(store, saver.keys(TOKEN_IDS)[1].key, -5000)
        real = prefix_cache.verify_record
        slow = threading.Event()

        def verify(data, checked, **kwargs):
            if checked.header.start >= 2 * CHUNK:
                slow.wait(10)  # later records: still verifying when the load stops
            real(data, checked, **kwargs)

        monkeypatch.setattr(prefix_cache, "verify_record", verify)
        dst = [torch.zeros_like(c) for c in src]
        loader = _transfer(store, dst, pinner=CountingPinner())
        start = time.perf_counter()
        assert loader.load_sequence(TOKEN_IDS, _slots(DST_BLOCKS))[0] == CHUNK
        assert time.perf_counter() - start < 5  # not the 10 s the later verdicts would take
        assert _loaded_blocks(src, dst, 6)[:1] == [True] and _untouched(dst, 1)
        assert loader.pool.stats()["leased_bytes"] > 0  # the later records' leases, still read
        slow.set()
        deadline = time.monotonic() + 10
        while loader.pool.stats()["leased_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader.pool.stats()["leased_bytes"] == 0
