"""The CUDA path for real: pinned pool, side stream, the vLLM GPU layout, the agent API on CUDA.

Marked ``gpu`` and skipped without CUDA (our CI machines have none). ``scripts/gpu_check`` runs
these and ``benchmarks/bench_gpu.py`` on a bare CUDA machine with torch installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.buffers import BufferPool
from kvstore.connectors.agent import AgentConfig, KVStoreAgent
from kvstore.keys import Namespace
from kvstore.paged import BHNCLayout, FlashLayout, KVTransfer, dtype_name, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.reference import PRESETS, ModelRunner
from kvstore.stores.memory import MemoryStore
from kvstore.testing.shm import memory_root

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check on a GPU machine)")]

B, N, H, D, L = 64, 16, 8, 128, 4


def _caches(layout: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "flash-2bnhd":
        return [torch.randn(2, B, N, H, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(L)]
    # vLLM's GPU view: physically [B][N][H][2D], handed over as a permuted [B, H, N, 2D] view
    return [torch.randn(B, N, H, 2 * D, device="cuda", generator=g).to(torch.bfloat16).permute(0, 2, 1, 3)
            for _ in range(L)]


def _transfer(layout: str, caches: list[torch.Tensor], store: MemoryStore) -> KVTransfer:
    lay = FlashLayout() if layout == "flash-2bnhd" else BHNCLayout()
    ns = Namespace(model="gpu", model_fingerprint="f", kv_dtype=dtype_name(caches[0].dtype), layout=lay.name,
                   block_size=N, chunk_tokens=64, layer_end=L)
    return KVTransfer(PrefixCache(store, ns), caches, lay)


def test_pinned_pool_hands_out_pinned_resident_buffers():
    pool = BufferPool(64 << 20, pin=True)
    lease = pool.lease(8 << 20)
    assert lease is not None and torch.from_numpy(lease.array).is_pinned()
    lease.release()


@pytest.mark.parametrize("layout", ["flash-2bnhd", "vllm-bhnc"])
@pytest.mark.parametrize("skip", [0, 32])
def test_save_and_load_on_cuda_copy_exactly_and_never_touch_skipped_slots(layout, skip):
    store = MemoryStore()
    src, dst = _caches(layout, 1), _caches(layout, 2)
    before = [c.clone() for c in dst]
    rng = np.random.default_rng(0)
    tokens = list(range(1000, 1256))
    src_slots = slots_from_block_table(rng.permutation(B)[:16].tolist(), N, 256, device="cuda")
    dst_blocks = rng.permutation(B)[:16].tolist()
    dst_slots = slots_from_block_table(dst_blocks, N, 256, device="cuda")
    saver = _transfer(layout, src, store)
    assert saver.pool.pin and saver.save_sequence(tokens, src_slots) == 4
    loader = _transfer(layout, dst, store)
    present, _ = loader.load_sequence(tokens, dst_slots, skip_tokens=skip)
    torch.cuda.synchronize()
    assert present == 256
    gather = saver.layout.gather
    for s, d, b in zip(src, dst, before):
        want = torch.empty((*saver.layout.chunk_shape(s, 256),), dtype=s.dtype, device="cuda")
        got = torch.empty_like(want)
        gather(s, src_slots, want)
        gather(d, dst_slots, got)
        old = torch.empty_like(want)
        gather(b, dst_slots, old)
        axis = 1 if layout == "flash-2bnhd" else 0
        assert torch.equal(got.narrow(axis, skip, 256 - skip), want.narrow(axis, skip, 256 - skip))
        assert torch.equal(got.narrow(axis, 0, skip), old.narrow(axis, 0, skip))  # the local hit is untouched


def test_loads_wait_for_queued_compute_on_the_same_blocks():
    """Work queued on the compute stream before a load must not land after it (side-stream order)."""
    store = MemoryStore()
    src, dst = _caches("flash-2bnhd", 3), _caches("flash-2bnhd", 4)
    tokens, slots = list(range(64)), slots_from_block_table(list(range(4)), N, 64, device="cuda")
    _transfer("flash-2bnhd", src, store).save_sequence(tokens, slots)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64  # keep the compute stream busy
    for c in dst:
        c[:, :4].fill_(7)  # queued behind the matmuls
    _transfer("flash-2bnhd", dst, store).load_sequence(tokens, slots)
    torch.cuda.synchronize()
    assert all(torch.equal(d[:, :4], s[:, :4]) for d, s in zip(dst, src))


@pytest.mark.parametrize("kv_layout", ["flash-2bnhd", "vllm-bhnc"])
def test_agent_api_on_the_reference_engine_on_cuda_gives_identical_output(kv_layout):
    cfg = PRESETS["tiny"].with_(device="cuda", kv_layout=kv_layout)
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, cfg.vocab_size, 160)]
    baseline = ModelRunner(cfg).generate([prompt], 8)
    store = MemoryStore()
    options = dict(store=("memory://",), model=cfg.name, model_fingerprint=cfg.fingerprint, chunk_tokens=64,
                   kv_layout=kv_layout if kv_layout != "flash-2bnhd" else "")
    first = ModelRunner(cfg, KVStoreAgent(AgentConfig(**options), store=store)).generate([prompt], 8)
    second = ModelRunner(cfg, KVStoreAgent(AgentConfig(**options), store=store)).generate([prompt], 8)
    assert first.tokens == baseline.tokens == second.tokens
    assert second.tokens_loaded >= 128


# -- the device path (kvstore.paged.device) on real CUDA ----------------------------------------
def _flash_ns(model: str, chunk: int = 64) -> Namespace:
    return Namespace(model=model, model_fingerprint="f", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=N,
                     chunk_tokens=chunk, layer_end=L)


@pytest.fixture(params=["memory", "shm", "redis"])
def gpu_store(request, tmp_path):
    """The stores a GPU host loads from (Redis where redis-server and redis-py are installed)."""
    import shutil
    import uuid

    from kvstore.stores import open_store

    if request.param == "redis":
        redis_server = request.getfixturevalue("redis_server")
        redis_server.flushall()
        url = redis_server.url
    elif request.param == "shm":
        name = f"gpu-{uuid.uuid4().hex[:8]}"
        root, _ = memory_root(256 << 20)  # a container's /dev/shm is 64 MB
        url = f"shm://{name}?max_bytes=256MiB&root={root}"
        request.addfinalizer(lambda: shutil.rmtree(f"{root}/kvstore-{name}", ignore_errors=True))
    else:
        url = "memory://?max_bytes=256MiB"
    with open_store(url) as store:
        yield store


def test_every_store_loads_onto_the_gpu_with_no_host_copy(gpu_store):
    """Records DMA'd from where they lie: memory://'s registered arena, registered shm://
    mappings, Redis records received into the pinned pool; none staged through pageable memory."""
    from kvstore.pinned import cuda_pinner

    pinner = cuda_pinner()
    assert pinner is not None, "the CUDA runtime torch uses was not found: nothing can be registered"
    src, dst = _caches("flash-2bnhd", 11), _caches("flash-2bnhd", 12)
    tokens, slots = list(range(5000, 5512)), slots_from_block_table(list(range(32)), N, 512, device="cuda")
    dst_slots = slots_from_block_table(list(range(32, 64)), N, 512, device="cuda")
    saver = KVTransfer(PrefixCache(gpu_store, _flash_ns("gpu-pinned")), src, FlashLayout())
    assert saver.save_sequence(tokens, slots) == 8
    assert dict(saver.copies.stats) == {("save", "pinned"): 8}
    loader = KVTransfer(PrefixCache(gpu_store, _flash_ns("gpu-pinned")), dst, FlashLayout())
    for _ in range(2):
        assert loader.load_sequence(tokens, dst_slots)[0] == 512
    assert dict(loader.copies.stats) == {("load", "pinned"): 16}
    assert all(torch.equal(d[:, 32:64], s[:, :32]) for d, s in zip(dst, src))  # on the compute stream, no sync
    assert pinner.stats()["failed"] == 0


def test_saves_wait_for_queued_compute_on_the_blocks_they_read():
    store = MemoryStore()
    src = _caches("flash-2bnhd", 13)
    tokens, slots = list(range(64)), slots_from_block_table(list(range(4)), N, 64, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64
    for c in src:
        c[:, :4].fill_(3)  # queued behind the matmuls, before the save
    KVTransfer(PrefixCache(store, _flash_ns("gpu-save-order")), src, FlashLayout()).save_sequence(tokens, slots)
    dst = [torch.zeros_like(c) for c in src]
    KVTransfer(PrefixCache(store, _flash_ns("gpu-save-order")), dst, FlashLayout()).load_sequence(tokens, slots)
    assert all(bool((d[:, :4] == 3).all()) for d in dst)


def test_shm_registrations_end_when_the_mappings_go():
    import gc
    import shutil
    import uuid

    from kvstore.pinned import cuda_pinner, flush_unpins
    from kvstore.stores import open_store

    pinner = cuda_pinner()
    assert pinner is not None and pinner.read_only_supported() is not None
    name = f"gpu-reg-{uuid.uuid4().hex[:8]}"
    root, _ = memory_root(256 << 20)
    before = pinner.stats()
    try:
        with open_store(f"shm://{name}?max_bytes=256MiB&root={root}") as store:
            src, dst = _caches("flash-2bnhd", 14), _caches("flash-2bnhd", 15)
            tokens, slots = list(range(256)), slots_from_block_table(list(range(16)), N, 256, device="cuda")
            KVTransfer(PrefixCache(store, _flash_ns("gpu-reg")), src, FlashLayout()).save_sequence(tokens, slots)
            loader = KVTransfer(PrefixCache(store, _flash_ns("gpu-reg")), dst, FlashLayout())
            assert loader.load_sequence(tokens, slots.cpu())[0] == 256  # host slots, as vLLM's
            assert dict(loader.copies.stats) == {("load", "pinned"): 4}
            assert pinner.stats()["pinned"] - before["pinned"] >= 4
        gc.collect()
        assert flush_unpins(30)  # registrations end on the unpin thread
        after = pinner.stats()
        assert after["unpinned"] - before["unpinned"] >= 4 and after["failed"] == before["failed"]
    finally:
        shutil.rmtree(f"{root}/kvstore-{name}", ignore_errors=True)


# -- issue 47: what a busy engine, host-side slots and freed memory must not break ----------------
def _busy(ms: float = 300.0) -> None:
    """Queue about ``ms`` of chained matmuls on the current stream (a forward): a few hundred
    long kernels, well under the launch queue's depth (which would block the host instead)."""
    import time

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(2):
        x = a @ x
    torch.cuda.synchronize()
    n = max(2, int(2 * ms / 1e3 / (time.perf_counter() - start)))
    for _ in range(n):
        x = a @ x


@pytest.mark.parametrize("thread", [False, True], ids=["engine thread", "loader thread"])
def test_a_load_with_host_slots_does_not_wait_for_a_busy_forward(thread):
    """vLLM passes slots on the host. A load must not copy them on the caller's stream (that
    waits for every queued forward): it returns while the forward still runs, and the KV is
    right once the forward is done (the scatter waited for it, the next forward waits for the
    scatter)."""
    import threading
    import time

    store = MemoryStore()
    src, dst = _caches("flash-2bnhd", 21), _caches("flash-2bnhd", 22)
    tokens = list(range(512))
    src_slots = slots_from_block_table(list(range(32)), N, 512, device="cuda")
    host_slots = slots_from_block_table(list(range(32, 64)), N, 512)  # on the host, as vLLM's block tables
    _transfer("flash-2bnhd", src, store).save_sequence(tokens, src_slots)
    loader = _transfer("flash-2bnhd", dst, store)
    loader.load_sequence(tokens, host_slots)  # warm: pools, pinned memory, kernels
    torch.cuda.synchronize()
    for c in dst:
        c.zero_()
    _busy(300)
    start = time.perf_counter()  # the forward is queued: it runs for about 300 ms from here
    got = []
    if thread:
        worker = threading.Thread(target=lambda: got.append(loader.load_sequence(tokens, host_slots)[0]))
        worker.start()
        worker.join()
    else:
        got.append(loader.load_sequence(tokens, host_slots)[0])
    returned = time.perf_counter() - start
    torch.cuda.synchronize()
    busy = time.perf_counter() - start
    assert got == [512]
    assert returned < busy / 2, (returned, busy)  # it did not wait for the forward
    assert all(torch.equal(d[:, 32:64], s[:, :32]) for d, s in zip(dst, src))


def _saved_prefix(seed: int) -> tuple[MemoryStore, list[torch.Tensor], list[torch.Tensor], list[int]]:
    """512 tokens of flash-layout KV saved into a fresh memory:// from blocks 0-31; an empty
    cache of the same shape to load into (blocks 32-63)."""
    store = MemoryStore()
    src, dst = _caches("flash-2bnhd", seed), _caches("flash-2bnhd", seed + 1)
    tokens = list(range(512))
    _transfer("flash-2bnhd", src, store).save_sequence(
        tokens, slots_from_block_table(list(range(32)), N, 512, device="cuda"))
    return store, src, dst, tokens


def test_device_slots_freed_by_their_maker_are_not_reused_while_the_scatter_reads_them():
    """Slots made on a stream the engine does not wait for, freed as soon as the load returns:
    the allocator must not hand their memory out before the (delayed) scatter has read them
    (``record_stream``), or KV lands in the wrong slots."""
    store, src, dst, tokens = _saved_prefix(23)
    loader = _transfer("flash-2bnhd", dst, store)
    other = torch.cuda.Stream()
    for _ in range(3):
        for c in dst:
            c.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(other):
            slots = slots_from_block_table(list(range(32, 64)), N, 512, device="cuda")
        _busy(200)  # the scatter waits behind it
        with torch.cuda.stream(other):
            assert loader.load_sequence(tokens, slots)[0] == 512
            del slots
            junk = torch.empty(512, dtype=torch.int64, device="cuda")  # the freed block, if it were free
            junk.fill_(0)  # slot 0: block 0 of every layer, were the scatter to read this
        torch.cuda.synchronize()
        assert all(torch.equal(d[:, 32:64], s[:, :32]) for d, s in zip(dst, src))
        assert all(not d[:, 0].any() for d in dst)


def test_a_load_in_windows_beside_a_busy_forward_lands_every_window():
    """Windows in the staging's two halves, DMAs on the copy stream, scatters behind the forward."""
    store, src, dst, tokens = _saved_prefix(25)
    record = 64 * L * 2 * H * D * 2
    lay = FlashLayout()
    ns = Namespace(model="gpu", model_fingerprint="f", kv_dtype="bfloat16", layout=lay.name, block_size=N,
                   chunk_tokens=64, layer_end=L)
    loader = KVTransfer(PrefixCache(store, ns), dst, lay, staging_bytes=2 * record)
    _busy(200)
    assert loader.load_sequence(tokens, slots_from_block_table(list(range(32, 64)), N, 512))[0] == 512
    torch.cuda.synchronize()
    assert all(torch.equal(d[:, 32:64], s[:, :32]) for d, s in zip(dst, src))
    saver = KVTransfer(PrefixCache(MemoryStore(), ns), src, lay, staging_bytes=2 * record)
    _busy(200)
    assert saver.save_sequence(tokens, slots_from_block_table(list(range(32)), N, 512)) == 8


def test_a_load_from_memory_on_cuda_hashes_its_records_once_not_per_load(monkeypatch):
    """memory:// keeps the digest each record's seal computed at the put: loads on the GPU
    compare digests, they do not hash the 268 MB again (the floor the first trace found)."""
    from kvstore.testing.hashes import count_hashes

    hashed = count_hashes(monkeypatch)
    store, src, dst, tokens = _saved_prefix(29)
    loader = _transfer("flash-2bnhd", dst, store)
    hashed.clear()
    for _ in range(3):
        assert loader.load_sequence(tokens, slots_from_block_table(list(range(32, 64)), N, 512))[0] == 512
    torch.cuda.synchronize()
    assert not [n for n in hashed if n >= 64 * L * 2 * H * D * 2]
    assert all(torch.equal(d[:, 32:64], s[:, :32]) for d, s in zip(dst, src))
