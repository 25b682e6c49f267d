"""Multimodal prompts on real vLLM CPU: a tiny random-weight Idefics3 (``vllm_multimodal``), fresh
engines over one file store. The same image at the same place loads every stored chunk with the
tokens vLLM alone gives; another image there loads only the text before it, and gives that
image's tokens; an engine that names images by request, not content, caches none of them.
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


def _run(model, connector, image_seed, prompt, **engine):
    spec = {"model": str(model.path), "connector": connector,
            "engine": {**{k: v for k, v in model.llm_kwargs.items() if k != "model"}, **engine},
            "actions": [{"generate": [{"ids": prompt, "images": [image_seed]}], "max_tokens": 8},
                        {"engine_info": True}]}
    generated, info = run_engine(spec)["results"]
    return generated["tokens"][0], info["kvstore"]


def test_an_image_prompt_hits_only_with_the_same_image(model, tmp_path):
    prompt = model.prompt(list(range(100, 140)), list(range(200, 220)))  # text, an image, text
    connector = {"store": [f"file://{tmp_path / 'kv'}"], "chunk_tokens": CHUNK, "load_policy": "always"}
    alone_a, _ = _run(model, None, 1, prompt)
    alone_b, _ = _run(model, None, 2, prompt)
    assert alone_a != alone_b  # the image reaches the model
    written, _ = _run(model, connector, 1, prompt)
    reader_a, seen_a = _run(model, connector, 1, prompt)
    reader_b, seen_b = _run(model, connector, 2, prompt)
    stored = (model.expanded_length(prompt) - 1) // CHUNK * CHUNK  # vLLM computes the last token itself
    before_image = model.placeholder_offsets(prompt)[0] // CHUNK * CHUNK
    assert stored > before_image > 0
    assert written == reader_a == alone_a and seen_a["tokens_loaded"] == stored
    assert reader_b == alone_b and seen_b["tokens_loaded"] == before_image  # the text before the image only
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
