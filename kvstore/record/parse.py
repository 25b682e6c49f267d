"""Judging a record by its frame and header alone, before any payload byte is used.

``read_header`` (of a whole record or its first bytes) and ``check_record`` (of a whole record,
with the reader's expectations) accept a header only if it is exactly what its version writes
(``kvstore.record.format``): the frame, every field (types, ranges, no unknown or repeated
field), their consistency (codec chain against dtype and lengths, lengths against shapes and
the bytes present) and, when given, the reader's namespace, key, tokens, dtype, shapes and
hidden state. Every failure is a ``CorruptRecordError`` whose reason says what failed; a lying
header never sizes a buffer. The checksum and tag, which need every byte, are checked by
``decode`` and ``land``.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.buffers import byte_view
from kvstore.errors import CorruptRecordError
from kvstore.keys import MAX_HEADS, ChunkKey, Namespace, TokenIds, tokens_to_array
from kvstore.record import codecs
from kvstore.record.auth import KEY_ID_BYTES, TAG_BYTES
from kvstore.record.format import (
    CHECKSUM_BYTES,
    DTYPES,
    FIELDS,
    FRAME,
    FRAME_BYTES,
    MAGIC,
    MAX_HEADER_BYTES,
    SIGNED_FIELDS,
    SUPPORTED_VERSIONS,
    TAG_MARKER,
    RecordHeader,
    kv_nbytes,
)
from kvstore.types import Buffer

MAX_RAW_BYTES = 4 << 30  # no record decodes to more: a lying header must not make us allocate without bound
_MAX_COMPRESSION_RATIO = 300  # above lz4's and far above what KV data reaches (1.5)
_MAX_START = 1 << 40  # token positions
_MAX_CREATED = 1e11  # unix seconds (year 5138): anything later is a lie, and so is NaN


def _fail(message: str, reason: str) -> CorruptRecordError:
    return CorruptRecordError(message, reason)


def _int(value: Any, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(f"header field {name}={value!r} is not an integer in [{lo}, {hi}]", "header")
    return value


def _bytes(value: Any, name: str, size: int | None = None) -> bytes:
    if type(value) is not bytes or (size is not None and len(value) != size):
        raise _fail(f"header field {name} is not {size if size else ''} bytes", "header")
    return value


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if type(value) is not list or not 1 <= len(value) <= 16:
        raise _fail(f"header field {name}={value!r} is not a shape of 1 to 16 dimensions", "header")
    return tuple(_int(d, name, 0, 1 << 40) for d in value)


def _shapes(value: list[Any]) -> tuple[tuple[int, ...], ...]:
    """The header's ``shapes``, each checked as ``_shape`` does. When every layer's shape is the
    same list of ints (the common case) only the first is checked item by item: a few C-level
    passes instead of a Python call per dimension of every layer."""
    first = value[0]
    if (set(map(type, value)) == {list} and value.count(first) == len(value)
            and set(map(type, itertools.chain.from_iterable(value))) == {int}):
        return (_shape(first, "shapes"),) * len(value)
    return tuple(_shape(s, "shapes") for s in value)


def _dtype(value: Any, name: str) -> str:
    if type(value) is not str or value not in DTYPES:
        raise _fail(f"header field {name}={value!r} is not a known dtype", "header")
    return value


def _heads(value: Any) -> tuple[int, int, int] | None:
    """The header's ``heads``: nil, or ``[a, b, H]`` with ``0 <= a < b <= H <= MAX_HEADS``."""
    if value is None:
        return None
    if type(value) is not list or len(value) != 3 or any(type(v) is not int for v in value) \
            or not 0 <= value[0] < value[1] <= value[2] <= MAX_HEADS:
        raise _fail(f"header field heads={value!r} is not [start, end, total] of a head range", "header")
    return value[0], value[1], value[2]


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a map repeats a key")  # two values for one field: which would a reader believe?
    return out


def _frame(view: memoryview) -> tuple[int, memoryview]:
    """The format version and header bytes of a record, after checking its frame."""
    if len(view) < FRAME_BYTES:
        raise _fail(f"record of {len(view)} bytes is shorter than its frame", "truncated")
    magic, version, reserved, header_len, header_crc = FRAME.unpack_from(view, 0)
    if magic != MAGIC:
        raise _fail(f"not a kvstore record (magic {bytes(magic)!r})", "foreign")
    if version not in SUPPORTED_VERSIONS:
        raise _fail(f"record format version {version} is not supported (this build reads {SUPPORTED_VERSIONS})", "version")
    if reserved != 0 or not 0 < header_len <= MAX_HEADER_BYTES:
        raise _fail(f"record frame is malformed (reserved {reserved}, header length {header_len})", "header")
    if FRAME_BYTES + header_len > len(view):
        raise _fail(f"record truncated inside its header ({len(view)} bytes)", "truncated")
    header_bytes = view[FRAME_BYTES:FRAME_BYTES + header_len]
    if zlib.crc32(header_bytes) != header_crc:
        raise _fail("record header checksum mismatch", "checksum")
    return version, header_bytes


def _fields(header_bytes: memoryview, version: int) -> dict[str, Any]:
    try:
        h = msgpack.unpackb(header_bytes, raw=False, strict_map_key=True, use_list=True,
                            max_bin_len=MAX_HEADER_BYTES, max_str_len=1 << 12,
                            max_array_len=1 << 16, max_map_len=64, object_pairs_hook=_unique_map)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise _fail(f"record header is not valid msgpack: {exc}", "header") from exc
    if type(h) is not dict:
        raise _fail("record header is not a map", "header")
    names = set(h)
    fields, signed_fields = FIELDS[version], SIGNED_FIELDS[version]
    signed = names & signed_fields
    if names - fields - signed_fields or fields - names or signed not in (set(), signed_fields):
        unknown, missing = sorted(map(repr, names - fields - signed_fields)), sorted(fields - names)
        raise _fail(f"record header fields are not version {version}'s (unknown {unknown}, missing {missing}, "
                    f"signature fields {sorted(signed)})", "header")
    if signed:
        _bytes(h["kid"], "kid", KEY_ID_BYTES)
    if signed and version == 1:
        tag = _bytes(h["tag"], "tag", TAG_BYTES)
        if bytes(header_bytes[-len(TAG_MARKER) - TAG_BYTES:]) != TAG_MARKER + tag:
            raise _fail("record tag is not the last header field", "header")
    return h


def read_header(data: Buffer, size: int | None = None) -> RecordHeader:
    """Parse and validate the frame, header and lengths of a record (not its checksum or tag).

    ``data`` is the whole record or, given ``size`` (the whole record's length), its first bytes:
    at least ``header_extent`` of them, or the error says ``truncated``. The lengths are then
    checked against ``size``, and a version-2 record's checksum and tag, in its trailer, are not
    read (``checksum`` is empty, ``tag`` None)."""
    view = byte_view(data)
    if size is not None and size < len(view):
        raise ValueError(f"size={size} is shorter than the {len(view)} bytes given")
    return parse_header(view, size)[0]


def header_extent(data: Buffer) -> int | None:
    """How many leading bytes of a record hold its frame and header (what ``read_header`` of a
    record's first bytes needs), from its frame; None when ``data`` is shorter than a frame or
    does not start with one of ours."""
    view = byte_view(data)
    if len(view) < FRAME_BYTES:
        return None
    magic, _, _, header_len, _ = FRAME.unpack_from(view, 0)
    return FRAME_BYTES + header_len if magic == MAGIC else None


def parse_header(view: memoryview, size: int | None = None) -> tuple[RecordHeader, int]:
    """The record's header and where its payload starts; ``view`` is the whole record, or its
    first bytes when ``size`` says how long the whole one is (``read_header``)."""
    version, header_bytes = _frame(view)
    h = _fields(header_bytes, version)
    v = _int(h["v"], "v")
    if v != version:
        raise _fail(f"header version {v} disagrees with frame version {version}", "header")
    dtype = _dtype(h["dtype"], "dtype")
    shapes_raw = h["shapes"]
    if type(shapes_raw) is not list or not 1 <= len(shapes_raw) <= 4096:
        raise _fail("header field shapes is not a list of 1 to 4096 shapes", "header")
    shapes = _shapes(shapes_raw)
    hidden = h["hidden"]
    hidden_dtype = hidden_shape = None
    if hidden is not None:
        if type(hidden) is not list or len(hidden) != 2:
            raise _fail("header field hidden is not [dtype, shape]", "header")
        hidden_dtype, hidden_shape = _dtype(hidden[0], "hidden"), _shape(hidden[1], "hidden")
    chain = h["codecs"]
    if type(chain) is not list:
        raise _fail("header field codecs is not a list", "header")
    codecs.validate_chain(chain, DTYPES[dtype])
    tokens = _bytes(h["tokens"], "tokens")
    if not tokens or len(tokens) % 4:
        raise _fail("header field tokens is not one or more uint32", "header")
    partial = h["partial"]
    if type(partial) is not bool:
        raise _fail("header field partial is not a boolean", "header")
    created = h["created"]
    if type(created) not in (float, int) or not 0 <= created < _MAX_CREATED:  # NaN fails too
        raise _fail(f"header field created={created!r} is not a time", "header")
    payload_at = FRAME_BYTES + len(header_bytes)
    signed = "kid" in h
    trailer = 0 if version == 1 else (TAG_BYTES if signed else 0) + CHECKSUM_BYTES
    total = len(view) if size is None else size
    payload_end = total - trailer
    if version == 1:
        checksum, tag = _bytes(h["checksum"], "checksum", 8), h.get("tag")
    elif payload_end < payload_at:
        raise _fail(f"record of {total} bytes is too short for its trailer", "truncated")
    elif total != len(view):  # the first bytes only: the trailer was not read
        checksum, tag = b"", None
    else:
        checksum = bytes(view[len(view) - CHECKSUM_BYTES:])
        tag = bytes(view[payload_end:payload_end + TAG_BYTES]) if signed else None
    header = RecordHeader(
        version=v,
        namespace=_bytes(h["ns"], "ns", 32),
        key=_bytes(h["key"], "key", 16),
        start=_int(h["start"], "start", 0, _MAX_START),
        partial=partial,
        tokens=tokens,
        dtype=dtype,
        shapes=shapes,
        hidden_dtype=hidden_dtype,
        hidden_shape=hidden_shape,
        codecs=tuple(chain),
        raw_len=_int(h["raw_len"], "raw_len"),
        payload_len=_int(h["payload_len"], "payload_len"),
        checksum=checksum,
        created=float(created),
        key_id=h.get("kid"),
        tag=tag,
        heads=_heads(h.get("heads")),
    )
    _check_lengths(header, payload_end - payload_at)
    return header, payload_at


def _check_lengths(header: RecordHeader, actual: int) -> None:
    """Lengths against shapes, codecs and the bytes present: a lying header never sizes a buffer."""
    if header.raw_len != kv_nbytes(header.dtype, header.shapes):
        raise _fail(f"raw_len {header.raw_len} disagrees with shapes {header.shapes}", "header")
    body_len = header.payload_len - header.hidden_len
    if header.raw_len > MAX_RAW_BYTES or header.hidden_len > MAX_RAW_BYTES or (
            header.codecs and header.raw_len > _MAX_COMPRESSION_RATIO * body_len + 4096):
        raise _fail(f"raw_len {header.raw_len} is implausible for a {header.payload_len}-byte payload", "header")
    if body_len < (1 if header.codecs else 0):
        raise _fail(f"hidden state ({header.hidden_len} bytes) leaves no room for the KV in the payload", "header")
    if not header.codecs and body_len != header.raw_len:
        raise _fail("payload_len disagrees with raw_len for an uncompressed record", "header")
    if header.start + header.num_tokens > _MAX_START:
        raise _fail(f"record tokens end past {_MAX_START}", "header")
    if actual != header.payload_len:
        reason = "truncated" if actual < header.payload_len else "header"
        raise _fail(f"record payload has {actual} bytes, header says {header.payload_len}", reason)


def check_expected(header: RecordHeader, namespace: Namespace | None, chunk: ChunkKey | None,
                   tokens: TokenIds | None, dtype: str | None, shapes: Sequence[Sequence[int]] | None,
                   hidden_dtype: str | None, hidden_shape: Sequence[int] | None) -> None:
    """The reader's expectations (each None: not checked; meanings as in ``decode_record``), all
    checked before the payload is read: a ``CorruptRecordError`` at the first that fails."""
    if namespace is not None and header.namespace != namespace.digest:
        raise _fail("record belongs to another namespace", "namespace")
    if chunk is not None:
        if header.key != chunk.digest:
            raise _fail("record key digest does not match the requested key", "key")
        if header.start != chunk.start or header.partial != chunk.partial or header.num_tokens != chunk.num_tokens:
            raise _fail(f"record covers tokens from {header.start} ({header.num_tokens}, partial={header.partial}), "
                        f"expected chunk {chunk.start}..{chunk.end}", "tokens")
        wanted = None if chunk.heads is None else chunk.heads.as_tuple()
        if header.heads != wanted:
            raise _fail(f"record holds heads {header.heads}, expected {wanted}", "heads")
    if tokens is not None and header.tokens != tokens_to_array(tokens).tobytes():
        raise _fail("record token ids differ from the requested prefix", "tokens")
    if dtype is not None and header.dtype != dtype:
        raise _fail(f"record dtype {header.dtype} differs from expected {dtype}", "shape")
    if shapes is not None and header.shapes != (shapes if type(shapes) is tuple else tuple(shapes)) \
            and header.shapes != tuple(tuple(int(d) for d in s) for s in shapes):
        raise _fail(f"record shapes {list(header.shapes)} differ from expected", "shape")
    if header.hidden_dtype is not None:
        if hidden_dtype is not None and header.hidden_dtype != hidden_dtype:
            raise _fail(f"record hidden state is {header.hidden_dtype}, expected {hidden_dtype}", "shape")
        if hidden_shape is not None and header.hidden_shape != tuple(int(d) for d in hidden_shape):
            raise _fail(f"record hidden state has shape {list(header.hidden_shape or ())}, "
                        f"expected {list(hidden_shape)}", "shape")


@dataclass(frozen=True)
class CheckedRecord:
    """A record whose frame, header and the reader's expectations passed (``check_record``),
    its checksum and tag not yet verified (``verify_record``): where its parts lie in its bytes."""

    header: RecordHeader
    #: Where the payload starts: the (encoded) KV bytes, then the hidden state's.
    payload_at: int

    @property
    def body(self) -> slice:
        """The encoded KV bytes' place in the record (``raw_len`` bytes when uncompressed)."""
        return slice(self.payload_at, self.payload_at + self.header.payload_len - self.header.hidden_len)

    @property
    def hidden(self) -> slice | None:
        """The hidden state's place in the record, if it carries one."""
        end = self.payload_at + self.header.payload_len
        return slice(end - self.header.hidden_len, end) if self.header.hidden_len else None


def check_record(
    data: Buffer,
    *,
    namespace: Namespace | None = None,
    chunk: ChunkKey | None = None,
    tokens: TokenIds | None = None,
    dtype: str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    hidden_dtype: str | None = None,
    hidden_shape: Sequence[int] | None = None,
) -> CheckedRecord:
    """Every check ``decode_record`` makes of a whole record but its checksum and tag: the frame,
    every header field and their consistency, and the reader's expectations given (their
    meaning as in ``decode_record``). Cheap (the header only), so a reader may start moving the
    payload somewhere that is not its destination (a device's staging) while ``verify_record``
    reads every byte; a ``CorruptRecordError`` otherwise."""
    header, payload_at = parse_header(byte_view(data))
    check_expected(header, namespace, chunk, tokens, dtype, shapes, hidden_dtype, hidden_shape)
    return CheckedRecord(header, payload_at)
