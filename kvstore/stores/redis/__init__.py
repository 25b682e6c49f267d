"""The Redis, Redis Cluster and client-sharded Redis stores (``single``, ``cluster``, ``sharded``,
all built on ``base``), their URL options (``config``), the direct socket I/O beside redis-py's
pipeline (``direct``, batched in ``waves``) and the redis-py internals they rely on (``hooks``)."""

from kvstore.stores.redis.cluster import RedisClusterStore
from kvstore.stores.redis.config import RedisConfig
from kvstore.stores.redis.sharded import ShardedRedisStore
from kvstore.stores.redis.single import RedisStore

__all__ = ["RedisConfig", "RedisStore", "RedisClusterStore", "ShardedRedisStore"]
