"""The connector with vLLM's hybrid KV cache allocator: several KV cache groups, sliding windows,
recurrent state. Scheduler -> metadata -> worker without an engine (tests/test_vllm_unit.py's
harness); the real-engine checks are in tests/test_vllm_hybrid.py."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # a skip on a developer machine, a failure in CI
    if __import__("os").environ.get("CI"):
        raise RuntimeError("vllm is not installed in CI")
    pytest.skip("vllm is not installed", allow_module_level=True)

from test_vllm_unit import BS, ask, facts, fake_request, fake_vllm_config, make_connector, paged, run_worker, step

from kvstore.connectors.vllm.facts import KVGroup, build_namespace, engine_facts
from kvstore.connectors.vllm.options import parse_options
from kvstore.connectors.vllm.plan import servable_ends, window_chunks, window_ends, window_start
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import BYPASSED
from kvstore.stores.memory import MemoryStore

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
WINDOW = 64
CHUNK = 64  # make_connector's chunk_tokens


def hybrid(window: int = WINDOW) -> SimpleNamespace:
    """Facts of a Gemma-2-like engine: layers 0 and 2 full attention, 1 and 3 a sliding window."""
    bpt = 2 * 2 * 32 * 2  # 2 layers x 2 heads x 32 (K|V of 16) x 2 bytes
    return replace(facts(), groups=(KVGroup(0, "full", (LAYERS[0], LAYERS[2]), bytes_per_token=bpt, isa="vec"),
                                    KVGroup(1, "sliding", (LAYERS[1], LAYERS[3]), window=window,
                                            bytes_per_token=bpt, isa="vec")))


class GroupManager:
    """vLLM's KV cache manager as the connector sees it: block ids per group per request."""

    def __init__(self) -> None:
        self.blocks: dict[str, tuple[list[int], ...]] = {}

    def get_block_ids(self, req_id):
        return self.blocks[req_id]


class GroupBlocks:
    def __init__(self, ids: tuple[list[int], ...]) -> None:
        self.ids = ids

    def get_block_ids(self):
        return self.ids


def connectors(store, f, **extra):
    sched, work = make_connector("scheduler", store, f, **extra), make_connector("worker", store, f, **extra)
    sched._kv_cache_manager = GroupManager()
    return sched, work


def rows(cache: torch.Tensor, blocks: list[int], start: int, end: int) -> torch.Tensor:
    return torch.stack([cache[blocks[i // BS], :, i % BS] for i in range(start, end)])


# -- the arithmetic ----------------------------------------------------------------------------

def test_a_window_needs_the_blocks_vllm_keeps_before_the_end():
    # The next token after `end` attends to [end - window + 1, end); vLLM keeps that span's blocks.
    assert window_start(288, 64, 32) == 224 and window_start(63, 64, 32) == 0 and window_start(64, 64, 32) == 0
    assert window_start(65, 64, 32) == 0 and window_start(97, 64, 32) == 32
    assert list(window_chunks(288, 64, 32, 64)) == [3, 4]  # [192, 256) and the partial [256, 288)
    assert list(window_chunks(256, 64, 32, 64)) == [3]
    assert list(window_chunks(4096, 1024, 32, 256)) == [12, 13, 14, 15]


def test_windows_are_stored_at_the_prompt_end_and_at_each_interval():
    ends = [256, 512, 768, 1024, 1184]
    assert window_ends(ends, 1200, 32, 256, 0) == [1184]
    assert window_ends(ends, 1200, 32, 256, 512) == [512, 1024, 1184]
    assert window_ends(ends, 1200, 32, 256, 600) == [768, 1184]  # the first end at or past each multiple
    assert window_ends([256], 1200, 32, 256, 0) == []


def test_an_end_is_servable_where_its_whole_window_is_present():
    ends = [64, 128, 192, 256, 288]
    present = [False, False, False, True, True]
    assert servable_ends(ends, present, 64, 32, 64) == {256, 288}
    assert servable_ends(ends, [True, True, True, False, True], 64, 32, 64) == {64, 128, 192}


# -- facts and namespaces ----------------------------------------------------------------------

def test_engine_facts_keep_every_group_and_name_each_one():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    cfg, kv = fake_vllm_config()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=full, layer_names=[LAYERS[0], LAYERS[2]]),
                          SimpleNamespace(kv_cache_spec=sliding, layer_names=[LAYERS[3], LAYERS[1]])]
    opts = parse_options({"store": "memory://", "chunk_tokens": 64})
    f = engine_facts(cfg, kv, opts)
    assert [(g.kind, g.window, g.layers) for g in f.kv_groups] == [
        ("full", 0, (LAYERS[0], LAYERS[2])), ("sliding", 128, (LAYERS[1], LAYERS[3]))]
    assert f.restorable and f.bytes_per_token == f.kv_groups[0].bytes_per_token  # a load is sized by full groups
    spaces = [build_namespace(f, opts, 0, g)[0] for g in f.kv_groups]
    assert spaces[0].id != spaces[1].id and all(ns.layer_end == 2 for ns in spaces)
    # An engine with one group keeps the namespace it had before groups existed.
    one = engine_facts(*fake_vllm_config(), opts)
    assert build_namespace(one, opts, 0)[0].id == build_namespace(replace(one, groups=()), opts, 0)[0].id


def test_engine_facts_know_every_kind_vllm_makes_and_refuse_the_others_by_name():
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SinkFullAttentionSpec,
        SlidingWindowMLASpec,
    )

    cfg, kv = fake_vllm_config()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")
    local = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                      attention_chunk_size=128)
    kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=full, layer_names=[LAYERS[3]]),
                          SimpleNamespace(kv_cache_spec=mamba, layer_names=LAYERS[:1]),
                          SimpleNamespace(kv_cache_spec=local, layer_names=LAYERS[1:3])]
    opts = parse_options({"store": "memory://", "chunk_tokens": 64})
    f = engine_facts(cfg, kv, opts)
    assert [(g.kind, g.window) for g in f.kv_groups] == [("full", 0), ("state", 0), ("local", 128)]
    assert f.restorable and f.stored_groups == f.kv_groups
    for other in (SinkFullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sink_len=4),
                  SlidingWindowMLASpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                       sliding_window=128)):
        kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=full, layer_names=[LAYERS[3]]),
                              SimpleNamespace(kv_cache_spec=other, layer_names=LAYERS[:3])]
        with pytest.raises(ConfigError, match=type(other).__name__):
            engine_facts(cfg, kv, opts)


def test_mla_latents_are_stored_once_for_every_tensor_parallel_rank():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    cfg, kv = fake_vllm_config(tp=2)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=mla, layer_names=LAYERS)]
    opts = parse_options({"store": "memory://", "chunk_tokens": 64})
    f = engine_facts(cfg, kv, opts)
    assert [g.kind for g in f.kv_groups] == ["mla"] and f.tp_size == 2
    (ns0, layout), (ns1, _) = (build_namespace(f, opts, rank, f.kv_groups[0]) for rank in (0, 1))
    assert layout.name == "mla-bnl" and ns0.id == ns1.id and (ns0.tp_rank, ns0.tp_size) == (0, 1)
    # Rank 1 saves nothing, rank 0 one copy; a reader's rank 1 loads rank 0's copy.
    store = MemoryStore()
    f = replace(f, block_size=16)
    latents = [torch.randn(12, 16, 576, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
               for r in range(4)]
    tokens = list(range(100, 229))  # limit 128: two chunks
    blocks = [list(range(1, 10))]
    from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec

    for rank in (1, 0):
        worker = make_connector("worker", store, f)
        worker.worker = type(worker.worker)(store, f, worker.opts, rank)
        worker.register_kv_caches(dict(zip(LAYERS, latents)))
        worker.bind_connector_metadata(KVStoreConnectorMetadata(saves=[SaveSpec("w", tokens[:128], blocks, [128])]))
        worker.wait_for_save()
        assert worker.worker.wait_idle(10)
        assert len(list(store.iter_keys())) == (0 if rank == 1 else 2)
    reader = make_connector("worker", store, f)
    reader.worker = type(reader.worker)(store, f, reader.opts, 1)
    dst = [torch.zeros(12, 16, 576, dtype=torch.bfloat16) for _ in range(4)]
    reader.register_kv_caches(dict(zip(LAYERS, dst)))
    target = [[5, 6, 7, 8, 9, 10, 11, 4]]
    run_worker(reader, KVStoreConnectorMetadata(loads=[LoadSpec("r", tokens[:128], target, 0, 128, background=True)]))
    for src, got in zip(latents, dst):
        assert torch.equal(got[target[0]].reshape(-1, 576), src[blocks[0][:8]].reshape(-1, 576))


def test_a_model_whose_state_vllm_does_not_keep_at_block_boundaries_bypasses_every_request():
    """Prefix caching off (mamba_cache_mode='none'): vLLM keeps one running state per request,
    none a later prompt could resume from; the engine starts, computes every prompt, counts it."""
    store = MemoryStore()
    f = replace(facts(), groups=(KVGroup(0, "full", (LAYERS[3],), isa="vec"),
                                 KVGroup(1, "state", tuple(LAYERS[:3]), aligned=False)))
    assert not f.restorable and f.stored_groups == ()
    sched, work = connectors(store, f)
    before = BYPASSED.value(reason="recurrent_state")
    req = fake_request("m", list(range(300)))
    assert ask(sched, req, 0) == (0, False) and ask(sched, req, 0) == (0, False)
    assert BYPASSED.value(reason="recurrent_state") == before + 1  # once per request
    meta = step(sched, req, ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11]), computed=0, scheduled=300, new=True)
    assert not meta.saves and not meta.loads
    work.register_kv_caches(paged("cpu"))
    run_worker(work, meta)
    assert not list(store.iter_keys())


def test_mla_on_vllm_cpus_reference_backend_bypasses_every_request():
    """vLLM CPU without AMX tiles runs MLA on its reference backend, which cannot compute a prompt
    over cached latents, and turns prefix caching off for it: the engine starts, computes every
    prompt, counts it; with prefix caching on (the AMX MLA backend) latents are stored."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    cfg, kv = fake_vllm_config()
    kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                                         dtype=torch.bfloat16), layer_names=LAYERS)]
    opts = parse_options({"store": "memory://", "chunk_tokens": 64})
    cfg.cache_config.enable_prefix_caching = True
    assert engine_facts(cfg, kv, opts).restorable
    cfg.cache_config.enable_prefix_caching = False
    f = engine_facts(cfg, kv, opts)
    assert f.bypass == "mla_backend" and not f.restorable and f.stored_groups == ()
    store = MemoryStore()
    sched, work = connectors(store, replace(f, block_size=16))
    before = BYPASSED.value(reason="mla_backend")
    req = fake_request("m", list(range(300)))
    assert ask(sched, req, 0) == (0, False) and ask(sched, req, 0) == (0, False)
    assert BYPASSED.value(reason="mla_backend") == before + 1
    meta = step(sched, req, (list(range(1, 20)),), computed=0, scheduled=300, new=True)
    assert not meta.saves and not meta.loads and not list(store.iter_keys())


def test_sync_loads_are_refused_with_several_groups():
    with pytest.raises(ConfigError, match=r"load_mode='sync'.*async"):
        make_connector("worker", MemoryStore(), hybrid(), load_mode="sync")


# -- save and load per group -------------------------------------------------------------------

def write_prompt(store, tokens, *, computed=0, blocks=None, **extra):
    """Engine A computes ``tokens`` in one step and saves what it completes; returns its caches."""
    sched, work = connectors(store, hybrid(), **extra)
    src = paged("cpu", seed=1, num_blocks=80)
    work.register_kv_caches(src)
    req = fake_request("a", tokens)
    assert ask(sched, req, 0) == (0, False)
    n = -(-len(tokens) // BS)
    blocks = blocks or ([10 + i for i in range(n)], [30 + i for i in range(n)])
    sched._kv_cache_manager.blocks["a"] = blocks
    sched.update_state_after_alloc(req, GroupBlocks(blocks), 0)
    run_worker(work, step(sched, req, blocks, computed=computed, scheduled=len(tokens) - computed, new=True))
    return src, blocks


def test_full_groups_store_every_chunk_and_sliding_groups_their_window():
    store = MemoryStore()
    tokens = list(range(1000, 2000))  # limit 992: 15 full chunks and a partial one
    write_prompt(store, tokens, window_interval=0)
    f = hybrid()
    opts = parse_options({"store": "memory://", "chunk_tokens": CHUNK})
    by_group = [sum(1 for k in store.iter_keys() if build_namespace(f, opts, 0, g)[0].id in k) for g in f.kv_groups]
    assert by_group == [16, len(window_chunks(992, WINDOW, BS, CHUNK))] == [16, 2]
    # The bytes a sliding-window group stores per prompt are bounded by its window, not the prompt.
    sizes = {k: len(bytes(store.get(k))) for k in store.iter_keys()}
    sliding = sum(v for k, v in sizes.items() if build_namespace(f, opts, 0, f.kv_groups[1])[0].id in k)
    assert sliding <= (WINDOW + CHUNK) * f.kv_groups[1].bytes_per_token * 1.1


def test_a_reader_loads_every_group_and_never_writes_outside_the_window():
    store = MemoryStore()
    tokens = list(range(1000, 1300))  # limit 288: window end 288 needs chunks 3 and 4
    src, (src_full, src_win) = write_prompt(store, tokens)
    sched, work = connectors(store, hybrid())
    dst = paged("cpu", seed=2, num_blocks=48)
    before = {k: v.clone() for k, v in dst.items()}
    work.register_kv_caches(dst)
    req = fake_request("b", tokens)
    assert ask(sched, req, 0) == (288, True)
    # vLLM hands the sliding-window group null blocks (id 0) before the window of the hit's end.
    full = [20 + i for i in range(10)]
    win = [0] * 7 + [40, 41, 42]
    assert window_start(288, WINDOW, BS) // BS == 7
    sched._kv_cache_manager.blocks["b"] = (full, win)
    sched.update_state_after_alloc(req, GroupBlocks((full, win)), 288)
    meta = step(sched, req, (full, win), computed=0, scheduled=0, new=True, waiting=True)
    assert [(s.start, s.end, [len(ids) for ids in s.block_ids]) for s in meta.loads] == [(0, 288, [9, 9])]
    run_worker(work, meta)
    assert work.last_finished[1] == {"b"} and not work.worker.failed_loads()
    for layer in (LAYERS[0], LAYERS[2]):
        assert torch.equal(rows(dst[layer], full, 0, 288), rows(src[layer], src_full, 0, 288))
    for layer in (LAYERS[1], LAYERS[3]):
        assert torch.equal(rows(dst[layer], win, 224, 288), rows(src[layer], src_win, 224, 288))
        assert torch.equal(dst[layer][0], before[layer][0])  # the null block is never written


def test_no_window_no_hit_and_a_lost_window_fails_the_request():
    store = MemoryStore()
    tokens = list(range(1000, 1300))
    write_prompt(store, tokens)
    f = hybrid()
    opts = parse_options({"store": "memory://", "chunk_tokens": CHUNK})
    window_ns = build_namespace(f, opts, 0, f.kv_groups[1])[0].id
    # A reader of a longer prompt: the full groups hold 4 whole chunks and the window of 256 too.
    sched, _ = connectors(store, f)
    assert ask(sched, fake_request("long", tokens[:256] + list(range(5000, 5100))), 0) == (256, True)
    # The window record of the prompt's last chunk goes: a hit at 288 is no longer servable.
    window_keys = sched.scheduler.group_caches[1][0].keys(tokens[:288])
    assert [k.key for k in window_keys[3:]] == sorted((k for k in store.iter_keys() if window_ns in k),
                                                      key=[k.key for k in window_keys].index)
    store.delete_many([window_keys[4].key])
    sched, _ = connectors(store, f)
    assert ask(sched, fake_request("c", tokens), 0) == (256, True)
    # And one that goes between the lookup and the load fails the whole request (vLLM recomputes it).
    sched, work = connectors(store, f)
    work.register_kv_caches(paged("cpu", seed=3, num_blocks=48))
    req = fake_request("d", tokens)
    assert ask(sched, req, 0) == (256, True)
    blocks = ([20 + i for i in range(9)], [0] * 6 + [40, 41, 42])
    sched._kv_cache_manager.blocks["d"] = blocks
    sched.update_state_after_alloc(req, GroupBlocks(blocks), 256)
    meta = step(sched, req, blocks, computed=0, scheduled=0, new=True, waiting=True)
    store.delete_many([k for k in store.iter_keys() if window_ns in k])
    work.bind_connector_metadata(meta)
    work.start_load_kv(None)
    work.wait_for_save()
    assert work.worker.wait_idle(10)
    results = work.get_transfer_results(set())
    assert results.finished_recving == {"d"} and results.failed_recving == {"d"}
    assert work.get_block_ids_with_load_errors() == set()  # block ids of several groups say nothing


def test_multimodal_prompts_bypass_and_are_counted():
    store = MemoryStore()
    sched, _ = connectors(store, facts())
    before = BYPASSED.value(reason="multimodal")
    req = SimpleNamespace(request_id="mm", prompt_token_ids=list(range(300)), cache_salt=None,
                          mm_features=[SimpleNamespace(identifier="img-1")])
    assert ask(sched, req, 0) == (0, False) and ask(sched, req, 0) == (0, False)
    assert BYPASSED.value(reason="multimodal") == before + 1
    assert not step(sched, req, ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],), computed=0, scheduled=300, new=True).saves
