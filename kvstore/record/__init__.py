"""Self-describing chunk records: the wire format (``format``), writing one (``encode``),
judging its header (``parse``), accepting a whole one (``decode``), landing one as it arrives
(``land``), its payload codecs (``codecs``) and tags (``auth``).

Stores are a trust boundary: every record read back is validated field by field before any of
its bytes are used, and nothing in it is ever unpickled.
"""

from kvstore.record.auth import RecordAuth
from kvstore.record.decode import decode_record, verify_record
from kvstore.record.encode import encode_record, encode_record_pieces
from kvstore.record.format import DTYPES, FRAME_BYTES, MAGIC, Record, RecordHeader, kv_nbytes
from kvstore.record.land import Landing, land_record, verify_landed
from kvstore.record.parse import CheckedRecord, check_record, header_extent, read_header

__all__ = ["CheckedRecord", "DTYPES", "FRAME_BYTES", "Landing", "MAGIC", "Record", "RecordAuth", "RecordHeader", "check_record", "decode_record", "encode_record",
           "encode_record_pieces", "header_extent", "kv_nbytes", "land_record", "read_header", "verify_landed", "verify_record"]
