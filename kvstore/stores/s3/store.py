"""``s3://bucket/prefix`` — an S3 (or S3-compatible) store on boto3 (options: ``config``).

One object per key, under ``prefix``. Batch operations run in parallel on bounded thread pools
(``max_workers`` threads each, also the size of each boto3 connection pool): S3 answers each
request slowly but many at once. Reads, lookups and deletes (the engine's critical path) and
writes (the background writer's uploads) have separate clients, connection pools and thread
pools, so a lookup never queues behind an upload. A miss (404 / NoSuchKey) is ``None``; a
connection error, a timeout, a 5xx, a throttle or an access error becomes
``StoreUnavailableError`` raised from the botocore error.

Deadlines: one read, lookup or delete call, retries included, returns within ``deadline``
(a hard bound: the caller stops waiting then and gets ``StoreTimeoutError``, whatever botocore's
retries and backoff are still doing on the pool thread); each attempt's socket reads wait at
most ``timeout``. Uploads wait at most ``write_timeout`` per socket read.
Nothing is cached here, misses included: an object written by another replica is found on the
next lookup.

Credentials come from boto3's standard chain (environment, shared files, ``profile``, instance
roles); they are never part of the URL or the config, so never in ``repr`` or logs.

S3's own checksums are off (``when_required``): every record carries its own checksum, verified
when it is decoded, and S3 over TLS already protects the transfer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config as BotoConfig

from kvstore.buffers import STREAM_SLICE, BufferPool, borrow, lease_or_fresh
from kvstore.errors import ConfigError, StoreTimeoutError, StoreUnavailableError
from kvstore.stores.base import Head, LeaseStream, Place, Store, Value, WriteValue, check_head_bytes
from kvstore.stores.s3.bodies import Fetch, PartsDigest, abandon, object_size, request_body
from kvstore.stores.s3.config import S3Config

T = TypeVar("T")
R = TypeVar("R")

_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
_LEASE_WAIT = 0.05  # seconds a GET waits for pool space before receiving into a buffer of its own
_TIMEOUTS = (botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError)


_EMPTY = object()  # _get_first's answer for an empty object


class _Missing(Exception):
    """Internal: the object does not exist (a miss, never raised to callers)."""


def _error_code(exc: BaseException | None) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _is_missing(exc: botocore.exceptions.ClientError) -> bool:
    err = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(err.get("Code")) in _MISSING_CODES or status == 404


class S3Store(Store):
    """Objects in an S3 bucket under a prefix. See the module docstring for the contract."""

    is_local = False
    Config = S3Config

    def __init__(self, config: S3Config) -> None:
        self.config = config
        try:
            self._session = boto3.session.Session(profile_name=config.profile or None)
            # Building a client does no network I/O: the store works once S3 is reachable.
            self._client = self._make_client(self._session, config.timeout)
        except botocore.exceptions.ProfileNotFound as exc:
            raise ConfigError(f"profile={config.profile!r} is not in the AWS config files") from exc
        except botocore.exceptions.NoRegionError as exc:
            raise ConfigError("no AWS region: give ?region= or set AWS_DEFAULT_REGION") from exc
        except ValueError as exc:  # botocore's own checks of the endpoint, region...
            raise ConfigError(f"s3://{config.bucket}: {exc}") from exc
        self._writes: Any = None  # the uploads' client, built on the first write (a reader never needs it)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pool_lock = threading.Lock()
        self._closed = False

    def _make_client(self, session: Any, read_timeout: float) -> Any:
        c = self.config
        style = c.addressing_style or ("path" if c.endpoint_url else "auto")
        boto_config = BotoConfig(
            region_name=c.region or None,
            connect_timeout=c.connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard", "max_attempts": c.retries + 1},
            max_pool_connections=c.max_workers,
            s3={"addressing_style": style, "payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return session.client("s3", endpoint_url=c.endpoint_url or None, config=boto_config)

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

    def _unavailable(self, exc: BaseException | str) -> StoreUnavailableError:
        what = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        cls = StoreTimeoutError if isinstance(exc, (str, *_TIMEOUTS)) else StoreUnavailableError
        return cls(f"s3://{self.config.bucket}/{self.config.prefix} ({self.config.endpoint_url or 'AWS'}): {what}")

    def _pool(self, kind: str) -> ThreadPoolExecutor:
        pool = self._pools.get(kind)
        if pool is None:
            with self._pool_lock:
                if self._closed:
                    raise self._unavailable("closed")
                pool = self._pools.get(kind)
                if pool is None:
                    pool = self._pools[kind] = ThreadPoolExecutor(self.config.max_workers,
                                                                  thread_name_prefix=f"kvstore-s3-{kind}")
        return pool

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` over ``items`` on the write pool, results in order; the first error is raised
        once no call runs any more (those not started are cancelled): a failed ``put_many``
        returns only when no upload reads the caller's values, which it may then reuse (a paged
        cache's blocks, a pool's leases)."""
        if self._closed:
            raise self._unavailable("closed")
        if len(items) <= 1:
            return [fn(i) for i in items]
        pool = self._pool("write")
        try:
            futures = [pool.submit(fn, i) for i in items]
        except RuntimeError:  # interpreter exit: executors refuse work before atexit hooks drain writes
            if self._closed:
                raise self._unavailable("closed") from None
            return [fn(i) for i in items]  # writes and deletes are idempotent: any already submitted may rerun
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)  # the running ones end by their socket timeouts at the latest
            raise

    def _read(self, fn: Callable[[T], R], items: Sequence[T], end: float | None = None) -> list[R]:
        """``fn`` over ``items`` on the read pool, results in order, all within ``end`` (default:
        ``deadline`` from now); ``StoreTimeoutError`` once it has passed, the first error otherwise."""
        if not items:
            return []
        end = time.monotonic() + self.config.deadline if end is None else end
        pool = self._pool("read")
        try:
            futures: list[Future[R]] = [pool.submit(fn, i) for i in items]
        except RuntimeError:  # the interpreter is exiting (executors refuse work then), or closed
            if self._closed:
                raise self._unavailable("closed") from None
            # Inline, as _map does: a save's lookup at exit still gets its answer (each request
            # keeps its socket timeout; the deadline is checked between them).
            out = []
            for i in items:
                if time.monotonic() > end:
                    raise self._unavailable(f"no answer within deadline={self.config.deadline:g}s") from None
                out.append(fn(i))
            return out
        _, pending = wait(futures, timeout=max(0.0, end - time.monotonic()))
        if pending:
            for f in pending:
                f.cancel()  # those not started yet; the rest end by their socket timeouts
            raise self._unavailable(f"no answer within deadline={self.config.deadline:g}s")
        return [f.result() for f in futures]

    # -- the small contract --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        return self._read(self._get, [key])[0]

    def _get(self, key: str) -> bytes | None:
        try:
            response = self._call(self._client.get_object, Key=self._key(key))
        except _Missing:
            return None
        with self._body_errors():
            # botocore checks the length read against Content-Length: a cut transfer raises
            # instead of returning part of a record.
            body: bytes = response["Body"].read()
        return body

    @contextmanager
    def _body_errors(self) -> Iterator[None]:
        """Errors while a GET's body streams in, as ``StoreUnavailableError``."""
        try:
            yield
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise self._unavailable(exc) from exc
        except Exception as exc:  # urllib3 protocol errors while streaming the body
            if type(exc).__module__.startswith("urllib3"):
                raise self._unavailable(exc) from exc
            raise

    def put(self, key: str, value: WriteValue) -> None:
        self._call(self._write_client().put_object, Key=self._key(key), Body=request_body(value))

    def _write_client(self) -> Any:
        if self._writes is None:
            with self._pool_lock:
                if self._closed:
                    raise self._unavailable("closed")
                if self._writes is None:
                    self._writes = self._make_client(self._session, self.config.write_timeout)
        return self._writes

    def _head(self, key: str) -> int | None:
        try:
            return int(self._call(self._client.head_object, Key=self._key(key))["ContentLength"])
        except _Missing:
            return None

    def exists(self, key: str) -> bool:
        return self._read(self._head, [key])[0] is not None

    def delete(self, key: str) -> bool:
        return self.delete_many([key]) == 1

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
        return self._read(self._get, list(keys))

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """Values received straight into leases of ``pool`` (``readinto``: no buffer of botocore's
        own), yielded in order while later ones still arrive, each within ``deadline`` of its
        first request (a consumer's own work between values never counts against the server).

        The first GETs of up to ``max_workers`` values ahead of the consumer run at once, each
        asking for the object's first ``part_size`` bytes: the reply tells the object's size. A
        larger object's other parts are then fetched by parallel ranged GETs into the same lease
        (``If-Match`` its first part's ETag: an object rewritten meanwhile is unavailable, never
        a mix of two writes), so one large record arrives over several connections. Each value
        is hashed as it lands (``PartsDigest``) and its lease carries the digest (``Lease.digest``).
        A lease is released only once no request writes into it any more, however the stream ends."""
        keys = list(keys)
        window = self.config.max_workers  # values in flight ahead of the consumer: bounds the leased bytes
        firsts: list[Future[Fetch | None]] = []
        ends: list[float] = []  # each value's deadline, from when its first GET was sent
        handed = 0  # values yielded: the consumer owns (and releases) their leases
        try:
            reads = self._pool("read")
            for i in range(len(keys)):
                while len(firsts) < min(len(keys), i + window):
                    firsts.append(self._submit(reads, self._first_part, keys[len(firsts)], pool, reads))
                    ends.append(time.monotonic() + self.config.deadline)
                fetch = self._wait(firsts[i], ends[i])
                if fetch is not None:
                    for part in fetch.parts:
                        self._wait(part, ends[i])
                    if fetch.digest is not None:
                        fetch.lease.digest = fetch.digest.digest()
                handed += 1
                yield None if fetch is None else fetch.lease
        finally:
            end = max(ends, default=0.0)
            # What a healthy server has in flight ends at once: its leases go back now. What a
            # frozen one still holds once the deadline has passed goes back when its GETs end.
            rest = firsts[handed:]
            for first in rest:
                first.cancel()
            wait(rest, timeout=max(0.0, end - time.monotonic()))
            for first in rest:
                if first.done() and not first.cancelled() and first.exception() is None:
                    fetch = first.result()
                    if fetch is not None:
                        fetch.release(wait_for=max(0.0, end - time.monotonic()))
                else:
                    first.add_done_callback(abandon)

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[..., R], *args: Any) -> Future[R]:
        try:
            return pool.submit(fn, *args)
        except RuntimeError as exc:  # the store was closed (or the interpreter is exiting)
            raise self._unavailable(f"closed: {exc}") from exc

    def _wait(self, future: Future[T], end: float) -> T:
        try:
            return future.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:
            raise self._unavailable(f"no answer within deadline={self.config.deadline:g}s") from None
        except CancelledError:  # cancelled by close()
            raise self._unavailable("closed while reading") from None

    def _get_first(self, key: str, nbytes: int) -> Any:
        """The response to a GET of ``key``'s first ``nbytes`` bytes (its body not read yet);
        None for a missing object, ``_EMPTY`` for an empty one (it has no byte 0 to range over)."""
        try:
            return self._call(self._client.get_object, Key=self._key(key), Range=f"bytes=0-{nbytes - 1}")
        except _Missing:
            return None
        except StoreUnavailableError as exc:
            if _error_code(exc.__cause__) != "InvalidRange":
                raise
            return _EMPTY

    def _first_part(self, key: str, pool: BufferPool, reads: ThreadPoolExecutor) -> Fetch | None:
        """GET of ``key``'s first ``part_size`` bytes into a lease of its whole size; the other
        parts' GETs submitted (not waited for: a pool thread never waits on the pool)."""
        part = self.config.part_size
        response = self._get_first(key, part)
        if response is None:
            return None
        if response is _EMPTY:
            return Fetch(borrow(bytearray()), [])  # the record decoder says what it is
        body = response["Body"]
        try:
            length = int(response["ContentLength"])
            size = object_size(response.get("ContentRange"), length)
            lease = lease_or_fresh(pool, size, _LEASE_WAIT)
        except BaseException:
            body.close()
            raise
        bounds = [(start, min(size, start + part)) for start in range(length, size, part)]
        fetch = Fetch(lease, [], PartsDigest(lease.view, bounds))
        try:
            self._read_body(body, lease.view[:length], fetch.digest)
            etag = response.get("ETag")
            for index, (start, stop) in enumerate(bounds):
                fetch.parts.append(self._submit(reads, self._read_range, key, etag, start, lease.view[start:stop],
                                                fetch.digest, index))
        except BaseException:
            fetch.release()
            raise
        return fetch

    def _read_range(self, key: str, etag: str | None, start: int, into: memoryview,
                    digest: PartsDigest | None = None, index: int = 0) -> None:
        match = {"IfMatch": etag} if etag else {}
        try:
            response = self._call(self._client.get_object, Key=self._key(key),
                                  Range=f"bytes={start}-{start + len(into) - 1}", **match)
        except _Missing:
            raise self._unavailable(f"{key} was deleted while it was read") from None
        if int(response["ContentLength"]) != len(into):  # the object changed between the parts
            response["Body"].close()
            raise self._unavailable(f"{key}: a ranged GET of {len(into)} bytes returned {response['ContentLength']}")
        self._read_body(response["Body"], into)
        if digest is not None:
            digest.landed(index)

    def _read_body(self, body: Any, into: memoryview, digest: PartsDigest | None = None) -> None:
        """Fill ``into`` from a GET's body; botocore checks the length read against
        Content-Length, so a cut transfer raises instead of leaving part of a value. With
        ``digest`` (a value's first part) the body is read in slices, each hashed right after it
        lands, while it is still in the CPU's cache."""
        done = 0
        try:
            with self._body_errors():
                while done < len(into):
                    stop = len(into) if digest is None else min(len(into), done + STREAM_SLICE)
                    n = body.readinto(into[done:stop])
                    if not n:
                        break
                    if digest is not None:
                        digest.arrived(into[done:done + n])
                    done += n
                if done < len(into):
                    body.readinto(into[done:])  # botocore raises IncompleteReadError here
        finally:
            body.close()
        if done < len(into):
            raise self._unavailable(f"the body ended after {done} of {len(into)} bytes")

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        self._map(lambda kv: self.put(*kv), list(items))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [size is not None for size in self.size_many(keys)]

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        return self._read(self._head, list(keys))

    def get_heads(self, keys: Sequence[str], nbytes: int) -> list[Head | None]:
        """One ranged GET per key, in parallel; the size from its ``Content-Range``."""
        check_head_bytes(nbytes)
        return self._read(lambda key: self._get_head(key, nbytes), list(keys))

    def _get_head(self, key: str, nbytes: int) -> Head | None:
        response = self._get_first(key, nbytes)
        if response is None:
            return None
        if response is _EMPTY:
            return 0, b""
        with self._body_errors():
            head: bytes = response["Body"].read()
        return object_size(response.get("ContentRange"), len(head)), head[:nbytes]

    def delete_many(self, keys: Sequence[str]) -> int:
        # S3 answers a DELETE the same whether the object existed or not: ask first.
        end = time.monotonic() + self.config.deadline
        keys = list(keys)
        present = [k for k, size in zip(keys, self._read(self._head, keys, end)) if size is not None]

        def delete(batch: list[str]) -> None:
            objects = [{"Key": self._key(k)} for k in batch]
            self._call(self._client.delete_objects, Delete={"Objects": objects, "Quiet": True})

        self._read(delete, [present[i:i + _DELETE_BATCH] for i in range(0, len(present), _DELETE_BATCH)], end)
        return len(present)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """Parallel HEADs, a window of ``max_workers`` keys at a time, stopping at the first gap,
        all within one ``deadline``.

        Why not a binary search: it needs log2(n) *sequential* round trips (9 for 512 chunks,
        each ~1 ms here and 10-30 ms on AWS) and it is wrong when presence is not monotonic (a
        middle chunk evicted or expired: it may report a prefix past the gap). A window of
        parallel HEADs costs one round trip per ``max_workers`` keys and is exact.
        """
        window = self.config.max_workers
        end = time.monotonic() + self.config.deadline
        for start in range(0, len(keys), window):
            sizes = self._read(self._head, keys[start:start + window], end)
            for i, size in enumerate(sizes):
                if size is None:
                    return start + i
        return len(keys)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the pools and the clients; later calls fail as ``StoreUnavailableError("closed")``
        (a tiered store's miss). Writes already handed to the write pool still run to their end
        on their own client, which is closed after them: a caller that closes this store while a
        write is in flight (a drain that ran out of time) gets that write's own answer, never a
        shut pool. Reads are cancelled: they have deadlines, and nothing waits for them."""
        with self._pool_lock:
            self._closed = True
            pools, self._pools = dict(self._pools), {}
        # A thread still stuck on a frozen server ends by its socket timeout, so waiting here
        # would only delay shutdown.
        if "read" in pools:
            pools["read"].shutdown(wait=False, cancel_futures=True)
        self._client.close()
        writes, uploads = pools.get("write"), self._writes
        if writes is None:
            if uploads is not None:
                uploads.close()
            return

        def finish() -> None:
            writes.shutdown(wait=True)
            if uploads is not None:
                uploads.close()

        threading.Thread(target=finish, name="kvstore-s3-close", daemon=True).start()

    @property
    def deadline(self) -> float:
        """One read, lookup or delete call, retries included (uploads run in the background)."""
        return self.config.deadline

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"store": "s3", "bucket": c.bucket, "prefix": c.prefix, "endpoint_url": c.endpoint_url,
                "region": c.region, "profile": c.profile, "max_workers": c.max_workers, "deadline": c.deadline,
                "timeout": c.timeout, "write_timeout": c.write_timeout}
