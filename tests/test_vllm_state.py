"""Recurrent state (Mamba, gated delta nets) and chunked local attention (Llama 4) with the
connector, without an engine: vLLM's real spec classes, the scheduler -> metadata -> worker path
over state pages shaped as vLLM hands them over (``[blocks, 1, 1, state bytes]`` int8), and the
edge cases a real engine rarely shows. The real-engine checks are in tests/test_vllm_hybrid.py."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # a skip on a developer machine, a failure in CI
    if __import__("os").environ.get("CI"):
        raise RuntimeError("vllm is not installed in CI")
    pytest.skip("vllm is not installed", allow_module_level=True)

from test_vllm_groups import GroupBlocks, connectors
from test_vllm_unit import BS, ask, facts, fake_request, fake_vllm_config, run_worker, step

from kvstore.connectors.vllm.facts import STATE_LAYOUT, KVGroup, build_namespace, engine_facts, resolve_chunk_tokens
from kvstore.connectors.vllm.options import parse_options
from kvstore.connectors.vllm.plan import state_ends, window_chunks, window_start
from kvstore.cost import CostModel
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import BYPASSED, CORRUPT
from kvstore.stores.memory import MemoryStore
from kvstore.stores.speed import LinkSpeed
from kvstore.testing.damage import flip_byte

CHUNK = 64  # make_connector's chunk_tokens
STATE_LAYERS = [f"model.layers.{i}.linear_attn" for i in range(3)]
FULL_LAYER = "model.layers.3.self_attn.attn"
#: A tiny Qwen3-Next's gated-delta-net state per layer: its conv window and its SSM state.
GDN = (((3, 192), "bfloat16"), ((1, 64, 64), "float32"))
STATE_BYTES = 3 * 192 * 2 + 64 * 64 * 4  # 17,536


def recurrent(*, checkpoints: bool = False) -> SimpleNamespace:
    """Facts of a Qwen3-Next-like engine: three gated-delta-net layers (a state group each, as
    vLLM groups them) and one full-attention layer."""
    states = tuple(KVGroup(i, "state", (STATE_LAYERS[i],), block_size=BS, state_backend="GDN_ATTN",
                           state_tensors=GDN, checkpoints=checkpoints) for i in range(3))
    full = KVGroup(3, "full", (FULL_LAYER,), bytes_per_token=2 * 32 * 2, isa="vec")
    return replace(facts(), groups=(*states, full))


def caches(seed: int, num_blocks: int = 160) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randint(-128, 128, (num_blocks, 1, 1, STATE_BYTES), generator=g, dtype=torch.int8)
           for n in STATE_LAYERS}
    out[FULL_LAYER] = torch.randn(num_blocks, 2, BS, 32, generator=g).to(torch.bfloat16)
    return out


def tables(full: list[int], state: list[list[int]]) -> tuple[list[int], ...]:
    return (*state, full)


def by_namespace(store, f, opts=None) -> list[int]:
    """Records per group of ``f`` (vLLM's group order)."""
    opts = opts or parse_options({"store": "memory://", "chunk_tokens": CHUNK})
    spaces = [build_namespace(f, opts, 0, g)[0].id for g in f.kv_groups]
    return [sum(1 for k in store.iter_keys() if ns in k) for ns in spaces]


def write(store, tokens, steps, *, seed=1, f=None, **extra):
    """An engine computes ``tokens`` in prefill steps ending at ``steps`` (as vLLM's align mode
    schedules them) and saves what each step completes; returns its caches and block tables
    (block i of every table: a block of its own)."""
    f = f or recurrent()
    sched, work = connectors(store, f, **extra)
    src = caches(seed)
    work.register_kv_caches(src)
    req = fake_request("a", tokens)
    assert ask(sched, req, 0) == (0, False)
    n = -(-len(tokens) // BS)
    blocks = tables(list(range(1, n + 1)), [list(range(1 + n, 1 + 2 * n))] * 3)
    sched._kv_cache_manager.blocks["a"] = blocks
    sched.update_state_after_alloc(req, GroupBlocks(blocks), 0)
    done = 0
    metas = []
    for end in steps:
        meta = step(sched, req, blocks, computed=done, scheduled=end - done, new=done == 0)
        metas.append(meta)
        run_worker(work, meta)
        done = end
    return src, blocks, metas, work


def read(store, tokens, hit, *, seed=2, f=None, req_id="b"):
    """A fresh engine looks ``tokens`` up and loads the hit into a state block of its own (vLLM
    hands the state groups null blocks before the hit's last block); returns its caches, tables
    and the worker's transfer results."""
    f = f or recurrent()
    sched, work = connectors(store, f)
    dst = caches(seed)
    before = {k: v.clone() for k, v in dst.items()}
    work.register_kv_caches(dst)
    req = fake_request(req_id, tokens)
    assert ask(sched, req, 0) == (hit, hit > 0)
    if not hit:
        return dst, None, None, sched
    n = hit // BS
    blocks = tables([40 + i for i in range(n)], [[0] * (n - 1) + [60 + g] for g in range(3)])
    sched._kv_cache_manager.blocks[req_id] = blocks
    sched.update_state_after_alloc(req, GroupBlocks(blocks), hit)
    meta = step(sched, req, blocks, computed=0, scheduled=0, new=True, waiting=True)
    assert [(s.start, s.end) for s in meta.loads] == [(0, hit)]
    work.bind_connector_metadata(meta)
    work.start_load_kv(None)
    work.wait_for_save()
    assert work.worker.wait_idle(10)
    results = work.get_transfer_results(set())
    for g in range(3):
        assert torch.equal(dst[STATE_LAYERS[g]][0], before[STATE_LAYERS[g]][0])  # the null block: never written
    return dst, blocks, results, sched


# -- arithmetic ------------------------------------------------------------------------------------

def test_a_state_is_stored_where_vllm_holds_it_at_the_same_few_ends_as_a_window():
    kw = dict(block_size=32, chunk_tokens=256, interval=2048, checkpoints=False)
    # A prompt of 5,000 tokens in 4,096-token steps: the first interval end a step ends at, and
    # the prompt's last hittable end, where vLLM's align mode ends a step.
    assert state_ends([4096], 5000, 0, 4096, **kw) == [4096]
    assert state_ends([4352, 4608, 4864, 4992], 5000, 4096, 4992, **kw) == [4992]
    # An interval end inside a step holds no state: none stored there.
    assert state_ends([2048, 2304], 5000, 0, 2400, **kw) == []
    # Mamba2 writes the prompt's last hittable end from inside the step that passes it.
    assert state_ends([4992], 5000, 4096, 5000, **kw) == []
    assert state_ends([4992], 5000, 4096, 5000, **{**kw, "checkpoints": True}) == [4992]
    # Decode: a chunk end the step ends at, past an interval.
    assert state_ends([6144], 5000, 6143, 6144, **kw) == [6144]
    assert state_ends([5888], 5000, 5887, 5888, **kw) == []
    assert state_ends([4992], 5000, 4096, 4992, **{**kw, "interval": 0}) == [4992]


def test_chunked_local_attention_needs_its_attention_chunk_before_the_end():
    # The next token after `end` attends from the start of its attention chunk (128 tokens).
    assert window_start(288, 128, 32, local=True) == 256 and window_start(256, 128, 32, local=True) == 256
    assert list(window_chunks(288, 128, 32, 64, local=True)) == [4]  # [256, 288)
    assert list(window_chunks(256, 128, 32, 64, local=True)) == []  # a new attention chunk: nothing
    assert list(window_chunks(4000, 1024, 32, 256, local=True)) == [12, 13, 14, 15]


# -- facts and namespaces --------------------------------------------------------------------------

def test_vllm_state_groups_become_state_facts_and_their_own_namespace():
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    cfg, kv = fake_vllm_config()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    gdn = MambaSpec(block_size=BS, shapes=((3, 192), (1, 64, 64)), dtypes=(torch.bfloat16, torch.float32),
                    page_size_padded=32768, mamba_cache_mode="align", mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=gdn, layer_names=[n]) for n in STATE_LAYERS]
    kv.kv_cache_groups.append(SimpleNamespace(kv_cache_spec=full, layer_names=[FULL_LAYER]))
    opts = parse_options({"store": "memory://", "chunk_tokens": CHUNK})
    f = engine_facts(cfg, kv, opts)
    state = f.kv_groups[0]
    assert (state.kind, state.block_size, state.state_tensors, state.aligned, state.checkpoints) == (
        "state", BS, GDN, True, False)
    assert state.state_bytes == STATE_BYTES and f.restorable and f.bytes_per_token == f.kv_groups[3].bytes_per_token
    ns, layout = build_namespace(f, opts, 0, state)
    assert layout is None and (ns.layout, ns.kv_dtype, ns.layer_end) == (STATE_LAYOUT, "uint8", 1)
    assert dict(ns.extra)["state"] == "GDN_ATTN:bfloat16[3, 192],float32[1, 64, 64]"
    # The namespace names the state's kind, shapes and dtypes: a state record is never read as KV
    # (nor as another group's, another shape's or another dtype's state).
    others = [build_namespace(f, opts, 0, g)[0] for g in f.kv_groups[1:]]
    others.append(build_namespace(replace(f, groups=(replace(state, state_tensors=((( 3, 192), "bfloat16"),
                                                                                   ((1, 64, 64), "bfloat16"))),)),
                                  opts, 0)[0])
    others.append(build_namespace(replace(f, groups=(replace(state, state_backend="MAMBA2"),)), opts, 0)[0])
    assert len({ns.id, *(o.id for o in others)}) == len(others) + 1
    # Mamba2 exports the prompt's checkpoint from inside a step; prefix caching off keeps no state.
    mamba2 = MambaSpec(block_size=BS, shapes=((3, 288), (8, 32, 16)), dtypes=(torch.bfloat16, torch.float32),
                       mamba_cache_mode="align", num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    kv.kv_cache_groups[0] = SimpleNamespace(kv_cache_spec=mamba2, layer_names=[STATE_LAYERS[0]])
    assert engine_facts(cfg, kv, opts).kv_groups[0].checkpoints
    kv.kv_cache_groups[0] = SimpleNamespace(kv_cache_spec=replace(gdn, block_size=1024, mamba_cache_mode="none"),
                                            layer_names=[STATE_LAYERS[0]])
    off = engine_facts(cfg, kv, opts)
    assert not off.restorable and off.stored_groups == ()
    kv.kv_cache_groups[0] = SimpleNamespace(kv_cache_spec=replace(gdn, num_speculative_blocks=1),
                                            layer_names=[STATE_LAYERS[0]])
    assert not engine_facts(cfg, kv, opts).restorable  # speculative state blocks move states around


def test_chunk_sizes_that_cannot_line_up_with_the_state_blocks_are_refused_naming_both():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    cfg, kv = fake_vllm_config()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    gdn = MambaSpec(block_size=128, shapes=((3, 192), (1, 64, 64)), dtypes=(torch.bfloat16, torch.float32),
                    mamba_cache_mode="align")
    kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=gdn, layer_names=STATE_LAYERS),
                          SimpleNamespace(kv_cache_spec=full, layer_names=[FULL_LAYER])]
    with pytest.raises(ConfigError, match=r"chunk_tokens=64 cannot line up with vLLM's mamba block size 128"):
        engine_facts(cfg, kv, parse_options({"store": "memory://", "chunk_tokens": 64}))
    with pytest.raises(ConfigError, match=r"attention block size=32 cannot line up with vLLM's mamba block size 128"):
        engine_facts(cfg, kv, parse_options({"store": "memory://", "chunk_tokens": 256}))


def test_without_chunk_tokens_the_chunk_fits_every_groups_blocks_and_a_set_value_is_kept_or_refused(caplog):
    """vLLM's align mode makes a hybrid's blocks as long as one attention page takes to hold a
    layer's state (a tiny Qwen3-Next from a plain config: 4,192 tokens), so no fixed default fits
    every model: chunk_tokens left at 0 becomes the smallest multiple of every block size that is
    at least 256, logged; a value the user set is kept, or refused naming both numbers."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    def facts_with(block: int, *, state: bool = True):
        cfg, kv = fake_vllm_config()
        full = FullAttentionSpec(block_size=block, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
        kv.kv_cache_groups = [SimpleNamespace(kv_cache_spec=full, layer_names=[FULL_LAYER])]
        if state:
            gdn = MambaSpec(block_size=block, shapes=((3, 192), (1, 64, 64)), dtypes=(torch.bfloat16, torch.float32),
                            mamba_cache_mode="align")
            kv.kv_cache_groups.insert(0, SimpleNamespace(kv_cache_spec=gdn, layer_names=STATE_LAYERS))
        return lambda opts: engine_facts(cfg, kv, opts)

    auto = parse_options({"store": "memory://"})
    assert auto.chunk_tokens == 0
    for block, chosen in ((4192, 4192), (160, 320), (32, 256), (96, 288)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvstore.vllm"):
            f = facts_with(block)(auto)
            resolved = resolve_chunk_tokens(auto, f)
        assert resolved.chunk_tokens == chosen, block
        assert f"chunk_tokens={chosen} (not set" in caplog.text
        assert build_namespace(f, resolved, 0, f.kv_groups[-1])[0].chunk_tokens == chosen
    assert resolve_chunk_tokens(auto, facts_with(32, state=False)(auto)).chunk_tokens == 256
    mine = parse_options({"store": "memory://", "chunk_tokens": 8384})
    assert resolve_chunk_tokens(mine, facts_with(4192)(mine)) is mine
    with pytest.raises(ConfigError, match=r"chunk_tokens=256 cannot line up with vLLM's mamba block size 4192"):
        facts_with(4192)(parse_options({"store": "memory://", "chunk_tokens": 256}))


def test_pipeline_parallelism_is_refused_naming_what_is_missing():
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2\): vLLM gives the scheduler's connector the KV "
                                          r"cache layers of the first stage only"):
        engine_facts(*fake_vllm_config(pp=2), parse_options({"store": "memory://"}))


# -- save and load ---------------------------------------------------------------------------------

def test_the_state_is_stored_with_the_chunk_it_ends_and_restored_into_the_hits_last_block():
    store = MemoryStore()
    tokens = list(range(1000, 1300))  # hit limit 288: vLLM's align mode ends the first step there
    before = BYPASSED.value(reason="recurrent_state")
    src, (*src_states, src_full), metas, _ = write(store, tokens, [288, 300])
    assert [(s.ends, s.state_ends) for s in metas[0].saves] == [([256, 288], [288])]
    assert not metas[1].saves
    assert by_namespace(store, recurrent()) == [1, 1, 1, 5]  # one state per group, every chunk of the full group
    dst, (*dst_states, dst_full), results, sched = read(store, tokens, 288)
    assert results.finished_recving == {"b"} and not results.failed_recving
    for g in range(3):  # the state after 288 tokens, into the block vLLM allocated for the hit's last block
        assert torch.equal(dst[STATE_LAYERS[g]][dst_states[g][8]], src[STATE_LAYERS[g]][src_states[g][8]])
    for i in range(9):
        assert torch.equal(dst[FULL_LAYER][dst_full[i]], src[FULL_LAYER][src_full[i]])
    assert BYPASSED.value(reason="recurrent_state") == before  # a supported family bypasses nothing
    # The cost model weighs the states a hit loads beside its chunks.
    assert sched.scheduler.hit_bytes == 3 * STATE_BYTES


def test_what_a_state_group_stores_per_prompt_is_bounded_by_the_interval_not_the_prompt():
    tokens = list(range(3000, 5000))  # limit 1984; steps of 512 (a token budget), then the split at 1984
    steps = [512, 1024, 1536, 1984, 2000]
    for interval, states in ((1024, 2), (0, 1), (512, 4)):
        store = MemoryStore()
        *_, metas, _ = write(store, tokens, steps, window_interval=interval)
        assert by_namespace(store, recurrent())[:3] == [states] * 3, interval
        state_bytes = sum(len(bytes(store.get(k))) for k in store.iter_keys()
                          if build_namespace(recurrent(), parse_options({"store": "memory://", "chunk_tokens": CHUNK}),
                                             0, recurrent().kv_groups[0])[0].id in k)
        assert states * STATE_BYTES < state_bytes < states * (STATE_BYTES + 1024)


def test_a_missing_state_is_a_shorter_hit_a_corrupt_one_a_recompute_and_both_heal():
    tokens = list(range(3000, 5000))
    steps = [512, 1024, 1536, 1984, 2000]
    store = MemoryStore()
    write(store, tokens, steps, window_interval=1024)
    f = recurrent()
    opts = parse_options({"store": "memory://", "chunk_tokens": CHUNK})
    state_ns = build_namespace(f, opts, 0, f.kv_groups[1])[0]
    sched, work = connectors(store, f)
    work.register_kv_caches(caches(3))
    last = next(k for k in work.worker.states[1].keys(tokens, [1984], state_ns))
    # Missing: the hit ends at the last end every group still serves (1024).
    value = bytes(store.get(last.key))
    store.delete_many([last.key])
    dst, _, results, _ = read(store, tokens, 1024, req_id="short")
    assert results.finished_recving == {"short"} and not results.failed_recving
    # The engine computes from 1024; the step that ends at 1984 stores that state again: healed.
    sched, work = connectors(store, f)
    work.register_kv_caches(caches(4))
    req = fake_request("r", tokens)
    assert ask(sched, req, 1024) == (0, False)  # vLLM's own hit (what the load left in its cache)
    blocks = tables(list(range(1, 64)), [list(range(64, 127))] * 3)
    sched._kv_cache_manager.blocks["r"] = blocks
    sched.update_state_after_alloc(req, GroupBlocks(blocks), 0)
    meta = step(sched, req, blocks, computed=1024, scheduled=960, new=True)
    assert [s.state_ends for s in meta.saves] == [[1984]]
    run_worker(work, meta)
    assert store.get(last.key) is not None
    read(store, tokens, 1984, req_id="full")
    # Corrupt: the lookup sees it stored; the load rejects it (counted, deleted) and the request is
    # recomputed whole; the recompute's saves rewrite it, and the next reader hits fully.
    store.put(last.key, value)
    flip_byte(store, last.key, offset=-100, mask=1)
    bad = CORRUPT.total()
    _, _, results, sched = read(store, tokens, 1984, req_id="c")
    assert results.finished_recving == results.failed_recving == {"c"} and CORRUPT.total() == bad + 1
    assert store.get(last.key) is None
    sched.update_connector_output(SimpleNamespace(finished_recving={"c"}, failed_recving={"c"},
                                                  invalid_block_ids=set()))
    req = fake_request("c", tokens)
    assert ask(sched, req, 0) == (0, False)  # a failed load is never offered again
    work = connectors(store, f)[1]
    work.register_kv_caches(caches(5))
    blocks = tables(list(range(1, 64)), [list(range(64, 127))] * 3)
    done = 0
    for end in steps:
        meta = step(sched, req, blocks, computed=done, scheduled=end - done, new=done == 0)
        run_worker(work, meta)
        done = end
    assert store.get(last.key) is not None
    read(store, tokens, 1984, req_id="healed")


def test_kv_events_announce_a_prefix_once_every_group_can_serve_it():
    class Recorder:
        def __init__(self) -> None:
            self.ranges: list[tuple[int, int]] = []

        def stored(self, keys, tokens, medium, *, first=0, until=None, cache_salt="", lora_name=None) -> int:
            chosen = [k for k in keys[first:] if not k.partial and (until is None or k.end <= until)]
            if chosen:
                self.ranges.append((chosen[0].start, chosen[-1].end))
            return len(chosen)

    store = MemoryStore()
    tokens = list(range(3000, 5000))
    f = recurrent()
    sched, work = connectors(store, f, window_interval=1024)
    work.register_kv_caches(caches(1))
    recorder = Recorder()
    work.worker.transfers[3].cache.announce(recorder, ["CPU"])
    req = fake_request("a", tokens)
    ask(sched, req, 0)
    blocks = tables(list(range(1, 64)), [list(range(64, 127))] * 3)
    sched._kv_cache_manager.blocks["a"] = blocks
    sched.update_state_after_alloc(req, GroupBlocks(blocks), 0)
    done = 0
    for end in (512, 1024, 1536, 1984, 2000):
        run_worker(work, step(sched, req, blocks, computed=done, scheduled=end - done, new=done == 0))
        done = end
    # Chunks up to 512 hold no state at their end: a router would over-count them. Announced at
    # 1024 (its state stored) and at 1984, from where the last announcement ended.
    assert recorder.ranges == [(0, 1024), (1024, 1984)]


def test_a_cost_model_weighs_the_state_bytes_a_hit_loads():
    speed = LinkSpeed("slow")
    model = CostModel("auto")
    model.observe_reads(speed, 10_000_000, 1.0, 1)  # 10 MB/s
    model.observe_prefill(10_000, 1.0)
    chunks = [64] * 4
    plain = model.plan([(speed, 4)], chunks, 1000)
    with_state = model.plan([(speed, 4)], chunks, 1000, extra_bytes=3 * STATE_BYTES)
    assert with_state.load_seconds == pytest.approx(plain.load_seconds + 3 * STATE_BYTES / 10_000_000, rel=1e-6)
    # A hit whose state costs more to load than its tokens cost to compute is recomputed.
    assert not model.plan([(speed, 4)], chunks, 1000, extra_bytes=10_000_000).loads


def test_chunked_local_attention_stores_and_loads_the_attention_chunk_before_the_end():
    store = MemoryStore()
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    bpt = 2 * 2 * 32 * 2
    f = replace(facts(), groups=(KVGroup(0, "local", (layers[0], layers[1]), window=128, bytes_per_token=bpt, isa="vec"),
                                 KVGroup(1, "full", (layers[2], layers[3]), bytes_per_token=bpt, isa="vec")))
    from test_vllm_unit import paged

    tokens = list(range(1000, 1300))  # limit 288: the local group needs [256, 288)
    sched, work = connectors(store, f)
    src = paged("cpu", seed=1, num_blocks=64)
    work.register_kv_caches(src)
    req = fake_request("a", tokens)
    ask(sched, req, 0)
    blocks = ([1 + i for i in range(10)], [20 + i for i in range(10)])
    sched._kv_cache_manager.blocks["a"] = blocks
    sched.update_state_after_alloc(req, GroupBlocks(blocks), 0)
    meta = step(sched, req, blocks, computed=0, scheduled=300, new=True)
    assert meta.saves[0].window_ends == [288]
    run_worker(work, meta)
    opts = parse_options({"store": "memory://", "chunk_tokens": CHUNK})
    assert [sum(1 for k in store.iter_keys() if build_namespace(f, opts, 0, g)[0].id in k) for g in f.kv_groups] == [1, 5]
    sched, work = connectors(store, f)
    dst = paged("cpu", seed=2, num_blocks=64)
    before = {k: v.clone() for k, v in dst.items()}
    work.register_kv_caches(dst)
    req = fake_request("b", tokens)
    assert ask(sched, req, 0) == (288, True)
    local = [0] * 8 + [30]  # vLLM hands the local group null blocks before the attention chunk
    full = [40 + i for i in range(9)]
    sched._kv_cache_manager.blocks["b"] = (local, full)
    sched.update_state_after_alloc(req, GroupBlocks((local, full)), 288)
    run_worker(work, step(sched, req, (local, full), computed=0, scheduled=0, new=True, waiting=True))
    assert work.last_finished[1] == {"b"} and not work.worker.failed_loads()
    for layer in layers[:2]:
        assert torch.equal(dst[layer][30], src[layer][blocks[0][8]]) and torch.equal(dst[layer][0], before[layer][0])
    for layer in layers[2:]:
        assert all(torch.equal(dst[layer][full[i]], src[layer][blocks[1][i]]) for i in range(9))


def test_the_device_staging_budget_is_shared_out_among_the_attention_groups():
    """device_staging_bytes is per copy path of a worker (step, background loads, background
    saves), divided among its KV cache groups that stage (state groups do not): vLLM does not
    count it in its memory budget, so it must not grow with the number of groups."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    bpt = 2 * 2 * 32 * 2
    f = replace(facts(), groups=(KVGroup(0, "local", (layers[0], layers[1]), window=128, bytes_per_token=bpt, isa="vec"),
                                 KVGroup(1, "full", (layers[2], layers[3]), bytes_per_token=bpt, isa="vec")))
    from test_vllm_unit import paged

    _, work = connectors(MemoryStore(), f, device_staging_bytes="64MiB")
    work.register_kv_caches(paged("cpu", seed=1, num_blocks=64))
    paths = [work.worker.transfers, work.worker._loaders, work.worker._savers]
    assert [[t.staging_bytes for t in path] for path in paths] == [[32 << 20] * 2] * 3
    _, work = connectors(MemoryStore(), recurrent(), device_staging_bytes="64MiB")  # 3 state groups, 1 full
    work.register_kv_caches(caches(1))
    assert [t.staging_bytes for t in work.worker.transfers if t is not None] == [64 << 20]
