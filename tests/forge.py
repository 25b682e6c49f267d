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
    """The header fields, payload and trailer (tag if signed, then checksum) of a record of the
    current format."""
    hlen = struct.unpack_from("<I", data, 8)[0]
    header = msgpack.unpackb(data[FRAME_BYTES:FRAME_BYTES + hlen])
    trailer = CHECKSUM_BYTES + (TAG_BYTES if "kid" in header else 0)
    return header, data[FRAME_BYTES + hlen:len(data) - trailer], data[len(data) - trailer:]


def frame(header: bytes, payload: bytes, *, tag: bytes = b"", trailer: bytes | None = None,
          version: int = FORMAT_VERSION) -> bytes:
    """``header`` (msgpack bytes) framed, then ``payload``, then ``trailer`` if given, else
    ``tag`` and the checksum that agrees."""
    framed = struct.pack("<4sHHII", MAGIC, version, 0, len(header), zlib.crc32(header)) + header + payload
    if trailer is not None:
        return framed + trailer
    return framed + tag + xxhash.xxh3_64_digest(framed + tag)


def reframe(header: dict[str, Any], payload: bytes, tag: bytes = b"") -> bytes:
    """A record of ``header`` (its payload_len set to agree) over ``payload``, then ``tag`` (for
    a signed header) and the checksum that agrees."""
    return frame(msgpack.packb(dict(header, payload_len=len(payload)), use_bin_type=True), payload, tag=tag)
