"""``KVTransferAgent(rank, local_rank, config)``: vLLM V0's KV-transfer agent, exactly, over kvstore.

A V0-style model runner builds its agent as ``KVTransferAgent(rank=world rank,
local_rank=local rank, config=vllm_config)`` and calls ``send_kv_caches_and_hidden_states``,
``recv_kv_caches_and_hidden_states`` and ``close``; this class has that constructor and those
three methods, forwarding to ``KVStoreAgent`` (``self.connector``, as in V0), so the runner swaps
it in without code changes.

Constructor semantics (V0's):

* ``config.kv_transfer_config`` missing or ``None``: ``ValueError`` (V0's message).
* The config must be a KV-transfer instance: ``kv_connector`` set and ``kv_role`` one of
  ``kv_producer``, ``kv_consumer``, ``kv_both`` (V0's ``is_kv_transfer_instance``; a config
  object that has that property is asked directly). V0 asserted this; here it is a
  ``ConfigError`` (a ``ValueError`` too), so it also holds under ``python -O``.
* The connector's options come from ``kv_transfer_config``: ``kv_role`` is the agent's role and
  ``kv_connector_extra_config`` holds ``AgentConfig``'s other options (``store`` is required;
  unknown keys are rejected by name). ``model`` defaults to ``config.model_config.model`` and
  ``model_fingerprint`` to ``kvstore.connectors.model.model_fingerprint`` of the model config
  (its HF config, dtype, revision and quantization: the vLLM connector's algorithm): KV is shared
  only between equal models.
* ``rank`` is the global rank; the tensor-parallel rank is ``rank % tensor_parallel_size``
  (V0 numbers ranks TP-fastest across pipeline stages), ``tensor_parallel_size`` comes from
  ``config.parallel_config``. Pipeline stages are told apart by the model's
  ``start_layer``/``end_layer``, as in ``KVStoreAgent``.

Everything is duck-typed: any object with these attributes works (``tests/test_agent_v0.py``
uses ``SimpleNamespace``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.connectors.agent.agent import KVStoreAgent
from kvstore.connectors.agent.config import AgentConfig
from kvstore.connectors.model import model_fingerprint
from kvstore.connectors.roles import KV_ROLE_NAMES
from kvstore.errors import ConfigError

__all__ = ["KVTransferAgent", "agent_config_from_vllm"]

_FROM_ARGUMENTS = ("rank", "local_rank", "tp_size")


def _is_kv_transfer_instance(ktc: Any) -> bool:
    flag = getattr(ktc, "is_kv_transfer_instance", None)
    if isinstance(flag, bool):
        return flag
    return getattr(ktc, "kv_connector", None) is not None and getattr(ktc, "kv_role", None) in KV_ROLE_NAMES


def _fingerprint(model_config: Any) -> str:
    """``model_fingerprint`` of vLLM's model config (the vLLM connector's algorithm)."""
    hf = getattr(model_config, "hf_config", None)
    to_dict = getattr(hf, "to_dict", None)
    config = to_dict() if callable(to_dict) else (hf if isinstance(hf, dict) else {"hf_config": str(hf)})
    dtype = str(getattr(model_config, "dtype", "")).removeprefix("torch.")
    return model_fingerprint(config, dtype=dtype, revision=getattr(model_config, "revision", None),
                             quantization=getattr(model_config, "quantization", None))


def agent_config_from_vllm(rank: int, local_rank: int, config: Any) -> AgentConfig:
    """The ``AgentConfig`` for V0's constructor arguments (see the module docstring)."""
    ktc = config.kv_transfer_config
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a mapping, not {type(extra).__name__}")
    given = [k for k in _FROM_ARGUMENTS if k in extra]
    if given:
        raise ConfigError(f"kv_connector_extra_config sets {', '.join(given)}: KVTransferAgent takes them from its "
                          "rank and local_rank arguments and config.parallel_config")
    options = dict(extra)
    role = ktc.kv_role
    if "role" in options and options["role"] != role:
        raise ConfigError(f"kv_connector_extra_config role={options['role']!r} contradicts kv_role={role!r}; "
                          "set kv_role only")
    options["role"] = role
    tp_size = int(getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    if type(rank) is not int or rank < 0 or type(local_rank) is not int or local_rank < 0:
        raise ConfigError(f"rank={rank!r} and local_rank={local_rank!r} must be non-negative integers")
    options.update(rank=rank % tp_size, local_rank=local_rank, tp_size=tp_size)
    model_config = getattr(config, "model_config", None)
    if "model" not in options and getattr(model_config, "model", None):
        options["model"] = str(model_config.model)  # type: ignore[union-attr]
    if "model_fingerprint" not in options and model_config is not None:
        options["model_fingerprint"] = _fingerprint(model_config)
    return AgentConfig.from_mapping(options)


class KVTransferAgent:
    """vLLM V0's ``KVTransferAgent`` over ``KVStoreAgent``; see the module docstring."""

    def __init__(self, rank: int, local_rank: int, config: Any) -> None:
        self.config = config
        if getattr(config, "kv_transfer_config", None) is None:
            raise ValueError("KVTransferConfig is not set in the VllmConfig, cannot initialize KVConnector.")
        if not _is_kv_transfer_instance(config.kv_transfer_config):
            raise ConfigError("KVTransferAgent should only be used when kv_connector is set "
                              f"and kv_role is one of {', '.join(KV_ROLE_NAMES)} "
                              f"(kv_role={getattr(config.kv_transfer_config, 'kv_role', None)!r})")
        self.connector = KVStoreAgent(agent_config_from_vllm(rank, local_rank, config))

    def send_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: Sequence[Any], hidden_or_intermediate_states: Any) -> None:
        self.connector.send_kv_caches_and_hidden_states(model_executable, model_input, kv_caches,
                                                        hidden_or_intermediate_states)

    def close(self) -> None:
        self.connector.close()

    def recv_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: Sequence[Any]) -> tuple[Any, bool, Any]:
        return self.connector.recv_kv_caches_and_hidden_states(model_executable, model_input, kv_caches)
