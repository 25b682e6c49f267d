"""The Redis and Redis Cluster stores (``store``), their URL options (``config``) and the redis-py
internals they rely on (``hooks``)."""

from kvstore.stores.redis.config import RedisConfig
from kvstore.stores.redis.store import RedisClusterStore, RedisStore

__all__ = ["RedisConfig", "RedisStore", "RedisClusterStore"]
