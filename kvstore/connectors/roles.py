"""What an engine adapter does with the cache: load (consumer), save (producer) or both.

One vocabulary for every adapter: ``producer``/``consumer``/``both`` and vLLM's
``kv_producer``/``kv_consumer``/``kv_both`` name the same three roles.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["Role", "parse_role", "ROLE_NAMES", "KV_ROLE_NAMES"]


@dataclass(frozen=True)
class Role:
    """A role: its canonical name and whether it loads and saves."""

    name: str
    loads: bool
    saves: bool


_ROLES = {
    "both": Role("both", True, True),
    "producer": Role("producer", False, True),
    "consumer": Role("consumer", True, False),
}
#: vLLM's spellings (``kv_transfer_config.kv_role``): what V0 calls a KV-transfer instance's role.
KV_ROLE_NAMES = tuple(f"kv_{n}" for n in _ROLES)
#: Every accepted spelling (vLLM's ``kv_`` names included).
ROLE_NAMES = tuple(_ROLES) + KV_ROLE_NAMES


def parse_role(name: str) -> Role:
    """The role called ``name`` (``kv_`` prefix optional); ``ConfigError`` naming the accepted ones."""
    role = _ROLES.get(str(name).removeprefix("kv_"))
    if role is None:
        raise ConfigError(f"role {name!r} is not accepted; use one of: {', '.join(ROLE_NAMES)}")
    return role
