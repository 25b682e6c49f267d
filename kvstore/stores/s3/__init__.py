"""The S3 store (``store``), its URL options (``config``) and the bytes of its requests and
replies (``bodies``)."""

from kvstore.stores.s3.config import S3Config
from kvstore.stores.s3.store import S3Store

__all__ = ["S3Config", "S3Store"]
