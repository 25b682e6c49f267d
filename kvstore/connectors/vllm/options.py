"""Options of the vLLM connector, read from ``kv_transfer_config.kv_connector_extra_config``.

One frozen dataclass, ``VLLMConnectorOptions``; every field carries its help text, so the
reference in ``docs/vllm.md`` and ``docs/configuration.md`` is generated from (and tested
against) it by ``kvstore.docs``; the options the agent offers too (store, chunk_tokens, codec,
authentication) are defined once for both (``kvstore.connectors.options``). Every value is
held to its declaration (``kvstore.config.check_options``): no control characters, numbers
within their range (``option(lo=, hi=)``). Values may be given as native JSON values or as strings
(``"8GiB"``, ``"true"``, comma-separated URL lists), which is what ``--kv-transfer-config`` on a
command line produces. An unknown key, a missing required key or a bad value raises
``ConfigError`` at engine start-up, naming the key and what is accepted.

This module imports nothing from vLLM, so tools and docs can use it without an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import build, check_options, option
from kvstore.connectors.options import (
    chunk_tokens_option,
    codec_option,
    land_in_cache_option,
    store_option,
    switch_interval_option,
)
from kvstore.errors import ConfigError
from kvstore.events import ENCODINGS, EventsConfig
from kvstore.record.auth import (
    RecordAuth,
    key_env_option,
    key_file_option,
    previous_window_option,
    shared_auth,
)

__all__ = ["VLLMConnectorOptions", "parse_options"]

MAX_TOKENS = 1 << 24  # token counts: beyond any context length


@dataclass(frozen=True)
class VLLMConnectorOptions:
    """Connector options; see ``docs/vllm.md`` for the full reference."""

    store: tuple[str, ...] = store_option()
    chunk_tokens: int = chunk_tokens_option(auto=True)
    codec: str = codec_option()
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
    save_decode: bool = option(
        True, help="Also save generated tokens' KV, chunk by chunk as each fills up, in the same chain as "
        "the prompt's: the next turn of a chat, whose prompt holds this turn's answer, loads it instead of "
        "recomputing it (a replica that did not serve the last turn too). Counted in "
        "kvstore_decode_chunks_saved_total.")
    min_load_tokens: int = option(
        0, lo=0, hi=MAX_TOKENS, help="Report no external hit shorter than this many tokens (a tiny load is not worth "
        "a round trip).")
    save_on_consumer: bool = option(
        False, help="With kv_role=kv_consumer, still save what this engine computes (the "
        "consumer then also fills the cache). Default: a consumer only loads.")
    flush_timeout: float = option(
        10.0, kind="duration", lo=0.0, hi=3600.0,
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
        0.005, kind="duration", lo=0.0, hi=60.0,
        help="How long a request's first lookup may hold the scheduler before it answers 'ask again "
        "later' (a memory or nearby Redis tier answers within it: the request is scheduled as "
        "without the connector; a slower answer delays it by a step, which changes batching).")
    lookup_timeout: float = option(
        0.5, kind="duration", lo=0.001, hi=60.0,
        help="A lookup not answered within this is a miss (a slow or frozen tier never holds a request longer), "
             "counted in kvstore_lookup_failures_total{reason=\"timeout\"}.")
    pool_bytes: int = option(
        1 << 30, kind="size", lo=16 << 20, hi=1 << 40,
        help="Size of the process's buffer pool that records are gathered into and received into "
        "(resident memory, pinned on CUDA). Must hold a load's records in flight plus queued saves.")
    device_staging_bytes: int = option(
        512 << 20, kind="size", lo=1 << 20, hi=1 << 40,
        help="On an accelerator (CUDA): device memory a worker stages records in, for each of its three copy "
        "paths (a step's loads and window saves, background loads, background saves), shared out among its KV "
        "cache groups; a larger load or save runs in windows of it. vLLM does not count it in "
        "gpu_memory_utilization: the three together must fit in what vLLM leaves free.")
    switch_interval: float = switch_interval_option()
    land_in_cache: bool = land_in_cache_option()
    window_interval: int = option(
        2048, lo=0, hi=MAX_TOKENS, help="Sliding-window and chunked-local-attention KV cache groups (Gemma 2/3, "
        "gpt-oss, Llama 4...) store the window before a prompt's last hittable end and before the first chunk end "
        "at or past every multiple of this many tokens (0: the prompt's end only), so prompts that share a long "
        "prefix hit at the last such end before they differ; recurrent-state groups (Qwen3-Next, Mamba hybrids...) "
        "store the state at those of the same ends where a prefill step of vLLM's ends. What such a group stores "
        "per prompt is its window (or one state) times the number of those ends.")
    writer_tp_max: int = option(
        8, lo=1, hi=1024, help="Read records written by engines of another tensor-parallel size: when a lookup "
        "does not find every chunk in the records of this engine's own KV head ranges, it asks (in one more "
        "round trip per tier) for those of writers of every power-of-two TP size up to this, and each rank "
        "joins finer records or slices a coarser one (docs/vllm.md, Keys). 1: TP=1 writers' records only.")
    miss_probe_interval: float = option(
        10.0, kind="duration", lo=0.0, hi=86400.0,
        help="A lookup that finds nothing asks, off the scheduler's step and at most once per this many seconds, "
        "whether the prompt's first chunk is stored under another engine configuration (KV dtype, chunk_tokens, "
        "CPU ISA, or before record format 3), and counts the miss by what it found in "
        "kvstore_lookup_misses_total{reason} (docs/vllm.md, Keys). 0: never asks (reason=\"unprobed\").")
    kv_events_endpoint: str = option(
        "", help="Publish KV events for routers (docs/routing.md): BlockStored for what this engine saves, "
        "BlockRemoved for its tiers' evictions, in vLLM's wire format on this ZMQ PUB address (e.g. "
        "tcp://*:5557; TP rank 0 publishes; needs pyzmq, the `events` extra). Empty: no events.")
    kv_events_replay_endpoint: str = option(
        "", help="ZMQ ROUTER address (bound) that replays buffered event batches from a sequence number, "
        "as vLLM's replay socket does (e.g. tcp://*:5558). Empty: no replay.")
    kv_events_topic: str = option("kvstore", help="First frame of every event message (llm-d: kv@<pod>@<model>).")
    kv_events_encoding: str = option(
        "map", choices=ENCODINGS, help="Event form: 'map' (vLLM 0.26 and later, what current routers decode) or "
        "'array' (positional, vLLM up to 0.23).")
    kv_events_blocks_per_chunk: int = option(
        0, lo=0, hi=4096, help="Blocks each saved chunk is announced as; 0: chunk_tokens / the engine's block "
        "size, so routers that index one block size per model see the engine's blocks.")
    pd_deadline: float = option(
        2.0, kind="duration", lo=0.0, hi=600.0,
        help="Disaggregated prefill (docs/disagg.md). A prefill engine (a request with do_remote_decode) promises "
        "its prompt's records visible in the shared tier within this many seconds of its response; a decode "
        "engine (do_remote_prefill) waits at most this long, and at most what the prefill engine promised, for "
        "them to appear, off the scheduler's step, then loads them; what is not there in time is recomputed, "
        "counted in kvstore_pd_load_failures_total{reason=\"timeout\"}.")
    http_port: int = option(
        0, lo=0, hi=65535,
        help="Serve kvstore's HTTP endpoint (router lookups POST /v1/lookup, /metrics, /healthz: docs/lookup.md) "
        "from the engine's scheduler process on this port, or the next free one of http_ports ports (several "
        "engines on one host). 0: not started (KVSTORE_METRICS_PORT still starts it in every process).")
    http_ports: int = option(
        1, lo=1, hi=256, help="How many consecutive ports from http_port to try (the first free one is used).")
    http_host: str = option(
        "127.0.0.1", help="Address the HTTP endpoint of http_port binds (0.0.0.0 for a router on another host).")
    auth_key_file: str = key_file_option()
    auth_key_env: str = key_env_option()
    auth_previous_window: float = previous_window_option()

    def events_config(self, block_size: int, data_parallel_rank: int = 0) -> EventsConfig | None:
        """The KV-event publisher's options (None without ``kv_events_endpoint``)."""
        if not self.kv_events_endpoint:
            return None
        per = self.kv_events_blocks_per_chunk or max(1, self.chunk_tokens // block_size)
        return EventsConfig(endpoint=self.kv_events_endpoint, replay_endpoint=self.kv_events_replay_endpoint,
                            topic=self.kv_events_topic, encoding=self.kv_events_encoding, blocks_per_chunk=per,
                            data_parallel_rank=data_parallel_rank)

    def record_auth(self) -> RecordAuth | None:
        """The deployment's record keys (None without a key), loaded once per process."""
        return shared_auth(self.auth_key_file, self.auth_key_env, self.auth_previous_window)

    def __post_init__(self) -> None:
        if not self.store:
            raise ConfigError(
                "kv_connector_extra_config needs 'store': a store URL or a list of them, fastest "
                "tier first, e.g. {\"store\": [\"memory://?max_bytes=4GiB\", \"redis://127.0.0.1:6379/0\"]}")
        check_options(self)  # text without control characters, every number within its range
        if not 0 <= self.lookup_wait <= self.lookup_timeout:
            raise ConfigError(f"lookup_wait={self.lookup_wait:g}s must be between 0 and lookup_timeout="
                              f"{self.lookup_timeout:g}s")
        if self.http_port and self.http_port + self.http_ports - 1 > 65535:
            raise ConfigError(f"http_port={self.http_port} with http_ports={self.http_ports} goes past port 65535")
        if self.kv_events_blocks_per_chunk and self.chunk_tokens % self.kv_events_blocks_per_chunk:
            raise ConfigError(f"kv_events_blocks_per_chunk={self.kv_events_blocks_per_chunk} must divide "
                              f"chunk_tokens={self.chunk_tokens} (0: the engine's blocks)")
        if self.kv_events_endpoint or self.kv_events_replay_endpoint:
            if not self.kv_events_endpoint:
                raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint (the PUB address)")
            self.events_config(self.chunk_tokens)  # the addresses' checks, at start-up


def parse_options(extra: Mapping[str, Any] | None) -> VLLMConnectorOptions:
    """Validated options from ``kv_connector_extra_config`` (ConfigError names any bad key)."""
    return build(VLLMConnectorOptions, dict(extra or {}), where="kv_connector_extra_config of KVStoreConnector")
