"""``redis+cluster://`` and ``rediss+cluster://``: a Redis Cluster (``RedisClusterStore``).

Every operation is ``RedisStoreBase``'s (``base``); this builds the cluster client, routes
direct reads and writes to each key's node, and runs pipelines with one deadline per batch,
following a moved slot once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import redis
import redis.cluster

from kvstore.stores.redis import hooks
from kvstore.stores.redis.base import RedisStoreBase
from kvstore.stores.redis.config import MAX_SPREAD

__all__ = ["RedisClusterStore"]

log = logging.getLogger("kvstore.stores")


class RedisClusterStore(RedisStoreBase):
    """A Redis Cluster: keys hash to slots on several primaries; batches go one per node, and
    ``get_into`` reads every node of a batch at once."""

    _cluster: ClassVar[bool] = True

    def _direct_reads(self, keys: Sequence[str]) -> list[tuple[Any, list[int]]] | None:
        client = self._redis
        by_node: dict[str, tuple[Any, list[int]]] = {}
        try:
            for i, key in enumerate(keys):
                node = client.get_node_from_key(self._key(key))
                by_node.setdefault(node.name, (node, []))[1].append(i)
            if len(by_node) > MAX_SPREAD:
                return None  # more nodes than one batch reads at once: the pipeline visits them
            return [(client.get_redis_connection(node).connection_pool, share) for node, share in by_node.values()]
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
            return None  # e.g. a slot not covered now: the pipeline says what is wrong

    def _write_threads(self) -> int:
        return MAX_SPREAD  # at least one sender per node a batch touches

    def _write_routes(self) -> tuple[Callable[[str], Any], int] | None:
        client = self._redis_writes
        primaries = len(client.get_primaries())
        if not 0 < primaries <= MAX_SPREAD:
            return None  # more nodes than one batch writes at once: the pipeline visits them

        def route(key: str) -> Any:
            try:
                return client.get_redis_connection(client.get_node_from_key(self._key(key))).connection_pool
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
                return None  # e.g. a slot not covered now: the pipeline says what is wrong

        return route, primaries

    def _execute(self, pipe: Any) -> list[Any]:
        """The pipeline's replies, a failed command raising. A timeout ends the batch: one
        deadline. (redis-py's own ``execute`` would then resend every command that failed one by
        one, a deadline each against a frozen node, and retry timeouts as if they were lost
        connections.) Only a moved slot runs the batch again: after refreshing the slot map,
        following the redirections."""
        stack = hooks.cluster_pipeline_commands(pipe)
        try:
            replies: list[Any] = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
            if any(isinstance(r, (redis.exceptions.MovedError, redis.exceptions.AskError)) for r in replies):
                self._rerouted(pipe)
                replies = pipe.send_cluster_commands(stack, raise_on_error=False)
        finally:
            pipe.reset()
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _rerouted(self, client: Any) -> None:
        """Learn the slots' new homes (best effort: the batch that was told MOVED then follows
        the redirections itself)."""
        try:
            client.nodes_manager.initialize()
        except Exception as exc:  # noqa: BLE001 - an outage shows in the next call, not here
            log.debug("refreshing the cluster's slots failed: %s", exc)

    def _make_client(self, timeout: float) -> redis.cluster.RedisCluster:
        c = self.config
        kwargs = self._connection_kwargs(timeout)
        (host, port), *others = c.hosts
        # ``url=`` makes redis-py build node pools from these kwargs as given, so our connection
        # class (and its packer) is used; credentials and TLS stay in kwargs, not in the URL.
        return redis.cluster.RedisCluster(
            url=f"redis://{host}:{port}",
            # redis-py leaves ClusterNode.__init__ unannotated.
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in others],  # type: ignore[no-untyped-call]
            retry=self._retry(),
            **kwargs,
        )
