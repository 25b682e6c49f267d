"""Options of the vLLM connector, read from ``kv_transfer_config.kv_connector_extra_config``.

One frozen dataclass, ``VLLMConnectorOptions``; every field carries its help text, so the
reference in ``docs/vllm.md`` and ``docs/configuration.md`` is generated from (and tested
against) it by ``kvstore.docs``. Values may be given as native JSON values or as strings
(``"8GiB"``, ``"true"``, comma-separated URL lists), which is what ``--kv-transfer-config`` on a
command line produces. An unknown key, a missing required key or a bad value raises
``ConfigError`` at engine start-up, naming the key and what is accepted.

This module imports nothing from vLLM, so tools and docs can use it without an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import build, check_range, option
from kvstore.errors import ConfigError
from kvstore.record.auth import (
    MAX_PREVIOUS_WINDOW,
    RecordAuth,
    key_env_option,
    key_file_option,
    previous_window_option,
    shared_auth,
)
from kvstore.record.codecs import CHAINS

__all__ = ["VLLMConnectorOptions", "parse_options"]


@dataclass(frozen=True)
class VLLMConnectorOptions:
    """Connector options; see ``docs/vllm.md`` for the full reference."""

    store: tuple[str, ...] = option(
        (), kind="urls", help="Store URLs, fastest tier first (a list, or one comma-separated string), e.g. "
        '["memory://?max_bytes=4GiB", "redis://host:6379/0", "s3://bucket/kv?endpoint_url=..."]. '
        "Several URLs build a tiered store: local tiers are written synchronously, shared tiers "
        "in the background. Required.")
    chunk_tokens: int = option(
        256, help="Tokens per stored record; a positive multiple of vLLM's block_size. Larger "
        "chunks mean fewer, bigger records; a prefix is only reusable in whole chunks (plus a "
        "final partial chunk of whole blocks).")
    codec: str = option(
        "raw", choices=tuple(CHAINS),
        help="Compression of the KV bytes in each record. 'raw' is fastest on loopback and LAN; "
        "'shuffle-lz4' saves ~15% on bf16 KV.")
    model_id: str = option(
        "", help="Model identity in the key namespace. Default: the model name or path given to "
        "vLLM. Set it when replicas load the same weights from different paths, or the same "
        "path holds different weights.")
    model_revision: str = option(
        "", help="Extra string mixed into the model fingerprint (e.g. a weights hash or release "
        "tag). The fingerprint already covers the HF config, dtype and vLLM's revision.")
    save_partial_chunks: bool = option(
        True, help="Also save the last, shorter chunk of a prompt (whole blocks only), so the "
        "same prompt hits to its last full block; a longer prompt reuses only full chunks.")
    min_load_tokens: int = option(
        0, help="Report no external hit shorter than this many tokens (a tiny load is not worth "
        "a round trip).")
    save_on_consumer: bool = option(
        False, help="With kv_role=kv_consumer, still save what this engine computes (the "
        "consumer then also fills the cache). Default: a consumer only loads.")
    flush_timeout: float = option(
        10.0, kind="duration",
        help="At shutdown, wait at most this long for background writes to shared tiers.")
    force_recompute_on_load_error: bool = option(
        True, help="Set vLLM's kv_load_failure_policy to 'recompute' at start-up: a record that "
        "fails verification after the scheduler counted it as a hit is recomputed by vLLM "
        "instead of failing the request. Turn off only to debug.")
    load_mode: str = option(
        "async", choices=("async", "sync"),
        help="'async': a hit loads in the background while the engine keeps running other "
        "requests (the request waits in WAITING_FOR_REMOTE_KVS); 'sync': the step that schedules "
        "the request loads it before its forward, and every running request waits.")
    save_mode: str = option(
        "async", choices=("async", "sync"),
        help="'async': a step's completed chunks are gathered and encoded by a background thread "
        "(vLLM keeps a finished request's blocks until the gather is done); 'sync': inside the step.")
    load_policy: str = option(
        "auto", choices=("auto", "always", "never"),
        help="'auto' loads a hit only when loading it (measured tier latency and bandwidth) is "
        "faster than recomputing it (measured prefill speed), per tier; 'always' and 'never' force it.")
    lookup_wait: float = option(
        0.005, kind="duration",
        help="How long a request's first lookup may hold the scheduler before it answers 'ask again "
        "later' (a memory or nearby Redis tier answers within it: the request is scheduled as "
        "without the connector; a slower answer delays it by a step, which changes batching).")
    lookup_timeout: float = option(
        0.5, kind="duration",
        help="A lookup not answered within this is a miss (a slow or frozen tier never holds a request longer), "
             "counted in kvstore_lookup_failures_total{reason=\"timeout\"}.")
    pool_bytes: int = option(
        1 << 30, kind="size",
        help="Size of the process's buffer pool that records are gathered into and received into "
        "(resident memory, pinned on CUDA). Must hold a load's records in flight plus queued saves.")
    auth_key_file: str = key_file_option()
    auth_key_env: str = key_env_option()
    auth_previous_window: float = previous_window_option()

    def record_auth(self) -> RecordAuth | None:
        """The deployment's record keys (None without a key), loaded once per process."""
        return shared_auth(self.auth_key_file, self.auth_key_env, self.auth_previous_window)

    def __post_init__(self) -> None:
        if not self.store:
            raise ConfigError(
                "kv_connector_extra_config needs 'store': a store URL or a list of them, fastest "
                "tier first, e.g. {\"store\": [\"memory://?max_bytes=4GiB\", \"redis://127.0.0.1:6379/0\"]}")
        if self.chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens={self.chunk_tokens} must be a positive number of tokens")
        if self.min_load_tokens < 0:
            raise ConfigError(f"min_load_tokens={self.min_load_tokens} must not be negative")
        if not 0 <= self.lookup_wait <= self.lookup_timeout:
            raise ConfigError(f"lookup_wait={self.lookup_wait:g}s must be between 0 and lookup_timeout="
                              f"{self.lookup_timeout:g}s")
        if not 0 < self.lookup_timeout <= 60:
            raise ConfigError(f"lookup_timeout={self.lookup_timeout:g}s must be in (0, 60] seconds")
        if not 16 << 20 <= self.pool_bytes <= 1 << 40:
            raise ConfigError(f"pool_bytes={self.pool_bytes} must be between 16MiB and 1TiB")
        check_range("auth_previous_window", self.auth_previous_window, 0.0, MAX_PREVIOUS_WINDOW)


def parse_options(extra: Mapping[str, Any] | None) -> VLLMConnectorOptions:
    """Validated options from ``kv_connector_extra_config`` (ConfigError names any bad key)."""
    return build(VLLMConnectorOptions, dict(extra or {}), where="kv_connector_extra_config of KVStoreConnector")
