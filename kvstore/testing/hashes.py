"""``count_hashes``: every xxh3 pass the data path makes over a value (``kvstore.buffers``'
``xxh3_digest``: a store's digest, a reader's check of a record), noted by size, so that a test
can say how often a load hashed its records (``memory://`` keeps their digests: once, not per
load)."""

from __future__ import annotations

from typing import Any

__all__ = ["count_hashes"]


def count_hashes(monkeypatch: Any) -> list[int]:
    """Patch ``xxh3_digest`` where the data path calls it (with pytest's ``monkeypatch``, undone
    after the test); the returned list gets the size of every buffer hashed from then on."""
    import kvstore.buffers as buffers
    import kvstore.record.decode as decode

    hashed: list[int] = []
    real = buffers.xxh3_digest

    def counting(data: Any) -> bytes:
        hashed.append(memoryview(data).nbytes)
        return real(data)

    monkeypatch.setattr(buffers, "xxh3_digest", counting)
    monkeypatch.setattr(decode, "xxh3_digest", counting)
    return hashed
