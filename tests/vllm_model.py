"""A small Llama for real-vLLM tests: a committed ``config.json`` plus seeded random weights.

``write_model(dir)`` writes ``config.json`` and a ``model.safetensors`` checkpoint at a
realistic scale (embeddings ~N(0, 1), projections ~N(0, 0.06)), never vLLM's near-zero
``load_format="dummy"`` weights: with these, the greedy tokens depend on every KV entry, so a
wrong load changes the output instead of passing unnoticed. The same seed gives the same bytes
in every process. ``engine_kwargs`` holds the ``LLM(...)`` arguments every test engine uses.

Importing this module does not import vLLM (only torch and safetensors when writing).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TINY_CONFIG = Path(__file__).parent / "data" / "tiny-llama" / "config.json"
BLOCK_SIZE = 32
DTYPE = "bfloat16"


def llama_config(**overrides: Any) -> dict[str, Any]:
    """The committed tiny config, with ``overrides`` applied (the benchmark scales it up)."""
    config = json.loads(TINY_CONFIG.read_text())
    config.update(overrides)
    return config


def write_model(directory: str | Path, *, config: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """Write ``config.json`` and seeded random weights into ``directory``; returns it.

    Idempotent: an existing checkpoint written with the same config and seed is kept.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = config or llama_config()
    stamp = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    marker = out / ".kvstore-seed.json"
    if marker.exists() and marker.read_text() == stamp and (out / "model.safetensors").exists():
        return out
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim", h // heads)
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def proj(out_features: int, in_features: int) -> torch.Tensor:
        # ~1/sqrt(fan_in), kept within the 0.05-0.1 band of a trained small model
        return normal(out_features, in_features, std=min(0.1, max(0.05, 1 / math.sqrt(in_features))))

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(vocab, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": proj(vocab, h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": proj(heads * head_dim, h),
            p + "self_attn.k_proj.weight": proj(kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": proj(kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": proj(h, heads * head_dim),
            p + "mlp.gate_proj.weight": proj(inter, h),
            p + "mlp.up_proj.weight": proj(inter, h),
            p + "mlp.down_proj.weight": proj(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(stamp)
    return out


def engine_kwargs(model_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    """``LLM(**engine_kwargs(dir))``: token-id prompts, no tokenizer, bounded KV memory."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), skip_tokenizer_init=True, dtype=DTYPE, max_model_len=4096,
        enforce_eager=True, seed=0, kv_cache_memory_bytes=256 << 20, block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
    )
    kwargs.update(overrides)
    return kwargs


def prompt(seed: int, length: int, vocab: int = 1024) -> list[int]:
    """A reproducible token-id prompt (ids 3..vocab-1, avoiding bos/eos)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]
