"""The committed plots are what benchmarks/report.py draws from the committed results: the bars
carry the results files' figures (any matplotlib), and, under the matplotlib version that wrote
the committed PNGs, regenerating them gives the same bytes (``make bench-report`` was rerun)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import report

pytestmark = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")


def _bars(ax) -> list[float]:
    return [round(p.get_height(), 6) for p in ax.patches]


def _close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_vllm_ttft_bars_are_the_fastest_runs_of_the_results_table():
    text = (RESULTS / "vllm_ttft.md").read_text()
    rows = re.findall(r"^\| (vLLM without|connector, miss|connector, hit)[^|]*\| \d+ \| (\d+) ms \((\d+)-(\d+)\) \|$",
                      text, re.M)
    assert len(rows) == 3, rows
    fig = report.ttft_figure(report.ttft_data(RESULTS))
    try:
        panel = fig.axes[1]
        assert _bars(panel) == [float(lo) for _, _, lo, _ in rows]  # bars: fastest runs, in the table's order
        dots = [line.get_ydata()[0] for line in panel.lines if line.get_marker() == "o"]
        assert dots == [float(m) for _, m, _, _ in rows]  # medians
        labels = [t.get_text() for t in panel.get_xticklabels()]
        assert labels == [name for _, name, _ in report.VLLM_CASES]
        notes = " ".join(t.get_text() for t in panel.texts)
        assert "fastest run" in notes and "median" in notes
    finally:
        _close(fig)


def test_the_reference_ttft_points_are_the_results_files():
    import json

    doc = json.loads((RESULTS / "ttft.json").read_text())
    fig = report.ttft_figure(report.ttft_data(RESULTS))
    try:
        curves = [line for line in fig.axes[0].lines if line.get_marker() == "o"]  # not the error bars' caps
        medians = sorted(tuple(c.get_ydata()) for c in curves)
        want = sorted(tuple(r[key][0] for r in sorted(doc["rows"], key=lambda r: r["tokens"]))
                      for key in ("miss_ms", "hit_ms"))
        assert medians == want
    finally:
        _close(fig)


def test_the_paged_bars_are_the_results_tables_and_the_target_is_in_the_legend():
    data = report.paged_data(RESULTS)
    fig = report.paged_figure(data)
    try:
        ax = fig.axes[0]
        want = [r["ratio"] for scope, op, _ in report.PAGED_SERIES for r in data["rows"]
                if (r["scope"], r["op"]) == (scope, op)]
        assert _bars(ax) == want and len(want) >= 8
        text = (RESULTS / "paged.md").read_text()
        assert all(f"{v:g}" in text or f"{v:.2f}" in text for v in want)
        assert not ax.texts, "a label drawn on the plot (the target's sat over a bar); use the legend"
        assert any(t.get_text() == f"target {report.PAGED_TARGET:g}" for t in fig.legends[0].get_texts())
    finally:
        _close(fig)


def _writer(png: bytes) -> str:
    m = re.search(rb"Matplotlib version([0-9][0-9.a-z+]*)", png)
    return m.group(1).decode() if m else ""


@pytest.mark.parametrize("name", ["ttft.png", "paged.png"])
def test_regenerating_gives_the_committed_png(name, tmp_path):
    import matplotlib

    committed = (RESULTS / name).read_bytes()
    if _writer(committed) != matplotlib.__version__:
        pytest.skip(f"{name} was written by matplotlib {_writer(committed)}, this is {matplotlib.__version__} "
                    "(its bytes differ across versions; the data tests above still hold)")
    assert report.main(["--results", str(RESULTS), "--out", str(tmp_path)]) == 0
    assert (tmp_path / name).read_bytes() == committed, f"{name} is stale: run make bench-report"
