"""Self-describing chunk records: a fixed frame, a msgpack header, the payload, a trailer.

Layout of format version 2, the one written (all integers little-endian)::

    0   4  magic  b"KVSR"
    4   2  format version (2)
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
decoded KV length, ``payload_len``, ``created`` unix seconds. A signed record (``auth``) adds,
last, ``kid`` the 8-byte id of the deployment key; its tag is the keyed BLAKE3 of every byte
before it. The checksum, the record's last 8 bytes, is the xxh3-64 of every byte before it, so
it binds the payload to its header (a payload spliced under another header fails) and a reader
can check a value without parsing it. Readers that ignore ``kid`` and the tag read signed
records.

The tag and checksum come after the payload so that a writer computes them as the record
leaves (``Pieces.stream``): each slice is hashed while it is in the CPU's cache for its send,
instead of in a pass over memory of its own before the first byte can go.

Format version 1 (still read, never written) had no trailer: the header held ``checksum``
before ``created``, and a signed record ended its header with ``kid`` and ``tag``, the tag
covering the header bytes before the tag value and the payload.

``decode_record`` accepts a record only if it is exactly what its version writes and what the
reader expects: the frame, every header field (types, ranges, no unknown or repeated field),
their consistency (codec chain against dtype and lengths, lengths against shapes, one
compressed frame and no trailing bytes), then, when given, the reader's namespace, key,
tokens, dtype, shapes, hidden state dtype and shape, destination size and keys; every failure
is a ``CorruptRecordError``, raised before a byte reaches the caller's ``out``. Records are
never unpickled: msgpack for the header, raw bytes after.

``land_record`` is the same check for a record still arriving: frame, header and the reader's
expectations before any KV byte lands in the reader's destination, then ``verify_landed``, the
checksum and tag once the last byte is in (the destination then holds the failed record's
bytes, and the reader must not count them as loaded).
"""

from __future__ import annotations

import itertools
import math
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import numpy as np
import xxhash

from kvstore.buffers import SELF_CHECK_BYTES, Lease, Pieces, byte_view, copy_bytes
from kvstore.errors import CorruptRecordError
from kvstore.keys import FORMAT_VERSION, ChunkKey, Namespace, TokenIds, tokens_to_array
from kvstore.record import codecs
from kvstore.record.auth import KEY_ID_BYTES, TAG_BYTES, TagKeys
from kvstore.types import Buffer

MAGIC = b"KVSR"
_FRAME = struct.Struct("<4sHHII")
FRAME_BYTES = _FRAME.size
MAX_HEADER_BYTES = 1 << 20
MAX_RAW_BYTES = 4 << 30  # no record decodes to more: a lying header must not make us allocate without bound
_MAX_COMPRESSION_RATIO = 300  # above lz4's and far above what KV data reaches (1.5)
SUPPORTED_VERSIONS = (1, 2)
CHECKSUM_BYTES = SELF_CHECK_BYTES  # a record is a self-checked value: what a store's ArrivalDigest hashes
_MAX_START = 1 << 40  # token positions
_MAX_CREATED = 1e11  # unix seconds (year 5138): anything later is a lie, and so is NaN
_TAG_MARKER = b"\xa3tag\xc4" + bytes([TAG_BYTES])  # version 1, msgpack: fixstr "tag", bin8 of 32 bytes
_COMMON_FIELDS = frozenset({"v", "ns", "key", "start", "partial", "tokens", "dtype", "shapes", "hidden", "codecs",
                            "raw_len", "payload_len", "created"})
#: Per version: the header fields of every record, and those only a signed record has.
_FIELDS = {1: _COMMON_FIELDS | {"checksum"}, 2: _COMMON_FIELDS}
_SIGNED_FIELDS = {1: frozenset({"kid", "tag"}), 2: frozenset({"kid"})}

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
    if shapes and shapes.count(shapes[0]) == len(shapes):  # every layer alike: the common case
        return DTYPES[dtype] * math.prod(shapes[0]) * len(shapes)
    return DTYPES[dtype] * sum(math.prod(s) for s in shapes)


def encode_record(
    *,
    namespace: Namespace,
    chunk: ChunkKey,
    tokens: TokenIds,
    dtype: str,
    shapes: Sequence[Sequence[int]],
    kv: Buffer,
    hidden: Buffer | None = None,
    hidden_dtype: str | None = None,
    hidden_shape: Sequence[int] | None = None,
    chain: Sequence[str] = (),
    out: bytearray | None = None,
    created: float | None = None,
    auth: TagKeys | None = None,
) -> bytes | memoryview:
    """Encode one chunk record into one buffer; see ``encode_record_pieces`` for the fields.

    Without ``out`` the result is a new immutable ``bytes``; with ``out`` (a reusable bytearray)
    the record is written there and a view valid until ``out`` is reused is returned.
    """
    pieces = encode_record_pieces(namespace=namespace, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes,
                                  kv=kv, hidden=hidden, hidden_dtype=hidden_dtype, hidden_shape=hidden_shape,
                                  chain=chain, created=created, auth=auth)
    if out is None:
        return pieces.tobytes()
    if len(out) < pieces.nbytes:
        out.extend(bytes(pieces.nbytes - len(out)))
    view = memoryview(out)[:pieces.nbytes]
    pieces.copy_into(view)
    return view


def encode_record_pieces(
    *,
    namespace: Namespace,
    chunk: ChunkKey,
    tokens: TokenIds,
    dtype: str,
    shapes: Sequence[Sequence[int]],
    kv: Buffer | Sequence[Buffer],
    hidden: Buffer | None = None,
    hidden_dtype: str | None = None,
    hidden_shape: Sequence[int] | None = None,
    chain: Sequence[str] = (),
    created: float | None = None,
    owner: Lease | None = None,
    auth: TagKeys | None = None,
) -> Pieces:
    """Encode one chunk record as the pieces a store sends in order: frame and header, the
    payload (the KV bytes after the codec chain, then the hidden state), then the trailer, never
    joined.

    ``tokens`` are the chunk's own tokens (``chunk.num_tokens`` of them). ``kv`` holds the
    tensors of ``shapes`` back to back in ``dtype``, in one buffer or in a list (or tuple) of
    buffers taken in order (a paged cache's blocks: no gather; a codec chain joins them first).
    With the raw codec the payload pieces are views of ``kv`` and ``hidden`` themselves (no
    copy): ``owner``, the lease holding them, goes with the pieces so a store that keeps the
    value past the call can retain it. With ``auth`` (the tenant's keys:
    ``RecordAuth.for_salt(namespace.cache_salt)``) the record is signed with the current key.
    The trailer (tag, checksum) is computed as a store streams the pieces (``Pieces.stream``).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
    if namespace.format_version != FORMAT_VERSION:
        raise ValueError(f"namespace of format version {namespace.format_version}: this build writes only "
                         f"version {FORMAT_VERSION}")
    shapes_t = _int_shapes(shapes)
    raw_len = kv_nbytes(dtype, shapes_t)
    kv_parts = [byte_view(p) for p in kv] if isinstance(kv, (list, tuple)) else [byte_view(kv)]
    kv_len = sum(len(p) for p in kv_parts)
    if kv_len != raw_len:
        raise ValueError(f"kv has {kv_len} bytes but {dtype} tensors of shapes {shapes_t} need {raw_len}")
    tok = tokens_to_array(tokens)
    if tok.shape[0] != chunk.num_tokens:
        raise ValueError(f"chunk {chunk.index} covers {chunk.num_tokens} tokens, got {tok.shape[0]}")
    hidden_view = None
    hidden_meta = None
    if hidden is not None:
        if hidden_dtype not in DTYPES or hidden_shape is None:
            raise ValueError("hidden needs hidden_dtype (a supported dtype) and hidden_shape")
        hidden_view = byte_view(hidden)
        expect = DTYPES[hidden_dtype] * math.prod(hidden_shape)
        if len(hidden_view) != expect:
            raise ValueError(f"hidden has {len(hidden_view)} bytes, {hidden_dtype}{list(hidden_shape)} needs {expect}")
        hidden_meta = [hidden_dtype, [int(d) for d in hidden_shape]]
    chain = tuple(chain)
    codecs.validate_chain(chain)
    if chain:
        joined = kv_parts[0] if len(kv_parts) == 1 else b"".join(kv_parts)
        kv_parts = [byte_view(codecs.encode(chain, joined))]
    payload_len = sum(len(p) for p in kv_parts) + (len(hidden_view) if hidden_view is not None else 0)
    fields: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "ns": namespace.digest,
        "key": chunk.digest,
        "start": chunk.start,
        "partial": chunk.partial,
        "tokens": tok.tobytes(),
        "dtype": dtype,
        "shapes": shapes_t,  # msgpack packs tuples as arrays, as it packs lists
        "hidden": hidden_meta,
        "codecs": list(chain),
        "raw_len": raw_len,
        "payload_len": payload_len,
        "created": float(time.time() if created is None else created),
    }
    if auth is not None:
        fields["kid"] = auth.key_id
    header = msgpack.packb(fields, use_bin_type=True)
    head = _FRAME.pack(MAGIC, FORMAT_VERSION, 0, len(header), zlib.crc32(header)) + header
    payload = kv_parts + ([hidden_view] if hidden_view is not None else [])
    signer = None if auth is None else auth.signer(len(head) + payload_len)
    return Pieces([head, *payload], owner=owner, seal=_RecordSeal(signer))


def _int_shapes(shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``shapes`` as tuples of Python ints; one shape object repeated (every layer alike, the
    common case) is converted once."""
    out = []
    last: Any = None
    converted: tuple[int, ...] = ()
    for shape in shapes:
        if shape is not last:
            last, converted = shape, tuple(int(d) for d in shape)
        out.append(converted)
    return tuple(out)


class _RecordSeal:
    """The trailer of a version-2 record, computed as the record streams out: for a signed
    record the tag, then the checksum, each over every byte before it."""

    first = 0  # the frame and header are covered too

    def __init__(self, signer: Any | None) -> None:
        self._signer = signer  # a fresh keyed hasher: each pass continues a copy
        self.nbytes = (TAG_BYTES if signer is not None else 0) + CHECKSUM_BYTES

    def start(self) -> _RecordSealing:
        return _RecordSealing(None if self._signer is None else self._signer.copy())


class _RecordSealing:
    __slots__ = ("_hasher", "_signer")

    def __init__(self, signer: Any | None) -> None:
        self._hasher = xxhash.xxh3_64()
        self._signer = signer

    def update(self, data: memoryview) -> None:
        self._hasher.update(data)
        if self._signer is not None:
            self._signer.update(data)

    def finish(self) -> bytes:
        tag = b"" if self._signer is None else self._signer.digest()
        self._hasher.update(tag)
        return tag + self._hasher.digest()


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


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a map repeats a key")  # two values for one field: which would a reader believe?
    return out


def _frame(view: memoryview) -> tuple[int, memoryview]:
    """The format version and header bytes of a record, after checking its frame."""
    if len(view) < FRAME_BYTES:
        raise _fail(f"record of {len(view)} bytes is shorter than its frame", "truncated")
    magic, version, reserved, header_len, header_crc = _FRAME.unpack_from(view, 0)
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
    fields, signed_fields = _FIELDS[version], _SIGNED_FIELDS[version]
    signed = names & signed_fields
    if names - fields - signed_fields or fields - names or signed not in (set(), signed_fields):
        unknown, missing = sorted(map(repr, names - fields - signed_fields)), sorted(fields - names)
        raise _fail(f"record header fields are not version {version}'s (unknown {unknown}, missing {missing}, "
                    f"signature fields {sorted(signed)})", "header")
    if signed:
        _bytes(h["kid"], "kid", KEY_ID_BYTES)
    if signed and version == 1:
        tag = _bytes(h["tag"], "tag", TAG_BYTES)
        if bytes(header_bytes[-len(_TAG_MARKER) - TAG_BYTES:]) != _TAG_MARKER + tag:
            raise _fail("record tag is not the last header field", "header")
    return h


def read_header(data: Buffer, size: int | None = None) -> RecordHeader:
    """Parse and validate the frame, header and lengths of a record (not its checksum or tag).

    ``data`` is the whole record or, given ``size`` (the whole record's length), its first bytes:
    at least ``header_extent`` of them, or the error says ``truncated``. The lengths are then
    checked against ``size``, and a version-2 record's checksum and tag, in its trailer, are not
    read (``checksum`` is empty, ``tag`` None)."""
    view = _flat(data)
    if size is not None and size < len(view):
        raise ValueError(f"size={size} is shorter than the {len(view)} bytes given")
    return _parse(view, size)[0]


def header_extent(data: Buffer) -> int | None:
    """How many leading bytes of a record hold its frame and header (what ``read_header`` of a
    record's first bytes needs), from its frame; None when ``data`` is shorter than a frame or
    does not start with one of ours."""
    view = _flat(data)
    if len(view) < FRAME_BYTES:
        return None
    magic, _, _, header_len, _ = _FRAME.unpack_from(view, 0)
    return FRAME_BYTES + header_len if magic == MAGIC else None


def _flat(data: Buffer) -> memoryview:
    return memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)


def _parse(view: memoryview, size: int | None = None) -> tuple[RecordHeader, int]:
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


def _expect(header: RecordHeader, namespace: Namespace | None, chunk: ChunkKey | None, tokens: TokenIds | None,
            dtype: str | None, shapes: Sequence[Sequence[int]] | None, hidden_dtype: str | None,
            hidden_shape: Sequence[int] | None) -> None:
    """The reader's expectations, all checked before the payload is read."""
    if namespace is not None and header.namespace != namespace.digest:
        raise _fail("record belongs to another namespace", "namespace")
    if chunk is not None:
        if header.key != chunk.digest:
            raise _fail("record key digest does not match the requested key", "key")
        if header.start != chunk.start or header.partial != chunk.partial or header.num_tokens != chunk.num_tokens:
            raise _fail(f"record covers tokens from {header.start} ({header.num_tokens}, partial={header.partial}), "
                        f"expected chunk {chunk.start}..{chunk.end}", "tokens")
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
    header, payload_at = _parse(_flat(data))
    _expect(header, namespace, chunk, tokens, dtype, shapes, hidden_dtype, hidden_shape)
    return CheckedRecord(header, payload_at)


def verify_record(data: Buffer, checked: CheckedRecord, *, auth: TagKeys | None = None,
                  digest: bytes | None = None) -> None:
    """The rest of a record's checks, after ``check_record`` of the same bytes: its checksum
    (against ``digest``, the caller's xxh3-64 of every byte but the last 8, when given: no pass
    over the bytes) and, with ``auth``, its tag. A ``CorruptRecordError`` if either fails.
    Reads every byte when it hashes: callers may run it on other threads (xxh3 and BLAKE3
    release the GIL)."""
    view = _flat(data)
    header, payload_at = checked.header, checked.payload_at
    payload = view[payload_at:payload_at + header.payload_len]
    signed: tuple[memoryview, ...]
    if header.version == 1:
        checked_bytes = payload
        signed = (view[FRAME_BYTES:payload_at - (TAG_BYTES if header.tag is not None else 0)], payload)
    else:
        checked_bytes, signed = view[:len(view) - CHECKSUM_BYTES], (view[:payload_at + header.payload_len],)
    if header.version == 1 or digest is None:
        digest = xxhash.xxh3_64_digest(checked_bytes)
    if digest != header.checksum:
        raise _fail("record checksum mismatch", "checksum")
    if auth is not None:
        auth.check(header.key_id, header.tag, signed)


def decode_record(
    data: Buffer,
    *,
    namespace: Namespace | None = None,
    chunk: ChunkKey | None = None,
    tokens: TokenIds | None = None,
    dtype: str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    out: memoryview | None = None,
    hidden_dtype: str | None = None,
    hidden_shape: Sequence[int] | None = None,
    auth: TagKeys | None = None,
    digest: bytes | None = None,
) -> Record:
    """Validate and decode a record. Every expectation given is checked before returning.

    ``tokens`` are the chunk's own token ids as the reader sees them: a record whose tokens
    differ (a hash collision, a foreign writer) is rejected. ``hidden_dtype``/``hidden_shape``
    are what the reader's model would consume: a record whose hidden state differs is rejected
    (a record without one is accepted, ``Record.hidden`` is then None). With ``auth`` (the
    tenant's keys) only a record signed with an accepted key whose tag verifies is accepted.
    With ``out`` (a byte buffer of exactly ``raw_len`` bytes, else the record is rejected) the
    KV bytes are written there, only once the record is accepted; otherwise ``Record.kv`` is a
    view of ``data`` for uncompressed records (no copy) or a new buffer. ``digest``, if given,
    is the xxh3-64 of all of ``data`` but its last 8 bytes as the caller computed it when the
    bytes arrived (``Lease.digest``): a version-2 record's checksum is compared with it instead
    of reading ``data`` again. ``check_record`` and ``verify_record`` are its two halves.
    """
    view = _flat(data)
    checked = check_record(view, namespace=namespace, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes,
                           hidden_dtype=hidden_dtype, hidden_shape=hidden_shape)
    header = checked.header
    if out is not None:
        if out.format != "B" or out.ndim != 1:
            out = out.cast("B")
        if out.nbytes != header.raw_len:
            raise _fail(f"record decodes to {header.raw_len} bytes, the destination holds {out.nbytes}", "shape")
    verify_record(view, checked, auth=auth, digest=digest)
    body = view[checked.body]
    hidden_at = checked.hidden
    hidden = view[hidden_at] if hidden_at is not None else None
    if header.codecs:
        kv = codecs.decode(header.codecs, body, header.raw_len, out)
    elif out is not None:
        copy_bytes(out, body)  # the GIL released: readers keep receiving meanwhile
        kv = out
    else:
        kv = body
    return Record(header, kv, hidden)


class Landing:
    """Where ``land_record`` put one record: after its run, ``kv`` holds the destination buffers
    its KV bytes went to (empty: the whole record went to the view, for ``decode_record``).

    A reader may get the key's value from somewhere other than the run that landed it (a tier
    that failed mid-record, then the tier below; a retry on a fresh buffer): ``landed_in(view)``
    says whether the value in ``view`` is the one whose KV went to the destination."""

    __slots__ = ("header", "kv", "payload_at", "view")

    def __init__(self) -> None:
        self.header: RecordHeader | None = None
        self.payload_at = 0
        self.kv: tuple[memoryview, ...] = ()
        self.view: memoryview | None = None

    def landed_in(self, view: memoryview) -> bool:
        """Whether the last ``land_record`` run landed the record now in ``view`` (that very
        memoryview object, kept alive here so that no other buffer's view can take its id)."""
        return self.header is not None and self.view is view


def land_record(
    view: memoryview,
    landing: Landing,
    destination: Callable[[], Sequence[memoryview] | None],
    *,
    namespace: Namespace | None = None,
    chunk: ChunkKey | None = None,
    tokens: TokenIds | None = None,
    dtype: str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    hidden_dtype: str | None = None,
    hidden_shape: Sequence[int] | None = None,
) -> Iterator[Sequence[memoryview]]:
    """Where a record of ``len(view)`` bytes arriving in order should land (``Store.get_into``'s
    ``place``): its frame and header into ``view``, then, once they arrived and passed every
    check ``decode_record`` makes of them (frame, fields, lengths, and the reader's expectations
    given here), its KV bytes into ``destination()``'s buffers (their sizes must add up to the
    record's ``raw_len``) and the rest (hidden state, trailer) into ``view`` again.

    Only an uncompressed version-2 record lands in the destination: a foreign, malformed,
    mismatched or compressed one, or one ``destination`` declines (None), lands whole in
    ``view``, where ``decode_record`` then judges it. A landed record's checksum and tag are
    only known once its last byte is in: ``verify_landed`` checks them, and until it accepts
    the record its destination holds bytes no one may use. Each run starts ``landing`` afresh:
    what an earlier, abandoned run landed no longer counts."""
    landing.header, landing.kv, landing.view = None, (), view
    size = len(view)
    if size <= FRAME_BYTES:
        yield (view,)
        return
    yield (view[:FRAME_BYTES],)
    _, version, _, header_len, _ = _FRAME.unpack_from(view, 0)
    if version != FORMAT_VERSION or not 0 < header_len <= min(MAX_HEADER_BYTES, size - FRAME_BYTES):
        yield (view[FRAME_BYTES:],)
        return
    payload_at = FRAME_BYTES + header_len
    yield (view[FRAME_BYTES:payload_at],)
    try:
        header, at = _parse(view)  # the trailer has not arrived: verify_landed reads it
        _expect(header, namespace, chunk, tokens, dtype, shapes, hidden_dtype, hidden_shape)
        kv = None if header.codecs else destination()
    except CorruptRecordError:
        kv = None
    if kv is None or sum(map(len, kv)) != header.raw_len:
        yield (view[payload_at:],)
        return
    landing.header, landing.payload_at, landing.kv = header, at, tuple(kv)
    yield landing.kv
    yield (view[at + header.raw_len:],)


def verify_landed(view: memoryview, landing: Landing, *, auth: TagKeys | None = None,
                  digest: bytes | None = None) -> Record:
    """The record ``land_record`` landed, once every byte is in: its checksum against
    ``digest`` (the store's ``ArrivalDigest`` of every byte, wherever it landed; required) and,
    with ``auth``, its tag over the header, the KV where it lies and the hidden state. A
    ``CorruptRecordError`` if either fails: the destination then holds the failed record's bytes."""
    header = landing.header
    if header is None or not landing.landed_in(view):
        raise ValueError("verify_landed needs the record land_record landed in this view")
    at, end = landing.payload_at, landing.payload_at + header.payload_len
    checksum = bytes(view[len(view) - CHECKSUM_BYTES:])
    if digest is None or digest != checksum:
        raise _fail("record checksum mismatch", "checksum")
    hidden = view[at + header.raw_len:end] if header.hidden_len else None
    tag = None
    if header.key_id is not None:
        tag = bytes(view[end:end + TAG_BYTES])
        if auth is not None:
            auth.check(header.key_id, tag, (view[:at], *landing.kv, *(() if hidden is None else (hidden,))))
    elif auth is not None:
        auth.check(None, None, ())
    return Record(replace(header, checksum=checksum, tag=tag), memoryview(b""), hidden, landed=True)
