"""Payload codecs: byte filters and compressors, chained, named in each record's header.

A chain is a tuple of codec ids applied in order on encode and in reverse on decode, e.g.
``("shuffle2", "lz4")``. Filters (``shuffle<N>``) keep the length; at most one compressor
(``lz4``, ``zstd``) may appear, and only last, so every step's decoded length is the record's
``raw_len``. Decoders never trust their input: a damaged stream raises ``CorruptRecordError``.

The default is raw: on real bf16 KV plain lz4 gains nothing and the shuffled chains gain a
little at well below network speed (figures: ``benchmarks/results/codec.md``), so compression
is a per-deployment choice for slow tiers (S3).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from kvstore.buffers import copy_bytes
from kvstore.errors import ConfigError, CorruptRecordError
from kvstore.extras import install_hint
from kvstore.types import Buffer, array_view

#: User-facing names of codec chains (``codec=`` option) -> the chain recorded in headers.
#: ``shuffle`` picks the element size from the record's dtype.
CHAINS: dict[str, tuple[str, ...]] = {
    "raw": (),
    "lz4": ("lz4",),
    "shuffle-lz4": ("shuffle", "lz4"),
    "zstd": ("zstd",),
    "shuffle-zstd": ("shuffle", "zstd"),
}
COMPRESSORS = ("lz4", "zstd")
_SHUFFLES = ("shuffle2", "shuffle4", "shuffle8")


def resolve_chain(name: str, itemsize: int) -> tuple[str, ...]:
    """The concrete chain for user-facing codec ``name`` and payload element size."""
    if name not in CHAINS:
        raise ConfigError(f"codec={name!r} is not known; accepted: {', '.join(CHAINS)}")
    chain = CHAINS[name]
    if "zstd" in chain:
        _zstd()  # fail at start-up, not on the first write
    out = []
    for step in chain:
        if step == "shuffle":
            if itemsize > 1:
                out.append(f"shuffle{itemsize}")
        else:
            out.append(step)
    return tuple(out)


def validate_chain(chain: Sequence[str], itemsize: int | None = None) -> None:
    """Raise ``CorruptRecordError`` unless ``chain`` is one this version writes and can decode.

    A decodable chain is what ``resolve_chain`` produces: empty, one compressor, or one
    ``shuffle<N>`` filter followed by one compressor. With ``itemsize`` (the record's element
    size) a shuffle filter must also split exactly that element size, as the encoder does.
    """
    steps = list(chain)
    for step in steps:
        if type(step) is not str:
            raise CorruptRecordError(f"codec entry {step!r} is not a name", "codec")
        if step not in COMPRESSORS and step not in _SHUFFLES:
            raise CorruptRecordError(f"unknown codec {step!r}", "codec")
    if len(steps) > 2 or (steps and steps[-1] not in COMPRESSORS) or (len(steps) == 2 and steps[0] not in _SHUFFLES):
        raise CorruptRecordError(f"codec chain {steps} is not one this version writes "
                                 "(raw, a compressor, or shuffle then a compressor)", "codec")
    if len(steps) == 2 and itemsize is not None and int(steps[0][7:]) != itemsize:
        raise CorruptRecordError(f"codec {steps[0]} does not match the record's {itemsize}-byte elements", "codec")


def _zstd() -> ModuleType:
    try:
        import zstandard
    except ImportError as exc:
        raise ConfigError(f"codec zstd needs the zstandard package: {install_hint('zstd')}") from exc
    return zstandard


def _shuffle(data: Buffer, itemsize: int) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.uint8)
    if arr.size % itemsize:
        raise ValueError(f"payload of {arr.size} bytes is not a multiple of element size {itemsize}")
    # .T.copy() runs at memcpy-like speed; .T.tobytes() walks element by element (10x slower).
    return arr.reshape(-1, itemsize).T.copy().reshape(-1)


def _unshuffle(data: Buffer, itemsize: int, out: memoryview | None) -> Buffer:
    arr = np.frombuffer(data, dtype=np.uint8)
    if arr.size % itemsize:
        raise CorruptRecordError(f"shuffled payload of {arr.size} bytes is not a multiple of {itemsize}", "codec")
    target = np.empty(arr.size, np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
    if target.size != arr.size:
        # numpy would broadcast a short payload over the whole destination: never write then.
        raise CorruptRecordError(f"shuffled payload of {arr.size} bytes for a {target.size}-byte destination",
                                 "codec")
    planes = arr.reshape(itemsize, -1)
    if itemsize == 2 and target.size:
        # Rebuild each 16-bit value arithmetically (little-endian: plane 0 is the low byte):
        # ~8x faster than interleaving bytes with a transposed copy, which walks one byte at a time.
        words = target.view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype="<u2")
        np.bitwise_or(words, planes[0], out=words)
    else:
        target.reshape(-1, itemsize)[...] = planes.T
    return array_view(target) if out is None else out


def encode(chain: Sequence[str], data: Buffer) -> Buffer:
    """Apply ``chain`` to ``data``; returns ``data`` itself for the empty chain."""
    for step in chain:
        if step.startswith("shuffle"):
            data = array_view(_shuffle(data, int(step[7:])))
        elif step == "lz4":
            import lz4.block

            data = lz4.block.compress(data, mode="default", store_size=False)
        elif step == "zstd":
            data = _zstd().ZstdCompressor(level=1).compress(data)
        else:
            raise ConfigError(f"unknown codec {step!r}")
    return data


def decode(chain: Sequence[str], data: Buffer, raw_len: int, out: memoryview | None = None) -> Buffer:
    """Invert ``chain``; the result is exactly ``raw_len`` bytes, written into ``out`` if given.

    Raises ``CorruptRecordError`` for any malformed stream, trailing bytes after a compressed
    stream or length mismatch, and ``ValueError`` if ``out`` is not ``raw_len`` bytes. ``out``
    is written only once every step has succeeded and produced exactly ``raw_len`` bytes.
    """
    validate_chain(chain)
    if out is not None and len(out) != raw_len:
        raise ValueError(f"out buffer has {len(out)} bytes, record payload has {raw_len}")
    for i, step in enumerate(reversed(chain)):
        last = i == len(chain) - 1
        try:
            if step == "lz4":
                import lz4.block

                data = lz4.block.decompress(data, uncompressed_size=raw_len)
            elif step == "zstd":
                zstd = _zstd()
                # decompress() allocates the size the frame declares and ignores max_output_size
                # when it declares one: a lying frame must not make us allocate without bound.
                declared = zstd.frame_content_size(data)
                if declared not in (-1, raw_len):
                    raise CorruptRecordError(f"zstd frame declares {declared} bytes, header says {raw_len}", "codec")
                # Exactly one frame: bytes after it are damage or a splice, never ignored.
                data = zstd.ZstdDecompressor().decompress(data, max_output_size=raw_len, allow_extra_data=False)
            else:
                if len(data) != raw_len:
                    raise CorruptRecordError(f"shuffled stream has {len(data)} bytes, header says {raw_len}", "codec")
                data = _unshuffle(data, int(step[7:]), out if last else None)
                if last and out is not None:
                    return out
        except CorruptRecordError:
            raise
        except Exception as exc:  # every decompressor has its own error types
            raise CorruptRecordError(f"codec {step} failed: {exc}", "codec") from exc
        if len(data) != raw_len:
            raise CorruptRecordError(f"codec {step} produced {len(data)} bytes, header says {raw_len}", "codec")
    if out is not None:
        copy_bytes(out, data)
        return out
    return data
