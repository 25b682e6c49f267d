"""Prefix-chained chunk keys.

Tokens are cut into chunks of ``chunk_tokens``. Chunk ``i`` is named by a hash of the whole
prefix up to its end, chained so each chunk costs one hash::

    h_0 = sha256(b"kvstore-prefix-v1" || namespace digest)
    h_i = sha256(h_{i-1} || kind || uint32-le tokens of chunk i)      kind: b"F" full, b"P" partial

A key therefore names a prefix, never a chunk alone, and two deployments whose namespaces
differ in anything that changes the KV bytes never share a key. The last, shorter chunk is keyed
too (``partial=True``). The functions here are pure and give the same keys in every process and
on every machine for a given ``FORMAT_VERSION``: golden tests pin them.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Sequence

import msgpack
import numpy as np

from kvstore.errors import ConfigError

#: Version of the key scheme and record format. Bump it for any change that alters keys or bytes.
FORMAT_VERSION = 1
KEY_PREFIX = f"kvs{FORMAT_VERSION}"
_DIGEST_BYTES = 16  # 128-bit prefix hashes: collisions are astronomically rare and every hit is verified


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the KV bytes of a token prefix.

    Two caches may share records only if every field is equal. ``model_fingerprint`` should
    change whenever weights or model config change (a revision, or a hash of the config).
    """

    model: str
    kv_dtype: str
    layout: str
    block_size: int
    chunk_tokens: int
    layer_start: int = 0
    layer_end: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    model_fingerprint: str = ""
    adapter: str = ""
    cache_salt: str = ""
    extra: tuple[tuple[str, str], ...] = field(default=())
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("namespace needs a model name (model='...')")
        if self.block_size <= 0:
            raise ConfigError(f"block_size={self.block_size} must be a positive number of tokens")
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size:
            raise ConfigError(
                f"chunk_tokens={self.chunk_tokens} must be a positive multiple of the engine's "
                f"block_size={self.block_size} (e.g. {self.block_size * max(1, 256 // self.block_size)})"
            )
        if not (0 <= self.layer_start <= self.layer_end):
            raise ConfigError(f"layer range [{self.layer_start}, {self.layer_end}) is not valid")
        if not (0 <= self.tp_rank < self.tp_size):
            raise ConfigError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")

    def with_salt(self, cache_salt: str) -> "Namespace":
        """The same namespace for another tenant's ``cache_salt``."""
        from dataclasses import replace

        return self if cache_salt == self.cache_salt else replace(self, cache_salt=cache_salt)

    @cached_property
    def digest(self) -> bytes:
        """32-byte sha256 of the canonical (sorted, msgpack) encoding of every field."""
        fields = asdict(self)
        fields["extra"] = [list(kv) for kv in sorted(self.extra)]
        canonical = msgpack.packb(sorted(fields.items()), use_bin_type=True)
        return hashlib.sha256(b"kvstore-namespace\x00" + canonical).digest()

    @property
    def id(self) -> str:
        """Short printable id used in store keys (first 8 bytes of the digest, hex)."""
        return self.digest[:8].hex()

    @property
    def key_prefix(self) -> str:
        """Every key of this namespace starts with this string (for listing and removal)."""
        return f"{KEY_PREFIX}/{self.id}/"


@dataclass(frozen=True)
class ChunkKey:
    """One chunk of a token prefix: tokens ``[start, end)`` and the key naming ``tokens[:end]``."""

    index: int
    start: int
    end: int
    digest: bytes
    partial: bool
    key: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def tokens_to_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array (the bytes that are hashed and stored)."""
    arr = np.ascontiguousarray(np.asarray(tokens), dtype="<u4") if not (
        isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4") and tokens.flags.c_contiguous
    ) else tokens
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


def chunk_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray, *,
               include_partial: bool = True, max_chunks: int | None = None) -> list[ChunkKey]:
    """Keys of every chunk of ``tokens`` under ``namespace``, in order.

    The last chunk is included when shorter than ``chunk_tokens`` only if ``include_partial``.
    ``max_chunks`` stops early (lookups that only need a bounded prefix).
    """
    arr = tokens_to_array(tokens)
    n = int(arr.shape[0])
    step = namespace.chunk_tokens
    prefix = namespace.key_prefix
    h = hashlib.sha256(b"kvstore-prefix-v1" + namespace.digest).digest()
    out: list[ChunkKey] = []
    data = memoryview(arr).cast("B")
    for index, start in enumerate(range(0, n, step)):
        if max_chunks is not None and index >= max_chunks:
            break
        end = min(start + step, n)
        partial = end - start < step
        if partial and not include_partial:
            break
        hasher = hashlib.sha256(h)
        hasher.update(b"P" if partial else b"F")
        hasher.update(data[start * 4:end * 4])
        h = hasher.digest()
        digest = h[:_DIGEST_BYTES]
        out.append(ChunkKey(index, start, end, digest, partial, prefix + digest.hex()))
    return out
