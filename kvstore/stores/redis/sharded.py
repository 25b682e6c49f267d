"""``redis+shards://h1:p1,h2:p2,...``: independent standalone Redis servers as one store, sharded
by the client (``ShardedRedisStore``).

For operators who run plain instances rather than a Redis Cluster. Each key lives on one server,
chosen by rendezvous hashing (the server with the highest xxh3-64 of ``host:port`` and the key):
the same in every process, independent of the order the servers are listed in, and adding a
server to N moves about 1/(N+1) of the keys (only those the new server now wins).

Every operation is ``RedisStoreBase``'s machinery, routed per server: ``get_into`` and
``put_many`` use its direct sockets with every server of a batch read or written at once
(``connections`` shared out over the servers, at least one each, as a cluster's nodes are),
and the other batch forms split a batch per server and run the parts in parallel, each on that
server's own ``RedisStore``. So a batch costs one round trip of the slowest server, and a frozen
server (``SIGSTOP``) costs it one deadline (``connect_timeout + timeout``), raised as
``StoreTimeoutError`` (the tiered store makes it a miss and its breaker skips the tier).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import xxhash

from kvstore.config import redact_url, split_url
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.stores.base import Head, Value, WriteValue
from kvstore.stores.redis.base import RedisStoreBase
from kvstore.stores.redis.config import MAX_SPREAD, RedisConfig, _parse_host
from kvstore.stores.redis.single import RedisStore

__all__ = ["ShardedRedisStore", "shards_config"]

T = TypeVar("T")

_SCHEMES = {"redis+shards": False, "rediss+shards": True}  # scheme -> TLS


def shards_config(url: str) -> RedisConfig:
    """The options of a ``redis+shards://`` URL: a Redis URL's (credentials, db, query), with
    every server listed in the host part."""
    parts = split_url(url)
    where = redact_url(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ConfigError(f"{where!r} is not a sharded Redis URL; accepted schemes: redis+shards, rediss+shards")
    userinfo, at, hostinfo = parts.netloc.rpartition("@")
    if not hostinfo:
        raise ConfigError(f"{where!r} names no servers; use redis+shards://host:port,host:port,...")
    hosts = tuple(_parse_host(h, where) for h in hostinfo.split(","))
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"{where!r} lists a server twice")
    if len(hosts) > MAX_SPREAD:
        raise ConfigError(f"{where!r} lists {len(hosts)} servers; accepted: at most {MAX_SPREAD}")
    # Everything but the host list is a standalone Redis URL's: parsed by RedisConfig itself.
    single = parts._replace(scheme="rediss" if _SCHEMES[scheme] else "redis",
                            netloc=userinfo + at + hostinfo.split(",")[0]).geturl()
    return dataclasses.replace(RedisConfig.from_url(single), hosts=hosts)


class ShardedRedisStore(RedisStoreBase):
    """Standalone Redis servers, each holding the keys that hash to it; see the module docstring."""

    def __init__(self, config: RedisConfig) -> None:
        if config.cluster or config.unix_path:
            raise ConfigError("a sharded Redis store is built from redis+shards:// (TCP servers)")
        super().__init__(config)
        self._ids = [f"{host}:{port}".encode() + b"\0" for host, port in config.hosts]
        # One store per server, sharing this one's options: their clients, direct sockets and
        # error mapping (messages name the server) are the single-server store's.
        self._shards = [RedisStore(dataclasses.replace(config, hosts=(host,))) for host in config.hosts]
        self._fanout: ThreadPoolExecutor | None = None

    @classmethod
    def from_url(cls, url: str) -> ShardedRedisStore:
        return cls(shards_config(url))

    # -- placement ---------------------------------------------------------------------------
    def shard_of(self, key: str) -> int:
        """The index (in the URL's order) of the server that holds ``key``."""
        name = self._key(key).encode()
        scores = [xxhash.xxh3_64_intdigest(ident + name) for ident in self._ids]
        return scores.index(max(scores))

    def _groups(self, keys: Sequence[str]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self.shard_of(key), []).append(i)
        return groups

    def _fan(self, keys: Sequence[str], op: Callable[[RedisStore, list[str]], list[T]]) -> list[T]:
        """``op`` on each server's share of ``keys``, all servers at once; results in key order."""
        groups = list(self._groups(keys).items())
        out: list[Any] = [None] * len(keys)

        def run(shard: int, indices: list[int]) -> None:
            for i, result in zip(indices, op(self._shards[shard], [keys[i] for i in indices])):
                out[i] = result

        futures: list[Future[None]] = []
        errors: list[BaseException] = []
        for shard, indices in groups[1:]:
            try:
                futures.append(self._fan_threads().submit(run, shard, indices))
            except RuntimeError:  # executors refuse work at interpreter exit: this thread does it
                try:
                    run(shard, indices)
                except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                    errors.append(exc)
        if groups:
            try:
                run(*groups[0])
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                errors.append(exc)
        for fut in futures:  # each bounded by one deadline, all running at once
            failure = fut.exception()
            if failure is not None:
                errors.append(failure)
        if errors:
            raise errors[0]
        return out

    def _fan_threads(self) -> ThreadPoolExecutor:
        executor = self._fanout
        if executor is None:
            with self._client_lock:
                if self._closed:
                    raise StoreUnavailableError(f"{self.describe()['url']} is closed")
                if self._fanout is None:
                    # Enough that concurrent batches, each waiting at most a deadline on a frozen
                    # server, do not queue behind each other.
                    self._fanout = ThreadPoolExecutor(4 * len(self._shards), thread_name_prefix="kvstore-shards")
                executor = self._fanout
        return executor

    # -- RedisStoreBase's direct I/O, routed per server ---------------------------------------
    def _direct_reads(self, keys: Sequence[str]) -> list[tuple[Any, list[int]]] | None:
        return [(self._shards[shard]._redis.connection_pool, indices)
                for shard, indices in self._groups(keys).items()]

    def _write_routes(self) -> tuple[Callable[[str], Any], int] | None:
        pools = [shard._redis_writes.connection_pool for shard in self._shards]
        return (lambda key: pools[self.shard_of(key)]), len(pools)

    def _write_threads(self) -> int:
        return max(self._spread, len(self._shards))  # at least one sender per server a batch touches

    def _put_pipelined(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        batch = list(items)
        for shard, indices in self._groups([k for k, _ in batch]).items():
            self._shards[shard].put_many([batch[i] for i in indices])  # direct sockets where it can

    # -- the rest of the contract, per server --------------------------------------------------
    def get(self, key: str) -> Value | None:
        return self._shards[self.shard_of(key)].get(key)

    def put(self, key: str, value: WriteValue) -> None:
        self._shards[self.shard_of(key)].put(key, value)

    def delete(self, key: str) -> bool:
        return self._shards[self.shard_of(key)].delete(key)

    def exists(self, key: str) -> bool:
        return self._shards[self.shard_of(key)].exists(key)

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        for shard in self._shards:
            yield from shard.iter_keys(prefix)

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        return self._fan(keys, RedisStore.get_many)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self._fan(keys, RedisStore.exists_many)

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(self._fan(keys, lambda shard, share: shard._integers("DEL", "delete", share)))

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        return self._fan(keys, RedisStore.size_many)

    def get_heads(self, keys: Sequence[str], nbytes: int) -> list[Head | None]:
        return self._fan(keys, lambda shard, share: shard.get_heads(share, nbytes))

    def close(self) -> None:
        super().close()
        with self._client_lock:
            executor, self._fanout = self._fanout, None
        if executor is not None:
            executor.shutdown(wait=True)
        for shard in self._shards:
            shard.close()

    def describe(self) -> dict[str, Any]:
        c = self.config
        user = f"{c.username}:***@" if c.password else (f"{c.username}@" if c.username else "")
        hosts = ",".join(f"{h}:{p}" for h, p in c.hosts)
        return {"store": "redis+shards", "url": f"{'rediss' if c.tls else 'redis'}+shards://{user}{hosts}/{c.db}",
                "shards": len(c.hosts), "prefix": c.prefix, "ttl": c.ttl, "max_connections": c.max_connections,
                "timeout": c.timeout}
