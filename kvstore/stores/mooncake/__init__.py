"""The Mooncake Store tier (``store``): a distributed DRAM pool read and written with zero-copy
batch calls. Its URL options (``config``), the client as the store uses it (``client``) and the
memory registered with the transfer engine (``memory``)."""

from kvstore.stores.mooncake.config import MooncakeConfig
from kvstore.stores.mooncake.store import MooncakeStore

__all__ = ["MooncakeConfig", "MooncakeStore"]
