"""The record wire format: a fixed frame, a msgpack header, the payload, a trailer.

This module is what a record *is*: its layout, the fields of each version, the dtypes a record
may hold, and the header and record types readers get. Writing it is ``encode``; reading a
header, ``parse``; accepting a whole record, ``decode``; landing one as it arrives, ``land``.

Layout of format version 3, the one written (all integers little-endian)::

    0   4  magic  b"KVSR"
    4   2  format version (3)
    6   2  reserved, zero
    8   4  header length H
    12  4  crc32 of the header bytes
    16  H  header, a msgpack map (fields below)
    16+H   payload: the encoded KV bytes, then (if any) the hidden state's raw bytes
    ...    trailer: a signed record's tag (32 B), then the checksum (8 B)

Header fields: ``v`` format version, ``ns`` namespace digest (32 B), ``key`` prefix digest of
this chunk (16 B), ``start`` first token index, ``partial``, ``tokens`` the chunk's token ids
(uint32-le bytes), ``dtype``, ``shapes`` one shape per stored tensor (typically one per layer),
``hidden`` ``[dtype, shape]`` or nil, ``codecs`` the chain applied to the KV bytes, ``raw_len``
decoded KV length, ``payload_len``, ``created`` unix seconds, ``heads`` ``[a, b, H]``: the
record holds KV heads ``[a, b)`` of the model's ``H`` (its key names them too, ``kvstore.keys``),
or nil for a record not cut by head. A signed record (``auth``) adds,
last, ``kid`` the 8-byte id of the deployment key; its tag is the keyed BLAKE3 of every byte
before it. The checksum, the record's last 8 bytes, is the xxh3-64 of every byte before it, so
it binds the payload to its header (a payload spliced under another header fails) and a reader
can check a value without parsing it. Readers that ignore ``kid`` and the tag read signed
records.

The tag and checksum come after the payload so that a writer computes them as the record
leaves (``Pieces.stream``): each slice is hashed while it is in the CPU's cache for its send,
instead of in a pass over memory of its own before the first byte can go.

Format version 2 (still read, never written) is version 3 without ``heads``: its records were
keyed by their writer's tensor-parallel rank and size. Format version 1 had no trailer: the
header held ``checksum`` before ``created``, and a signed record ended its header with ``kid``
and ``tag``, the tag covering the header bytes before the tag value and the payload.

Records are never unpickled: msgpack for the header, raw bytes after.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.buffers import SELF_CHECK_BYTES
from kvstore.record.auth import TAG_BYTES
from kvstore.types import Buffer

MAGIC = b"KVSR"
#: magic, format version, reserved, header length, crc32 of the header.
FRAME = struct.Struct("<4sHHII")
FRAME_BYTES = FRAME.size
MAX_HEADER_BYTES = 1 << 20
SUPPORTED_VERSIONS = (1, 2, 3)
CHECKSUM_BYTES = SELF_CHECK_BYTES  # a record is a self-checked value: what a store's ArrivalDigest hashes
#: Version 1: how a signed header ends (msgpack: fixstr "tag", bin8 of 32 bytes), then the tag.
TAG_MARKER = b"\xa3tag\xc4" + bytes([TAG_BYTES])
_COMMON_FIELDS = frozenset({"v", "ns", "key", "start", "partial", "tokens", "dtype", "shapes", "hidden", "codecs",
                            "raw_len", "payload_len", "created"})
#: Per version: the header fields of every record, and those only a signed record has.
FIELDS = {1: _COMMON_FIELDS | {"checksum"}, 2: _COMMON_FIELDS, 3: _COMMON_FIELDS | {"heads"}}
SIGNED_FIELDS = {1: frozenset({"kid", "tag"}), 2: frozenset({"kid"}), 3: frozenset({"kid"})}

#: dtype name -> element size. fp8 and integer types are stored raw (no shuffle benefit).
DTYPES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int8": 1, "uint8": 1, "int32": 4,
}


@dataclass(frozen=True)
class RecordHeader:
    version: int
    namespace: bytes
    key: bytes
    start: int
    partial: bool
    tokens: bytes
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    hidden_dtype: str | None
    hidden_shape: tuple[int, ...] | None
    codecs: tuple[str, ...]
    raw_len: int
    payload_len: int
    checksum: bytes
    created: float
    #: Signed records: the id of the deployment key and the tag (both None when unsigned).
    key_id: bytes | None = None
    tag: bytes | None = None
    #: ``(a, b, H)``: the record holds KV heads ``[a, b)`` of ``H`` (None: not cut by head).
    heads: tuple[int, int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<u4")

    @property
    def hidden_len(self) -> int:
        if self.hidden_dtype is None or self.hidden_shape is None:
            return 0
        return DTYPES[self.hidden_dtype] * math.prod(self.hidden_shape)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able view for tools (``kvstore inspect``)."""
        return {
            "version": self.version, "namespace": self.namespace.hex(), "key": self.key.hex(),
            "start": self.start, "partial": self.partial, "num_tokens": self.num_tokens,
            "dtype": self.dtype, "shapes": [list(s) for s in self.shapes],
            "hidden": None if self.hidden_dtype is None else {"dtype": self.hidden_dtype, "shape": list(self.hidden_shape or ())},
            "codecs": list(self.codecs), "raw_len": self.raw_len, "payload_len": self.payload_len,
            "checksum": self.checksum.hex(), "created": self.created,
            "signed": None if self.key_id is None else {"key_id": self.key_id.hex()},
            "heads": None if self.heads is None else list(self.heads),
        }


@dataclass(frozen=True)
class Record:
    """A decoded, verified record: ``kv`` holds the tensors' bytes in header order."""

    header: RecordHeader
    kv: Buffer
    hidden: memoryview | None
    #: The KV bytes already lie in the reader's destination (``land_record``); ``kv`` is then empty.
    landed: bool = False


def kv_nbytes(dtype: str, shapes: Sequence[Sequence[int]]) -> int:
    """Bytes of ``dtype`` tensors of ``shapes`` back to back: a record's ``raw_len``."""
    if shapes and shapes.count(shapes[0]) == len(shapes):  # every layer alike: the common case
        return DTYPES[dtype] * math.prod(shapes[0]) * len(shapes)
    return DTYPES[dtype] * sum(math.prod(s) for s in shapes)
