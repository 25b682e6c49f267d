"""Build a real vLLM V1 ``Scheduler`` (and the requests and model-runner outputs it consumes)
without a GPU and without an engine, to drive a KV connector's scheduler side.

Adapted from vLLM's own connector unit-test helpers, ``tests/v1/kv_connector/unit/utils.py``
(vllm-project/vllm, Apache-2.0; ``create_vllm_config``, ``create_scheduler``,
``create_request``, ``create_model_runner_output``), read at the version stored by the search
index. Changes here: the model is a local ``config.json`` (tests/data/tiny-llama, no HF hub
access, no tokenizer), the KV cache config mirrors that model (4 layers, 2 KV heads of 64, bf16),
the connector is kvstore's (``kv_connector_module_path``), and only arguments that vLLM 0.32 and
0.33 both accept are passed, so the same helpers run under either.

Importing this module imports vLLM; run it with the vLLM under test on ``sys.path``.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from itertools import count
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "tests" / "data" / "tiny-llama" / "config.json"
EOS_TOKEN_ID = 2
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
NUM_KV_HEADS = 2
HEAD_SIZE = 64
KV_DTYPE = torch.bfloat16


def model_dir() -> str:
    """A temporary directory holding the committed tiny Llama ``config.json`` (no weights: the
    scheduler never loads any)."""
    out = Path(tempfile.mkdtemp(prefix="kvstore-vllm033-model-"))
    atexit.register(shutil.rmtree, out, True)
    shutil.copy(TINY_CONFIG, out / "config.json")
    return str(out)


def create_vllm_config(
    model: str,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    block_size: int = 32,
    max_model_len: int = 4096,
    kv_connector: str = "KVStoreConnector",
    kv_connector_module_path: str | None = "kvstore.connectors.vllm.connector",
    kv_role: str = "kv_both",
    kv_connector_extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "fail",
) -> VllmConfig:
    """``VllmConfig`` for a scheduler-only test (vLLM's ``create_vllm_config``, local model)."""
    model_config = ModelConfig(model=model, dtype="bfloat16", seed=42, skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=True)
    kv_transfer_config = KVTransferConfig(
        kv_connector=kv_connector,
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        kv_connector_extra_config=kv_connector_extra_config or {},
        kv_load_failure_policy=kv_load_failure_policy,
    )
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


def create_kv_cache_config(block_size: int, num_blocks: int) -> KVCacheConfig:
    """One full-attention group over the tiny Llama's four layers."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(
            block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=KV_DTYPE))],
    )


def create_scheduler(vllm_config: VllmConfig, num_blocks: int = 256,
                     kv_cache_config: KVCacheConfig | None = None) -> Scheduler:
    """A real ``Scheduler`` (vLLM's ``create_scheduler``); it builds the SCHEDULER-role connector."""
    block_size = vllm_config.cache_config.block_size
    kv_cache_config = kv_cache_config or create_kv_cache_config(block_size, num_blocks)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )


_request_count = count(1)
_none_hash_initialized = False


def create_request(prompt_token_ids: list[int], *, request_id: str | None = None, max_tokens: int = 2,
                   block_size: int = 32) -> Request:
    """A request with vLLM's own block hasher (vLLM's ``create_request``, explicit prompt)."""
    global _none_hash_initialized
    if not _none_hash_initialized:
        init_none_hash(sha256)
        _none_hash_initialized = True
    sampling_params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id or f"id-{next(_request_count)}",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def create_model_runner_output(req_ids: list[str], *, sampled: dict[str, list[int]] | None = None,
                               kv_connector_output: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    """What a model runner returns for one step (vLLM's ``create_model_runner_output``):
    ``sampled[req_id]`` tokens per request (none for a prefill chunk)."""
    sampled = sampled or {}
    return ModelRunnerOutput(
        req_ids=list(req_ids),
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[list(sampled.get(r, [])) for r in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_connector_output,
    )


def model_config_json() -> dict[str, Any]:
    return json.loads(TINY_CONFIG.read_text())
