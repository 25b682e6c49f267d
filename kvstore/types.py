"""Types shared by every layer."""

from __future__ import annotations

from typing import Union

#: Bytes a caller hands to kvstore: anything with the buffer protocol that ``memoryview`` takes.
Buffer = Union[bytes, bytearray, memoryview]
