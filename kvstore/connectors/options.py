"""The options every engine adapter offers, defined once (``kvstore.connectors.agent.config``
and ``kvstore.connectors.vllm.options`` both declare their fields with these): the same name
means the same help, default, type and accepted range in both. The authentication options live
beside the keys (``kvstore.record.auth``).
"""

from __future__ import annotations

from typing import Any

from kvstore.config import option
from kvstore.connectors.gil import DEFAULT_SWITCH_INTERVAL
from kvstore.record.codecs import CHAINS

__all__ = ["DEFAULT_CHUNK_TOKENS", "MAX_CHUNK_TOKENS", "store_option", "chunk_tokens_option", "codec_option", "switch_interval_option"]

#: The most tokens a record may cover (a million: longer than any model's context).
MAX_CHUNK_TOKENS = 1 << 20


def store_option() -> Any:
    return option(
        (), kind="urls", help="Store URLs, fastest tier first (a list, or one string of URLs separated by spaces or "
        'commas), e.g. ["memory://?max_bytes=4GiB", "redis://host:6379/0", "s3://bucket/kv?endpoint_url=..."]. '
        "Several URLs build a tiered store: local tiers are written synchronously, shared tiers in the "
        "background. Required.")


#: Tokens per record when the engine chooses (the vLLM connector without ``chunk_tokens``: at
#: least this many, see ``chunk_tokens_option``).
DEFAULT_CHUNK_TOKENS = 256


def chunk_tokens_option(*, auto: bool = False) -> Any:
    """``auto``: 0, the default, lets the engine adapter choose from its block sizes."""
    if auto:
        return option(
            0, lo=0, hi=MAX_CHUNK_TOKENS,
            help=f"Tokens per stored record; a positive multiple of every KV cache group's block size. Larger "
            f"chunks mean fewer, bigger records; a prefix is only reusable in whole chunks (plus a final partial "
            f"chunk of whole blocks). 0 (default): the smallest such multiple that is at least "
            f"{DEFAULT_CHUNK_TOKENS} (a model whose recurrent state vLLM aligns to long blocks gets longer "
            f"chunks), logged at start-up and listed by the lookup endpoint's GET /v1/namespaces.")
    return option(
        DEFAULT_CHUNK_TOKENS, lo=1, hi=MAX_CHUNK_TOKENS,
        help="Tokens per stored record; a positive multiple of the engine's block size. Larger chunks "
        "mean fewer, bigger records; a prefix is only reusable in whole chunks (plus a final partial "
        "chunk of whole blocks).")


def codec_option() -> Any:
    return option(
        "raw", choices=tuple(CHAINS),
        help="Compression of the KV bytes in each record. 'raw' is fastest on loopback and LAN; "
        "'shuffle-lz4' saves ~15% on bf16 KV.")


def land_in_cache_option() -> Any:
    return option(
        True, help="On a CPU engine, loads from Redis and files land each record's KV straight in the request's blocks as "
        "it arrives, once its header passed every check (no copy out of a buffer); its checksum and tag are "
        "checked as its last byte lands, and a record failing them leaves its blocks to be recomputed, like "
        "every block past a hit. From every tier that receives piece by piece, a host (shm) tier above "
        "included: a record promoted from a tier below is copied into the tiers above from the blocks. "
        "false: each record is received into a buffer, verified there, then copied into the blocks, so no "
        "byte of a failed record reaches the cache, at the CPU of that copy (benchmarks/results/cpu.md).")


def switch_interval_option() -> Any:
    return option(
        DEFAULT_SWITCH_INTERVAL, kind="duration", lo=0.0, hi=0.005,
        help="Python's thread switch interval, lowered to this at start-up if it is longer (CPython's default "
        "is 5ms): every system call of a background load or save waits up to this long for the GIL while the "
        "engine's thread runs Python (kvstore.connectors.gil). 0 leaves the interpreter's setting.")
