"""Records of KV head ranges: which heads each tensor-parallel rank holds and writes, which records
cover the heads a reader needs, and ``KVTransfer`` moving them between caches of different TP
sizes, on vLLM's CPU pages and on the GPU's token rows (the device path, run on the CPU).

The readers' caches are compared slot by slot with the writers': every head a reader rank holds
must hold the writer's bytes for that head, whichever records (exact, finer joined, coarser
sliced) it read them from.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.heads import (
    amplification,
    candidate_ranges,
    cover,
    covered_count,
    lookup_tp_sizes,
    rank_heads,
    writer_ranges,
    writes_heads,
)
from kvstore.keys import HeadRange, Namespace, chunk_keys
from kvstore.paged import BHNCLayout, CPUPackedLayout, KVTransfer, slots_from_block_table
from kvstore.paged.kernels import BlockBytes
from kvstore.prefix_cache import PrefixCache, covered_by_tier
from kvstore.stores import open_store
from kvstore.stores.tiered import TieredStore
from kvstore.testing.pinner import CountingPinner


def R(a: int, b: int, total: int = 8) -> HeadRange:
    return HeadRange(a, b, total)


# -- which heads, which records --------------------------------------------------------------------
def test_ranks_hold_contiguous_head_ranges():
    assert [rank_heads(r, 4, 8) for r in range(4)] == [R(0, 2), R(2, 4), R(4, 6), R(6, 8)]
    assert rank_heads(0, 1, 8) == R(0, 8) and writer_ranges(1, 8) == [R(0, 8)]
    assert all(writes_heads(r, 4, 8) for r in range(4))


def test_more_ranks_than_kv_heads_store_every_head_once_and_serve_every_rank():
    """GQA with TP=8 over 2 KV heads: ranks 0-3 replicate head 0 and ranks 4-7 head 1, as vLLM's
    QKVParallelLinear does; only ranks 0 and 4 write, so each head is stored once, and every rank
    (and a TP=1 or TP=2 reader) finds its heads among the records written."""
    held = [rank_heads(r, 8, 2) for r in range(8)]
    assert held == [R(0, 1, 2)] * 4 + [R(1, 2, 2)] * 4
    writers = [r for r in range(8) if writes_heads(r, 8, 2)]
    assert writers == [0, 4] and writer_ranges(8, 2) == [R(0, 1, 2), R(1, 2, 2)]
    written = writer_ranges(8, 2)
    for tp in (1, 2, 4, 8):
        for r in range(tp):
            need = rank_heads(r, tp, 2)
            got = cover(need, written)
            assert got is not None and {h for g in got for h in range(g.start, g.end)} >= set(range(need.start, need.end))
    # A TP=8 reader of a TP=1 writer's records: every rank slices the one record.
    assert all(cover(rank_heads(r, 8, 2), [R(0, 2, 2)]) == [R(0, 2, 2)] for r in range(8))
    assert covered_count({R(0, 1, 2): 3, R(1, 2, 2): 5}, 2) == 3


@pytest.mark.parametrize("tp, total", [(3, 8), (0, 8), (2, 0), (5, 2)])
def test_sizes_that_cannot_split_the_heads_are_config_errors(tp, total):
    with pytest.raises(ConfigError):
        rank_heads(0, tp, total)


def test_candidate_ranges_are_every_writer_tp_sizes_ranges_coarsest_first():
    assert lookup_tp_sizes(2, 8) == (1, 2, 4, 8) and lookup_tp_sizes(6, 4) == (1, 2, 4, 6)
    assert candidate_ranges(2, (1, 2, 4, 8)) == [R(0, 2, 2), R(0, 1, 2), R(1, 2, 2)]
    assert len(candidate_ranges(8, (1, 2, 4, 8))) == 15 and candidate_ranges(8, (3,)) == []


@pytest.mark.parametrize("need, available, expected, amp", [
    (R(2, 4), [R(0, 8), R(2, 4), R(2, 3), R(3, 4)], [R(2, 4)], 1.0),          # exact
    (R(0, 4), [R(0, 8), R(0, 2), R(2, 4)], [R(0, 2), R(2, 4)], 1.0),          # finer, joined
    (R(0, 4), [R(0, 8), R(0, 1), R(2, 4)], [R(0, 8)], 2.0),                   # finer do not join: coarser
    (R(2, 4), [R(0, 8), R(0, 4)], [R(0, 4)], 2.0),                            # the smallest coarser
    (R(2, 6), [R(0, 4), R(4, 8)], [R(0, 4), R(4, 8)], 2.0),                   # a mix
    (R(2, 6), [R(0, 4), R(4, 6), R(4, 8)], [R(0, 4), R(4, 6)], 1.5),
    (R(2, 4), [R(0, 2), R(4, 8), R(0, 4, 4)], None, None),                    # not covered
])
def test_cover_prefers_exact_then_joins_then_the_smallest_slice(need, available, expected, amp):
    got = cover(need, available)
    assert got == expected
    if got is not None:
        assert amplification(need, got) == amp


def test_every_reader_of_every_writer_is_covered():
    for total in (1, 2, 4, 8):
        for wtp, rtp in itertools.product((1, 2, 4, 8, 16), repeat=2):
            written = writer_ranges(wtp, total)
            for r in range(rtp):
                got = cover(rank_heads(r, rtp, total), written)
                assert got is not None and amplification(rank_heads(r, rtp, total), got) == max(
                    1.0, min(total, rtp) / min(total, wtp)), (total, wtp, rtp, r)


# -- KVTransfer across TP sizes ----------------------------------------------------------------------
H, D, L, BS, CHUNK, TOKENS = 4, 8, 3, 4, 8, 24  # KV heads, head size, layers, block size, chunk tokens
NB = 16
TOKEN_IDS = list(range(100, 100 + TOKENS))
LAYOUTS = {"vllm-cpu-vec": (CPUPackedLayout("vec"), BS), "vllm-bhnc": (BHNCLayout(), 1)}


def _namespace(layout: str) -> Namespace:
    return Namespace(model="heads", model_fingerprint="f", kv_dtype="float32", layout=layout,
                     block_size=LAYOUTS[layout][1], chunk_tokens=CHUNK, layer_end=L)


def _full_cache(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, H, BS, 2 * D, generator=g) for _ in range(L)]


def _rank_caches(full: list[torch.Tensor], heads: HeadRange) -> list[torch.Tensor]:
    """One rank's caches: the heads it holds, as vLLM allocates them (a contiguous view per layer)."""
    return [c[:, heads.start:heads.end].contiguous() for c in full]


def _transfer(store, layout: str, caches, heads: HeadRange, **kw) -> KVTransfer:
    cache = PrefixCache(store, _namespace(layout), heads=heads)
    return KVTransfer(cache, caches, LAYOUTS[layout][0], **kw)


SRC = [5, 2, 9, 12, 0, 7]
DST = [3, 14, 1, 8, 10, 6]


@pytest.mark.parametrize("path", ["host", "host-landing", "device"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("writer_tp, reader_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (4, 4)])
def test_readers_of_any_tp_size_load_the_writers_bytes_for_their_heads(layout, writer_tp, reader_tp, path, tmp_path,
                                                                        monkeypatch):
    """``host-landing``: a file store, which receives piece by piece: on vLLM CPU's pages every
    record lands in the blocks (the heads the rank does not hold into scratch), counted."""
    device_path = path == "device"
    store = open_store(f"file://{tmp_path}") if path == "host-landing" else open_store("memory://")
    landed = []
    real = BlockBytes.part_targets

    def spy(self, *args, **kw):
        out = real(self, *args, **kw)
        landed.append(out is not None)
        return out

    monkeypatch.setattr(BlockBytes, "part_targets", spy)
    written = _full_cache(1)
    src_slots = slots_from_block_table(SRC, BS, TOKENS)
    for r in range(writer_tp):
        heads = rank_heads(r, writer_tp, H)
        xfer = _transfer(store, layout, _rank_caches(written, heads), heads)
        assert xfer.save_sequence(TOKEN_IDS, src_slots) == TOKENS // CHUNK
    keys = sorted(store.iter_keys())
    assert len(keys) == writer_tp * TOKENS // CHUNK and all(k.endswith(f"of{H}") for k in keys)
    dst_slots = slots_from_block_table(DST, BS, TOKENS)
    pinner = CountingPinner() if device_path else None
    for r in range(reader_tp):
        heads = rank_heads(r, reader_tp, H)
        mine = [torch.zeros(NB, heads.count, BS, 2 * D) for _ in range(L)]
        xfer = _transfer(store, layout, mine, heads, device_path=device_path, pinner=pinner)
        sources = cover(heads, writer_ranges(writer_tp, H))
        got, _ = xfer.load_sequence(TOKEN_IDS, dst_slots, sources=sources)
        assert got == TOKENS
        for layer in range(L):  # every slot of every head this rank holds: the writer's bytes
            assert torch.equal(mine[layer][DST], written[layer][SRC][:, heads.start:heads.end])
        untouched = [b for b in range(NB) if b not in DST]
        assert all(not mine[layer][untouched].any() for layer in range(L))
    # Other ranges' records land in the blocks (every one) exactly where a file store meets CPU pages.
    assert all(landed) and bool(landed) == (path == "host-landing" and layout == "vllm-cpu-vec" and writer_tp != reader_tp)


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
def test_a_join_stops_where_one_range_falls_short_and_skips_a_local_hit(device_path):
    store = open_store("memory://")
    written = _full_cache(2)
    src_slots = slots_from_block_table(SRC, BS, TOKENS)
    for r in range(2):
        heads = rank_heads(r, 2, H)
        upto = TOKENS if r == 0 else 2 * CHUNK  # rank 1 stored two chunks of three
        _transfer(store, "vllm-cpu-vec", _rank_caches(written, heads), heads).save_sequence(TOKEN_IDS[:upto], src_slots)
    mine = [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]
    xfer = _transfer(store, "vllm-cpu-vec", mine, R(0, 4, 4), device_path=device_path,
                     pinner=CountingPinner() if device_path else None)
    dst_slots = slots_from_block_table(DST, BS, TOKENS)
    got, _ = xfer.load_sequence(TOKEN_IDS, dst_slots, sources=[R(0, 2, 4), R(2, 4, 4)], skip_tokens=BS)
    assert got == 2 * CHUNK
    loaded = DST[1:(2 * CHUNK) // BS]  # the first block was the local hit: never written
    for layer in range(L):
        assert torch.equal(mine[layer][loaded], written[layer][SRC[1:(2 * CHUNK) // BS]])
        assert not mine[layer][DST[0]].any()


def test_a_damaged_record_of_another_range_that_landed_ends_the_load_there(tmp_path):
    """Records of other heads land in the blocks before their checksum is known (as a rank's own
    do): one that then fails is a miss, and the load counts only the chunks before it."""
    from kvstore.testing.damage import flip_byte

    store = open_store(f"file://{tmp_path}")
    written = _full_cache(3)
    src_slots = slots_from_block_table(SRC, BS, TOKENS)
    for r in range(2):
        heads = rank_heads(r, 2, H)
        _transfer(store, "vllm-cpu-vec", _rank_caches(written, heads), heads).save_sequence(TOKEN_IDS, src_slots)
    mine = [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]
    xfer = _transfer(store, "vllm-cpu-vec", mine, R(0, 4, 4))
    second = xfer.keys(TOKEN_IDS)[1].with_heads(R(2, 4, 4)).key
    flip_byte(store, second, offset=-100)  # in the KV: lands, then fails its checksum
    got, _ = xfer.load_sequence(TOKEN_IDS, slots_from_block_table(DST, BS, TOKENS), sources=[R(0, 2, 4), R(2, 4, 4)])
    assert got == CHUNK and store.get(second) is None  # discarded, a miss from there
    for layer in range(L):
        assert torch.equal(mine[layer][DST[:CHUNK // BS]], written[layer][SRC[:CHUNK // BS]])


def test_sources_that_do_not_cover_the_cache_are_refused():
    store = open_store("memory://")
    mine = [torch.zeros(NB, 2, BS, 2 * D) for _ in range(L)]
    xfer = _transfer(store, "vllm-cpu-vec", mine, R(0, 2, 4))
    slots = slots_from_block_table(DST, BS, TOKENS)
    with pytest.raises(ValueError, match="do not cover"):
        xfer.load_sequence(TOKEN_IDS, slots, sources=[R(0, 1, 4)])
    with pytest.raises(ValueError, match="hold none"):
        xfer.load_sequence(TOKEN_IDS, slots, sources=[R(0, 2, 4), R(2, 4, 4)])


def test_a_cache_of_other_heads_than_its_records_is_a_config_error():
    with pytest.raises(ConfigError, match="heads"):
        _transfer(open_store("memory://"), "vllm-cpu-vec", [torch.zeros(NB, 2, BS, 2 * D)] * L, R(0, 4, 4))


# -- lookups: which chunks every head is covered for -------------------------------------------------
def test_exists_by_tier_asks_each_tier_once_and_none_after_those_holding_every_key(tmp_path):
    from kvstore.stores.base import WrapperStore

    class Counting(WrapperStore):
        def __init__(self, inner):
            super().__init__(inner)
            self.asked: list[int] = []

        def exists_many(self, keys):
            self.asked.append(len(keys))
            return super().exists_many(keys)

    top, bottom = open_store("memory://"), Counting(open_store(f"file://{tmp_path}"))
    store = TieredStore([top, bottom])
    top.put("a", b"1")
    bottom.put("b", b"2")
    assert store.exists_by_tier(["a", "b", "c"]) == [[True, False, False], [False, True, False]]
    assert bottom.asked == [3]  # one call for every key
    assert store.exists_by_tier(["a"]) == [[True], [False]] and bottom.asked == [3]  # the top held all: not asked
    assert top.exists_by_tier(["a", "c"]) == [[True, False]]  # a single store is one tier



def test_covered_by_tier_counts_chunks_every_head_has_in_some_range(tmp_path):
    top, bottom = open_store("memory://"), open_store(f"file://{tmp_path}")
    store = TieredStore([top, bottom])
    ns = _namespace("vllm-cpu-vec")
    base = chunk_keys(ns, TOKEN_IDS)
    half = [R(0, 2, 4), R(2, 4, 4)]
    for k in base:  # heads [0, 2) everywhere in memory; [2, 4) only two chunks, in the file tier
        top.put(k.with_heads(half[0]).key, b"x")
    for k in base[:2]:
        bottom.put(k.with_heads(half[1]).key, b"x")
    bottom.put(base[2].with_heads(R(0, 4, 4)).key, b"x")  # a TP=1 writer's third chunk only

    def sources(ranges):
        return [[(h, [k.with_heads(h) for k in base]) for h in ranges]]

    covered = covered_by_tier(store, sources([R(0, 4, 4)]), more=sources(half), counted=False)
    assert covered.per_tier == [0, 0] and covered.chunks == 2
    assert covered.found(0, 2) == half and covered.found(0, 3) == [R(0, 2, 4)]
    # The reader's own ranges cover everything asked: the other ranges are never asked.
    bottom.put(base[2].with_heads(half[1]).key, b"x")
    full = covered_by_tier(store, sources(half), more=sources([R(0, 4, 4)]), counted=False)
    assert full.chunks == 3 and full.counts == [{R(0, 2, 4): 3, R(2, 4, 4): 3}] and full.per_tier == [0, 0]
