"""docker/kvstore_metrics_hook.py: the dev image's hook fires in a process that loads the connector.

The hook runs at the start of every Python process in the image, so it cannot import kvstore to
learn the module it waits for: it names it. These tests fail when that name drifts from the
product (a module renamed, or the connector no longer importing it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK_DIR = ROOT / "docker"


def load_hook():
    spec = importlib.util.spec_from_file_location("kvstore_metrics_hook_under_test", HOOK_DIR / "kvstore_metrics_hook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_METRICS")}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), str(ROOT), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300,
                          check=False)


def test_the_trigger_is_a_module_of_the_product():
    trigger = load_hook().TRIGGER
    assert trigger.startswith("kvstore.connectors.vllm.")
    assert importlib.util.find_spec(trigger) is not None, f"{trigger} is not a module any more: update the hook"


def test_importing_the_trigger_starts_the_endpoint_once():
    trigger = load_hook().TRIGGER
    out = run(f"import kvstore_metrics_hook, importlib; importlib.import_module({trigger!r}); "
              f"importlib.import_module({trigger!r})", KVSTORE_METRICS_PORT="0")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("kvstore: metrics at") == 1, out.stderr


def test_without_the_port_nothing_is_hooked():
    out = run("import sys, kvstore_metrics_hook; print(sum(type(f).__name__ == '_Hook' for f in sys.meta_path))")
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_module_vllm_loads_for_the_connector_imports_the_trigger():
    """vLLM imports ``CONNECTOR_MODULE`` in its scheduler and worker processes; the hook must fire there."""
    from kvstore.connectors.vllm.plugin import CONNECTOR_MODULE

    trigger = load_hook().TRIGGER
    out = run(f"import importlib, sys; importlib.import_module({CONNECTOR_MODULE!r}); print({trigger!r} in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True", f"{CONNECTOR_MODULE} no longer imports {trigger}"
