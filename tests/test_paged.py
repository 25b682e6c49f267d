"""Paged layouts: gather/scatter round trips (contiguous and CUDA-like strides), block rules,
and KVTransfer save/load through a PrefixCache."""

from __future__ import annotations

import pytest
import torch

from kvstore.buffers import BufferPool
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.paged import (
    BHNCLayout,
    CPUPackedLayout,
    FlashLayout,
    KVTransfer,
    MLALayout,
    dtype_name,
    get_layout,
    slots_from_block_table,
)
from kvstore.prefix_cache import PrefixCache
from kvstore.stores.memory import MemoryStore

B, N, H, D = 12, 4, 3, 8


def _ref_token(layout, cache, slot):
    """The KV of one slot, by plain indexing (what gather must produce for that token)."""
    b, n = divmod(slot, N)
    if isinstance(layout, FlashLayout):
        return cache[:, b, n]
    if isinstance(layout, BHNCLayout):
        return cache[b, :, n]
    return cache[b, n]


def _caches(dtype):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return [
        (FlashLayout(), r(2, B, N, H, D)),
        (BHNCLayout(), r(B, N, H, 2 * D).permute(0, 2, 1, 3)),   # vLLM GPU NHD: physical [B][N][H][2D]
        (BHNCLayout(), r(B, H, N, 2 * D)),                       # HND: slots not mergeable -> fallback path
        (BHNCLayout(), r(3, B, N, H, 2 * D)[1].permute(0, 2, 1, 3)),  # a layer view at an offset of a shared buffer
        (MLALayout(), r(B, N, 5 * D)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(5))
def test_token_layout_round_trip(dtype, case):
    layout, cache = _caches(dtype)[case]
    slots = torch.tensor([17, 3, 18, 40, 41, 42, 43, 0, 47])
    out = torch.empty(layout.chunk_shape(cache, len(slots)), dtype=dtype)
    layout.gather(cache, slots, out)
    tok_axis = 1 if isinstance(layout, FlashLayout) else 0
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(out.select(tok_axis, i), _ref_token(layout, cache, s))
    target = torch.zeros_like(cache)
    layout.scatter(target, slots, out)
    for s in range(B * N):
        expect = _ref_token(layout, cache, s) if s in slots.tolist() else torch.zeros_like(_ref_token(layout, cache, s))
        assert torch.equal(_ref_token(layout, target, s), expect)


def test_odd_row_width_skips_int64_view():
    layout = MLALayout()
    cache = torch.randn(B, N, 3, dtype=torch.float16)  # 6-byte rows: no int64 view possible
    slots = torch.tensor([5, 1, 9])
    out = torch.empty(layout.chunk_shape(cache, 3), dtype=cache.dtype)
    layout.gather(cache, slots, out)
    assert torch.equal(out, cache.view(-1, 3)[slots])


def test_cpu_packed_copies_whole_blocks_only():
    layout = CPUPackedLayout("vec")
    assert layout.granularity == "block" and layout.name == "vllm-cpu-vec"
    cache = torch.randn(B, H, N, 2 * D).bfloat16()
    slots = slots_from_block_table([7, 2, 9], N, 3 * N)
    out = torch.empty(layout.chunk_shape(cache, 3 * N), dtype=cache.dtype)
    layout.gather(cache, slots, out)
    assert torch.equal(out, cache[[7, 2, 9]])
    target = torch.zeros_like(cache)
    layout.scatter(target, slots, out)
    assert torch.equal(target[[7, 2, 9]], cache[[7, 2, 9]]) and target.abs().sum() == cache[[7, 2, 9]].abs().sum()
    with pytest.raises(ValueError, match="whole blocks"):
        layout.chunk_shape(cache, 2 * N + 1)
    with pytest.raises(ValueError, match="whole blocks"):
        layout.gather(cache, slots[1:N + 1], torch.empty(1, H, N, 2 * D, dtype=cache.dtype))


def test_get_layout_names():
    assert get_layout("vllm-bhnc").name == "vllm-bhnc"
    with pytest.raises(ValueError, match="accepted"):
        get_layout("nope")


def test_transfer_stages_through_the_pool_and_returns_every_buffer():
    layout, cache = _caches(torch.bfloat16)[0]
    cache_ = _transfer(layout, [cache, cache + 1]).cache
    cache_.pool = BufferPool(64 << 20)  # this test's own: the default one is shared
    # Gathered and scattered through the pool (not sent from, nor landed in, the blocks).
    xfer = KVTransfer(cache_, [cache, cache + 1], layout, land=False, save_from_blocks=False)
    tokens, slots = list(range(300, 316)), slots_from_block_table([9, 2, 5, 11], N, 16)
    assert xfer.save_sequence(tokens, slots) == 2
    fresh = [torch.zeros_like(c) for c in xfer.kv_caches]
    assert KVTransfer(xfer.cache, fresh, layout, land=False).load_sequence(tokens, slots)[0] == 16
    stats = xfer.pool.stats()
    assert stats["leased_bytes"] == 0 and stats["allocations"] >= 1 and stats["misses"] == 0


def _transfer(layout, caches, chunk=8, **ns):
    c0 = caches[0]
    namespace = Namespace(model="m", model_fingerprint="f", kv_dtype=dtype_name(c0.dtype), layout=layout.name,
                          block_size=layout.block_size(c0), chunk_tokens=chunk, layer_end=len(caches), **ns)
    return KVTransfer(PrefixCache(MemoryStore(), namespace), caches, layout)


@pytest.mark.parametrize("case", range(5))
def test_transfer_save_load_round_trip(case):
    layout, cache = _caches(torch.bfloat16)[case]
    caches = [cache, cache * 2]
    xfer = _transfer(layout, caches)
    tokens = list(range(100, 130))  # 30 tokens: 3 full chunks of 8 and a partial one
    slots = slots_from_block_table([9, 2, 5, 11, 0, 7, 3, 1], N, 30)
    hidden = torch.randn(30, 16)
    assert xfer.save_sequence(tokens, slots, hidden_states=hidden) == 4
    assert xfer.save_sequence(tokens, slots, hidden_states=hidden) == 0  # already stored
    fresh = [torch.zeros_like(c) for c in caches]
    xfer2 = KVTransfer(xfer.cache, fresh, layout)
    other_slots = slots_from_block_table([4, 6, 8, 10, 1, 3, 2, 0], N, 30)
    n, h = xfer2.load_sequence(tokens, other_slots)
    assert n == 30 and torch.equal(h, hidden[29])
    out_a = torch.empty(layout.chunk_shape(cache, 30), dtype=cache.dtype)
    out_b = torch.empty_like(out_a)
    for src, dst in zip(caches, fresh):
        assert torch.equal(layout.gather(src, slots, out_a), layout.gather(dst, other_slots, out_b))
    n, h = xfer2.load_sequence(tokens, other_slots, max_tokens=20)  # chunks ending by token 20
    assert n == 16 and torch.equal(h, hidden[15])
    assert xfer2.load_sequence(tokens[:5] + [1] + tokens[6:], other_slots) == (0, None)


def test_transfer_block_layout_stores_whole_blocks_only():
    layout = CPUPackedLayout("vec")
    cache = torch.randn(B, H, N, 2 * D).bfloat16()
    xfer = _transfer(layout, [cache])
    tokens = list(range(11))  # 2 whole blocks of 4 and 3 tokens of a partial block
    slots = slots_from_block_table([3, 8, 5], N, 11)
    assert xfer.usable_tokens(11) == 8
    assert xfer.save_sequence(tokens, slots) == 1  # one (partial, 8-token) chunk: the whole blocks
    fresh = torch.zeros_like(cache)
    n, _ = KVTransfer(xfer.cache, [fresh], layout).load_sequence(tokens, slots_from_block_table([1, 2, 4], N, 11))
    assert n == 8 and torch.equal(fresh[[1, 2]], cache[[3, 8]]) and fresh[4].abs().sum() == 0


def test_transfer_checks_namespace_against_cache():
    cache = torch.zeros(2, B, N, H, D, dtype=torch.float16)
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="vllm-bhnc", block_size=8, chunk_tokens=8, layer_end=2)
    with pytest.raises(ConfigError) as e:
        KVTransfer(PrefixCache(MemoryStore(), ns), [cache], FlashLayout())
    for what in ("layout", "kv_dtype", "block_size", "layer range"):
        assert what in str(e.value)


@pytest.mark.parametrize("case", [0, 1, 3, 4])
def test_whole_blocks_and_token_rows_copy_alike(case):
    """Slots that are whole blocks in order are copied block by block on the CPU; the result is
    the same as token by token (and as plain indexing)."""
    layout, cache = _caches(torch.bfloat16)[case]
    tok_axis = 1 if isinstance(layout, FlashLayout) else 0
    for slots in (slots_from_block_table([5, 0, 9], N, 3 * N),            # whole blocks: block items
                  slots_from_block_table([5, 0, 9], N, 3 * N).flip(0),    # same slots, reversed: token rows
                  torch.tensor([21, 22, 23, 20]),                          # one block, out of order
                  torch.tensor([1, 2, 3, 4])):                             # straddles two blocks
        out = torch.empty(layout.chunk_shape(cache, len(slots)), dtype=cache.dtype)
        layout.gather(cache, slots, out)
        for i, s in enumerate(slots.tolist()):
            assert torch.equal(out.select(tok_axis, i), _ref_token(layout, cache, s))
        target = torch.zeros_like(cache)
        layout.scatter(target, slots, out)
        for s in slots.tolist():
            assert torch.equal(_ref_token(layout, target, s), _ref_token(layout, cache, s))
        assert target.float().abs().sum() == out.float().abs().sum()


@pytest.mark.parametrize("case", [0, 1, 3, 4])  # not 2: advanced indexing reads -1 as the last slot
def test_slots_out_of_range_raise_index_error(case):
    layout, cache = _caches(torch.float32)[case]
    for slots in (torch.tensor([0, B * N]), torch.tensor([-1, 0]), slots_from_block_table([B], N, N)):
        out = torch.empty(layout.chunk_shape(cache, len(slots)), dtype=cache.dtype)
        with pytest.raises(IndexError):
            layout.gather(cache, slots, out)
        with pytest.raises(IndexError):
            layout.scatter(cache, slots, out)


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("skip", [0, 4, 5])
def test_transfer_loads_from_record_bytes_with_skip(case, skip):
    """CPU loads scatter straight from the (read-only, arbitrarily aligned) record bytes; with
    ``skip_tokens`` the slots before it are never written, whatever they hold."""
    layout, cache = _caches(torch.bfloat16)[case]
    tokens = list(range(200, 216))
    slots = slots_from_block_table([9, 2, 5, 11], N, 16)
    for hidden in (None, torch.randn(16, 3)):  # a hidden state shifts the payload's alignment
        xfer = _transfer(layout, [cache, cache + 1])
        assert xfer.save_sequence(tokens, slots, hidden_states=hidden) == 2
        fresh = [torch.zeros_like(c) for c in xfer.kv_caches]
        dst = slots_from_block_table([4, 6, 8, 10], N, 16)
        n, _ = KVTransfer(xfer.cache, fresh, layout).load_sequence(tokens, dst, skip_tokens=skip)
        assert n == 16
        for src, got in zip(xfer.kv_caches, fresh):
            for i in range(16):
                expect = _ref_token(layout, src, int(slots[i]))
                actual = _ref_token(layout, got, int(dst[i]))
                assert torch.equal(actual, expect if i >= skip else torch.zeros_like(expect))


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("skip", [0, 4, 8])
def test_the_accelerator_path_loads_what_the_host_path_saved(case, skip):
    """The device path (``DeviceCopies``: records DMA'd to staging, one scatter pass), run on the
    CPU, loads what the host path saved into other blocks; slots before ``skip`` are untouched."""
    layout, cache = _caches(torch.bfloat16)[case]
    src = [cache, cache + 1]
    xfer = _transfer(layout, src)
    tokens, slots = list(range(100, 116)), slots_from_block_table([9, 2, 5, 11], N, 16)
    assert xfer.save_sequence(tokens, slots) == 2
    fresh = [torch.zeros_like(c) for c in src]
    dst = slots_from_block_table([4, 6, 8, 10], N, 16)
    loader = KVTransfer(xfer.cache, fresh, layout, device_path=True)
    assert loader.load_sequence(tokens, dst, skip_tokens=skip)[0] == 16
    for layer_src, got in zip(src, fresh):
        for i in range(16):
            expect = _ref_token(layout, layer_src, int(slots[i]))
            actual = _ref_token(layout, got, int(dst[i]))
            assert torch.equal(actual, expect if i >= skip else torch.zeros_like(expect))


def test_transfer_layers_with_different_strides():
    """Layers of one shape but different strides still copy (with the item kinds all share)."""
    layout = BHNCLayout()
    g = torch.Generator().manual_seed(3)
    a = torch.randn(B, N, H, 2 * D, generator=g).permute(0, 2, 1, 3)   # blocks and rows mergeable
    b = torch.randn(B, N, 2, H, 2 * D, generator=g)[:, :, 0].permute(0, 2, 1, 3)  # rows only
    xfer = _transfer(layout, [a, b])
    tokens, slots = list(range(16)), slots_from_block_table([3, 1, 7, 0], N, 16)
    assert xfer.save_sequence(tokens, slots) == 2
    fresh = [torch.zeros_like(a), torch.zeros(B, N, 2, H, 2 * D)[:, :, 0].permute(0, 2, 1, 3)]
    assert KVTransfer(xfer.cache, fresh, layout).load_sequence(tokens, slots)[0] == 16
    blocks = [3, 1, 7, 0]
    assert torch.equal(fresh[0][blocks], a[blocks]) and torch.equal(fresh[1][blocks], b[blocks])
    assert fresh[0].abs().sum() == a[blocks].abs().sum() and fresh[1].abs().sum() == b[blocks].abs().sum()
