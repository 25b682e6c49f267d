"""The reference engine: deterministic, layout-independent, and sensitive to every KV value."""

from __future__ import annotations

import random

import torch

from kvstore.reference import PRESETS, LlamaModel, ModelRunner
from kvstore.reference.runner import build_model_input

CFG = PRESETS["tiny"]


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


def test_deterministic_across_runners_and_layouts():
    p = prompt(70)
    ref = ModelRunner(CFG).generate([p], 8)
    assert ModelRunner(CFG).generate([p], 8).tokens == ref.tokens
    for layout in ("vllm-bhnc", "vllm-cpu-vec"):
        out = ModelRunner(CFG.with_(kv_layout=layout)).generate([p], 8)
        assert out.tokens == ref.tokens
        torch.testing.assert_close(out.first_logits[0], ref.first_logits[0], rtol=0, atol=1e-5)


def test_batching_does_not_change_outputs():
    a, b = prompt(50, 1), prompt(33, 2)
    alone = [ModelRunner(CFG).generate([p], 6).tokens[0] for p in (a, b)]
    assert ModelRunner(CFG).generate([a, b], 6).tokens == alone


def test_noise_in_the_kv_cache_changes_the_tokens():
    """Realistic-scale weights: a small perturbation of the prompt's KV changes the generation,
    so a test that compares tokens really checks the KV that was loaded."""
    p = prompt(64, 3)
    runner = ModelRunner(CFG)
    ref = runner.generate([p], 8).tokens[0]
    seq = runner.add_request(p, 8)
    runner.step([seq])
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.add_(torch.randn(cache.shape, generator=g) * 0.1)
    while not seq.done:
        runner.step([seq])
    assert seq.output[0] == ref[0]          # the first token comes from the prefill's own compute
    assert seq.output[1:] != ref[1:]       # every later token reads the (noisy) cache


def test_model_input_shape_for_a_mixed_batch():
    runner = ModelRunner(CFG)
    a = runner.add_request(prompt(20), 4)
    runner.step([a])
    b = runner.add_request(prompt(10, 5), 4)
    mi = build_model_input([a, b], CFG.block_size)
    md = mi.attn_metadata
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (1, 10, 1)
    assert md.query_start_loc.tolist() == [0, 10, 11] and md.seq_lens == [10, 21]
    assert mi.input_positions.tolist() == list(range(10)) + [20]


def test_pipeline_stages_compose_to_the_full_model():
    full = LlamaModel(CFG)
    s0, s1 = LlamaModel(CFG, 0, 2), LlamaModel(CFG, 2, CFG.num_layers)
    runner = ModelRunner(CFG, model=full)
    seq = runner.add_request(prompt(30), 1)
    mi = build_model_input([seq], CFG.block_size)
    ref = full(mi.input_tokens, mi.input_positions, full.allocate_kv_caches(), mi.attn_metadata)
    mid = s0(mi.input_tokens, mi.input_positions, s0.allocate_kv_caches(), mi.attn_metadata)
    out = s1(mi.input_tokens, mi.input_positions, s1.allocate_kv_caches(), mi.attn_metadata, intermediate=mid)
    assert torch.equal(out, ref)
