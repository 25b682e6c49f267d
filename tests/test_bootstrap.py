"""``scripts/bootstrap`` asks for CPU torch: a torch wheel in pip's own find-links folder first,
then PyTorch's CPU wheel index, and the package index only where that index cannot be reached,
saying so in one line. ``--dry-run`` prints the pip commands it would run (the venv is made)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """One fresh venv without torch for every case (a dry run installs nothing into it)."""
    return tmp_path_factory.mktemp("bootstrap") / "venv"


@pytest.fixture(scope="module")
def cpu_index() -> Iterator[str]:
    """A stand-in for PyTorch's CPU wheel index on loopback: it answers ``/torch/``."""
    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path.rstrip("/").endswith("/torch") else 404)
            self.end_headers()
            self.wfile.write(b"<html></html>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bootstrap(venv: Path, index: str, *, find_links: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(KVSTORE_VENV=str(venv), KVSTORE_TORCH_INDEX=index, PIP_CONFIG_FILE=os.devnull)  # no pip.conf
    if find_links:
        env["PIP_FIND_LINKS"] = find_links
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap"), "--dry-run", "core"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _pip_commands(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def test_without_a_local_wheel_folder_it_asks_the_cpu_index(venv, cpu_index):
    proc = bootstrap(venv, cpu_index)
    torch, kvstore = _pip_commands(proc.stdout)
    assert torch.endswith(f"install torch==2.13.0 --index-url {cpu_index}"), proc.stdout
    assert kvstore.endswith("install -e ."), proc.stdout
    assert "cannot be reached" not in proc.stdout + proc.stderr


def test_an_unreachable_cpu_index_is_said_in_one_line_before_the_fallback(venv):
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    proc = bootstrap(venv, index)
    notice = [line for line in proc.stdout.splitlines() if "cannot be reached" in line]
    assert len(notice) == 1 and index in notice[0], proc.stdout
    torch = _pip_commands(proc.stdout)[0]
    assert torch.endswith("install torch==2.13.0"), proc.stdout


def test_a_local_wheel_folder_is_used_when_present(venv, tmp_path):
    wheels = [w for w in Path("/opt/wheels").glob("torch-2.13.0*.whl")] if Path("/opt/wheels").is_dir() else []
    if not wheels:
        pytest.skip("no local torch 2.13.0 wheel folder on this machine")
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"  # never asked: the folder answers first
    proc = bootstrap(venv, index, find_links=str(wheels[0].parent))
    assert "local wheel folder" in proc.stdout and "cannot be reached" not in proc.stdout, proc.stdout
    assert _pip_commands(proc.stdout)[0].endswith("install torch==2.13.0"), proc.stdout
