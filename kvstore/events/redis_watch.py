"""Removals from Redis: the server's keyspace notifications for evicted and expired keys.

Redis evicts keys (``maxmemory`` with an eviction policy) and expires them (``ttl=``) without
telling its clients, unless the operator enables keyevent notifications for those events::

    CONFIG SET notify-keyspace-events Exe      (or notify-keyspace-events "Exe" in redis.conf)

(``E``: keyevent channels, ``x``: expired, ``e``: evicted). A ``RedisRemovalWatcher`` subscribes
to ``__keyevent@<db>__:evicted`` and ``__keyevent@<db>__:expired`` on one server and announces
every kvstore key (the store's ``prefix`` stripped) as ``BlockRemoved``. Notifications are
fire-and-forget: what happens while the watcher is disconnected is lost (it reconnects and logs
it), so a router may keep a removed block until it misses on it. A sharded store has one watcher
per server (``watch_store``), a Redis Cluster one per primary (listed from the cluster's slot map
when the watchers start; a primary promoted later is not watched until they start again), since
each node notifies only of its own keys.

Needs ``redis`` (redis-py, the ``redis`` extra), imported when a watcher starts.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Protocol

from kvstore.errors import ConfigError
from kvstore.extras import install_hint
from kvstore.stores.base import Store
from kvstore.stores.redis.config import RedisConfig

__all__ = ["RedisRemovalWatcher", "watch_store", "NOTIFY_FLAGS"]

log = logging.getLogger(__name__)

#: The ``notify-keyspace-events`` flags the watcher needs (at least these).
NOTIFY_FLAGS = "Exe"
_RETRY = 1.0  # seconds between reconnect attempts
_POLL = 0.2  # seconds a read waits, so ``close`` is noticed


class _Removals(Protocol):
    def removed(self, keys: Any, medium: str) -> int: ...


class RedisRemovalWatcher:
    """Turns one Redis server's evicted and expired kvstore keys into ``sink.removed(keys, medium)``.

    ``config``: the server's options as the store has them (host or socket, db, credentials, TLS,
    key ``prefix``), e.g. ``RedisConfig.from_url(url)``. Runs a thread until ``close``. At start it
    checks ``notify-keyspace-events`` (where ``CONFIG`` is allowed) and logs a warning naming the
    missing flags: without them the server sends nothing.
    """

    def __init__(self, config: RedisConfig, sink: _Removals, *, medium: str = "REDIS") -> None:
        try:
            import redis
        except ImportError as exc:
            raise ConfigError(f"watching Redis removals needs redis-py: {install_hint('redis')}") from exc
        if config.cluster:
            raise ConfigError("a Redis Cluster notifies per node: watch each primary with its own redis:// URL")
        self._redis = redis
        self.config = config
        self.sink = sink
        self.medium = medium
        self.missing_flags = ""
        self._stop = threading.Event()
        self._channels = [f"__keyevent@{config.db}__:evicted", f"__keyevent@{config.db}__:expired"]
        self.subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-redis-removals", daemon=True)
        self._thread.start()

    @classmethod
    def from_url(cls, url: str, sink: _Removals, *, medium: str = "REDIS") -> RedisRemovalWatcher:
        return cls(RedisConfig.from_url(url), sink, medium=medium)

    def _client(self) -> Any:
        c = self.config
        kwargs: dict[str, Any] = {"db": c.db, "username": c.username or None, "password": c.password or None,
                                  "socket_connect_timeout": c.connect_timeout, "socket_timeout": None}
        if c.unix_path:
            kwargs["unix_socket_path"] = c.unix_path
        else:
            kwargs["host"], kwargs["port"] = c.hosts[0]
        if c.tls:
            kwargs.update(ssl=True, ssl_ca_certs=c.ca_certs or None, ssl_cert_reqs="required" if c.tls_verify else "none",
                          ssl_check_hostname=c.tls_verify)
        return self._redis.Redis(**kwargs)

    def _check_flags(self, client: Any) -> None:
        try:
            flags = str(client.config_get("notify-keyspace-events").get("notify-keyspace-events", ""))
        except self._redis.RedisError:
            return  # CONFIG disabled (managed Redis): the operator's settings are not ours to see
        has_all = "A" in flags  # "A": every event class, evicted and expired included
        missing = "".join(f for f in NOTIFY_FLAGS if f not in flags and not (has_all and f in "xe"))
        self.missing_flags = missing
        if missing:
            log.warning("Redis %s sends no removal events: notify-keyspace-events=%r lacks %r; set "
                        "CONFIG SET notify-keyspace-events %s", self.config.safe_url(), flags, missing, NOTIFY_FLAGS)

    def _run(self) -> None:
        prefix = self.config.prefix
        while not self._stop.is_set():
            client = pubsub = None
            try:
                client = self._client()
                self._check_flags(client)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(*self._channels)
                self.subscribed.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=_POLL)
                    if message is None:
                        continue
                    key = message.get("data")
                    if isinstance(key, bytes):
                        key = key.decode("utf-8", "replace")
                    if isinstance(key, str) and key.startswith(prefix):
                        self.sink.removed([key[len(prefix):]], self.medium)
            except self._redis.RedisError as exc:
                self.subscribed.clear()
                log.warning("Redis removal watcher for %s lost its connection (%s); removals meanwhile are "
                            "not announced; reconnecting", self.config.safe_url(), exc)
                self._stop.wait(_RETRY)
            finally:
                for thing in (pubsub, client):
                    if thing is not None:
                        try:
                            thing.close()
                        except (self._redis.RedisError, OSError):
                            pass

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


def watch_store(store: Store, sink: _Removals, *, medium: str = "REDIS") -> list[RedisRemovalWatcher]:
    """Watchers for every server of the Redis store ``store`` (one, or one per shard)."""
    config = getattr(store, "config", None)
    if not isinstance(config, RedisConfig):
        raise ConfigError(f"{store!r} is not a Redis store; removals can be watched on redis:// and "
                          "redis+shards:// stores")
    if config.cluster:
        hosts = _cluster_primaries(store, config)
        if not hosts:
            return []
        single = dataclasses.replace(config, cluster=False)
    else:
        hosts = list(config.hosts if not config.unix_path else config.hosts[:1])
        single = config
    return [RedisRemovalWatcher(dataclasses.replace(single, hosts=(host,)), sink, medium=medium) for host in hosts]


def _cluster_primaries(store: Store, config: RedisConfig) -> list[tuple[str, int]]:
    """The primaries of a Redis Cluster store, each watched on its own (keyspace notifications are
    a node's own). A primary promoted later (a failover) is not watched until the watchers start
    again: its removals are missed, never wrong."""
    try:
        client = store._redis  # type: ignore[attr-defined]  # the cluster store's client: the current slot map
        return [(node.host, int(node.port)) for node in client.get_primaries()]
    except Exception as exc:  # noqa: BLE001 - an unreachable cluster: nothing to watch now, said once
        log.warning("Redis Cluster %s: removals are not watched (its primaries could not be listed: %s)",
                    config.safe_url(), exc)
        return []
