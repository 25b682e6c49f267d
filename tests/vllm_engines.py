"""Real vLLM engines for tests, each in its own process: ``run_engine(spec)``.

An engine process runs ``tests/vllm_worker.py``'s ``main(spec)``. Importing vLLM costs more CPU
than most test engines then run (docs/testing.md), so by default the processes are forked from one
engine server (``vllm_worker.py --serve``) that has imported vLLM once per test session (its
docstring says why that is sound). ``KVSTORE_TEST_ENGINE_SERVER=0`` starts a fresh interpreter
per engine instead (slower; for telling a fork-related problem from others).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from servers import die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "vllm_worker.py"
SERVER_READY_S = 180.0  # the server's one import of vLLM, on a loaded machine


def engine_env(env: dict | None = None, *, multiprocess: bool = False) -> dict[str, str]:
    """The environment of an engine process: ours, ``env`` on top, this checkout importable, and
    vLLM's engine core in-process unless ``multiprocess``."""
    out = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if not multiprocess:
        out["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return out


class _Server:
    """The engine server of this test session, started on first use."""

    _lock = threading.Lock()
    _current: _Server | None = None

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvstore-engines-")
        self.path = os.path.join(self._dir, "socket")
        self._log = open(os.path.join(self._dir, "server.log"), "w+")
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "--serve", self.path], env=engine_env(),
                                     cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + SERVER_READY_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                self._log.seek(0)
                raise RuntimeError(f"the vLLM engine server did not start:\n{self._log.read()[-4000:]}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        self._log.seek(0)
        return "READY" in self._log.read()

    @classmethod
    def get(cls) -> _Server:
        with cls._lock:
            if cls._current is None or cls._current.proc.poll() is not None:
                cls._current = cls()
                atexit.register(cls._current.close)
            return cls._current

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class _EngineProcess:
    """One engine: its output lines, a way to answer it, its exit status."""

    def __init__(self, spec: dict, env: dict[str, str]) -> None:
        self.returncode: int | None = None
        if os.environ.get("KVSTORE_TEST_ENGINE_SERVER", "1") == "0":
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(spec)], env=env, cwd=str(ROOT), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.pid = self._proc.pid
            return
        self._proc = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(_Server.get().path)
        self._sock.sendall((json.dumps({"spec": spec, "env": env}) + "\n").encode())
        self._file = self._sock.makefile("r", encoding="utf-8", errors="replace")
        first = self._file.readline()
        if not first.startswith("PID "):
            raise RuntimeError(f"the vLLM engine server answered {first!r}")
        self.pid = int(first.split()[1])

    def lines(self, deadline: float):
        """Output lines until the engine ends (``returncode`` set); TimeoutError past ``deadline``."""
        if self._proc is not None:
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                yield line
                if time.monotonic() > deadline:
                    raise TimeoutError
            self.returncode = self._proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            return
        while True:
            self._sock.settimeout(max(0.1, deadline - time.monotonic()))  # past it: TimeoutError
            line = self._file.readline()
            if not line:
                self.returncode = -1  # the supervisor died: no status
                return
            if line.startswith("EXIT "):
                self.returncode = int(line.split()[1])
                return
            yield line

    def answer(self) -> None:
        """A line on the engine's stdin (the reply to ``WAITING``)."""
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.write("\n")
            self._proc.stdin.flush()
        else:
            self._sock.sendall(b"\n")

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            return
        try:
            os.killpg(self.pid, 9)  # the engine's group: it and the vLLM processes it forked
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self._proc is None:
            self._file.close()
            self._sock.close()


def run_engine(spec: dict, *, multiprocess: bool = False, timeout: float = 240,
               stdin_hook: Callable[[str], None] | None = None, env: dict | None = None,
               check: bool = True) -> dict:
    """Run one engine on ``spec``; its RESULT json plus ``wall`` (seconds), ``log`` (its output)
    and ``returncode``. With ``check`` (the default) the engine must have finished and exited 0."""
    start = time.monotonic()
    engine = _EngineProcess(spec, engine_env(env, multiprocess=multiprocess))
    lines: list[str] = []
    try:
        for line in engine.lines(start + timeout):
            lines.append(line)
            if line.startswith("WAITING ") and stdin_hook is not None:
                stdin_hook(line.split()[1])
                engine.answer()
    except TimeoutError:
        engine.kill()
        pytest.fail(f"engine did not finish within {timeout}s:\n{''.join(lines[-60:])}")
    finally:
        engine.close()
    result = [ln for ln in lines if ln.startswith("RESULT ")]
    if check:
        assert engine.returncode == 0 and result, f"engine failed (rc={engine.returncode}):\n{''.join(lines[-80:])}"
    out = json.loads(result[-1][len("RESULT "):]) if result else {}
    out.update(wall=time.monotonic() - start, log="".join(lines), returncode=engine.returncode)
    return out


# -- servers: vLLM's OpenAI server and other HTTP servers, each in its own process group ----------
class ForkedServer:
    """vLLM's OpenAI server forked by the engine server (``vllm_worker.serve``: vLLM imported once,
    not once per server), with the part of ``subprocess.Popen``'s interface the tests use: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``."""

    def __init__(self, args: list[str], *, env: dict[str, str], log: Path, cwd: Path, cpus: list[int] | None) -> None:
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(_Server.get().path)
        request = {"openai": args, "env": env, "log": str(log), "cwd": str(cwd), "cpus": cpus}
        self._sock.sendall((json.dumps(request) + "\n").encode())
        self._file = self._sock.makefile("r", encoding="utf-8", errors="replace")
        first = self._file.readline()
        if not first.startswith("PID "):
            raise RuntimeError(f"the vLLM engine server answered {first!r}")
        self.pid = int(first.split()[1])
        threading.Thread(target=self._watch, name=f"exit-of-{self.pid}", daemon=True).start()

    def _watch(self) -> None:
        line = self._file.readline()
        self.returncode = int(line.split()[1]) if line.startswith("EXIT ") else -1
        self._ended.set()
        self._file.close()
        self._sock.close()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


class ServerProcess:
    """An HTTP server on 127.0.0.1:``port`` in its own process group (its children too), its output
    in ``log``; ready once ``GET /health`` answers 200. ``forked``: vLLM's OpenAI server arguments,
    forked by the engine server instead of started as ``argv`` (``KVSTORE_TEST_ENGINE_SERVER=0``:
    as ``argv``)."""

    def __init__(self, name: str, argv: list[str], port: int, workdir: Path, env: dict[str, str], *,
                 forked: list[str] | None = None, cpus: list[int] | None = None) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(workdir) / f"{name}.log"
        self.log_path.write_text("")
        self.proc: subprocess.Popen | ForkedServer
        if forked is not None and os.environ.get("KVSTORE_TEST_ENGINE_SERVER", "1") != "0":
            self.proc = ForkedServer(forked, env=env, log=self.log_path, cwd=Path(workdir), cpus=cpus)
            return
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=str(workdir), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        """Whether it answers its health check; RuntimeError (with its log) once it has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log[-4000:]}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        """Its ``/metrics``: series name with labels -> value."""
        return scrape(self.url + "/metrics")

    def terminate(self, timeout: float) -> int:
        """SIGTERM to the server alone (as an orchestrator sends it); its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL to its whole group, and wait for it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page at ``url``: series name with labels -> value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``metrics``' series of ``name`` that carry every one of ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metrics.items() if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


class OpenAIServer(ServerProcess):
    """vLLM's OpenAI server for token-id prompts (no tokenizer), the model served as ``m``, with
    kvstore's connector in ``role`` over ``conn`` (no connector when ``conn`` is None); started
    through ``vllm_worker.py --openai``, so it runs the kernels of every test engine.
    ``cores``: vLLM's OMP threads bound to them (``"0"``, ``"0,1"``; ``"0|1"`` for two TP ranks);
    with ``taskset``, the server's every process too. ``connector_module``: where vLLM finds the
    connector (default: by name, through kvstore's plugin); ``env``: more environment."""

    def __init__(self, model: str, workdir: Path, *, name: str = "server", role: str = "kv_both",
                 conn: dict | None = None, dtype: str = "bfloat16", block_size: int = 32, cores: str | None = None,
                 taskset: bool = False, kv_cache_gib: int = 1, extra: tuple[str, ...] = (),
                 connector_module: str | None = None, env: dict | None = None) -> None:
        port = free_port()
        args = ["--model", model, "--served-model-name", "m", "--skip-tokenizer-init", "--dtype", dtype,
                "--max-model-len", "4096", "--enforce-eager", "--block-size", str(block_size), "--seed", "0",
                "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", *extra]
        if conn is not None:
            config = {"kv_connector": "KVStoreConnector", "kv_role": role, "kv_connector_extra_config": conn}
            if connector_module:
                config["kv_connector_module_path"] = connector_module
            args += ["--kv-transfer-config", json.dumps(config)]
        argv = [sys.executable, str(WORKER), "--openai", *args]
        env = engine_env(env, multiprocess=True)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        cpus = None
        if cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores.replace(",", "-")
            if taskset:
                argv = ["taskset", "-c", cores.replace("|", ","), *argv]
                cpus = sorted({int(c) for c in cores.replace("|", ",").replace("-", ",").split(",")})
        super().__init__(name, argv, port, workdir, env, forked=args, cpus=cpus)
