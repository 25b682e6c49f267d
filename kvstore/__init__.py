"""kvstore: a shared, tiered KV-cache store for LLM inference.

The public surface: ``open_store`` (stores from URLs), ``Namespace`` and ``chunk_keys`` (prefix
keys), ``encode_record``/``decode_record`` (self-describing records), ``PrefixCache`` (the
engine-agnostic save/load of token prefixes) and the error family.
"""

from kvstore.errors import ConfigError, CorruptRecordError, KVStoreError, StoreUnavailableError
from kvstore.keys import FORMAT_VERSION, ChunkKey, Namespace, chunk_keys
from kvstore.record import Record, RecordHeader, decode_record, encode_record, read_header
from kvstore.stores import Store, open_store, register_backend

__version__ = "0.1.0"

__all__ = [
    "ChunkKey", "ConfigError", "CorruptRecordError", "FORMAT_VERSION", "KVStoreError", "Namespace",
    "Record", "RecordHeader", "Store", "StoreUnavailableError", "chunk_keys", "decode_record",
    "encode_record", "open_store", "read_header", "register_backend",
]
