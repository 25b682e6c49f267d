"""A small reference LLM engine with a paged KV cache, for end-to-end tests, the demo and benchmarks.

A Llama-style decoder (RMSNorm, RoPE, grouped-query attention over paged KV with block tables
and slot mapping, SwiGLU, greedy sampling) whose model runner follows vLLM's V0 KV-transfer
protocol: ``recv`` before the model, skip it when told to bypass, compute only the suffix on a
partial hit, ``send`` after. Weights are seeded random at a realistic scale, so every KV value
matters: a wrong or noisy KV changes the generated tokens.
"""

from kvstore.reference.config import PRESETS, EngineConfig
from kvstore.reference.model import LlamaModel
from kvstore.reference.runner import AttnMetadata, ModelInput, ModelRunner, Sequence

__all__ = ["EngineConfig", "PRESETS", "LlamaModel", "ModelRunner", "ModelInput", "AttnMetadata", "Sequence"]
