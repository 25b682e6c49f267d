"""Tiny random-weight checkpoints of hybrid-attention model families for real-vLLM tests.

``write_family_model(name, dir)`` writes ``config.json`` and ``model.safetensors`` for one of
``FAMILIES``: the Hugging Face model is built with transformers ``from_config`` (so the tensor
names and layouts are the ones vLLM's loader expects) and every parameter is then re-drawn from
a seeded normal at a realistic scale, like ``vllm_model.write_model`` does for the tiny Llama:
embeddings ~N(0, 1), matrices ~N(0, min(0.1, max(0.05, 1/sqrt(fan_in)))), and the 1-D tensors
(norms, biases, gated-delta-net ``A_log``/``dt_bias``, gpt-oss sinks) keep transformers' own
(seeded) initialisation, which already follows each family's norm convention (Gemma and
Qwen3-Next RMSNorm compute ``x * (1 + w)`` and start at zeros; the others compute ``x * w`` and
start at ones). Gemma scales its embeddings by sqrt(hidden) and ties lm_head to them, so an
untrained Gemma only copies its last input token: its embeddings are drawn at 1/sqrt(hidden)
and its post-attention/post-feedforward norms at scale sqrt(hidden), after which the greedy
tokens vary and depend on the whole context. No tokenizer is written: tests use token-id
prompts with ``skip_tokenizer_init=True``. The same name and seed give the same bytes.

Sizes are test sizes: hidden 256, 2-6 layers, vocab 1024 (token ids below 1024), and sliding
windows of 64 tokens, small next to the test prompts (hundreds of tokens), so a sliding-window
KV cache group visibly holds less than the prompt.

What vLLM CPU 0.32 makes of them (block_size 32, hybrid KV cache manager on; seen 2026-12-02):

* ``gemma2``: 4 layers, sliding (64) / full alternating -> 2 groups (SlidingWindowSpec of layers
  0, 2; FullAttentionSpec of layers 1, 3), pages of 16 KiB.
* ``gemma3``: text-only ``Gemma3ForCausalLM``, 6 layers, 5 sliding : 1 full -> 6 groups of one
  layer each (5 SlidingWindowSpec, 1 FullAttentionSpec).
* ``gpt-oss``: 4 layers, sliding (64) / full alternating, MoE of 4 tiny bf16 experts (no mxfp4)
  -> 2 groups like gemma2.
* ``qwen3-next``: 3 gated-delta-net (linear attention) layers : 1 full, MoE -> 4 groups (3
  MambaSpec of one layer, 1 FullAttentionSpec), pages of 32 KiB. Needs the hybrid KV cache
  manager: a connector without ``SupportsHMA`` fails at start-up.
* ``deepseek-v2``: 2 layers of MLA -> 1 group (MLAAttentionSpec, head 576: vLLM CPU's MLA
  backends only run a latent of ``kv_lora_rank + qk_rope_head_dim == 576``, 512 + 64). On a CPU
  with AMX tiles vLLM picks its AMX MLA backend (bfloat16 only, block sizes that are multiples of
  32, prefix caching on); elsewhere its reference MLA backend, which overrides the block size to
  16 and turns prefix caching and chunked prefill off.

Importing this module imports neither vLLM nor transformers (only when writing).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
SLIDING_WINDOW = 64
VOCAB = 1024
_SCHEME = 3  # bump when the weight recipe changes: rewrites existing checkpoints

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}

_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "query_pre_attn_scalar": 64,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "query_pre_attn_scalar": 64,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "attention_bias": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096,
                            "rope_theta": 150000.0},
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
    },
    "qwen3-next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        # vLLM CPU's gated-delta-net kernel takes head dims of 64 (32 fails: "Unexpected head
        # dim size, 32"), and the fp32 state [v_heads, 64, 64] + conv must fit one full-attention
        # page of 32 tokens or vLLM raises the block size (to 160 with 4 v-heads and 2 kv heads):
        # 1 k/v head here and 4 kv heads of 64 (32 KiB pages) keep block_size 32
        "num_key_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
    },
    "nemotron-h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "layers_block_type": ["mamba", "mlp", "mamba", "attention", "mamba", "mlp"],
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 1,
        "chunk_size": 64,
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "layer_norm_epsilon": 1e-05,
        "tie_word_embeddings": False,
    },
    "granitemoehybrid": {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "shared_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 1,
        "mamba_chunk_size": 64,
        "position_embedding_type": "rope",
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
    "falcon-h1": {
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "mamba_d_ssm": 256,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 1,
        "mamba_chunk_size": 64,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
    "llama4": {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "intermediate_size": 256,
        "intermediate_size_mlp": 512,
        "num_hidden_layers": 4,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "moe_layers": [1, 3],
        "interleave_moe_layer_step": 2,
        "no_rope_layers": [1, 1, 1, 0],
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 128,
        "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
    },
    "deepseek-v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,          # vLLM CPU MLA: kv_lora_rank + qk_rope_head_dim must be 576
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "head_dim": 64,
        "q_lora_rank": None,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
    },
}

FAMILIES: tuple[str, ...] = tuple(_CONFIGS)


def family_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The config.json dict of family ``name`` (``overrides`` applied on top)."""
    if name not in _CONFIGS:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    config = {**copy.deepcopy(_COMMON), **copy.deepcopy(_CONFIGS[name])}
    config.update(overrides)
    return config


def _std(fan_in: int) -> float:
    return min(0.1, max(0.05, 1 / math.sqrt(max(fan_in, 1))))


def _fan_in(name: str, shape: tuple[int, ...], hidden: int) -> int:
    if len(shape) == 2:
        return shape[1]  # nn.Linear [out, in]
    if len(shape) == 3 and shape[1] == 1:
        return shape[2]  # depthwise conv1d [channels, 1, kernel]
    if len(shape) == 3:  # fused experts (gpt-oss: [E, in, out]); gate/up read the hidden state
        if "down" in name:
            return shape[1] if shape[2] == hidden else shape[2]
        return hidden
    return int(math.prod(shape[1:]))


def write_family_model(name: str, directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write family ``name``'s ``config.json`` and seeded weights into ``directory``; returns it.

    Idempotent: an existing checkpoint written with the same config and seed is kept.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = family_config(name, **overrides)
    stamp = json.dumps({"family": name, "config": config, "seed": seed, "scheme": _SCHEME}, sort_keys=True)
    marker = out / ".kvstore-seed.json"
    if marker.exists() and marker.read_text() == stamp and (out / "model.safetensors").exists():
        return out

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    fields = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    with torch.random.fork_rng(devices=[]):  # seeded transformers init, caller's RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if name.startswith("gemma") and ("post_attention_layernorm" in pname
                                             or "post_feedforward_layernorm" in pname):
                # Gemma's tied lm_head makes an untrained model copy its input token (the
                # residual holds sqrt(hidden) * embedding); post-norms of scale sqrt(hidden)
                # (weight sqrt(hidden) - 1 under the 1 + w convention) put the layers' outputs
                # on that scale, so the greedy tokens vary and depend on the whole context
                param.fill_(math.sqrt(hidden) - 1)
                continue
            if pname.endswith("A_log") and name == "qwen3-next":
                # transformers draws A in (0, 16): the gated delta net's state then decays within a
                # few tokens and a wrong (or lost) state changes nothing a test could see. A of
                # 0.002-0.02 keeps it for hundreds of tokens, as a trained model's long-memory heads do
                param.copy_(torch.empty(param.shape).uniform_(0.002, 0.02, generator=gen).log())
                continue
            if param.dim() < 2 or "bias" in pname.rsplit(".", 1)[-1]:
                continue  # norms, biases, A_log, dt_bias, sinks: transformers' own init
            if "embed_tokens" in pname:
                # Gemma multiplies embeddings by sqrt(hidden) (and ties lm_head to them): draw
                # them at 1/sqrt(hidden) so the scaled residual is ~N(0, 1) as elsewhere
                std = hidden ** -0.5 if name.startswith("gemma") else 1.0
            else:
                std = _std(_fan_in(pname, tuple(param.shape), hidden))
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    model = model.to(torch.bfloat16)
    model.config.architectures = config["architectures"]
    model.save_pretrained(str(out), safe_serialization=True)
    # the config as written by transformers, plus the fields it may drop or rename
    written = json.loads((out / "config.json").read_text())
    written.update({"architectures": config["architectures"], "torch_dtype": "bfloat16"})
    (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True))
    for extra in ("generation_config.json",):
        (out / extra).unlink(missing_ok=True)
    marker.write_text(stamp)
    return out


if __name__ == "__main__":  # python tests/vllm_families.py DIR [family...]
    import sys

    root = Path(sys.argv[1])
    for family in sys.argv[2:] or FAMILIES:
        print(family, write_family_model(family, root / family))
