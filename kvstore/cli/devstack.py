"""``kvstore dev-stack``: the compose file's dev stack, run natively (no Docker).

It reads ``docker-compose.yml`` (``kvstore.cli.compose``: the file's own values and the env file)
and starts, on 127.0.0.1 and the host ports the file publishes:

* ``redis``: the service's ``command`` as it is (``redis-server --requirepass ... --maxmemory ...
  --maxmemory-policy allkeys-lru ...``; ``valkey-server`` when only Valkey is installed), plus
  ``--port``/``--bind``/``--dir``; healthy when it answers ``PING`` with the file's password.
* ``minio``: ``rclone serve s3`` in MinIO's place, with MinIO's root user and password as the
  access key, on the port of its ``--address``, serving the bucket ``minio-init`` creates. The
  bucket's expiry rule is not applied (rclone has no lifecycle rules).
* ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` (the image's entry point) with the
  service's ``command``: ``--kv-transfer-config`` as written, its store URLs pointed from the
  service names (``redis:6379``, ``minio:9000``) to the published host ports; the service's
  ``environment`` (S3 credentials, ``KVSTORE_METRICS_*``, ``VLLM_CPU_KVCACHE_SPACE``) with its
  addresses and ports mapped the same way; and the image's metrics hook
  (``docker/kvstore_metrics_hook.py``, loaded by a ``sitecustomize`` here instead of a ``.pth``):
  every vLLM process that loads the connector serves kvstore's ``/metrics``.
  ``--model`` replaces the file's model (no network: a local directory) and ``--vllm-arg`` adds
  flags; healthy when ``/health`` answers.
* ``prometheus``, ``grafana``: not run (no binaries here); the endpoints Prometheus would scrape
  (``docker/prometheus.yml``'s targets, mapped to host ports) are printed instead.

When every service is healthy it prints ``dev-stack: READY <json>`` (the OpenAI base URL, the
scrape targets, the Redis and S3 URLs with secrets redacted) and runs until interrupted
(Ctrl-C, SIGTERM), then stops everything it started (whole process groups) and exits 0. A
service that fails to start stops the rest and ends with one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.cli.compose import Compose, arg_value, load_compose, published_port
from kvstore.config import redact_url
from kvstore.errors import ConfigError, KVStoreError

__all__ = ["register", "cmd_dev_stack", "plan_stack", "Planned", "VLLM_ENTRY", "SERVICES"]

#: The image's entry point (docker/Dockerfile's ENTRYPOINT): the `vllm` command is broken in vllm-cpu.
VLLM_ENTRY = ("-m", "vllm.entrypoints.openai.api_server")
LOOPBACK = "127.0.0.1"
#: The services it runs (``--only`` picks among them), in start order.
SERVICES = ("redis", "minio", "vllm")


@dataclass
class Planned:
    """One service to run: its command, environment, and how to tell it is up."""

    name: str
    argv: list[str]
    env: dict[str, str]
    healthy: Callable[[], bool]
    endpoint: str
    timeout: float = 30.0
    notes: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None


def _binary(name: str, *fallbacks: str) -> str:
    for candidate in (name, *fallbacks):
        found = shutil.which(candidate) or (str(Path(sys.executable).parent / candidate)
                                            if (Path(sys.executable).parent / candidate).exists() else None)
        if found:
            return found
    raise ConfigError(f"{name} is not installed (needed to run the dev stack natively)")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.3):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status) == 200
    except OSError:
        return False


def _service_hosts(compose: Compose) -> dict[tuple[str, int], int]:
    """(service name, container port) -> host port, for every port a service publishes."""
    out: dict[tuple[str, int], int] = {}
    for name, svc in compose.services.items():
        for item in svc.get("ports", []):
            inner = str(item).split(":")[-1].split("/")[0]
            lo, _, hi = inner.partition("-")
            for port in range(int(lo), int(hi or lo) + 1):
                out[(name, port)] = published_port(svc, port)
    return out


def _map_addresses(text: str, hosts: dict[tuple[str, int], int]) -> str:
    """``redis:6379`` / ``//minio:9000`` / ``@redis:6379`` -> ``127.0.0.1:<host port>``."""
    for (name, port), host_port in hosts.items():
        text = re.sub(rf"(?<=[/@]){re.escape(name)}:{port}\b", f"{LOOPBACK}:{host_port}", text)
    return text


def plan_stack(compose: Compose, state: Path, *, model: str | None = None, vllm_args: tuple[str, ...] = (),
               python: str = sys.executable, only: set[str] | None = None) -> list[Planned]:
    """What ``kvstore dev-stack`` runs for ``compose`` (see the module docstring), in start order."""
    services = compose.services
    for required in ("redis", "minio", "minio-init", "vllm"):
        if required not in services:
            raise ConfigError(f"{compose.path} has no {required!r} service")
    hosts = _service_hosts(compose)
    plans: list[Planned] = []
    unknown = sorted(set(only or ()) - set(SERVICES))
    if unknown:
        raise ConfigError(f"--only: no service {', '.join(map(repr, unknown))}; accepted: {', '.join(SERVICES)}")
    wanted = only or set(SERVICES)

    redis = services["redis"]
    cmd = [str(c) for c in redis["command"]]
    password = arg_value(cmd, "--requirepass")
    redis_port = published_port(redis, 6379)
    if "redis" in wanted:
        (state / "redis").mkdir(parents=True, exist_ok=True)
        argv = [_binary(cmd[0], "valkey-server"), *cmd[1:], "--port", str(redis_port), "--bind", LOOPBACK,
                "--dir", str(state / "redis"), "--daemonize", "no"]

        def redis_up() -> bool:
            from kvstore.stores.redis.raw import RawRedis

            try:
                with RawRedis(LOOPBACK, redis_port, password=password, timeout=1) as r:
                    return r.ping()
            except Exception:  # noqa: BLE001 - not up yet (refused, loading, auth not ready)
                return False

        auth = f":{password}@" if password else ""
        plans.append(Planned("redis", argv, {}, redis_up, redact_url(f"redis://{auth}{LOOPBACK}:{redis_port}/0")))

    minio, init = services["minio"], services["minio-init"]
    address = arg_value([str(c) for c in minio["command"]], "--address") or ":9000"
    s3_port = published_port(minio, int(address.rsplit(":", 1)[1]))
    bucket = str((init.get("environment") or {}).get("KVSTORE_BUCKET", "kvstore"))
    if "minio" in wanted:
        menv = minio.get("environment") or {}
        user, secret = str(menv.get("MINIO_ROOT_USER", "")), str(menv.get("MINIO_ROOT_PASSWORD", ""))
        if not user or not secret:
            raise ConfigError("the minio service needs MINIO_ROOT_USER and MINIO_ROOT_PASSWORD")
        data = state / "s3"
        (data / bucket).mkdir(parents=True, exist_ok=True)  # what minio-init's `mc mb` does
        argv = [_binary("rclone"), "serve", "s3", "--addr", f"{LOOPBACK}:{s3_port}", "--auth-key", f"{user},{secret}",
                "--vfs-cache-mode", "off", "--no-modtime", str(data)]
        days = (init.get("environment") or {}).get("KVSTORE_S3_EXPIRE_DAYS")
        plans.append(Planned("minio", argv, {"RCLONE_CONFIG": str(state / "rclone.conf")},
                             lambda: _port_open(s3_port), f"http://{LOOPBACK}:{s3_port} (bucket {bucket})",
                             notes=[f"rclone serve s3 in MinIO's place; bucket {bucket!r} created, its expiry rule "
                                    f"({days} days) not applied (rclone has no lifecycle rules)"]))

    vllm = services["vllm"]
    if "vllm" in wanted:
        plans.append(_plan_vllm(compose, vllm, hosts, state, model, vllm_args, python))
    return plans


def _plan_vllm(compose: Compose, vllm: dict[str, Any], hosts: dict[tuple[str, int], int], state: Path,
               model: str | None, vllm_args: tuple[str, ...], python: str) -> Planned:
    cmd = [str(c) for c in vllm["command"]]
    container_port = int(arg_value(cmd, "--port") or 8000)
    port = published_port(vllm, container_port)
    out: list[str] = []
    skip = False
    for i, item in enumerate(cmd):
        if skip:
            skip = False
            continue
        if model is not None and (item == "--model" or item.startswith("--model=")):
            out.append(f"--model={model}")
            skip = item == "--model"
        elif item.startswith("--host") or item.startswith("--port"):
            skip = "=" not in item
        elif i > 0 and cmd[i - 1] == "--kv-transfer-config":
            out.append(_map_addresses(item, hosts))
        else:
            out.append(item)
    out += ["--host", LOOPBACK, "--port", str(port), *vllm_args]
    if "--kv-transfer-config" in out:
        json.loads(out[out.index("--kv-transfer-config") + 1])  # what the file holds must be JSON
    env = {str(k): _map_addresses(str(v), hosts) for k, v in (vllm.get("environment") or {}).items()}
    for key in ("KVSTORE_METRICS_HOST",):
        if env.get(key) == "0.0.0.0":
            env[key] = LOOPBACK
    if "KVSTORE_METRICS_PORT" in env:
        env["KVSTORE_METRICS_PORT"] = str(hosts.get(("vllm", int(env["KVSTORE_METRICS_PORT"])),
                                                    int(env["KVSTORE_METRICS_PORT"])))
    hook = compose.path.parent / "docker" / "kvstore_metrics_hook.py"
    site = state / "site"
    site.mkdir(parents=True, exist_ok=True)
    if hook.is_file():
        shutil.copy(hook, site / "kvstore_metrics_hook.py")
        (site / "sitecustomize.py").write_text("import kvstore_metrics_hook  # written by kvstore dev-stack\n")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    base = f"http://{LOOPBACK}:{port}"
    return Planned("vllm", [python, *VLLM_ENTRY, *out], env, lambda: _http_ok(base + "/health"), base + "/v1",
                   timeout=600.0)


def scrape_targets(compose: Compose) -> dict[str, list[str]]:
    """Prometheus's scrape targets (its mounted config), mapped to host URLs; job -> URLs."""
    import yaml

    prom = compose.services.get("prometheus") or {}
    path = next((str(v).split(":")[0] for v in prom.get("volumes", []) if str(v).split(":")[1].endswith(".yml")),
                None)
    if path is None:
        return {}
    config = yaml.safe_load((compose.path.parent / path).read_text())
    hosts = _service_hosts(compose)
    out: dict[str, list[str]] = {}
    for job in config.get("scrape_configs", []):
        urls = []
        for sc in job.get("static_configs", []):
            for target in sc.get("targets", []):
                name, _, port = str(target).partition(":")
                if (name, int(port or 80)) in hosts:
                    urls.append(f"http://{LOOPBACK}:{hosts[(name, int(port or 80))]}{job.get('metrics_path', '/metrics')}")
        if urls:
            out[str(job["job_name"])] = urls
    return out


def _die_with_parent() -> None:
    # A stack started in the background of a script inherits SIGINT ignored; the services must
    # still stop on the SIGINT that _stop sends (vLLM shuts its engine down on it).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _start(p: Planned, logs: Path) -> None:
    p.log = logs / f"{p.name}.log"
    with open(p.log, "ab") as log:
        p.proc = subprocess.Popen(p.argv, env={**os.environ, **p.env}, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)


def _stop(p: Planned) -> None:
    if p.proc is None or p.proc.poll() is not None:
        return
    first = signal.SIGINT if p.name == "vllm" else signal.SIGTERM  # vLLM shuts its engine down on SIGINT
    for sig, wait in ((first, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # whatever the group left behind (vLLM's engine process)
        os.killpg(p.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_healthy(p: Planned) -> None:
    deadline = time.monotonic() + p.timeout
    while time.monotonic() < deadline:
        if p.proc is not None and p.proc.poll() is not None:
            tail = p.log.read_text(errors="replace")[-1500:] if p.log else ""
            print(f"dev-stack: {p.name} log ({p.log}) ends with:\n{tail}", file=sys.stderr)
            raise KVStoreError(f"{p.name} exited with status {p.proc.returncode} before it was healthy")
        if p.healthy():
            return
        time.sleep(0.2)
    raise KVStoreError(f"{p.name} was not healthy within {p.timeout:g}s (log: {p.log})")


class _Stop(Exception):
    pass


def cmd_dev_stack(args: argparse.Namespace) -> int:
    compose_path = Path(args.compose_file)
    env_file = args.env_file
    if env_file is None and not (compose_path.parent / ".env").is_file() \
            and (compose_path.parent / ".env.example").is_file():
        env_file = compose_path.parent / ".env.example"
        print(f"dev-stack: no .env beside {compose_path}; using {env_file} (change its secrets for real use)")
    compose = load_compose(compose_path, env_file)
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="kvstore-dev-stack-"))
    state.mkdir(parents=True, exist_ok=True)
    only = {name.strip() for name in args.only.split(",")} if args.only is not None else None
    try:
        plans = plan_stack(compose, state, model=args.model, vllm_args=tuple(args.vllm_arg or ()), only=only)
    except BaseException:
        if not args.state_dir:
            shutil.rmtree(state, ignore_errors=True)
        raise
    if args.dry_run:
        for p in plans:
            print(f"{p.name}: {' '.join(_redact_argv(p.argv))}")
        if not args.state_dir:
            shutil.rmtree(state, ignore_errors=True)
        return 0

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop

    # Both handled here: a process started in the background of a script inherits SIGINT ignored,
    # and would never see Ctrl-C / SIGINT as KeyboardInterrupt.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    started: list[Planned] = []
    try:
        for p in plans:
            for note in p.notes:
                print(f"dev-stack: {p.name}: {note}")
            _start(p, state)
            started.append(p)
            print(f"dev-stack: {p.name}: started (pid {p.proc.pid if p.proc else '?'}, log {p.log})", flush=True)
            _wait_healthy(p)
            print(f"dev-stack: {p.name}: healthy at {p.endpoint}", flush=True)
        ready = {"services": {p.name: p.endpoint for p in started}, "scrape": scrape_targets(compose),
                 "not_run": sorted(set(compose.services) - {p.name for p in plans} - {"minio-init"}),
                 "state_dir": str(state)}
        print("dev-stack: READY " + json.dumps(ready), flush=True)
        while True:
            for p in started:
                if p.proc is not None and p.proc.poll() is not None:
                    raise KVStoreError(f"{p.name} exited with status {p.proc.returncode} (log: {p.log})")
            time.sleep(0.5)
    except (KeyboardInterrupt, _Stop):
        print("dev-stack: stopping", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in reversed(started):
            _stop(p)
        if not args.state_dir:
            shutil.rmtree(state, ignore_errors=True)


def _redact_argv(argv: list[str]) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if i > 0 and argv[i - 1] in ("--requirepass", "--auth-key"):
            out.append("***")
        else:
            out.append(re.sub(r"://[^@/\s\"]*:[^@/\s\"]*@", "://***@", a))
    return out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dev-stack", help="run docker-compose.yml's dev stack natively (no Docker)")
    p.add_argument("--compose-file", default="docker-compose.yml", metavar="PATH",
                   help="the compose file (default ./docker-compose.yml)")
    p.add_argument("--env-file", default=None, metavar="PATH",
                   help="variables for the file (default .env beside it, else .env.example)")
    p.add_argument("--model", default=None, metavar="NAME_OR_DIR", help="serve this model instead of the file's")
    p.add_argument("--vllm-arg", action="append", metavar="ARG", help="an extra flag for the vLLM server (repeat)")
    p.add_argument("--only", default=None, metavar="LIST",
                   help=f"run only these services, comma-separated (of {','.join(SERVICES)})")
    p.add_argument("--state-dir", default=None, metavar="DIR", help="data and logs here (default: a temporary "
                   "directory, removed at exit)")
    p.add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    p.set_defaults(func=cmd_dev_stack)
