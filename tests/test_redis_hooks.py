"""The redis-py internals the Redis store relies on still exist in the installed redis-py.

If this fails after a redis-py upgrade, the store would lose its zero-copy sends and direct
reads (or break): pin redis to a supported version or adapt ``kvstore/stores/redis/hooks.py``.
"""

from __future__ import annotations

import redis

from kvstore.stores.redis import hooks


def test_installed_redis_py_has_every_hook():
    hooks.check_redis_py()


def test_our_connection_uses_the_zero_copy_packer():
    conn = hooks.Connection()
    assert isinstance(conn._command_packer, hooks.ZeroCopyPacker)
    big = memoryview(bytearray(conn._buffer_cutoff + 1))
    packed = conn._command_packer.pack("SET", "k", big)
    assert any(piece is big or (isinstance(piece, memoryview) and piece.obj is big.obj) for piece in packed)


def test_check_names_what_is_missing(monkeypatch):
    monkeypatch.delattr(redis.connection.AbstractConnection, "_construct_command_packer")
    try:
        hooks.check_redis_py()
    except RuntimeError as exc:
        assert "_construct_command_packer" in str(exc) and redis.__version__ in str(exc)
    else:
        raise AssertionError("check_redis_py accepted a redis-py without the packer hook")
