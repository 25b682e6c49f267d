"""The README's Python snippets run as written (a user copies them first)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index):
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {"__name__": "readme"})


def test_public_api_names_the_entry_points():
    import kvstore

    for name in ("open_store", "Namespace", "PrefixCache", "TieredStore", "WrapperStore", "KVTransfer",
                 "KVStoreAgent", "AgentConfig", "ConfigError", "CorruptRecordError", "StoreUnavailableError",
                 "KVStoreError", "encode_record", "decode_record"):
        assert name in kvstore.__all__ and getattr(kvstore, name) is not None, name


def test_import_kvstore_stays_light():
    import subprocess
    import sys

    code = "import sys, kvstore; print('torch' in sys.modules, 'vllm' in sys.modules, 'redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False"]
