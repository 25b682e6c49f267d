"""Multimodal prompts on real vLLM CPU: a tiny random-weight Idefics3 (``vllm_multimodal``), fresh
engines over one file store. The same image at the same place loads every stored chunk with the
tokens vLLM alone gives after its own prefix-cache hit of that prompt; another image there loads
only the text before it, with the tokens vLLM alone gives when its own cache holds that text and
another image (``tests/oracles.py``, rule 1); an engine that names images by request, not content,
caches none of them.
"""

from __future__ import annotations

import pytest
import vllm_multimodal
from vllm_engines import run_engine

pytestmark = pytest.mark.vllm
CHUNK = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> vllm_multimodal.MultimodalModel:
    return vllm_multimodal.write_mm_model("idefics3", tmp_path_factory.mktemp("tiny-idefics3"))


def _run(model, connector, image_seeds, prompt, **engine):
    """One engine, ``prompt`` with each image of ``image_seeds`` in turn (an int: one image; ``None``
    empties vLLM's prefix cache): the tokens and cached counts of each, and kvstore's counters."""
    seeds = [image_seeds] if isinstance(image_seeds, int) else image_seeds
    actions = [{"reset_prefix_cache": True} if seed is None else
               {"generate": [{"ids": prompt, "images": [seed]}], "max_tokens": 8} for seed in seeds]
    spec = {"model": str(model.path), "connector": connector,
            "engine": {**{k: v for k, v in model.llm_kwargs.items() if k != "model"}, **engine},
            "actions": [*actions, {"engine_info": True}]}
    *generated, info = run_engine(spec)["results"]
    if isinstance(image_seeds, int):
        return generated[0]["tokens"][0], info["kvstore"]
    return [(g["tokens"][0], g["cached"][0]) for g in generated], info["kvstore"]


def test_an_image_prompt_hits_only_with_the_same_image(model, tmp_path):
    prompt = model.prompt(list(range(100, 140)), list(range(200, 220)))  # text, an image, text
    connector = {"store": [f"file://{tmp_path / 'kv'}"], "chunk_tokens": CHUNK, "load_policy": "always"}
    # vLLM alone: image 1 cold, then again (its own hit of the whole prompt), then image 2 (its own
    # hit of the text before the image), then image 2 cold.
    runs, _ = _run(model, None, [1, 1, 2, None, 2], prompt)
    (alone_a, _), (warm_a, hit_a), (after_a_b, hit_b), (alone_b, _) = runs
    assert alone_a != alone_b  # the image reaches the model
    written, _ = _run(model, connector, 1, prompt)
    reader_a, seen_a = _run(model, connector, 1, prompt)
    reader_b, seen_b = _run(model, connector, 2, prompt)
    stored = (model.expanded_length(prompt) - 1) // CHUNK * CHUNK  # vLLM computes the last token itself
    before_image = model.placeholder_offsets(prompt)[0] // CHUNK * CHUNK
    assert stored > before_image > 0 and (hit_a, hit_b) == (stored, before_image)
    assert written == alone_a
    assert reader_a == warm_a and seen_a["tokens_loaded"] == stored
    assert reader_b == after_a_b and seen_b["tokens_loaded"] == before_image  # the text before the image only
    assert seen_a["bypassed"] == seen_b["bypassed"] == 0


def test_images_named_by_request_bypass_the_cache(model, tmp_path):
    """With prefix caching and the processor cache off, vLLM names each image by a per-request
    counter: a fresh engine's first image has the id of every other engine's first image."""
    prompt = model.prompt(list(range(300, 340)), list(range(400, 420)))
    connector = {"store": [f"file://{tmp_path / 'kv'}"], "chunk_tokens": CHUNK, "load_policy": "always"}
    unhashed = {"enable_prefix_caching": False, "mm_processor_cache_gb": 0}
    alone_b, _ = _run(model, None, 2, prompt, **unhashed)
    _, writer = _run(model, connector, 1, prompt, **unhashed)
    reader_b, seen = _run(model, connector, 2, prompt, **unhashed)
    assert writer["tokens_saved"] == 0 and writer["bypassed"] == 1
    assert reader_b == alone_b and seen["tokens_loaded"] == 0 and seen["bypassed"] == 1
