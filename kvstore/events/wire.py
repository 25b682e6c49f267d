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

A block is a chunk, or with ``blocks`` > 1 (``block_digests``) an equal part of one (an engine
block: routers that index one block size per model need the engine's). A block hash is an
unsigned 64-bit integer (``"int"``: what vLLM publishes by default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the digest's low 64 bits, big-endian) or the digest's
bytes (``"bytes"``), ``HASH_FORMATS``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

__all__ = ["ENCODINGS", "HASH_FORMATS", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Event", "block_hash",
           "block_digests", "encode_batch", "encode_event"]

ENCODINGS = ("map", "array")
HASH_FORMATS = ("int", "bytes")
_LOW64 = (1 << 64) - 1

BlockHash = int | bytes


@dataclass(frozen=True)
class BlockStored:
    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int] | np.ndarray
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


def block_digests(digest: bytes, blocks: int) -> list[bytes]:
    """The names of a chunk's ``blocks`` blocks, in order: the last is the chunk's own digest (so
    the next chunk's parent is the digest it chains from), the others derived from it, so a
    removal, which knows only the chunk's key, names them all."""
    if blocks == 1:
        return [digest]
    return [hashlib.sha256(b"kvstore-block\x00" + digest + j.to_bytes(4, "big")).digest()[:len(digest)]
            for j in range(blocks - 1)] + [digest]


def block_hash(digest: bytes, hash_format: str) -> BlockHash:
    """A chunk digest as a block hash in ``hash_format`` (``HASH_FORMATS``)."""
    if hash_format == "int":
        return int.from_bytes(digest, "big") & _LOW64  # vLLM's maybe_convert_block_hash
    return bytes(digest)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _map_header(n: int) -> bytes:
    return bytes((0x80 | n,))  # events have fewer than 16 fields


#: One msgpack uint 32 (0xce, then the value big-endian), as a numpy record.
_UINT32 = np.dtype([("marker", "u1"), ("value", ">u4")])


def _pack_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as a msgpack array of uint32s, packed by numpy: a prompt's tokens as Python ints
    would cost the publisher more than all else it does."""
    arr = np.asarray(tokens)
    body = np.empty(arr.shape[0], dtype=_UINT32)
    body["marker"] = 0xCE
    body["value"] = arr
    return _array_header(arr.shape[0]) + body.tobytes()


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


# Field names, tags and None, packed once: a batch of many small events is mostly these.
_P = {name: _pack(name) for name in ("type", "BlockStored", "BlockRemoved", "AllBlocksCleared", "block_hashes",
                                     "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                                     "extra_keys")}
_NONE = _pack(None)


def encode_event(event: Event, encoding: str) -> bytes:
    """One event's msgpack bytes in ``encoding`` (what ``encode_batch`` takes in place of it)."""
    if isinstance(event, BlockStored):
        fields: list[tuple[str, bytes]] = [
            ("block_hashes", _pack(list(event.block_hashes))),
            ("parent_block_hash", _NONE if event.parent_block_hash is None else _pack(event.parent_block_hash)),
            ("token_ids", _pack_tokens(event.token_ids)), ("block_size", _pack(event.block_size)),
            ("lora_id", _NONE), ("medium", _pack(event.medium)),
            ("lora_name", _NONE if event.lora_name is None else _pack(event.lora_name))]
        if encoding == "map" and event.extra_keys is not None:
            fields.append(("extra_keys", _pack([None if k is None else list(k) for k in event.extra_keys])))
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = [("block_hashes", _pack(list(event.block_hashes))), ("medium", _pack(event.medium))]
        tag = "BlockRemoved"
    elif isinstance(event, AllBlocksCleared):
        fields = []
        tag = "AllBlocksCleared"
    else:
        raise TypeError(f"not a KV event: {event!r}")
    if encoding == "map":
        return b"".join([_map_header(len(fields) + 1), _P["type"], _P[tag],
                         *(_P[name] + value for name, value in fields)])
    return b"".join([_array_header(len(fields) + 1), _P[tag], *(value for _, value in fields)])


def encode_batch(ts: float, events: Sequence[Event | bytes], data_parallel_rank: int | None, *,
                 encoding: str) -> bytes:
    """The msgpack bytes of vLLM's ``KVEventBatch(ts, events, data_parallel_rank)`` in ``encoding``
    (an event may be given already encoded, by ``encode_event`` in the same encoding)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding={encoding!r}; accepted: {', '.join(ENCODINGS)}")
    # msgpack concatenates: each part is packed on its own (the tokens by numpy) and joined.
    parts = [_array_header(2 if data_parallel_rank is None else 3), _pack(float(ts)), _array_header(len(events)),
             *(e if isinstance(e, bytes) else encode_event(e, encoding) for e in events)]
    if data_parallel_rank is not None:  # omit_defaults: vLLM leaves a None rank out
        parts.append(_pack(data_parallel_rank))
    return b"".join(parts)
