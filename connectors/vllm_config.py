"""Options of the vLLM connector, read from ``kv_transfer_config.kv_connector_extra_config``.

One frozen dataclass, ``VLLMConnectorOptions``; every field carries its help text, so the
reference in ``docs/vllm.md`` is generated from (and tested against) this module. Values may be
given as native JSON values or as strings (``"8GiB"``, ``"true"``, comma-separated URL lists),
which is what ``--kv-transfer-config`` on a command line produces. An unknown key, a missing
required key or a bad value raises ``ConfigError`` at engine start-up, naming the key and what
is accepted.

This module imports nothing from vLLM, so tools and docs can use it without an engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.codecs import CHAINS
from kvstore.config import build, option
from kvstore.errors import ConfigError

__all__ = ["VLLMConnectorOptions", "parse_options", "options_reference", "options_markdown", "KV_ROLES"]

#: vLLM's kv_role values and what the connector does in each.
KV_ROLES = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}


@dataclass(frozen=True)
class VLLMConnectorOptions:
    """Connector options; see ``docs/vllm.md`` for the full reference."""

    store: tuple[str, ...] = option(
        (), help="Store URLs, fastest tier first (a list, or one comma-separated string), e.g. "
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

    def __post_init__(self) -> None:
        if not self.store:
            raise ConfigError(
                "kv_connector_extra_config needs 'store': a store URL or a list of them, fastest "
                "tier first, e.g. {\"store\": [\"memory://?max_bytes=4GiB\", \"redis://127.0.0.1:6379/0\"]}")
        for url in self.store:
            if not isinstance(url, str) or "://" not in url:
                raise ConfigError(f"store entry {url!r} is not a URL (scheme://...)")
        if self.chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens={self.chunk_tokens} must be a positive number of tokens")
        if self.min_load_tokens < 0:
            raise ConfigError(f"min_load_tokens={self.min_load_tokens} must not be negative")

    def check_block_size(self, block_size: int) -> None:
        """ConfigError unless ``chunk_tokens`` is a multiple of vLLM's ``block_size``."""
        if block_size <= 0 or self.chunk_tokens % block_size:
            suggestion = block_size * max(1, round(self.chunk_tokens / max(block_size, 1)))
            raise ConfigError(
                f"chunk_tokens={self.chunk_tokens} must be a multiple of vLLM's block_size={block_size} "
                f"(e.g. chunk_tokens={suggestion}); set it in kv_connector_extra_config")


def parse_options(extra: Mapping[str, Any] | None) -> VLLMConnectorOptions:
    """Validated options from ``kv_connector_extra_config`` (ConfigError names any bad key)."""
    raw = dict(extra or {})
    store = raw.get("store")
    if isinstance(store, str):
        raw["store"] = tuple(u.strip() for u in store.split(",") if u.strip())
    elif isinstance(store, (list, tuple)):
        raw["store"] = tuple(store)
    elif store is not None:
        raise ConfigError(f"store={store!r} must be a URL string or a list of URL strings")
    return build(VLLMConnectorOptions, raw, where="kv_connector_extra_config of KVStoreConnector")


def options_reference() -> list[tuple[str, str, str]]:
    """``(name, default, help)`` of every option, in declaration order (for docs)."""
    rows = []
    for f in dataclasses.fields(VLLMConnectorOptions):
        default = "required" if f.name == "store" else repr(f.default)
        if f.metadata.get("kind") == "duration":
            default = f"{f.default:g}s"
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            help_text += " Accepted: " + ", ".join(f"'{c}'" for c in choices) + "."
        rows.append((f.name, default, help_text))
    return rows


def options_markdown() -> str:
    """The options table of ``docs/vllm.md`` (a test keeps the two identical)."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {default} | {text} |" for name, default, text in options_reference()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
