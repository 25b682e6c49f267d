"""The Mooncake Store tier (``store``): a distributed DRAM pool read and written with zero-copy
batch calls. Its URL options (``config``), the client as the store uses it (``client``) and the
memory registered with the transfer engine (``memory``).

``MooncakeStore`` is imported when first asked for: the options, and the configuration reference
generated from them, need no Mooncake wheel (there is none for some platforms)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.stores.mooncake.config import MooncakeConfig

if TYPE_CHECKING:
    from kvstore.stores.mooncake.store import MooncakeStore

__all__ = ["MooncakeConfig", "MooncakeStore"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeStore":
        from kvstore.stores.mooncake.store import MooncakeStore

        return MooncakeStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
