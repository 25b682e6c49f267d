"""The library's error family.

Each error also inherits the builtin that fits, so callers that know nothing of kvstore can
still catch what they expect (``except ValueError``, ``except ConnectionError``).

* ``ConfigError``: a bad URL, option or value; raised at start-up, naming the value and what
  would be accepted.
* ``CorruptRecordError``: a stored record that is truncated, damaged, foreign (another
  namespace, format or token sequence) or otherwise unusable. Readers treat it as a miss.
* ``StoreUnavailableError``: a backend that cannot be reached or did not answer in time.
  The tiered store turns it into a miss; it never reaches the inference path.
  ``StoreTimeoutError``, its subclass, says a deadline expired (a frozen or overloaded server):
  the tiered store then skips the tier at once instead of after several failures.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """Invalid configuration: a URL, query parameter or option value."""


class CorruptRecordError(KVStoreError, ValueError):
    """A stored record failed validation and must be treated as a miss.

    ``reason`` is a short machine-readable tag (``truncated``, ``checksum``, ``namespace``,
    ``tokens``, ...) used as a metric label.
    """

    def __init__(self, message: str, reason: str = "corrupt") -> None:
        super().__init__(message)
        self.reason = reason


class StoreUnavailableError(KVStoreError, ConnectionError):
    """A storage backend could not be reached or did not answer within its deadline."""


class StoreTimeoutError(StoreUnavailableError):
    """A backend did not answer within its deadline (a frozen, overloaded or unreachable server)."""
