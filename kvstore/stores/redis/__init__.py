"""The Redis and Redis Cluster stores (``single``, ``cluster``, both built on ``base``), their
URL options (``config``), the direct socket I/O beside redis-py's pipeline (``direct``, batched
in ``waves``) and the redis-py internals they rely on (``hooks``)."""

from kvstore.stores.redis.cluster import RedisClusterStore
from kvstore.stores.redis.config import RedisConfig
from kvstore.stores.redis.single import RedisStore

__all__ = ["RedisConfig", "RedisStore", "RedisClusterStore"]
