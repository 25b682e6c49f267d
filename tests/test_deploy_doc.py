"""docs/deploy.md works as written where it can be checked here: its vLLM config file parses
into the connector's options, its store URLs parse, and every ``kvstore`` command it shows exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvstore.cli import build_parser
from kvstore.connectors.vllm.options import parse_options

DOC = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()


def test_the_vllm_config_file_gives_valid_connector_options():
    block = re.search(r"cat > /etc/kvstore/vllm.yaml <<'EOF'\n(.*?)\nEOF", DOC, re.S)
    assert block, "deploy.md lost its vLLM config file"
    cfg = yaml.safe_load(block.group(1))
    ktc = cfg["kv-transfer-config"]
    assert ktc["kv_connector"] == "KVStoreConnector" and "kv_connector_module_path" not in ktc
    options = parse_options(ktc["kv_connector_extra_config"])
    assert [u.split(":", 1)[0] for u in options.store] == ["memory", "rediss+cluster", "s3"]
    assert options.auth_key_file == "/etc/kvstore/record.key"


def test_every_kvstore_command_it_shows_exists():
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    shown = set(re.findall(r"^kvstore ([a-z-]+)", DOC, re.M))
    assert shown and shown <= set(sub.choices), shown - set(sub.choices)


def test_install_lines_name_the_distribution_and_no_placeholders():
    assert "pip install '.[redis,s3,auth]'" in DOC and "kvstore_llm-" in DOC
    assert not re.search(r"<[a-z][^>]*>", DOC.replace("<<'EOF'", "")), "a placeholder in deploy.md"
