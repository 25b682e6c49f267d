"""Tiny random-weight multimodal checkpoints for real-vLLM CPU tests, built offline.

``write_mm_model(family, dir)`` writes everything vLLM needs to serve an image+text model with
no hub access: ``config.json`` + ``model.safetensors`` (transformers ``_from_config``, every
matrix then re-drawn from a seeded normal like ``vllm_families``), a word-level tokenizer built
with ``tokenizers`` and a processor config (PIL-backend image processor, so no torchvision). It
returns a ``MultimodalModel``: the directory, the image token id, how long the placeholder run
of one image is, the ``vllm.LLM`` keyword arguments that run it on CPU, and ``prompt(...)``,
which makes a token-id prompt with one ``<image>`` token per image (vLLM expands each into the
image's placeholder run; ``placeholder_offsets`` says where those runs start).

Tokenizer: ids below ``FIRST_WORD`` are special (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2,
``<image>`` 3, ``<unk>`` 4, the family's image-frame tokens after), then ``wN`` has id N up to
``VOCAB - 1``; prompts use ids in ``[FIRST_WORD, VOCAB)``.

Families (vLLM CPU 0.32, transformers 5.19, no torchvision in the venv; seen 2026-12-02):

* ``idefics3`` (``Idefics3ForConditionalGeneration``: SigLIP-style vision tower, pixel-shuffle
  connector, Llama text; image splitting off): runs. One image is resized to
  ``IMAGE_SIZE`` square and becomes ``<fake_token_around_image><global-img>`` +
  ``IMAGE_SEQ_LEN`` x ``<image>`` + ``<fake_token_around_image>``; vLLM's ``mm_position``
  covers the whole run (``IMAGE_SEQ_LEN + 3`` tokens) with ``is_embed`` marking the
  ``<image>`` tokens. Several images per prompt, anywhere in it.
* ``llava`` (CLIP tower + Llama): the checkpoint and processor build, but vLLM cannot import
  its model: ``vllm/model_executor/models/llava.py`` imports ``pixtral.py``, which imports
  transformers' torchvision pixtral image processor (``ModuleNotFoundError: No module named
  'torchvision'``). Kept for a venv with torchvision.

What reaches a KV connector's scheduler side (``request.mm_features``, one
``MultiModalFeatureSpec`` per image, sorted by offset): ``identifier`` (== ``mm_hash`` without
LoRA) hashes the model id (its path here), the image content and any processor kwargs: the
same image gives the same identifier at any position and in every engine serving the same
path, another image or another model path another one; ``mm_position.offset`` is where the run
starts in the expanded prompt (``placeholder_offsets``), ``length`` is ``placeholder_tokens``.
Exception: with the processor cache off (``mm_processor_cache_gb=0``) and prefix caching off,
vLLM skips hashing and the identifier is a per-request counter, the same in every fresh engine
(see ``llm_kwargs``).

Importing this module imports neither vLLM nor transformers (only when writing).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB = 1024
FIRST_WORD = 64
PAD_ID, BOS_ID, EOS_ID, IMAGE_TOKEN_ID, UNK_ID = 0, 1, 2, 3, 4
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
#: idefics3 vision tower: IMAGE_SIZE square images in PATCH patches, pixel shuffle by SCALE.
IMAGE_SIZE = 224
PATCH = 14
SCALE = 2
#: ``<image>`` tokens (embeddings) one idefics3 image becomes.
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
_SCHEME = 1  # bump when a recipe changes: rewrites existing checkpoints

_TEXT: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "hidden_act": "silu",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": False,
}

_VISION: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH,
    "num_channels": 3,
    "layer_norm_eps": 1e-06,
}

_MEAN = [0.5, 0.5, 0.5]
_STD = [0.5, 0.5, 0.5]
FAMILIES: tuple[str, ...] = ("idefics3", "llava")


@dataclass(frozen=True)
class MultimodalModel:
    """What a test needs to run a tiny multimodal checkpoint on vLLM CPU."""

    family: str
    path: Path
    #: the prompt token that stands for one image (vLLM expands it)
    image_token_id: int
    #: the length of one image's placeholder run, ``mm_position.length``
    placeholder_tokens: int
    #: how many of those carry image embeddings (``mm_position.is_embed`` set)
    embed_tokens: int
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def prompt(self, before: Sequence[int], *after: Sequence[int]) -> list[int]:
        """A token-id prompt: ``before``, then for each ``after`` part one ``<image>`` token and
        that part (``prompt(a, b)`` is ``a + [<image>] + b``; ``prompt(a, b, c)`` has two
        images). Token ids must be in ``[FIRST_WORD, VOCAB)``."""
        out = [int(t) for t in before]
        for part in after:
            out.append(self.image_token_id)
            out.extend(int(t) for t in part)
        bad = [t for t in out if t != self.image_token_id and not FIRST_WORD <= t < VOCAB]
        if bad:
            raise ValueError(f"prompt token ids must be in [{FIRST_WORD}, {VOCAB}) besides <image>; got {bad[:5]}")
        return out

    def placeholder_offsets(self, prompt: Sequence[int]) -> list[int]:
        """Where each image's placeholder run starts in the prompt vLLM runs (after expansion)."""
        offsets, grown = [], 0
        for i, t in enumerate(prompt):
            if t == self.image_token_id:
                offsets.append(i + grown)
                grown += self.placeholder_tokens - 1
        return offsets

    def expanded_length(self, prompt: Sequence[int]) -> int:
        """The length of the prompt vLLM runs (``request.num_prompt_tokens``)."""
        return len(prompt) + len(self.placeholder_offsets(prompt)) * (self.placeholder_tokens - 1)


def llm_kwargs(path: str | Path, max_model_len: int = 1024, block_size: int = 32,
               images_per_prompt: int = 2, processor_cache_gb: float | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments that run a checkpoint of this module on vLLM CPU 0.32.

    The tokenizer must be loaded (``skip_tokenizer_init=True`` fails: "Idefics3MultiModalProcessor
    requires a tokenizer"). ``processor_cache_gb`` None keeps vLLM's multimodal processor cache
    at its default; 0 turns it off, and with ``enable_prefix_caching=False`` as well vLLM stops
    hashing images: identifiers become per-request counters (``renderer0-mm-1-image-0``) that
    a fresh engine hands out again for a different image.
    """
    kwargs: dict[str, Any] = {
        "model": str(path),
        "tokenizer": str(path),
        "skip_tokenizer_init": False,
        "dtype": "bfloat16",
        "max_model_len": max_model_len,
        "block_size": block_size,
        "enforce_eager": True,
        "max_num_seqs": 4,
        "limit_mm_per_prompt": {"image": images_per_prompt},
        "seed": 0,
    }
    if processor_cache_gb is not None:
        kwargs["mm_processor_cache_gb"] = processor_cache_gb
    return kwargs


def _std(fan_in: int) -> float:
    return min(0.1, max(0.05, 1 / math.sqrt(max(fan_in, 1))))


def _specials(family: str) -> dict[str, int]:
    specials = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, IMAGE_TOKEN: IMAGE_TOKEN_ID, "<unk>": UNK_ID}
    if family == "idefics3":
        frame = [FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE]
        frame += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
        specials.update({tok: 5 + n for n, tok in enumerate(frame)})
    assert max(specials.values()) < FIRST_WORD
    return specials


def _write_tokenizer(family: str, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = _specials(family)
    vocab = dict(specials)
    vocab.update({f"<reserved_{i}>": i for i in range(FIRST_WORD) if i not in specials.values()})
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # added tokens are matched before pre-tokenisation, so vLLM's unspaced placeholder strings
    # ("<fake_token_around_image><global-img><image>...") encode token by token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    wrap: Any = PreTrainedTokenizerFast
    fast = wrap(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(str(out))


def _write_processor(family: str, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    processor: Any
    image_processor: Any
    if family == "idefics3":
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        image_processor = Idefics3ImageProcessorPil(
            do_resize=True, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
            do_image_splitting=False, do_rescale=True, do_normalize=True, do_pad=True,
            do_convert_rgb=True, image_mean=_MEAN, image_std=_STD)
        processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                      image_seq_len=IMAGE_SEQ_LEN, chat_template=template)
    else:
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            do_resize=True, do_center_crop=True, do_rescale=True, do_normalize=True,
            do_convert_rgb=True, image_mean=_MEAN, image_std=_STD)
        llava: Any = LlavaProcessor
        processor = llava(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                                   vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                                   num_additional_image_tokens=1, chat_template=template)
    processor.save_pretrained(str(out))


def _hf_model(family: str) -> Any:
    import torch
    from transformers import LlamaConfig

    text = LlamaConfig(**_TEXT)
    config: Any
    if family == "idefics3":
        from transformers import Idefics3Config, Idefics3ForConditionalGeneration
        from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

        config = Idefics3Config(vision_config=Idefics3VisionConfig(**_VISION).to_dict(), text_config=text.to_dict(),
                                image_token_id=IMAGE_TOKEN_ID, scale_factor=SCALE, pad_token_id=PAD_ID,
                                tie_word_embeddings=False)
        cls: Any = Idefics3ForConditionalGeneration
    else:
        from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

        vision = CLIPVisionConfig(**_VISION, projection_dim=64, hidden_act="quick_gelu")
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                             projector_hidden_act="gelu", vision_feature_select_strategy="default",
                             vision_feature_layer=-1, image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
                             tie_word_embeddings=False)
        cls = LlavaForConditionalGeneration
    return cls._from_config(config, dtype=torch.float32), cls.__name__


def _describe(family: str, out: Path, max_model_len: int, block_size: int) -> MultimodalModel:
    if family == "idefics3":
        placeholder, embed = IMAGE_SEQ_LEN + 3, IMAGE_SEQ_LEN
    else:
        placeholder = embed = (IMAGE_SIZE // PATCH) ** 2
    return MultimodalModel(family, out, IMAGE_TOKEN_ID, placeholder, embed,
                           llm_kwargs(out, max_model_len, block_size))


def write_mm_model(family: str, directory: str | Path, seed: int = 0, max_model_len: int = 1024,
                   block_size: int = 32) -> MultimodalModel:
    """Write family ``family``'s tiny checkpoint, tokenizer and processor into ``directory``.

    Idempotent: an existing checkpoint written with the same recipe and seed is kept; the same
    seed gives the same weights.
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown multimodal family {family!r}; known: {', '.join(FAMILIES)}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stamp = json.dumps({"family": family, "text": _TEXT, "vision": _VISION, "seed": seed, "scheme": _SCHEME,
                        "image": [IMAGE_SIZE, PATCH, SCALE]}, sort_keys=True)
    marker = out / ".kvstore-seed.json"
    model = _describe(family, out, max_model_len, block_size)
    if marker.exists() and marker.read_text() == stamp and (out / "model.safetensors").exists():
        return model

    import torch

    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    with torch.random.fork_rng(devices=[]):  # seeded transformers init, caller's RNG untouched
        torch.manual_seed(seed)
        hf, arch = _hf_model(family)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() < 2 or name.endswith("bias"):
                continue  # norms, biases: transformers' own init
            if "embed_tokens" in name:
                std = 1.0
            elif "position_embedding" in name or "class_embedding" in name:
                std = 0.02
            else:
                std = _std(int(math.prod(param.shape[1:])))
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    hf = hf.to(torch.bfloat16)
    hf.config.architectures = [arch]
    hf.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    _write_tokenizer(family, out)
    _write_processor(family, out)
    marker.write_text(stamp)
    return model


def image(seed: int, size: int = 64) -> Any:
    """A small seeded RGB PIL image (noise): the same seed gives the same pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


if __name__ == "__main__":  # python tests/vllm_multimodal.py DIR [family...]
    import sys

    root = Path(sys.argv[1])
    for fam in sys.argv[2:] or FAMILIES[:1]:
        print(write_mm_model(fam, root / fam))
