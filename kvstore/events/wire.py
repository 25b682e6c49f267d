"""vLLM's KV-event wire format, encoded with msgpack (kvstore never imports vLLM for it).

A message is one ``EventBatch``: the array ``[ts, events, data_parallel_rank]`` (vLLM's
``EventBatch`` is ``array_like`` in every version). Each event is a tagged ``msgspec`` struct,
encoded in one of two forms, ``ENCODINGS``:

* ``"map"``: vLLM since PR #42892 (0.26 and later, 0.32 and 0.33 included): a map whose
  ``"type"`` key holds the tag (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``),
  then the fields by name; fields with a default are left out when they hold it
  (``omit_defaults``), the others are always present, ``None`` included.
* ``"array"``: vLLM up to 0.23 (``array_like=True``): ``[tag, field, field, ...]`` in declaration
  order, stopping after ``lora_name``; decoders of that form ignore trailing fields they lack.

The events, field for field (what ``encode_batch`` writes; the rest of vLLM's optional fields
are left at their defaults):

* ``BlockStored``: ``block_hashes`` (one per block, in chain order), ``parent_block_hash`` (the
  hash of the block before the first, ``None`` for a prefix's first block), ``token_ids`` (every
  block's tokens, back to back), ``block_size`` (tokens per block), ``lora_id`` (``None``),
  ``medium``, ``lora_name``; map form also ``extra_keys`` when given.
* ``BlockRemoved``: ``block_hashes``, ``medium``.
* ``AllBlocksCleared``: no fields.

A block hash is an unsigned 64-bit integer (``"int"``: what vLLM publishes by default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the digest's low 64 bits, big-endian) or the digest's
bytes (``"bytes"``), ``HASH_FORMATS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = ["ENCODINGS", "HASH_FORMATS", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Event", "block_hash",
           "encode_batch"]

ENCODINGS = ("map", "array")
HASH_FORMATS = ("int", "bytes")
_LOW64 = (1 << 64) - 1

BlockHash = int | bytes


@dataclass(frozen=True)
class BlockStored:
    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None
    lora_name: str | None = None
    #: One entry per block (map form only): what besides the tokens its hash covers.
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: Sequence[BlockHash]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def block_hash(digest: bytes, hash_format: str) -> BlockHash:
    """A chunk digest as a block hash in ``hash_format`` (``HASH_FORMATS``)."""
    if hash_format == "int":
        return int.from_bytes(digest, "big") & _LOW64  # vLLM's maybe_convert_block_hash
    return bytes(digest)


def _event(event: Event, encoding: str) -> Any:
    if isinstance(event, BlockStored):
        fields: list[tuple[str, Any]] = [
            ("block_hashes", list(event.block_hashes)), ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)), ("block_size", event.block_size), ("lora_id", None),
            ("medium", event.medium), ("lora_name", event.lora_name)]
        if encoding == "map" and event.extra_keys is not None:
            fields.append(("extra_keys", [None if k is None else list(k) for k in event.extra_keys]))
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = [("block_hashes", list(event.block_hashes)), ("medium", event.medium)]
        tag = "BlockRemoved"
    elif isinstance(event, AllBlocksCleared):
        fields = []
        tag = "AllBlocksCleared"
    else:
        raise TypeError(f"not a KV event: {event!r}")
    if encoding == "map":
        return {"type": tag, **dict(fields)}
    return [tag, *(value for _, value in fields)]


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int | None, *, encoding: str) -> bytes:
    """The msgpack bytes of vLLM's ``KVEventBatch(ts, events, data_parallel_rank)`` in ``encoding``."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding={encoding!r}; accepted: {', '.join(ENCODINGS)}")
    batch: list[Any] = [float(ts), [_event(e, encoding) for e in events]]
    if data_parallel_rank is not None:  # omit_defaults: vLLM leaves a None rank out
        batch.append(data_parallel_rank)
    packed: bytes = msgpack.packb(batch, use_bin_type=True)
    return packed
