"""``KVTransferAgent(rank, local_rank, config)``: vLLM V0's constructor semantics, and the reference
engine run through it (a V0-shaped, duck-typed config) with output identical to no cache."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from connectors.agent import KVTransferAgent
from kvstore.connectors.agent.v0 import agent_config_from_vllm
from kvstore.errors import ConfigError
from kvstore.reference import PRESETS, ModelRunner

CFG = PRESETS["tiny"]


def v0_config(store: str | None, *, role: str = "kv_both", connector: str | None = "KVStoreConnector",
              tp: int = 1, **extra) -> SimpleNamespace:
    """What V0's VllmConfig offers a KV-transfer agent: kv_transfer_config, model_config,
    parallel_config (duck-typed, as V0's connectors read them)."""
    ktc = None
    if store is not None:
        ktc = SimpleNamespace(kv_connector=connector, kv_role=role, kv_rank=None, kv_parallel_size=1,
                              kv_buffer_device="cpu", kv_connector_extra_config={"store": store, "chunk_tokens": 32,
                                                                                 **extra})
    hf = SimpleNamespace(to_dict=lambda: {"hidden_size": CFG.hidden_size, "num_hidden_layers": CFG.num_layers,
                                          "seed": CFG.seed})
    return SimpleNamespace(kv_transfer_config=ktc,
                           model_config=SimpleNamespace(model=CFG.name, revision=None, dtype=torch.float32,
                                                        quantization=None, hf_config=hf),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


def test_missing_kv_transfer_config_is_a_value_error():
    with pytest.raises(ValueError, match="KVTransferConfig is not set"):
        KVTransferAgent(0, 0, v0_config(None))
    with pytest.raises(ValueError, match="KVTransferConfig is not set"):
        KVTransferAgent(0, 0, SimpleNamespace())  # no attribute at all


@pytest.mark.parametrize("connector, role", [(None, "kv_both"), ("KVStoreConnector", None),
                                             ("KVStoreConnector", "both")])
def test_requires_a_kv_transfer_instance(tmp_path, connector, role):
    with pytest.raises(ValueError, match="should only be used when kv_connector is set"):
        KVTransferAgent(0, 0, v0_config(f"file://{tmp_path}", connector=connector, role=role))


def test_a_config_with_its_own_is_kv_transfer_instance_is_asked(tmp_path):
    cfg = v0_config(f"file://{tmp_path}")
    cfg.kv_transfer_config.is_kv_transfer_instance = False
    with pytest.raises(ConfigError):
        KVTransferAgent(0, 0, cfg)


def test_options_come_from_kv_transfer_config(tmp_path):
    url = f"file://{tmp_path}"
    c = agent_config_from_vllm(5, 1, v0_config(url, role="kv_consumer", tp=2, codec="lz4"))
    assert (c.role, c.rank, c.tp_size, c.local_rank, c.codec, c.chunk_tokens) == ("consumer", 1, 2, 1, "lz4", 32)
    assert c.store == (url,) and c.model == CFG.name and len(c.model_fingerprint) == 32
    assert agent_config_from_vllm(0, 0, v0_config(url)).model_fingerprint == c.model_fingerprint
    with pytest.raises(ConfigError, match="no_such_option"):
        agent_config_from_vllm(0, 0, v0_config(url, no_such_option=1))
    with pytest.raises(ConfigError, match="rank"):
        agent_config_from_vllm(0, 0, v0_config(url, rank=1))
    cfg = v0_config(url, role="kv_producer")
    cfg.kv_transfer_config.kv_connector_extra_config["role"] = "consumer"
    with pytest.raises(ConfigError, match="contradicts kv_role"):
        agent_config_from_vllm(0, 0, cfg)
    with pytest.raises(ConfigError, match="store"):
        agent_config_from_vllm(0, 0, v0_config(""))


def test_reference_engine_through_kv_transfer_agent_is_identical(tmp_path):
    url = f"file://{tmp_path / 'kv'}"
    prompts = [prompt(96, 1), prompt(70, 2)]
    ref = ModelRunner(CFG).generate(prompts, 8)
    producer = KVTransferAgent(0, 0, v0_config(url, role="kv_producer"))
    first = ModelRunner(CFG, producer).generate(prompts, 8)
    producer.close()
    assert first.tokens == ref.tokens and first.tokens_loaded == 0
    consumer = KVTransferAgent(0, 0, v0_config(url, role="kv_consumer"))
    hit = ModelRunner(CFG, consumer).generate(prompts, 8)
    assert hit.tokens == ref.tokens
    assert hit.bypassed and hit.tokens_loaded == sum(len(p) for p in prompts)
    assert torch.equal(hit.first_logits[0], ref.first_logits[0])
    assert consumer.connector.stats.chunks_saved == 0  # a consumer never writes
    consumer.close()
