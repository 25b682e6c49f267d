"""What the scheduler side tells the worker side each step (pickled by vLLM from the scheduler
process to every worker; built by the connector, never read from a store)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["LoadSpec", "SaveSpec", "KVStoreConnectorMetadata"]


@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` of ``tokens`` into ``block_ids`` (``[0, start)`` is a local hit)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    salt: str = ""


@dataclass
class SaveSpec:
    """After this step's forward, save the prefixes ``tokens[:e]`` for ``e`` in ``ends``."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    ends: list[int]
    salt: str = ""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
