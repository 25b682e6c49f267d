"""Dev image only: serve kvstore's metrics from every process that loads the kvstore connector.

Installed with a ``kvstore-metrics.pth`` file (``import kvstore_metrics_hook``), so it runs at the
start of every Python process in the image. When ``KVSTORE_METRICS_PORT`` is set it waits, with a
one-shot import hook, until the process imports the connector's options module
(``kvstore.connectors.vllm.options``, imported by the connector in vLLM's scheduler and worker
processes), then calls ``kvstore.metrics.server.start_from_env()``: each such process serves
``/metrics`` on the next free port of ``KVSTORE_METRICS_PORT .. + KVSTORE_METRICS_PORT_RANGE``.
Processes that never load the connector (pip, the healthcheck) open nothing. A failure is one
line on stderr, never an error in the engine.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

#: The module whose import starts the endpoint. Named, not imported: this runs at the start of every
#: Python process (pip too), before anything may import kvstore. tests/test_metrics_hook.py fails
#: when this stops being a module of the product that vLLM's connector module imports.
TRIGGER = "kvstore.connectors.vllm.options"


class _StartAfterExec(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        self._inner.exec_module(module)
        try:
            from kvstore.metrics.server import start_from_env

            server = start_from_env()
            if server is not None:
                print(f"kvstore: metrics at {server.url} (pid {os.getpid()})", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - metrics must never stop the engine
            print(f"kvstore: metrics endpoint not started: {exc}", file=sys.stderr)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != TRIGGER:
            return None
        sys.meta_path.remove(self)  # once per process; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _StartAfterExec(spec.loader)
        return spec


if os.environ.get("KVSTORE_METRICS_PORT") and not any(isinstance(f, _Hook) for f in sys.meta_path):
    sys.meta_path.insert(0, _Hook())
