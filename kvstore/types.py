"""Types shared by every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union, cast

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer as _BufferProtocol

#: Bytes a caller hands to kvstore: anything with the buffer protocol that ``memoryview`` takes.
Buffer = Union[bytes, bytearray, memoryview]


def array_view(arr: npt.NDArray[Any]) -> memoryview:
    """``memoryview(arr)``: a view of a numpy array's buffer, no copy.

    numpy arrays have the buffer protocol, but numpy's stubs declare ``__buffer__`` only for
    Python 3.12 and later, so type checkers targeting 3.11 reject ``memoryview(arr)``.
    """
    return memoryview(cast("_BufferProtocol", arr))
