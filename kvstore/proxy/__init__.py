"""``kvstore proxy``: an OpenAI-compatible front for disaggregated prefill (``docs/disagg.md``).

``pools`` chooses servers (round robin or least outstanding requests, health-checked);
``app`` is the HTTP front (aiohttp: the ``proxy`` extra) that hands a request to a
prefill server, then to a decode server with the prefill's ``kv_transfer_params``. Neither
imports vLLM: the proxy runs anywhere.
"""

from __future__ import annotations

from kvstore.proxy.pools import Backend, Pool, ProxyConfig

__all__ = ["Backend", "Pool", "ProxyConfig"]
