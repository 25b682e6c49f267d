"""The docs cannot drift from the code.

* ``docs/configuration.md`` is generated (``python -m kvstore.docs``) and must equal what the code
  generates now: every URL parameter of every store scheme, every connector option.
* ``docs/operations.md`` explains every metric kvstore registers, and the commands it documents exist.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvstore import docs

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_matches_the_code():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == docs.render(), "docs/configuration.md is out of date: run `python -m kvstore.docs`"
    assert docs.main(["--check"]) == 0


def test_vllm_guide_options_table_matches_the_code():
    committed = (ROOT / "docs" / "vllm.md").read_text()
    assert committed == docs.render_vllm_doc(committed), "docs/vllm.md is out of date: run `python -m kvstore.docs`"


def test_check_mode_detects_drift(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(docs.render().replace("max_bytes", "max_byte", 1))
    guide = tmp_path / "vllm.md"
    guide.write_text((ROOT / "docs" / "vllm.md").read_text())
    args = ["--output", str(stale), "--vllm-doc", str(guide)]
    assert docs.main(["--check", *args]) == 1
    assert "out of date" in capsys.readouterr().err
    assert docs.main(args) == 0 and stale.read_text() == docs.render()


def test_every_store_parameter_and_connector_option_is_documented():
    from kvstore.connectors.agent import AgentConfig
    from kvstore.connectors.vllm.options import VLLMConnectorOptions
    from kvstore.stores import known_schemes
    from kvstore.stores.registry import BACKENDS
    from kvstore.stores.tiered import TieredConfig

    text = docs.render()
    classes = {(docs._load(b.config), b.url_fields) for b in BACKENDS}
    classes |= {(TieredConfig, ()), (VLLMConnectorOptions, ()), (AgentConfig, ())}
    for cls, url_fields in classes:
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal") or f.name in url_fields:
                continue
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} is not documented"
    for scheme in known_schemes():
        assert f"`{scheme}://`" in text


def test_an_option_without_help_fails_the_generator():
    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        thing: int = 0

    with pytest.raises(RuntimeError, match="thing has no help"):
        docs.options_table(Undocumented)


def test_operations_guide_explains_every_metric():
    from kvstore.metrics import REGISTRY

    guide = (ROOT / "docs" / "operations.md").read_text()
    missing = [name for name in REGISTRY._metrics if f"`{name}`" not in guide]
    assert not missing, f"docs/operations.md does not explain: {missing}"


def test_documented_commands_exist():
    from kvstore.cli import build_parser

    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for name in ("operations.md", "architecture.md"):
        text = (ROOT / "docs" / name).read_text()
        code = "\n".join(re.findall(r"```.*?```", text, re.S) + re.findall(r"`[^`\n]+`", text))
        for cmd in set(re.findall(r"(?<![\w/.-])kvstore ([a-z][a-z-]*)", code)):
            assert cmd in commands, f"docs/{name} mentions `kvstore {cmd}`, which does not exist"


def test_every_environment_variable_kvstore_reads_is_documented():
    """Every ``KVSTORE_*`` name in the library is in configuration.md's table (dev-stack's
    compose-file variables, such as ``KVSTORE_BUCKET``, are the compose file's own)."""
    names = set()
    for path in (ROOT / "kvstore").rglob("*.py"):
        if path.name not in ("devstack.py", "compose.py"):
            names |= set(re.findall(r"[\"'](KVSTORE_[A-Z0-9_]+)[\"']", path.read_text()))
    documented = {name for name, _, _ in docs.ENVIRONMENT}
    assert names and names <= documented, sorted(names - documented)
    assert "| `KVSTORE_METRICS_LOOKUP` |" in (ROOT / "docs" / "configuration.md").read_text()


def _extras() -> dict[str, list[str]]:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return {name: [line.strip() for line in value.splitlines() if line.strip()]
            for name, value in cfg["options.extras_require"].items()}


def test_the_readme_names_every_extra_and_only_those():
    readme = (ROOT / "README.md").read_text()
    paragraph = re.search(r"Extras: (.*?`all`)\.", readme, re.S)
    assert paragraph, "README.md lists the extras as `Extras: ... `all`.`"
    named = re.findall(r"(?:^|,\s+)`([a-z0-9_-]+)`", paragraph.group(1))
    assert sorted(named) == sorted(_extras())


def test_every_feature_extra_installs_only_what_kvstore_imports():
    """An extra nothing imports (``metrics`` named prometheus-client, which only vLLM uses) is a
    promise kvstore does not keep."""
    from importlib.metadata import packages_distributions

    from packaging.requirements import Requirement

    modules_of: dict[str, set[str]] = {}
    for module, dists in packages_distributions().items():
        for dist in dists:
            modules_of.setdefault(dist.lower().replace("_", "-"), set()).add(module)
    source = "\n".join(p.read_text() for p in (ROOT / "kvstore").rglob("*.py"))
    for extra, requirements in _extras().items():
        if extra in ("test", "bench", "all"):
            continue
        for line in requirements:
            dist = Requirement(line).name.lower().replace("_", "-")
            modules = modules_of.get(dist)
            if not modules:
                pytest.skip(f"{dist} (extra {extra}) is not installed here")
            assert any(re.search(rf"^\s*(?:import|from) {re.escape(m)}\b", source, re.M) for m in modules), (
                f"the {extra!r} extra installs {dist}, which no kvstore module imports")


def test_the_readme_says_what_gc_removes_as_the_code_does():
    """gc removes old-format, undecodable and misplaced records (expired ones with --older-than)
    and never touches keys that are not kvstore's (``kvstore.cli.clean``, docs/operations.md)."""
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "`gc [--older-than" in line)
    for reason in ("old-format", "undecodable", "misplaced", "expired", "never keys that are not kvstore's"):
        assert reason in row, reason
    assert "foreign" not in row
