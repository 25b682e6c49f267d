"""Multimodal prompts: chunk keys carry the identity and placeholder range of each non-text input.

Two prompts with the same placeholder tokens but different images never share a chunk that
overlaps (or follows) an image; the same image at the same place does; chunks before the first
image are shared with text-only prompts. Through the vLLM connector (its scheduler and worker
halves around one store, as in test_vllm_unit) with vLLM's own ``MultiModalFeatureSpec``;
tests/test_vllm_multimodal.py runs a real multimodal model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from kvstore.keys import InputSpan, Namespace, chunk_keys, prefix_keys

NS = Namespace(model="m", kv_dtype="bfloat16", layout="L", block_size=16, chunk_tokens=64)
TOKENS = list(range(1000, 1300))
IMAGE = 7  # the placeholder token a processor repeats where an image goes
PLACEHOLDER = [*TOKENS[:70], *[IMAGE] * 70, *TOKENS[140:]]  # an image fills [70, 140): chunks 1 and 2


def keys(tokens=PLACEHOLDER, spans=(), **kw):
    return [k.key for k in chunk_keys(NS, tokens, spans=spans, **kw)]


def test_text_prompts_keep_their_keys_and_spans_change_only_the_chunks_from_the_first_image_on():
    a = keys(spans=[InputSpan(70, 70, "image-a", "image")])
    b = keys(spans=[InputSpan(70, 70, "image-b", "image")])
    text = keys()
    assert keys(spans=[]) == text == [k.key for k in chunk_keys(NS, PLACEHOLDER)]
    assert a[0] == b[0] == text[0]  # before the image: shared with text-only prompts
    assert all(x != y and x != t and y != t for x, y, t in zip(a[1:], b[1:], text[1:]))  # chunk 3 by the chain
    assert keys(spans=[InputSpan(70, 70, "image-a", "image")]) == a  # the same image at the same place
    assert keys(spans=[InputSpan(72, 68, "image-a", "image")])[1:] != a[1:]  # ... elsewhere, differs
    assert keys(spans=[InputSpan(70, 70, "image-a", "audio")])[1:] != a[1:]


def test_spans_are_order_free_and_those_past_the_tokens_change_nothing():
    one, two = InputSpan(70, 70, "image-a"), InputSpan(200, 10, "image-c")
    assert keys(spans=[one, two]) == keys(spans=[two, one])
    assert keys(PLACEHOLDER[:140], spans=[one]) == keys(PLACEHOLDER[:140], spans=[one, two])
    assert keys(spans=[one, two])[:3] == keys(spans=[one])[:3] and keys(spans=[one, two])[3] != keys(spans=[one])[3]


def test_prefix_keys_agree_with_chunk_keys_of_each_prefix_with_spans():
    spans = [InputSpan(70, 70, "image-a"), InputSpan(150, 40, "image-b")]
    ends = [100, 128, 160, 288]
    got = {(k.start, k.end): k.key for k in prefix_keys(NS, PLACEHOLDER, ends, spans=spans)}
    for end in ends:
        for k in chunk_keys(NS, PLACEHOLDER[:end], spans=spans):
            assert got[(k.start, k.end)] == k.key


def test_the_multimodal_key_scheme_is_pinned():
    """A golden value: every process and machine keys an image prompt alike (and a change to
    the scheme is a format change, not an accident)."""
    for version, golden in GOLDEN_IMAGE_KEYS.items():
        ns = dataclasses.replace(NS, format_version=version)
        assert chunk_keys(ns, PLACEHOLDER, spans=[InputSpan(70, 70, "image-a", "image")])[1].key == golden


GOLDEN_IMAGE_KEYS = {2: "kvs2/c6f80027fdf53528/24eac3e8f09c42165938c06c65ae4462",
                     3: "kvs3/b54e7b6d70e1af54/c1f420fad4f6ef6cedd07a756ef1febf"}


@pytest.mark.parametrize("bad", [dict(offset=-1, length=4, identity="x"), dict(offset=0, length=0, identity="x"),
                                 dict(offset=0, length=4, identity=""), dict(offset=0, length=4, identity=None),
                                 dict(offset=1.5, length=4, identity="x")])
def test_an_input_without_identity_or_range_cannot_be_keyed(bad):
    with pytest.raises(ValueError):
        InputSpan(**bad)


def test_spans_must_be_input_spans():
    with pytest.raises(TypeError):
        chunk_keys(NS, PLACEHOLDER, spans=[(70, 70, "image-a")])


# -- through the vLLM connector ---------------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not __import__("os").environ.get("CI"),
                                reason="needs vLLM (installed by scripts/bootstrap test)")


def _feature(identifier, offset, length, modality="image"):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality=modality, identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def _request(req_id, *features, tokens=PLACEHOLDER):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, cache_salt=None, mm_features=list(features))


@needs_vllm
def test_input_spans_read_vllms_multimodal_features():
    from kvstore.connectors.vllm.facts import input_spans

    assert input_spans(SimpleNamespace(mm_features=None)) == ()
    assert input_spans(_request("r", _feature("b", 150, 40), _feature("a", 70, 70))) == (
        InputSpan(70, 70, "a", "image"), InputSpan(150, 40, "b", "image"))
    assert input_spans(SimpleNamespace(mm_features=[SimpleNamespace(identifier="a")])) is None  # no position
    assert input_spans(_request("r", _feature(None, 70, 70))) is None  # no identity
    # An engine that names inputs by request (not content) keys none of them; text is unaffected.
    assert input_spans(_request("r", _feature("renderer0-mm-1-image-0", 70, 70)), content_hashed=False) is None
    assert input_spans(SimpleNamespace(mm_features=[]), content_hashed=False) == ()


@needs_vllm
@pytest.mark.parametrize(("mm", "prefix_caching", "hashed"), [
    (None, False, True), (SimpleNamespace(mm_processor_cache_gb=4), False, True),
    (SimpleNamespace(mm_processor_cache_gb=0), True, True), (SimpleNamespace(mm_processor_cache_gb=0), False, False)])
def test_vllm_hashes_images_unless_both_of_its_caches_are_off(mm, prefix_caching, hashed):
    from kvstore.connectors.vllm.facts import _mm_content_hashed

    config = SimpleNamespace(model_config=SimpleNamespace(multimodal_config=mm),
                             cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))
    assert _mm_content_hashed(config) is hashed


@needs_vllm
def test_an_image_prompt_hits_with_the_same_image_and_only_its_text_prefix_with_another():
    from test_vllm_unit import SYNC, alloc, ask, facts, make_connector, paged, run_worker, step

    from kvstore.metrics.catalog import BYPASSED
    from kvstore.stores.memory import MemoryStore

    store, f = MemoryStore(), facts()
    sched_a, work_a = make_connector("scheduler", store, f, **SYNC), make_connector("worker", store, f, **SYNC)
    src = paged("cpu", seed=1)
    work_a.register_kv_caches(src)
    req = _request("a", _feature("image-a", 70, 70))
    blocks = [5, 2, 11, 7, 0, 9, 14, 3, 21, 1]
    assert ask(sched_a, req, 0) == (0, False)
    alloc(sched_a, req, blocks, 0)
    meta = step(sched_a, req, blocks, computed=0, scheduled=300, new=True)
    assert [s.spans for s in meta.saves] == [(InputSpan(70, 70, "image-a", "image"),)]
    run_worker(work_a, meta)
    assert len(list(store.iter_keys())) == 5

    bypassed = BYPASSED.value(reason="multimodal")
    sched_b, work_b = make_connector("scheduler", store, f, **SYNC), make_connector("worker", store, f, **SYNC)
    dst = paged("cpu", seed=2)
    work_b.register_kv_caches(dst)
    assert ask(sched_b, _request("b", _feature("image-a", 70, 70)), 0) == (288, False)  # the same image
    assert ask(sched_b, _request("c", _feature("image-b", 70, 70)), 0) == (64, False)  # another: text only
    assert ask(sched_b, _request("d", _feature("image-a", 72, 68)), 0) == (64, False)  # elsewhere
    assert ask(sched_b, _request("e"), 0) == (64, False)  # the placeholder tokens as text
    assert BYPASSED.value(reason="multimodal") == bypassed  # identified inputs do not bypass

    req_b = _request("b2", _feature("image-a", 70, 70))
    assert ask(sched_b, req_b, 0) == (288, False)
    blocks_b = [3, 4, 6, 8, 10, 12, 13, 15, 16, 17]
    alloc(sched_b, req_b, blocks_b, 288)
    mb = step(sched_b, req_b, blocks_b, computed=288, scheduled=12, new=True)
    assert [(s.start, s.end, s.spans) for s in mb.loads] == [(0, 288, (InputSpan(70, 70, "image-a", "image"),))]
    assert run_worker(work_b, mb) == set()
    for s, d in zip(src.values(), dst.values()):
        assert all(torch.equal(d[blocks_b[i]], s[blocks[i]]) for i in range(9))  # 288 tokens of A's KV
