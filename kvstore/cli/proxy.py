"""``kvstore proxy``: an OpenAI-compatible front for disaggregated prefill (``docs/disagg.md``).

Each request goes to a prefill server (``--prefill``, a vLLM server with ``KVStoreConnector`` as
``kv_producer``) with ``max_tokens=1``, then to a decode server (``--decode``, ``kv_consumer``) with
the prefill's ``kv_transfer_params``: the decode server loads the prompt's KV from the store
instead of computing it. Without a healthy prefill server the decode server prefills itself.
Needs aiohttp (the ``proxy`` extra), not vLLM.
"""

from __future__ import annotations

import argparse

from kvstore.cli.common import number
from kvstore.errors import ConfigError
from kvstore.extras import install_hint


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("proxy", help="OpenAI-compatible P/D proxy: prefill servers hand prompts to decode servers "
                                     "through the store")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill server's base URL (repeat for a pool), e.g. http://10.0.0.5:8100")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode server's base URL (repeat for a pool); at least one")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=number(int, 1, 65535), default=8000, help="port to listen on (default 8000)")
    p.add_argument("--policy", choices=("round_robin", "least_outstanding"), default="least_outstanding",
                   help="how a pool picks a server (default least_outstanding: fewest requests in flight)")
    p.add_argument("--health-interval", type=number(float, 0.05, 3600), default=2.0,
                   help="seconds between health checks (GET /health) of each server (default 2)")
    p.add_argument("--prefill-timeout", type=number(float, 0.05, 3600), default=300.0,
                   help="seconds a prefill may take before the decode server prefills instead (default 300)")
    p.add_argument("--report-prefill-cache-hits", action="store_true",
                   help="responses' cached_tokens count the prefill server's prefix-cache hits (vLLM's P/D "
                        "reporting) instead of the prompt tokens the decode server loaded from the store")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from kvstore.proxy.app import serve
    except ImportError as exc:
        raise ConfigError(f"kvstore proxy needs aiohttp ({exc}): {install_hint('proxy')}") from None
    from kvstore.proxy.pools import ProxyConfig

    config = ProxyConfig(prefill=tuple(args.prefill), decode=tuple(args.decode), policy=args.policy,
                         health_interval=args.health_interval, prefill_timeout=args.prefill_timeout,
                         report_prefill_cache_hits=args.report_prefill_cache_hits)
    serve(config, args.host, args.port)
    return 0
