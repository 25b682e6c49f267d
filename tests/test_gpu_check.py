"""``scripts/gpu_check`` end to end on the CPU (``--dry-run``): a lent GPU machine is rare and its
time short, so the script that spends it must not stop at its first step (issue 47: an
``importlib.util`` that Debian's python3 does not preload stopped it under ``set -e``), lose
rows measured before a failing one, or ask /dev/shm for more than it has. The dry run takes the
same path through every section, the device path on the CPU, at a toy scale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "KVSTORE_RESULTS": str(tmp_path)}
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=600, cwd=tmp_path)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    for line in ("# scripts/gpu_check --dry-run", "xxhash ", "/dev/shm", "## tests (gpu, device path)",
                 "## bench_gpu.py", "## bench_breakeven.py", "gpu_check: "):
        assert line in out, line
    assert (tmp_path / "gpu_check.md").read_text() == out.split("gpu_check: results in")[0]
    rows = json.loads((tmp_path / "bench_gpu.json").read_text())
    paths = [r["path"] for r in rows["rows"]]
    for wanted in ("copy_ pinned host -> device", "save into shm://", "load from shm://, slots on the host",
                   "xxh3 of the", "the first in a fresh process", "beside a busy forward",
                   "scatter of", "one reduction pass"):
        assert any(wanted in p for p in paths), wanted
    assert not [n for n in rows["notes"] if "failed" in n], rows["notes"]
    breakeven = json.loads((tmp_path / "breakeven.json").read_text())
    assert [r["path"] for r in breakeven["rows"]][:2] == ["prefill", "copy_ pinned H2D"]
    assert any(r["path"] == "load from shm://" for r in breakeven["rows"])


def test_a_row_that_fails_is_a_note_and_loses_no_row_before_it(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_common import Rows
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    path = tmp_path / "rows.json"
    rows = Rows(1_000_000, str(path), {"device": "test"})
    rows.add("first", [0.001])
    assert json.loads(path.read_text())["rows"][0]["path"] == "first"  # written as soon as it was measured

    def boom() -> None:
        rows.add("second", [0.002])
        raise RuntimeError("the device went away\nmore")

    assert rows.run("group", boom) is False
    assert rows.run("third", lambda: rows.add("third", [0.004])) is True
    saved = json.loads(path.read_text())
    assert [r["path"] for r in saved["rows"]] == ["first", "second", "third"]
    assert saved["notes"] == ["group: failed: RuntimeError: the device went away"]
    printed = capsys.readouterr().out
    assert printed.index("| first |") < printed.index("| second |") < printed.index("group: failed") \
        < printed.index("| third |")


@pytest.mark.parametrize("free,expect", [(10 << 30, "/dev/shm"), (64 << 20, "elsewhere")])
def test_an_shm_tier_goes_where_there_is_room(monkeypatch, free, expect):
    from kvstore.testing import shm

    def fake_free(path: str) -> tuple[int, int]:
        return (free, 64 << 20) if path == "/dev/shm" else (100 << 30, 200 << 30)

    monkeypatch.setattr(shm, "free_bytes", fake_free)
    root, note = shm.memory_root(268 << 20)
    if expect == "/dev/shm":
        assert (root, note) == ("/dev/shm", "")
    else:
        assert root != "/dev/shm" and "/dev/shm has 67 MB free of 67 MB, 281 MB wanted" in note
