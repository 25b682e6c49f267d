"""Which backend serves which URL scheme: the one table of schemes (``BACKENDS``).

Backends are named as ``"module:Class"`` and imported on first use, so a missing optional
client (redis-py, boto3) only matters to users of that scheme. Third-party backends add
themselves with ``register_backend``. The configuration reference (``kvstore.docs``) is
generated from this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvstore.config import check_url, redact_url
from kvstore.errors import ConfigError
from kvstore.extras import install_hint
from kvstore.stores.base import Store

__all__ = ["Backend", "BACKENDS", "register_backend", "known_schemes", "backend_class", "open_backend"]


@dataclass(frozen=True)
class Backend:
    """One store backend: the class serving ``schemes``, its options class and how to install it."""

    title: str
    schemes: tuple[str, ...]
    target: str
    #: Its options dataclass (``"module:Class"``), for the configuration reference.
    config: str = ""
    #: The extra (setup.cfg) that brings its client library ("" if none is needed): ``install_hint``.
    extra: str = ""
    #: URL forms, for the configuration reference.
    forms: tuple[str, ...] = ()
    notes: str = ""
    #: Options that come from the URL's host or path rather than its query.
    url_fields: tuple[str, ...] = field(default=())


BACKENDS: list[Backend] = [
    Backend("Memory", ("memory",), "kvstore.stores.memory:MemoryStore", "kvstore.stores.memory:MemoryConfig",
            forms=("memory://?max_bytes=8GiB",), notes="Private to the process: the fastest tier of one replica."),
    Backend("File", ("file",), "kvstore.stores.file:FileStore", "kvstore.stores.file:FileConfig",
            forms=("file:///var/cache/kvstore?max_bytes=100GiB",), url_fields=("path",),
            notes="The path must be absolute; several processes on one host may share the directory."),
    Backend("Host shared memory", ("shm",), "kvstore.stores.shm:ShmStore", "kvstore.stores.shm:ShmConfig",
            forms=("shm://NAME?max_bytes=8GiB",), url_fields=("name",),
            notes="One bounded memory tier shared by every process of a host that opens the same NAME (records "
                  "as files in /dev/shm/kvstore-NAME, renamed into place: never seen half-written; LRU across "
                  "processes; a writer killed mid-record leaves nothing behind). Put it before Redis: "
                  "`memory://,shm://host,redis://...`. Size /dev/shm (`--shm-size` in containers) above max_bytes."),
    Backend("Redis", ("redis", "rediss", "unix"), "kvstore.stores.redis:RedisStore",
            "kvstore.stores.redis:RedisConfig", extra="redis",
            forms=("redis://[user:password@]host[:port][/db]?ttl=1h",
                   "rediss://[user:password@]host[:port][/db]?ca_certs=/path/ca.pem (TLS)",
                   "unix://[user:password@]/path/to/redis.sock?db=0"),
            notes="The password is part of the URL (percent-encode special characters), or read when the store "
                  "opens from `password_file=PATH` or `password_env=NAME`, so it never shows in a command line; "
                  "`redact_url` hides it in logs. `db` may also be given as the URL path (`/0`). Values are written with `SET ... PX ttl` "
                  "when `ttl` is set; run Redis with `maxmemory` and `maxmemory-policy allkeys-lru`. "
                  "Valkey servers are served the same way."),
    Backend("Redis Cluster", ("redis+cluster", "rediss+cluster"), "kvstore.stores.redis:RedisClusterStore",
            "kvstore.stores.redis:RedisConfig", extra="redis",
            forms=("redis+cluster://[user:password@]host:port[,host:port...]?ttl=1h", "rediss+cluster://... (TLS)"),
            notes="Same options as Redis; a cluster has only database 0. Startup nodes are listed in the "
                  "host part, comma-separated."),
    Backend("Redis shards", ("redis+shards", "rediss+shards"), "kvstore.stores.redis.sharded:ShardedRedisStore",
            "kvstore.stores.redis:RedisConfig", extra="redis",
            forms=("redis+shards://[user:password@]host:port,host:port[,host:port...][/db]?ttl=1h",
                   "rediss+shards://... (TLS)"),
            notes="Independent standalone servers as one store: each key on one server by rendezvous hashing "
                  "(any process, any order of the list; adding a server moves about 1/N of the keys), every batch "
                  "split per server and sent to all of them at once. Same options as Redis, for every server; "
                  "a frozen server costs a batch one deadline."),
    Backend("Mooncake Store", ("mooncake",), "kvstore.stores.mooncake.store:MooncakeStore",
            "kvstore.stores.mooncake.config:MooncakeConfig", extra="mooncake",
            forms=("mooncake://MASTER_HOST[:50051]?metadata=http://MASTER_HOST:8080/metadata&protocol=tcp&segment=4GiB",),
            notes="A distributed DRAM pool (`mooncake_master`, kvcache-ai/Mooncake) read and written with zero-copy "
                  "batch calls, straight into the reader's buffer pool (registered with the transfer engine over "
                  "RDMA), over TCP or RDMA; every call within `deadline`. Embedded: each engine process contributes "
                  "`segment` bytes and its objects die with it (a miss); standalone (`segment=0`): a "
                  "`mooncake_client` process per host owns the pool. The client's binaries need libibverbs1 and "
                  "librdmacm1 (apt) even over TCP; `docs/deploy.md` has the commands."),
    Backend("S3", ("s3",), "kvstore.stores.s3:S3Store", "kvstore.stores.s3:S3Config", extra="s3",
            forms=("s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1",),
            notes="Credentials never go in the URL: boto3's standard chain provides them (`AWS_ACCESS_KEY_ID` / "
                  "`AWS_SECRET_ACCESS_KEY`, `~/.aws`, `?profile=`, instance roles). The URL path is the key prefix."),
]


def register_backend(backend: Backend) -> None:
    """Serve ``backend.schemes`` with ``backend.target`` (replacing what served them before)."""
    taken = set(backend.schemes)
    BACKENDS[:] = [b for b in BACKENDS if not taken & set(b.schemes)] + [backend]


def _find(scheme: str) -> Backend | None:
    return next((b for b in BACKENDS if scheme in b.schemes), None)


def known_schemes() -> list[str]:
    return sorted(s for b in BACKENDS for s in b.schemes)


def _accepted() -> str:
    return ", ".join(s + "://" for s in known_schemes())


def backend_class(scheme: str) -> type[Store]:
    """The store class serving ``scheme``; ``ConfigError`` if none does or its client is missing."""
    backend = _find(scheme)
    if backend is None:
        raise ConfigError(f"unknown store scheme {scheme + '://'!r}; accepted: {_accepted()}")
    module_name, _, class_name = backend.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install it with: {install_hint(backend.extra)}" if backend.extra else ""
        raise ConfigError(f"the {scheme}:// store needs a package that is not installed ({exc}){hint}") from exc
    cls: type[Store] = getattr(module, class_name)
    return cls


def open_backend(url: str) -> Store:
    """The single store ``url`` names (``open_store`` also builds tiered stores from lists)."""
    if not isinstance(url, str):
        raise ConfigError(f"a store URL must be a string, got {type(url).__name__}")
    check_url(url)
    if "://" not in url:
        raise ConfigError(f"store URL {redact_url(url)!r} has no scheme; accepted: {_accepted()}")
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise ConfigError(f"store URL {redact_url(url)!r} is not valid: {exc}") from exc
    try:
        store: Store = backend_class(scheme).from_url(url)  # type: ignore[attr-defined]
    except ConfigError:
        raise
    except (ValueError, TypeError, OverflowError, OSError) as exc:  # a backend's own parsing, past our checks
        raise ConfigError(f"store URL {redact_url(url)!r} is not usable: {type(exc).__name__}: {exc}") from exc
    return store
