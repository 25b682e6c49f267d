"""benchmarks/report.py: the committed results parse (JSON sidecars first, markdown tables as the
fallback) and render as PNG plots; the README shows them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import report


def _need_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        if os.environ.get("CI"):
            pytest.fail("matplotlib is missing; CI installs it with the test extra", pytrace=False)
        pytest.skip("pip install matplotlib")


def test_markdown_fallbacks_read_the_committed_tables(tmp_path):
    for name in ("peer_lmcache.md", "stores.md", "ttft.md", "vllm_ttft.md", "paged.md"):
        shutil.copy(RESULTS / name, tmp_path / name)  # markdown only: no sidecars
    peer = report.peer_data(tmp_path)
    resp32 = next(r for r in peer["rows"] if r["chunk_mib"] == 32 and r["path"] == "LMCache resp://")
    assert resp32["store_gbps"][0] > 0 and resp32["store_gbps"][1] <= resp32["store_gbps"][0] <= resp32["store_gbps"][2]
    assert {r["role"] for r in peer["rows"]} == {"kvstore", "peer", "ceiling"}
    assert {r["chunk_mib"] for r in peer["rows"]} == {3.0, 32.0}
    ttft = report.ttft_data(tmp_path)
    assert ttft["reference"]["rows"][0]["tokens"] == 2048
    assert set(ttft["vllm"]["cases"]) == {"baseline", "miss", "hit"} and ttft["vllm"]["tokens"] == 2100
    paged = report.paged_data(tmp_path)
    ops = {(r["scope"], r["op"]) for r in paged["rows"]}
    assert ops == {("prompt", "gather"), ("prompt", "scatter"), ("chunk", "gather"), ("chunk", "load")}
    assert all(0 < r["ratio"] < 2 for r in paged["rows"])
    for data in (peer, paged):
        assert "machine not recorded" not in data["machine"]


def test_a_json_sidecar_wins_over_the_markdown(tmp_path):
    for name in ("peer_lmcache.md", "stores.md"):
        shutil.copy(RESULTS / name, tmp_path / name)
    sizes = {"4MiB": {"nbytes": 1, "loads": [1.0], "lookups_ms": {},
                      "paths": {"raw zero-copy client": {"store": [2, 4, 3], "retrieve": [1, 3, 2]},
                                "kvstore PrefixCache save/load": {"store": [1, 1, 1], "retrieve": [1, 2, 3]}}}}
    (tmp_path / "peer_lmcache.json").write_text(json.dumps({"machine": "M", "reps": 3, "sizes": sizes}))
    data = report.peer_data(tmp_path)
    assert data["machine"] == "M" and data["source"] == "peer_lmcache.json"
    assert data["rows"] == [
        {"chunk_mib": 4.0, "path": "raw zero-copy client", "role": "ceiling", "store_gbps": [3, 2, 4], "retrieve_gbps": [2, 1, 3]},
        {"chunk_mib": 4.0, "path": "kvstore PrefixCache save/load", "role": "kvstore", "store_gbps": [1, 1, 1],
         "retrieve_gbps": [2, 1, 3]}]


def test_report_writes_the_pngs(tmp_path):
    _need_matplotlib()
    assert report.main(["--results", str(RESULTS), "--out", str(tmp_path)]) == 0
    for name in ("peer_lmcache.png", "ttft.png", "paged.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, name


def test_readme_shows_the_committed_plots():
    readme = (ROOT / "README.md").read_text()
    shown = [name for name in ("peer_lmcache.png", "ttft.png", "paged.png")
             if f"](benchmarks/results/{name})" in readme]
    assert len(shown) >= 2, shown
    for name in shown:
        assert (RESULTS / name).is_file(), f"{name} is shown in the README but not committed (make bench-report)"
