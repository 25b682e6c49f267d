"""The options of an ``s3://`` store (``S3Config``), parsed and checked from its URL.

URL: ``s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1&max_workers=16
&deadline=2s&timeout=1s&connect_timeout=500ms&retries=1&write_timeout=30s&addressing_style=path&profile=NAME``.
Credentials are never part of the URL or the config (boto3's standard chain provides them), so
never in ``repr`` or logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstore.config import build, check_range, option, query_options, redact_url, split_url
from kvstore.errors import ConfigError

MAX_TIMEOUT = 300.0
_BUCKET = re.compile(r"^[A-Za-z0-9._-]{1,255}$", re.ASCII)  # S3's rules, and the legacy names AWS still serves


@dataclass(frozen=True)
class S3Config:
    bucket: str = option(internal=True)
    prefix: str = option("", internal=True, help="Key prefix inside the bucket (the URL path).")
    endpoint_url: str = option("", help="S3-compatible endpoint (MinIO, Ceph, rclone...); empty for AWS.")
    region: str = option("", help="Region; empty takes boto3's default chain.")
    profile: str = option("", help="Named profile from the shared AWS config files.")
    addressing_style: str = option("", choices=("", "auto", "path", "virtual"),
                                   help="Bucket in the path or the host name; default path with endpoint_url.")
    max_workers: int = option(16, help="Parallel requests: threads and connections for reads, and as many for writes.")
    deadline: float = option(
        2.0, kind="duration", help="Longest one read, lookup or delete call may take, retries included (the engine's "
        "critical path); then it is a miss and the circuit breaker skips the tier.")
    timeout: float = option(1.0, kind="duration", help="Deadline of each socket read of a read, lookup or delete attempt.")
    connect_timeout: float = option(0.5, kind="duration", help="Deadline to connect.")
    write_timeout: float = option(30.0, kind="duration", help="Deadline of each socket read of a background upload.")
    retries: int = option(1, help="Retries of a failed request (boto3 standard mode), 0 to 10; reads retry only "
                                  "within deadline.")
    part_size: int = option(8 << 20, kind="size", help="Objects larger than this are read in parallel ranged GETs of "
                                                       "this size (1MiB to 1GiB).")

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ConfigError("s3:// needs a bucket: s3://bucket/prefix")
        if not _BUCKET.match(self.bucket):
            raise ConfigError(f"bucket {self.bucket!r} is not an S3 bucket name (letters, digits, dots, hyphens "
                              "and underscores)")
        check_range("max_workers", self.max_workers, 1, 256)
        check_range("retries", self.retries, 0, 10)
        check_range("part_size", self.part_size, 1 << 20, 1 << 30)
        for name in ("deadline", "timeout", "connect_timeout", "write_timeout"):
            value = getattr(self, name)
            if not 0 < value <= MAX_TIMEOUT:  # NaN fails too
                raise ConfigError(f"{name}={value!r} is out of range; accepted: more than 0 and at most "
                                  f"{MAX_TIMEOUT:g}s (every remote call has a deadline)")
        if self.endpoint_url:
            endpoint = split_url(self.endpoint_url, name="endpoint_url")
            try:
                endpoint.port  # noqa: B018  (a property: raises for a port that is not a number)
            except ValueError as exc:
                raise ConfigError(f"endpoint_url={self.endpoint_url!r} is not a valid URL: {exc}") from None
            if endpoint.scheme not in ("http", "https") or not endpoint.hostname:
                raise ConfigError(f"endpoint_url={self.endpoint_url!r} must be an http:// or https:// URL with a host")

    @classmethod
    def from_url(cls, url: str) -> S3Config:
        parts = split_url(url)
        if parts.scheme.lower() != "s3":
            raise ConfigError(f"{redact_url(url)!r} is not an s3:// URL")
        if "@" in parts.netloc:
            raise ConfigError("s3:// URLs take no credentials: boto3's standard chain provides them "
                              "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, ?profile=, instance roles)")
        prefix = parts.path.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return build(cls, query_options(url), where="s3://", bucket=parts.netloc, prefix=prefix)
