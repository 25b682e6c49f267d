"""``VLLMWarmEngine``: warm with vLLM in-process and the kvstore connector."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from kvstore.connectors.vllm.plugin import CONNECTOR_MODULE, CONNECTOR_NAME
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkKey
from kvstore.metrics.catalog import BYTES_WRITTEN
from kvstore.stores import Store
from kvstore.warm.engine import EngineUnavailableError, WarmEngine

__all__ = ["VLLMWarmEngine"]

log = logging.getLogger(__name__)


class VLLMWarmEngine(WarmEngine):
    """vLLM in-process with the kvstore connector (``connectors.vllm_v1``), prompts in batches.

    The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the warm
    run asks the connector (``kvstore.connectors.vllm.inprocess``) for the keys it saves (its
    namespaces, one per KV cache group and TP rank, and its lookup limit) and checks them in the
    connector's own store. ``engine_args`` are extra
    ``vllm.LLM`` arguments; prompts are token ids, so the tokenizer is not loaded by default.
    """

    name = "vllm"

    def __init__(self, model: str, store: str | Sequence[str], *, chunk_tokens: int | None = None,
                 codec: str | None = None, kv_config: dict[str, Any] | None = None,
                 engine_args: dict[str, Any] | None = None, batch_size: int = 16) -> None:
        from kvstore.connectors.vllm.inprocess import InProcessConnector, connectors_now
        from kvstore.connectors.vllm.options import parse_options

        if batch_size < 1:
            raise ConfigError(f"--batch-size {batch_size} must be at least 1")
        extra = dict(kv_config or {})
        if "store" in extra:
            raise ConfigError("give the store with --store, not in --kv-config")
        extra["store"] = [store] if isinstance(store, str) else list(store)
        if chunk_tokens is not None:
            extra["chunk_tokens"] = chunk_tokens
        if codec is not None:
            extra["codec"] = codec
        opts = parse_options(extra)  # a bad option fails here, before the engine loads
        # vLLM logs to stdout by default; stdout carries the warm summary (--json).
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
        except ImportError as exc:
            raise ConfigError(f"--engine vllm needs vLLM installed ({exc})") from exc
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keep the connector reachable from here
        kwargs: dict[str, Any] = {"model": model, "skip_tokenizer_init": True}
        kwargs.update(engine_args or {})
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both", kv_connector_extra_config=extra)
        self.model = model
        self.batch_size = batch_size
        self._flush_timeout = opts.flush_timeout
        before = connectors_now()
        try:
            self.llm = LLM(**kwargs)
        except (KVStoreError, ImportError):
            raise
        except (OSError, ValueError, RuntimeError) as exc:
            raise EngineUnavailableError(f"vLLM could not start with model {model!r}: {exc}") from exc
        self.params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        self.connector = InProcessConnector.started_after(before, opts.store)
        self._store = self.connector.store if self.connector is not None else None
        if self.connector is None:
            log.warning("the kvstore connector is not reachable in this process: every prompt will run")

    @property
    def store(self) -> Store | None:
        return self._store

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey] | None:
        return None if self.connector is None else self.connector.chunk_keys(tokens)

    def prefill(self, tokens: Sequence[int]) -> None:
        self.llm.generate([{"prompt_token_ids": list(tokens)}], self.params, use_tqdm=False)

    def prefill_batch(self, batch: Sequence[Sequence[int]]) -> list[BaseException | None]:
        try:
            self.llm.generate([{"prompt_token_ids": list(t)} for t in batch], self.params, use_tqdm=False)
            return [None] * len(batch)
        except Exception as exc:  # noqa: BLE001 - vLLM rejects a whole batch for one bad prompt: find which
            return super().prefill_batch(batch) if len(batch) > 1 else [exc]

    def bytes_written(self) -> int | None:
        tiers = getattr(self._store, "tiers", None)
        if not tiers:
            return None
        return int(BYTES_WRITTEN.value(tier=tiers[0].name))

    def flush(self) -> None:
        """Wait for the connector's background saves (a prompt's generate returns before its
        gather has run, with save_mode=async), then for the stores' writes."""
        if self.connector is not None and not self.connector.wait_saved(self._flush_timeout):
            log.warning("kvstore: background saves still running after %.0fs", self._flush_timeout)
        super().flush()

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"engine": self.name, "model": self.model, "batch_size": self.batch_size}
        if self.connector is not None:
            d["namespace"] = self.connector.namespace_id
        return d

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                log.debug("vLLM shutdown failed", exc_info=True)
