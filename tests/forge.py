"""Records built by hand, as a deliberate (or hostile) writer of the current format would: any
header, framed with a CRC that agrees, the payload, and a trailer whose checksum agrees."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack
import xxhash

from kvstore import FORMAT_VERSION
from kvstore.record import FRAME_BYTES, MAGIC
from kvstore.record.auth import TAG_BYTES
from kvstore.record.format import CHECKSUM_BYTES


def split(data: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """The header fields, payload and trailer of a record of the current format."""
    hlen = struct.unpack_from("<I", data, 8)[0]
    header = msgpack.unpackb(data[FRAME_BYTES:FRAME_BYTES + hlen])
    trailer = CHECKSUM_BYTES + (TAG_BYTES if "kid" in header else 0)
    return header, data[FRAME_BYTES + hlen:len(data) - trailer], data[len(data) - trailer:]


def checksum(header: bytes, payload: bytes) -> bytes:
    """The checksum a version-2 record of ``header`` (msgpack bytes) over ``payload`` carries."""
    return xxhash.xxh3_64_digest(header + xxhash.xxh3_64_digest(payload))


def frame(header: bytes, payload: bytes, trailer: bytes | None = None, version: int = FORMAT_VERSION) -> bytes:
    """``header`` (msgpack bytes) framed, then ``payload``, then ``trailer`` (by default the
    checksum that agrees)."""
    if trailer is None:
        trailer = checksum(header, payload)
    return struct.pack("<4sHHII", MAGIC, version, 0, len(header), zlib.crc32(header)) + header + payload + trailer


def reframe(header: dict[str, Any], payload: bytes, tag: bytes = b"") -> bytes:
    """A record of ``header`` (its payload_len set to agree) over ``payload``, its checksum
    agreeing, then ``tag`` (for a signed header)."""
    packed = msgpack.packb(dict(header, payload_len=len(payload)), use_bin_type=True)
    return frame(packed, payload, checksum(packed, payload) + tag)
