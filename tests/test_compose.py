"""The dev stack's files agree with the code (Docker does not run here, so the files are checked).

docker-compose.yml is parsed with pyyaml and interpolated with the values of .env.example the way
Compose does (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``). Then: the connector's
``kv_connector_extra_config`` validates with the connector's own option parser; every store URL
opens (``open_store``: full URL validation, no network I/O) and points at the service that
serves it, with the credentials that service is given; ports are loopback-only; healthchecks and
start order are in place; Prometheus scrapes the port kvstore's metrics endpoint uses.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def read_env_example() -> tuple[dict[str, str], set[str]]:
    """Values of .env.example and every variable it documents (commented ``# NAME=...`` too)."""
    values: dict[str, str] = {}
    documented: set[str] = set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(r"^\s*(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            documented.add(m.group(2))
            if not m.group(1):
                values[m.group(2)] = m.group(3).strip()
    return values, documented


def interpolate(value: Any, env: dict[str, str], used: set[str]) -> Any:
    """Compose-style variable substitution over a parsed YAML tree."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, used) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, used) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        used.add(name)
        op, arg = m.group(2), m.group(3)
        current = env.get(name)
        if op in (":-", "-"):
            return current if (current if op == ":-" else current is not None) else arg
        if op in (":?", "?"):
            if not current:
                raise AssertionError(f"{name} is required ({arg}) but .env.example does not set it")
            return current
        return current or ""

    return _VAR.sub(sub, value)


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE.read_text())
    env, documented = read_env_example()
    used: set[str] = set()
    doc = interpolate(raw, env, used)
    doc["_used_vars"] = used
    doc["_documented"] = documented
    doc["_env"] = env
    doc["_raw"] = raw
    return doc


def _services(stack) -> dict[str, dict]:
    return stack["services"]


def kv_transfer_config(stack) -> dict[str, Any]:
    command = _services(stack)["vllm"]["command"]
    i = command.index("--kv-transfer-config")
    return json.loads(command[i + 1])


def _arg(command: list[str], name: str) -> str:
    for i, item in enumerate(command):
        if item == name:
            return command[i + 1]
        if item.startswith(name + "="):
            return item.split("=", 1)[1]
    raise AssertionError(f"{name} not in {command}")


# -- structure ----------------------------------------------------------------------------------------------
def test_services_and_variables(stack):
    assert set(_services(stack)) == {"redis", "minio", "minio-init", "vllm", "prometheus"}
    undocumented = stack["_used_vars"] - stack["_documented"]
    assert not undocumented, f"variables used by docker-compose.yml but not in .env.example: {sorted(undocumented)}"


def test_every_port_is_bound_to_loopback(stack):
    for name, svc in _services(stack).items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_healthchecks_and_start_order(stack):
    services = _services(stack)
    for name, svc in services.items():
        if name == "minio-init":
            continue
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
    init = services["minio-init"]
    assert init["restart"] == "no" and init["depends_on"]["minio"]["condition"] == "service_healthy"
    deps = services["vllm"]["depends_on"]
    assert deps["redis"]["condition"] == "service_healthy"
    assert deps["minio-init"]["condition"] == "service_completed_successfully"
    # The engine's healthcheck asks the port the server listens on.
    port = _arg(services["vllm"]["command"], "--port")
    assert f"127.0.0.1:{port}/health" in " ".join(services["vllm"]["healthcheck"]["test"])
    assert any(p.endswith(f":{port}") for p in services["vllm"]["ports"])


def test_credentials_come_from_env(stack):
    raw = stack["_raw"]["services"]
    for name, svc in raw.items():
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"PASSWORD|SECRET|TOKEN|AUTH|ACCESS_KEY", key):
                assert isinstance(value, str) and value.startswith("${"), f"{name}.{key} is a literal secret"
    redis_cmd = raw["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD")
    raw_cfg = raw["vllm"]["command"][raw["vllm"]["command"].index("--kv-transfer-config") + 1]
    assert "redis://:${REDIS_PASSWORD}@" in raw_cfg


def test_redis_is_a_bounded_lru_cache(stack):
    cmd = _services(stack)["redis"]["command"]
    assert cmd[0] == "redis-server"
    assert _arg(cmd, "--maxmemory-policy") == "allkeys-lru"
    from kvstore.config import parse_size

    assert parse_size(_arg(cmd, "--maxmemory").replace("gb", "GiB").replace("mb", "MiB")) > 0


# -- the connector ------------------------------------------------------------------------------------------
def test_connector_configuration_validates(stack):
    from kvstore.connectors.roles import ROLE_NAMES
    from kvstore.connectors.vllm.options import parse_options
    from kvstore.keys import check_chunk_tokens

    ktc = kv_transfer_config(stack)
    assert ktc["kv_connector"] == "KVStoreConnector"
    spec = importlib.util.find_spec(ktc["kv_connector_module_path"])
    assert spec is not None and spec.origin
    assert "import KVStoreConnector" in Path(spec.origin).read_text()
    assert ktc["kv_role"] in ROLE_NAMES
    opts = parse_options(ktc["kv_connector_extra_config"])
    for block_size in (16, 32, 64, 128):  # vLLM's GPU default (16) up to its CPU default (128)
        check_chunk_tokens(opts.chunk_tokens, block_size)


def test_store_urls_open_and_point_at_their_services(stack):
    from kvstore.connectors.vllm.options import parse_options
    from kvstore.stores import open_store

    services = _services(stack)
    env = stack["_env"]
    urls = parse_options(kv_transfer_config(stack)["kv_connector_extra_config"]).store
    schemes = [urlsplit(u).scheme for u in urls]
    assert schemes == ["memory", "redis", "s3"]
    for url in urls:
        open_store(url).close()  # full validation of every parameter; builds clients, connects to nothing
    redis = urlsplit(urls[1])
    assert (redis.hostname, redis.port or 6379) == ("redis", 6379)
    assert redis.password == env["REDIS_PASSWORD"] == _arg(services["redis"]["command"], "--requirepass")
    s3 = urlsplit(urls[2])
    endpoint = urlsplit(parse_qs(s3.query)["endpoint_url"][0])
    assert endpoint.hostname == "minio"
    assert _arg(services["minio"]["command"], "--address") == f":{endpoint.port}"
    assert s3.hostname == services["minio-init"]["environment"]["KVSTORE_BUCKET"] == env["KVSTORE_BUCKET"]
    assert "mc mb" in services["minio-init"]["command"][0] and "mc ilm rule add" in services["minio-init"]["command"][0]
    vllm_env = services["vllm"]["environment"]
    minio_env = services["minio"]["environment"]
    assert vllm_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"] == env["MINIO_ROOT_USER"]
    assert vllm_env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]


# -- metrics ------------------------------------------------------------------------------------------------
def test_prometheus_scrapes_the_metrics_endpoint(stack):
    from kvstore.metrics.server import DEFAULT_PORT, DEFAULT_PORT_RANGE, ENV_HOST, ENV_PORT

    services = _services(stack)
    vllm_env = services["vllm"]["environment"]
    port = int(vllm_env[ENV_PORT])
    assert port == DEFAULT_PORT and vllm_env[ENV_HOST] == "0.0.0.0"  # reachable from the prometheus container
    mount = next(v for v in services["prometheus"]["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((ROOT / mount.split(":")[0]).read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = [t for sc in jobs["kvstore"]["static_configs"] for t in sc["targets"]]
    assert targets and all(t.split(":")[0] == "vllm" for t in targets)
    ports = sorted(int(t.split(":")[1]) for t in targets)
    assert ports[0] == DEFAULT_PORT and ports[-1] < DEFAULT_PORT + DEFAULT_PORT_RANGE
    published: set[int] = set()
    for p in services["vllm"]["ports"]:
        lo, _, hi = p.rsplit(":", 1)[1].partition("-")
        published.update(range(int(lo), int(hi or lo) + 1))
    assert set(ports) <= published
    vllm_port = _arg(services["vllm"]["command"], "--port")
    assert [f"vllm:{vllm_port}"] == [t for sc in jobs["vllm"]["static_configs"] for t in sc["targets"]]


# -- images ------------------------------------------------------------------------------------------------
def test_dockerfile_targets_and_versions(stack):
    vllm = _services(stack)["vllm"]
    dockerfile = ROOT / vllm["build"]["dockerfile"]
    text = dockerfile.read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M)
    assert {"cpu", "gpu"} <= set(stages) and vllm["build"]["target"] == "cpu"
    version = re.search(r"^ARG VLLM_VERSION=(\S+)", text, re.M).group(1)
    connector = (ROOT / "kvstore" / "connectors" / "vllm" / "facts.py").read_text()  # importing it would import vLLM
    assert 'SUPPORTED_VLLM = (">=0.32", "<0.33")' in connector
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    assert "vllm>=0.32,<0.33" in extras["vllm"].replace(" ", "")
    major, minor, *_ = (int(x) for x in version.split("."))
    assert (major, minor) == (0, 32)
    for extra in re.findall(r"\[([a-z0-9_,]+)\]\"", text):
        assert set(extra.split(",")) <= set(extras), extra
    for src in re.findall(r"^COPY (?!--from)(.+) /src", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"Dockerfile copies {path}, which is not in the repository"
    from kvstore.metrics.server import DEFAULT_PORT

    assert re.search(rf"KVSTORE_METRICS_PORT={DEFAULT_PORT}\b", text)
    assert (ROOT / "docker" / "Dockerfile.dockerignore").exists()


def test_gpu_override(stack):
    override = yaml.safe_load((ROOT / "docker" / "compose.gpu.yml").read_text())
    vllm = override["services"]["vllm"]
    assert set(override["services"]) == {"vllm"}
    assert vllm["build"]["target"] == "gpu" and vllm["build"]["dockerfile"] == _services(stack)["vllm"]["build"]["dockerfile"]
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_metrics_hook_serves_from_connector_processes_only(tmp_path):
    """docker/kvstore_metrics_hook.py (loaded by a .pth file in the image): a process that imports
    the connector serves /metrics on KVSTORE_METRICS_PORT; one that does not opens nothing."""
    import os
    import subprocess
    import sys

    from kvstore.metrics.server import start_metrics_server

    probe = start_metrics_server(0)  # find a free port, then free it for the child
    port = probe.port
    probe.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "docker"), str(ROOT)]),
           "KVSTORE_METRICS_PORT": str(port), "KVSTORE_METRICS_PORT_RANGE": "1"}
    script = f"""
import socket, sys, urllib.request
import kvstore_metrics_hook  # what the .pth line does at start-up
import kvstore.metrics
def serving():
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % {port}, timeout=2) as r:
            return b"kvstore_info" in r.read()
    except OSError:
        return False
before = serving()
import kvstore.connectors.vllm.options
print(before, serving())
"""
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
    assert f"metrics at http://127.0.0.1:{port}/metrics" in out.stderr
