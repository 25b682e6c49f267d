"""Damage stored records on purpose, for tests of detection and healing (``kvstore.testing``).

Each helper reads the record at ``key`` straight from ``store``, damages it in one precise way
and writes it back, so the next reader must detect it and treat it as a miss.
"""

from __future__ import annotations

from kvstore.stores.base import Store

__all__ = ["flip_byte", "truncate"]


def flip_byte(store: Store, key: str, offset: int = -1, mask: int = 0xFF) -> bytes:
    """XOR the byte at ``offset`` (negative: from the end) of ``key``'s value with ``mask``;
    returns the damaged value. ``KeyError`` if ``key`` is not stored."""
    value = store.get(key)
    if value is None:
        raise KeyError(key)
    damaged = bytearray(value)
    damaged[offset] ^= mask
    store.put(key, damaged)
    return bytes(damaged)


def truncate(store: Store, key: str, keep: int) -> bytes:
    """Cut ``key``'s value to its first ``keep`` bytes (negative: drop that many from the end)."""
    value = store.get(key)
    if value is None:
        raise KeyError(key)
    cut = bytes(value)[:keep]
    store.put(key, cut)
    return cut
