"""vLLM plugin: makes ``kv_connector: "KVStoreConnector"`` work without a module path.

vLLM loads the ``vllm.general_plugins`` entry points (setup.cfg: ``kvstore =
kvstore.connectors.vllm.plugin:register``) once in every process it starts (the API server,
EngineCore, each worker) and calls them outside any ``try``: ``register`` must be idempotent and
must never raise, or the engine does not start. It only adds a lazy entry to vLLM's connector
registry; the connector module (which imports vLLM's connector API) is imported when vLLM asks
for the class. ``kv_connector_module_path="kvstore.vllm"`` keeps working: vLLM prefers the
module path when one is given. vLLM loads no plugin in the process that builds a ``VllmConfig``
by itself: ``import kvstore.vllm`` calls ``register`` there.

Importing this module imports no vLLM.
"""

from __future__ import annotations

import logging

__all__ = ["CONNECTOR_NAME", "CONNECTOR_MODULE", "CONNECTOR_CLASS", "register"]

log = logging.getLogger("kvstore.vllm")

#: The name users write in ``kv_connector``, and where the class lives.
CONNECTOR_NAME = "KVStoreConnector"
CONNECTOR_MODULE = "kvstore.connectors.vllm.connector"
CONNECTOR_CLASS = "KVStoreConnector"


def register() -> None:
    """Register ``KVStoreConnector`` with vLLM's ``KVConnectorFactory`` (idempotent, never raises)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        # register_connector raises ValueError on a duplicate name; vLLM may load plugins again.
        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except Exception as exc:  # noqa: BLE001 - a plugin that raises stops vLLM from starting at all
        log.warning("kvstore: could not register %s with vLLM (%s: %s); use "
                    "kv_connector_module_path='kvstore.vllm' instead", CONNECTOR_NAME,
                    type(exc).__name__, exc)
