"""Self-describing chunk records: the format (``format``) and the payload codecs (``codecs``).

Stores are a trust boundary: every record read back is validated field by field before any of
its bytes are used, and nothing in it is ever unpickled.
"""

from kvstore.record.auth import RecordAuth
from kvstore.record.format import (
    DTYPES,
    FRAME_BYTES,
    MAGIC,
    CheckedRecord,
    Landing,
    Record,
    RecordHeader,
    check_record,
    decode_record,
    encode_record,
    encode_record_pieces,
    header_extent,
    kv_nbytes,
    land_record,
    read_header,
    verify_landed,
    verify_record,
)

__all__ = ["CheckedRecord", "DTYPES", "FRAME_BYTES", "Landing", "MAGIC", "Record", "RecordAuth", "RecordHeader", "check_record", "decode_record", "encode_record",
           "encode_record_pieces", "header_extent", "kv_nbytes", "land_record", "read_header", "verify_landed", "verify_record"]
