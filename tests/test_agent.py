"""The agent API end to end on the reference engine: the output with the cache equals the
output without it (full hit, partial hit, miss, mixed batches, layouts, TP/PP ranks, two
processes over Redis, damaged records), and the loaded KV is really used."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvstore.connectors.agent import AgentConfig, KVStoreAgent
from kvstore.errors import ConfigError
from kvstore.record import decode_record, encode_record
from kvstore.reference import PRESETS, LlamaModel, ModelRunner
from kvstore.reference.runner import build_model_input
from kvstore.testing.damage import flip_byte

CFG = PRESETS["tiny"]
CHUNK = 32
# A full hit reuses the stored bytes and hidden state: logits are bit-identical. A partial hit
# computes the suffix over a different batch shape: equal within float32 rounding.
PARTIAL_ATOL = 1e-4


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


@pytest.fixture
def store_url(tmp_path):
    return f"file://{tmp_path / 'kv'}"


def make_agent(url, cfg=CFG, **kw) -> KVStoreAgent:
    return KVStoreAgent(dict(store=url, model=cfg.name, model_fingerprint=cfg.fingerprint, chunk_tokens=CHUNK, **kw))


def baseline(prompts, cfg=CFG, n=8):
    return ModelRunner(cfg).generate(prompts, n)


@pytest.mark.parametrize("layout", ["flash-2bnhd", "vllm-bhnc", "vllm-cpu-vec"])
def test_full_hit_bypasses_the_model(store_url, layout):
    cfg = CFG.with_(kv_layout=layout)
    p = prompt(128 if layout == "vllm-cpu-vec" else 101)  # block layouts only store whole blocks
    ref = baseline([p], cfg)
    first = ModelRunner(cfg, make_agent(store_url, cfg, kv_layout=layout)).generate([p], 8)
    assert (first.tokens_loaded, first.tokens_computed) == (0, len(p)) and first.tokens == ref.tokens
    agent = make_agent(store_url, cfg, kv_layout=layout)
    hit = ModelRunner(cfg, agent).generate([p], 8)
    assert hit.bypassed and (hit.tokens_loaded, hit.tokens_computed) == (len(p), 0)
    assert hit.tokens == ref.tokens
    assert torch.equal(hit.first_logits[0], ref.first_logits[0])
    assert agent.stats.chunks_saved == 0  # nothing rewritten
    agent.close()


def test_bypassed_step_stores_no_placeholder_hidden_states(store_url):
    # After a bypass the runner still calls send, with the agent's own hidden tensor (zeros
    # but for each prompt's last row). A chunk evicted in between must not be re-stored with a
    # zero row as its hidden state: a later prompt ending there would bypass with it.
    p = prompt(96, 11)
    ModelRunner(CFG, make_agent(store_url)).generate([p], 2)
    agent = make_agent(store_url)
    runner = ModelRunner(CFG, agent)
    keys = [k.key for k in agent.transfer(runner.model, runner.kv_caches).keys(p)]
    send = agent.send_kv_caches_and_hidden_states

    def evict_then_send(*args):
        agent.store.delete(keys[1])  # chunk [32, 64) evicted between recv and send
        return send(*args)

    agent.send_kv_caches_and_hidden_states = evict_then_send
    assert runner.generate([p], 2).bypassed
    agent.close()
    out = ModelRunner(CFG, make_agent(store_url)).generate([p[:64]], 4)
    assert out.tokens == baseline([p[:64]], n=4).tokens


def test_block_layout_partial_block_is_computed(store_url):
    cfg = CFG.with_(kv_layout="vllm-cpu-vec")
    p = prompt(101)
    ref = baseline([p], cfg)
    ModelRunner(cfg, make_agent(store_url, cfg, kv_layout="vllm-cpu-vec")).generate([p], 8)
    hit = ModelRunner(cfg, make_agent(store_url, cfg, kv_layout="vllm-cpu-vec")).generate([p], 8)
    assert not hit.bypassed and (hit.tokens_loaded, hit.tokens_computed) == (96, 5)
    assert hit.tokens == ref.tokens


def test_partial_prefix_hit_computes_only_the_suffix(store_url):
    shared = prompt(70)
    p1, p2 = shared + prompt(20, 1), shared + prompt(45, 2)
    ModelRunner(CFG, make_agent(store_url)).generate([p1], 8)
    ref = baseline([p2])
    out = ModelRunner(CFG, make_agent(store_url)).generate([p2], 8)
    assert not out.bypassed and out.tokens_loaded == 64 and out.tokens_computed == len(p2) - 64
    assert out.tokens == ref.tokens
    torch.testing.assert_close(out.first_logits[0], ref.first_logits[0], rtol=0, atol=PARTIAL_ATOL)


def test_miss_changes_nothing(store_url):
    p = prompt(90, 7)
    agent = make_agent(store_url)
    out = ModelRunner(CFG, agent).generate([p], 8)
    assert (out.tokens_loaded, out.bypassed) == (0, False) and out.tokens == baseline([p]).tokens
    assert agent.stats.chunks_saved == 3  # 2 full chunks of 32 and the partial last one


def test_batch_of_hits_and_misses(store_url):
    a, b = prompt(80, 1), prompt(50, 2)
    ModelRunner(CFG, make_agent(store_url)).generate([a], 4)
    out = ModelRunner(CFG, make_agent(store_url)).generate([a, b], 6)
    assert not out.bypassed and out.tokens_loaded == 79 and out.tokens == baseline([a, b], n=6).tokens


def test_mixed_prefill_decode_batch_loads_but_never_bypasses(store_url):
    a, b = prompt(40, 3), prompt(75, 4)
    ModelRunner(CFG, make_agent(store_url)).generate([b], 2)   # b fully stored, hidden included

    def schedule(runner):
        sa = runner.add_request(a, 5)
        runner.step([sa])
        sb = runner.add_request(b, 5)
        stats = runner.step([sa, sb])          # b's prefill next to a's decode
        while not (sa.done and sb.done):
            runner.step([s for s in (sa, sb) if not s.done])
        return sa, sb, stats

    ra, rb, _ = schedule(ModelRunner(CFG))
    agent = make_agent(store_url)
    sa, sb, stats = schedule(ModelRunner(CFG, agent))
    assert not stats.bypassed and sb.tokens_loaded == 74 and sb.tokens_computed == 1
    assert (sa.output, sb.output) == (ra.output, rb.output)
    assert agent.stats.bypasses == 0


def test_roles(store_url):
    p = prompt(64, 9)
    consumer = make_agent(store_url, role="consumer")
    ModelRunner(CFG, consumer).generate([p], 2)
    assert consumer.stats.chunks_saved == 0
    producer = make_agent(store_url, role="kv_producer")
    ModelRunner(CFG, producer).generate([p], 2)
    out = ModelRunner(CFG, producer).generate([p], 2)
    assert out.tokens_loaded == 0 and producer.stats.recv_calls == 0
    assert ModelRunner(CFG, make_agent(store_url, role="both")).generate([p], 2).bypassed


def _stored_records(agent, p):
    runner = ModelRunner(CFG)
    keys = agent.transfer(runner.model, runner.kv_caches).keys(p)
    return keys, [agent.store.get(k.key) for k in keys]


def test_corrupted_record_is_a_miss(store_url):
    p = prompt(100, 5)
    agent = make_agent(store_url)
    ModelRunner(CFG, agent).generate([p], 4)
    keys, values = _stored_records(agent, p)
    damaged = flip_byte(agent.store, keys[1].key, offset=len(values[1]) // 2, mask=0x01)  # one bit of KV noise
    agent.flush()
    out = ModelRunner(CFG, make_agent(store_url)).generate([p], 8)
    assert out.tokens_loaded == 32 and out.tokens == baseline([p]).tokens  # first chunk only
    # The damaged record was dropped, and the run that recomputed the chunk stored a good one.
    fixed = agent.store.get(keys[1].key)
    assert bytes(fixed) != bytes(damaged) and decode_record(fixed).header.num_tokens == 32


@pytest.mark.parametrize("delete_fails", [False, True])
def test_every_damaged_chunk_of_a_prefix_heals(store_url, monkeypatch, delete_fails):
    """Every chunk of two prompts damaged (a flipped byte; every key holding its neighbour's
    valid record): the first reader recomputes with the same tokens and its save replaces every
    damaged chunk, not only the first one it met, even when deleting the bad record failed (the
    pre-check then sees every chunk stored); the next reader loads every token."""
    from kvstore.metrics.catalog import HEALS

    p1, p2 = prompt(160, 21), prompt(150, 22)
    writer = make_agent(store_url)
    ModelRunner(CFG, writer).generate([p1], 4)
    ModelRunner(CFG, writer).generate([p2], 4)
    keys1, values1 = _stored_records(writer, p1)
    keys2, values2 = _stored_records(writer, p2)
    assert len(keys1) == len(keys2) == 5
    for k in keys1:
        flip_byte(writer.store, k.key, offset=-9)
    for k, neighbour in zip(keys2, values2[1:] + values2[:1]):
        writer.store.put(k.key, neighbour)
    writer.close()
    ref = baseline([p1, p2])

    reader = make_agent(store_url)
    if delete_fails:
        monkeypatch.setattr(reader.store, "delete", lambda key: None)
    healed = HEALS.total()
    first = [ModelRunner(CFG, reader).generate([p], 8) for p in (p1, p2)]
    assert [r.tokens[0] for r in first] == ref.tokens and [r.tokens_loaded for r in first] == [0, 0]
    assert HEALS.total() - healed == len(keys1) + len(keys2)
    reader.close()
    second = [ModelRunner(CFG, make_agent(store_url)).generate([p], 8) for p in (p1, p2)]
    assert [r.tokens[0] for r in second] == ref.tokens
    assert [r.tokens_loaded for r in second] == [len(p1), len(p2)] and all(r.bypassed for r in second)


def test_hidden_state_of_another_size_is_a_miss_not_an_engine_error(store_url):
    # Two engines that differ only in hidden_size but were given the same fingerprint share a
    # namespace (their KV shapes agree); the writer's hidden states do not fit the reader's model.
    from kvstore.metrics.catalog import CORRUPT

    wide = CFG.with_(hidden_size=128)
    p = prompt(96, 12)
    writer = KVStoreAgent(dict(store=store_url, model=CFG.name, model_fingerprint="shared", chunk_tokens=CHUNK))
    ModelRunner(CFG, writer).generate([p], 2)
    writer.close()
    corrupt = CORRUPT
    before = corrupt.value(reason="shape")
    reader = KVStoreAgent(dict(store=store_url, model=CFG.name, model_fingerprint="shared", chunk_tokens=CHUNK,
                               role="consumer"))
    out = ModelRunner(wide, reader).generate([p], 8)  # raised "mat1 and mat2 shapes cannot be multiplied"
    assert not out.bypassed and out.tokens_loaded == 0 and out.tokens == baseline([p], wide).tokens
    assert corrupt.value(reason="shape") - before == 1  # the first chunk, then loading stopped
    assert KVStoreAgent.expected_hidden(ModelRunner(wide).model) == (torch.float32, (128,))
    reader.close()


def test_loaded_kv_is_really_used(store_url):
    """Valid records (correct checksum) whose KV carries noise must change the generation."""
    p = prompt(96, 6)
    agent = make_agent(store_url)
    ModelRunner(CFG, agent).generate([p], 8)
    keys, values = _stored_records(agent, p)
    xfer = next(iter(agent._transfers.values()))
    rng = np.random.default_rng(0)
    for chunk, value in zip(keys, values):
        rec = decode_record(value)
        kv = np.frombuffer(rec.kv, np.float32) + rng.standard_normal(rec.header.raw_len // 4).astype(np.float32) * 0.5
        agent.store.put(chunk.key, encode_record(
            namespace=xfer.cache.namespace, chunk=chunk, tokens=p[chunk.start:chunk.end], dtype=rec.header.dtype,
            shapes=rec.header.shapes, kv=kv.astype(np.float32), hidden=rec.hidden,
            hidden_dtype=rec.header.hidden_dtype, hidden_shape=rec.header.hidden_shape))
    out = ModelRunner(CFG, make_agent(store_url)).generate([p], 8)
    ref = baseline([p])
    assert out.bypassed and out.tokens_loaded == len(p)
    assert out.tokens[0][0] == ref.tokens[0][0]     # from the stored hidden state
    assert out.tokens[0][1:] != ref.tokens[0][1:]   # decode attends over the loaded (noisy) KV


def test_tensor_parallel_ranks_store_their_own_head_shards(store_url):
    p = prompt(70, 8)
    runner = ModelRunner(CFG)
    seq = runner.add_request(p, 1)
    mi = build_model_input([seq], CFG.block_size)
    hidden = runner.model(mi.input_tokens, mi.input_positions, runner.kv_caches, mi.attn_metadata)
    half = CFG.num_kv_heads // 2
    shards = [[c[..., r * half:(r + 1) * half, :].contiguous() for c in runner.kv_caches] for r in range(2)]
    agents = [make_agent(store_url, rank=r, tp_size=2) for r in range(2)]
    for r in range(2):
        agents[r].send_kv_caches_and_hidden_states(runner.model, mi, shards[r], hidden)
    k0, k1 = (a.transfer(runner.model, s).keys(p) for a, s in zip(agents, shards))
    assert not {k.key for k in k0} & {k.key for k in k1}
    for r in range(2):
        fresh = [torch.zeros_like(c) for c in shards[r]]
        h, bypass, _ = make_agent(store_url, rank=r, tp_size=2).recv_kv_caches_and_hidden_states(runner.model, mi, fresh)
        assert bypass and torch.equal(h[-1], hidden[-1])
        assert all(torch.equal(f, s) for f, s in zip(fresh, shards[r]))


def test_pipeline_stage_layer_range(store_url):
    p = prompt(64, 10)
    s0, s1 = LlamaModel(CFG, 0, 2), LlamaModel(CFG, 2, CFG.num_layers)
    c0, c1 = s0.allocate_kv_caches(), s1.allocate_kv_caches()
    seq = ModelRunner(CFG, model=s0).add_request(p, 1)
    mi = build_model_input([seq], CFG.block_size)
    mid = s0(mi.input_tokens, mi.input_positions, c0, mi.attn_metadata)
    hidden = s1(mi.input_tokens, mi.input_positions, c1, mi.attn_metadata, intermediate=mid)
    a0, a1 = make_agent(store_url), make_agent(store_url)
    a0.send_kv_caches_and_hidden_states(s0, mi, c0, mid)     # intermediate tensors: no hidden stored
    a1.send_kv_caches_and_hidden_states(s1, mi, c1, hidden)
    rec = decode_record(a1.store.get(a1.transfer(s1, c1).keys(p)[-1].key))
    assert len(rec.header.shapes) == 2 and a1.transfer(s1, c1).cache.namespace.layer_start == 2
    f0, f1 = s0.allocate_kv_caches(), s1.allocate_kv_caches()
    h0, bypass0, mi0 = make_agent(store_url).recv_kv_caches_and_hidden_states(s0, mi, f0)
    assert (h0, bypass0) == (None, False) and mi0.input_tokens.shape[0] == 1  # only the last token to compute
    assert mi0.input_positions.tolist() == [len(p) - 1] and mi0.attn_metadata.context_lens_tensor.tolist() == [len(p) - 1]
    h1, bypass1, _ = make_agent(store_url).recv_kv_caches_and_hidden_states(s1, mi, f1)
    assert bypass1 and torch.equal(h1[-1], hidden[-1])
    assert all(torch.equal(a, b) for a, b in zip(f0 + f1, c0 + c1))
    again = s0(mi0.input_tokens, mi0.input_positions, f0, mi0.attn_metadata)
    torch.testing.assert_close(again["residual"][-1], mid["residual"][-1], rtol=0, atol=PARTIAL_ATOL)


def test_two_processes_share_redis(redis_server):
    url = redis_server.url
    p = prompt(120, 11)
    child = textwrap.dedent(f"""
        import json
        from kvstore.connectors.agent import KVStoreAgent
        from kvstore.reference import PRESETS, ModelRunner
        cfg = PRESETS["tiny"]
        agent = KVStoreAgent(dict(store={url!r}, model=cfg.name, model_fingerprint=cfg.fingerprint,
                                  chunk_tokens={CHUNK}, role="producer", cache_salt="two-proc"))
        out = ModelRunner(cfg, agent).generate([{p!r}], 8)
        agent.close()
        print(json.dumps(out.tokens))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    produced = json.loads(done.stdout.strip().splitlines()[-1])
    agent = make_agent(url, role="consumer", cache_salt="two-proc")
    out = ModelRunner(CFG, agent).generate([p], 8)
    agent.close()
    assert out.bypassed and out.tokens_loaded == len(p) and out.tokens == produced == baseline([p]).tokens


def test_config_errors(store_url):
    with pytest.raises(ConfigError, match="store, model_fingerprint"):
        KVStoreAgent(dict(model="m"))
    with pytest.raises(ConfigError, match="role"):
        AgentConfig(store="memory://", model="m", model_fingerprint="f", role="reader")
    with pytest.raises(ConfigError, match="chunk_size"):
        AgentConfig.from_mapping(dict(store="memory://", model="m", model_fingerprint="f", chunk_size=3))
    with pytest.raises(ConfigError, match="rank"):
        AgentConfig(store="memory://", model="m", model_fingerprint="f", rank=2, tp_size=2)
    with pytest.raises(ConfigError, match="kv_layout"):
        AgentConfig(store="memory://", model="m", model_fingerprint="f", kv_layout="weird")
    with pytest.raises(ConfigError, match="chunk_tokens"):  # not a multiple of the block size
        ModelRunner(CFG, make_agent(store_url, chunk_tokens=24) if False else
                    KVStoreAgent(dict(store=store_url, model="m", model_fingerprint="f", chunk_tokens=24))).generate([prompt(40)], 1)
    cfg = CFG.with_(kv_layout="vllm-bhnc")
    with pytest.raises(ConfigError, match="kv_layout"):   # 4-d caches are ambiguous
        ModelRunner(cfg, make_agent(store_url, cfg)).generate([prompt(40)], 1)


def test_config_repr_hides_the_store_password():
    cfg = AgentConfig(store=("memory://", "redis://:hunter2@cache:6379/0"), model="m", model_fingerprint="f")
    assert "hunter2" not in repr(cfg) and "redis://:***@cache:6379/0" in repr(cfg)
