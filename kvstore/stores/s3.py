"""``s3://bucket/prefix`` — an S3 (or S3-compatible) store on boto3.

One object per key, under ``prefix``. Batch operations run in parallel on a bounded thread pool
(``max_workers``, also the size of boto3's connection pool): S3 answers each request slowly but
many at once. A miss (404 / NoSuchKey) is ``None``; a connection error, a timeout, a 5xx, a
throttle or an access error becomes ``StoreUnavailableError`` raised from the botocore error.
Nothing is cached here, misses included: an object written by another replica is found on the
next lookup.

Credentials come from boto3's standard chain (environment, shared files, ``profile``, instance
roles); they are never part of the URL or the config, so never in ``repr`` or logs.

S3's own checksums are off (``when_required``): every record carries its own checksum, verified
when it is decoded, and S3 over TLS already protects the transfer.

URL: ``s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1&max_workers=16
&timeout=10s&connect_timeout=2s&retries=1&addressing_style=path&profile=NAME``.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
from botocore.config import Config as BotoConfig

from kvstore.buffers import Pieces
from kvstore.config import build, option, query_options, redact_url
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.stores.base import Store, Value, WriteValue

T = TypeVar("T")
R = TypeVar("R")

_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys


@dataclass(frozen=True)
class S3Config:
    bucket: str = option(internal=True)
    prefix: str = option("", internal=True, help="Key prefix inside the bucket (the URL path).")
    endpoint_url: str = option("", help="S3-compatible endpoint (MinIO, Ceph, rclone...); empty for AWS.")
    region: str = option("", help="Region; empty takes boto3's default chain.")
    profile: str = option("", help="Named profile from the shared AWS config files.")
    addressing_style: str = option("", choices=("", "auto", "path", "virtual"),
                                   help="Bucket in the path or the host name; default path with endpoint_url.")
    max_workers: int = option(16, help="Parallel requests (thread pool and connection pool size).")
    timeout: float = option(10.0, kind="duration", help="Deadline of each socket read.")
    connect_timeout: float = option(2.0, kind="duration", help="Deadline to connect.")
    retries: int = option(1, help="Retries of a failed request (boto3 standard mode).")

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ConfigError("s3:// needs a bucket: s3://bucket/prefix")
        if self.max_workers < 1:
            raise ConfigError(f"max_workers={self.max_workers} must be at least 1")
        if self.retries < 0:
            raise ConfigError(f"retries={self.retries} must not be negative")
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("timeout and connect_timeout must be positive: every remote call has a deadline")
        if self.endpoint_url and urlsplit(self.endpoint_url).scheme not in ("http", "https"):
            raise ConfigError(f"endpoint_url={self.endpoint_url!r} must be an http:// or https:// URL")

    @classmethod
    def from_url(cls, url: str) -> S3Config:
        parts = urlsplit(url)
        if parts.scheme.lower() != "s3":
            raise ConfigError(f"{redact_url(url)!r} is not an s3:// URL")
        if "@" in parts.netloc:
            raise ConfigError("s3:// URLs take no credentials: boto3's standard chain provides them "
                              "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, ?profile=, instance roles)")
        prefix = parts.path.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return build(cls, query_options(url), where="s3://", bucket=parts.netloc, prefix=prefix)


class _Missing(Exception):
    """Internal: the object does not exist (a miss, never raised to callers)."""


def _is_missing(exc: botocore.exceptions.ClientError) -> bool:
    err = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(err.get("Code")) in _MISSING_CODES or status == 404


class _PiecesBody(io.RawIOBase):
    """A ``Pieces`` value as the seekable file botocore streams a body from (no join)."""

    def __init__(self, pieces: Pieces) -> None:
        self._parts = pieces.parts
        self._size = pieces.nbytes
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written, start = 0, 0
        for part in self._parts:
            end = start + len(part)
            if self._pos < end and written < len(out):
                lo = self._pos - start
                n = min(len(part) - lo, len(out) - written)
                out[written:written + n] = part[lo:lo + n]
                written += n
                self._pos += n
            start = end
        return written


def _body(value: WriteValue) -> bytes | bytearray | _PiecesBody:
    """``value`` in a form botocore sends as is; it takes bytes, bytearray and files, not memoryview."""
    if isinstance(value, Pieces):
        return _PiecesBody(value)
    if isinstance(value, (bytes, bytearray)):
        return value
    view = memoryview(value)
    base = view.obj
    if isinstance(base, (bytes, bytearray)) and view.contiguous and view.nbytes == len(base):
        return base  # a view of a whole buffer: send the buffer itself
    return view.tobytes()


class S3Store(Store):
    """Objects in an S3 bucket under a prefix. See the module docstring for the contract."""

    is_local = False
    Config = S3Config

    def __init__(self, config: S3Config) -> None:
        self.config = config
        c = config
        style = c.addressing_style or ("path" if c.endpoint_url else "auto")
        boto_config = BotoConfig(
            region_name=c.region or None,
            connect_timeout=c.connect_timeout,
            read_timeout=c.timeout,
            retries={"mode": "standard", "max_attempts": c.retries + 1},
            max_pool_connections=c.max_workers,
            s3={"addressing_style": style, "payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            session = boto3.session.Session(profile_name=c.profile or None)
            # Building a client does no network I/O: the store works once S3 is reachable.
            self._client = session.client("s3", endpoint_url=c.endpoint_url or None, config=boto_config)
        except botocore.exceptions.ProfileNotFound as exc:
            raise ConfigError(f"profile={c.profile!r} is not in the AWS config files") from exc
        except botocore.exceptions.NoRegionError as exc:
            raise ConfigError("no AWS region: give ?region= or set AWS_DEFAULT_REGION") from exc
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        return cls(S3Config.from_url(url))

    # -- plumbing --------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return self.config.prefix + key

    def _call(self, fn: Callable[..., T], **kwargs: Any) -> T:
        try:
            return fn(Bucket=self.config.bucket, **kwargs)
        except botocore.exceptions.ClientError as exc:
            if _is_missing(exc) and "Key" in kwargs:
                raise _Missing(kwargs["Key"]) from exc
            raise self._unavailable(exc) from exc
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: BaseException) -> StoreUnavailableError:
        return StoreUnavailableError(f"s3://{self.config.bucket}/{self.config.prefix} "
                                     f"({self.config.endpoint_url or 'AWS'}): {type(exc).__name__}: {exc}")

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` over ``items`` on the thread pool, results in order; the first error is raised."""
        if len(items) <= 1:
            return [fn(i) for i in items]
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.config.max_workers, thread_name_prefix="kvstore-s3")
        return list(self._pool.map(fn, items))

    # -- the small contract --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        try:
            response = self._call(self._client.get_object, Key=self._key(key))
        except _Missing:
            return None
        try:
            # botocore checks the length read against Content-Length: a cut transfer raises
            # (below) instead of returning part of a record.
            body: bytes = response["Body"].read()
            return body
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise self._unavailable(exc) from exc
        except Exception as exc:  # urllib3 protocol errors while streaming the body
            if type(exc).__module__.startswith("urllib3"):
                raise self._unavailable(exc) from exc
            raise

    def put(self, key: str, value: WriteValue) -> None:
        self._call(self._client.put_object, Key=self._key(key), Body=_body(value))

    def _head(self, key: str) -> int | None:
        try:
            return int(self._call(self._client.head_object, Key=self._key(key))["ContentLength"])
        except _Missing:
            return None

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def delete(self, key: str) -> bool:
        # S3 answers a DELETE the same whether the object existed or not: ask first.
        if not self.exists(key):
            return False
        self._call(self._client.delete_object, Key=self._key(key))
        return True

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        cut = len(self.config.prefix)
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.config.bucket, Prefix=self._key(prefix)):
                for obj in page.get("Contents", ()):
                    yield obj["Key"][cut:]
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError, OSError) as exc:
            raise self._unavailable(exc) from exc

    # -- batch forms: parallel requests ----------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        return self._map(self.get, list(keys))

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        self._map(lambda kv: self.put(*kv), list(items))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [size is not None for size in self.size_many(keys)]

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        return self._map(self._head, list(keys))

    def delete_many(self, keys: Sequence[str]) -> int:
        keys = list(keys)
        present = [k for k, p in zip(keys, self.exists_many(keys)) if p]
        for i in range(0, len(present), _DELETE_BATCH):
            objects = [{"Key": self._key(k)} for k in present[i:i + _DELETE_BATCH]]
            self._call(self._client.delete_objects, Delete={"Objects": objects, "Quiet": True})
        return len(present)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """Parallel HEADs, a window of ``max_workers`` keys at a time, stopping at the first gap.

        Why not a binary search: it needs log2(n) *sequential* round trips (9 for 512 chunks,
        each ~1 ms here and 10-30 ms on AWS) and it is wrong when presence is not monotonic (a
        middle chunk evicted or expired: it may report a prefix past the gap). A window of
        parallel HEADs costs one round trip per ``max_workers`` keys and is exact.
        """
        window = self.config.max_workers
        for start in range(0, len(keys), window):
            present = self.exists_many(keys[start:start + window])
            for i, p in enumerate(present):
                if not p:
                    return start + i
        return len(keys)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._client.close()

    @property
    def deadline(self) -> float:
        c = self.config
        return (c.connect_timeout + c.timeout) * (1 + c.retries)

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"store": "s3", "bucket": c.bucket, "prefix": c.prefix, "endpoint_url": c.endpoint_url,
                "region": c.region, "profile": c.profile, "max_workers": c.max_workers, "timeout": c.timeout}
