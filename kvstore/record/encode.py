"""Writing records: a chunk's KV (and hidden state) as the pieces of one record, trailer last.

``encode_record_pieces`` checks what it is given (dtype, shapes against the KV's length, the
chunk's tokens, the codec chain) and raises ``ValueError`` before anything is built; it writes
only the current format version (``kvstore.record.format``), never joins the KV it can send as
it lies, and leaves the trailer (tag, checksum) to be computed as a store streams the pieces.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import xxhash

from kvstore.buffers import Lease, Pieces, byte_view
from kvstore.keys import FORMAT_VERSION, ChunkKey, Namespace, TokenIds, tokens_to_array
from kvstore.record import codecs
from kvstore.record.auth import TAG_BYTES, TagKeys
from kvstore.record.format import CHECKSUM_BYTES, DTYPES, FRAME, MAGIC, kv_nbytes
from kvstore.types import Buffer


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
    value past the call can retain it. The record holds the KV heads ``chunk.heads`` names (its
    header says so; None: a record not cut by head). With ``auth`` (the tenant's keys:
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
        "heads": None if chunk.heads is None else list(chunk.heads.as_tuple()),
    }
    if auth is not None:
        fields["kid"] = auth.key_id
    header = msgpack.packb(fields, use_bin_type=True)
    head = FRAME.pack(MAGIC, FORMAT_VERSION, 0, len(header), zlib.crc32(header)) + header
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
    self_check = True  # the checksum ends the trailer: the xxh3-64 of every byte before it (Pieces.digest)

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
