"""Plots of the recorded benchmark results (``make bench-report``).

    python benchmarks/report.py [--results benchmarks/results] [--out DIR]

Reads the results directory and writes, next to the results (or into ``--out``):

* ``peer_lmcache.png``: store / retrieve GB/s by chunk size over Redis: kvstore (``PrefixCache``
  with encode and verification, bare ``RedisStore``), LMCache ``resp://`` and ``redis://``, and
  the raw ceiling (a client that only moves bytes);
* ``ttft.png``: time to first token, hit vs miss, by prompt length (reference engine) and on
  vLLM CPU (Redis hit, miss, no connector: each case's fastest run as the bar, see ``ttft_figure``);
* ``paged.png``: paged-cache copies as a fraction of memcpy, by layout (one thread).

Each figure carries the machine description of the run it plots. Nothing here measures: the
numbers come from the files the benchmarks write. Per plot, a JSON sidecar is read when it
exists, else the committed markdown table is parsed (the markdown stays what the benchmark
printed, never edited for the plot). The sidecars' schemas (every GB/s or ms triple is
``[median, min, max]``):

``peer_lmcache.json`` (bench_peer_lmcache.py)::

    {"machine": str, "versions": str, "reps": int, "chunks": 16,
     "sizes": {"32MiB": {"nbytes": int, "loads": [float, ...],
                         "paths": {"LMCache resp://": {"store": [GB/s per rep], "retrieve": [...]}, ...},
                         "lookups_ms": {name: [ms, ...]}}, ...}}

    (every rep's figure, not triples: the plot takes median, min and max; the path
    ``raw zero-copy client`` is the ceiling, paths starting with ``kvstore`` are ours)

    Fallback: peer_lmcache.md's first "16 x <N>MiB chunks" tables (``| path | store | retrieve |``);
    the ceiling then comes from stores.md's ``raw redis-py python-packer`` row at the same record
    size (another run: the legend says so).

``ttft.json`` (bench_ttft.py ``--json``)::

    {"benchmark": "ttft", "engine": "reference", "machine": str,
     "rows": [{"tokens": 2048, "miss_ms": [m, lo, hi], "hit_ms": [m, lo, hi]}, ...]}

    Fallback: ttft.md's first table (one prompt length, from its "N-token prompt").

``vllm_ttft.json`` (bench_vllm_ttft.py ``--json``)::

    {"benchmark": "vllm_ttft", "machine": str, "tokens": 2100,
     "cases": {"baseline": [m, lo, hi], "miss": [m, lo, hi], "hit": [m, lo, hi]}}

    Fallback: vllm_ttft.md's table.

``paged.json`` (bench_paged.py)::

    {"benchmark": "paged", "machine": str, "threads": 1,
     "rows": [{"layout": "flash-2bnhd", "scope": "prompt" | "chunk",
               "op": "gather" | "scatter" | "load", "ratio": 0.77}, ...]}

    Fallback: paged.md's "One torch thread" tables, the "after" columns.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

Triple = tuple[float, float, float]


# -- markdown ---------------------------------------------------------------------------------------
def md_tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every table of a markdown text: (the last heading above it, header cells, body rows)."""
    out = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
            header = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((heading, header, rows))
            continue
        i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def triple(cell: str) -> Triple:
    """``"0.92 [0.56-0.98]"`` / ``"1647 ms (1624-1754)"`` / ``"0.77"`` -> (median, min, max)."""
    m = re.match(r"^\s*([\d.]+)\s*(?:ms)?\s*(?:[\[(]\s*([\d.]+)\s*-\s*([\d.]+)\s*[\])])?", cell)
    if not m:
        raise ValueError(f"not a number: {cell!r}")
    med = float(m.group(1))
    return (med, float(m.group(2) or med), float(m.group(3) or med))


def machine_line(text: str) -> str:
    m = re.search(r"^\**Machine:?\**:?\s*(.+)$", text, re.M | re.I) or re.search(r"^\s*machine: (.+)$", text, re.M)
    return m.group(1).strip() if m else "machine not recorded"


def _spread(samples: list[float]) -> list[float]:
    """[median, min, max] of one path's figures over the reps."""
    return [statistics.median(samples), min(samples), max(samples)]


def _load_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


# -- the data of each plot --------------------------------------------------------------------------
def peer_data(results: Path) -> dict[str, Any]:
    doc = _load_json(results / "peer_lmcache.json")
    if doc is not None:
        rows = [{"chunk_mib": float(size.removesuffix("MiB")), "path": path,
                 "role": "ceiling" if path.startswith("raw") else "kvstore" if path.startswith("kvstore") else "peer",
                 "store_gbps": _spread(figures["store"]), "retrieve_gbps": _spread(figures["retrieve"])}
                for size, result in doc["sizes"].items() for path, figures in result["paths"].items()]
        return {"machine": doc["machine"], "source": "peer_lmcache.json", "rows": rows}
    text = (results / "peer_lmcache.md").read_text()
    rows: list[dict[str, Any]] = []
    seen: set[float] = set()
    for heading, header, body in md_tables(text):
        m = re.match(r"16 x ([\d.]+)\s*MiB chunks", heading)
        if not m or header[:3] != ["path", "store", "retrieve"] or float(m.group(1)) in seen:
            continue
        size = float(m.group(1))
        seen.add(size)
        for path, store, retrieve in (r[:3] for r in body):
            rows.append({"chunk_mib": size, "path": path, "role": "kvstore" if path.startswith("kvstore") else "peer",
                         "store_gbps": list(triple(store)), "retrieve_gbps": list(triple(retrieve))})
    stores = (results / "stores.md").read_text()
    for heading, header, body in md_tables(stores):
        m = re.match(r"Redis, \d+ x ([\d.]+)MiB records", heading)
        if not m or float(m.group(1)) not in seen or "put" not in header:
            continue
        for r in body:
            if r[0] == "raw redis-py python-packer":
                rows.append({"chunk_mib": float(m.group(1)), "path": "raw ceiling (redis-py, stores.md run)",
                             "role": "ceiling", "store_gbps": list(triple(r[header.index("put")])),
                             "retrieve_gbps": list(triple(r[header.index("get")]))})
    if not rows:
        raise ValueError("peer_lmcache.md has no '16 x N MiB chunks' tables")
    return {"machine": machine_line(text), "source": "peer_lmcache.md + stores.md (markdown)", "rows": rows}


def ttft_data(results: Path) -> dict[str, Any]:
    doc = _load_json(results / "ttft.json")
    if doc is not None:
        ref = {"machine": doc["machine"], "source": "ttft.json", "rows": doc["rows"]}
    else:
        text = (results / "ttft.md").read_text()
        tokens = int(re.search(r"([\d,]+)-token prompt", text).group(1).replace(",", ""))  # type: ignore[union-attr]
        _, header, body = md_tables(text)[0]
        cells = {r[0].split(" ")[0]: r for r in body}
        med = header.index("median ms")
        spread = header.index("min-max ms")

        def row(name: str) -> list[float]:
            lo, hi = cells[name][spread].split("-")
            return [float(cells[name][med]), float(lo), float(hi)]

        ref = {"machine": machine_line(text), "source": "ttft.md (markdown)",
               "rows": [{"tokens": tokens, "miss_ms": row("miss"), "hit_ms": row("hit")}]}
    vdoc = _load_json(results / "vllm_ttft.json")
    if vdoc is not None:
        vllm = {"machine": vdoc["machine"], "tokens": vdoc["tokens"], "cases": vdoc["cases"],
                "source": "vllm_ttft.json"}
    else:
        text = (results / "vllm_ttft.md").read_text()
        tokens = int(re.search(r"\*\*Prompt:\*\*\s*(\d+)", text).group(1))  # type: ignore[union-attr]
        cases = {}
        for _, header, body in md_tables(text):
            if header[:1] != ["case"]:
                continue
            for r in body:
                key = "baseline" if "without" in r[0] else "hit" if "hit" in r[0] else "miss"
                cases[key] = list(triple(r[-1]))
            break
        vllm = {"machine": machine_line(text).replace("*", ""), "tokens": tokens, "cases": cases,
                "source": "vllm_ttft.md (markdown)"}
    return {"reference": ref, "vllm": vllm}


def paged_data(results: Path) -> dict[str, Any]:
    doc = _load_json(results / "paged.json")
    if doc is not None:
        return {"machine": doc["machine"], "source": "paged.json", "rows": doc["rows"]}
    text = (results / "paged.md").read_text()
    rows: list[dict[str, Any]] = []
    section = ""
    for heading, header, body in md_tables(text):
        if heading.startswith("One torch thread"):
            section = heading
        if not section or heading != section:
            continue
        scope = "chunk" if any("load/memcpy" in h for h in header) else "prompt"
        for r in body:
            for col, cell in zip(header[1:], r[1:]):
                m = re.match(r"after (gather|scatter|load)/memcpy", col)
                if m:
                    rows.append({"layout": r[0], "scope": scope, "op": m.group(1), "ratio": float(cell)})
    if not rows:
        raise ValueError("paged.md has no 'One torch thread' tables")
    return {"machine": machine_line(text), "source": "paged.md (markdown)", "rows": rows}


# -- plotting ---------------------------------------------------------------------------------------
def _figure(title: str, machine: str, source: str, ncols: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 5.2 * ncols + 1.6
    fig, axes = plt.subplots(1, ncols, figsize=(width, 5.0))
    fig.suptitle(title, fontsize=12)
    note = textwrap.fill(f"{machine}  (data: benchmarks/results/{source})", int(width * 16))
    fig.text(0.01, 0.01, note, fontsize=7, color="0.35", va="bottom")
    return fig, axes


def _legend_below(fig: Any, ax: Any, ncol: int) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.06))


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.15, 1, 0.95))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_peer(data: dict[str, Any], out: Path) -> Path:
    fig, axes = _figure("Redis, 16 chunks per op: kvstore vs LMCache 0.5.6 vs the raw ceiling", data["machine"],
                        data["source"], 2)
    sizes = sorted({r["chunk_mib"] for r in data["rows"]})
    paths = list(dict.fromkeys(r["path"] for r in data["rows"]))
    width = 0.8 / len(paths)
    colors = {"kvstore": ["#1f77b4", "#6baed6"], "peer": ["#d62728", "#ff9896"], "ceiling": ["0.45", "0.7"]}
    used: dict[str, int] = {}
    for ax, key, label in zip(axes, ("store_gbps", "retrieve_gbps"), ("store", "retrieve")):
        used.clear()
        for j, path in enumerate(paths):
            pts = {r["chunk_mib"]: r[key] for r in data["rows"] if r["path"] == path}
            role = next(r["role"] for r in data["rows"] if r["path"] == path)
            color = colors[role][used.get(role, 0) % 2]
            used[role] = used.get(role, 0) + 1
            xs = [i + (j - (len(paths) - 1) / 2) * width for i, s in enumerate(sizes) if s in pts]
            med = [pts[s][0] for s in sizes if s in pts]
            err = [[pts[s][0] - pts[s][1] for s in sizes if s in pts], [pts[s][2] - pts[s][0] for s in sizes if s in pts]]
            ax.bar(xs, med, width, yerr=err, capsize=2, label=path, color=color,
                   hatch="//" if role == "ceiling" else None, edgecolor="white" if role != "ceiling" else "0.3")
        ax.set_xticks(range(len(sizes)), [f"{s:g} MiB chunks" for s in sizes])
        ax.set_ylabel(f"{label}, GB/s (median, min-max)")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    _legend_below(fig, axes[0], 3)
    return _save(fig, out / "peer_lmcache.png")


def plot_ttft(data: dict[str, Any], out: Path) -> Path:
    return _save(ttft_figure(data), out / "ttft.png")


#: The vLLM panel's cases, in order: (key in the results, bar label, colour).
VLLM_CASES = (("baseline", "vLLM, no connector", "0.6"), ("miss", "connector, miss", "#d62728"),
              ("hit", "connector, Redis hit", "#1f77b4"))


def ttft_figure(data: dict[str, Any]) -> Any:
    """The TTFT figure. Its vLLM panel's bars are each case's fastest run, with the median as a
    dot and the slowest run as the whisker's top: the no-connector runs come from two other
    engine processes than the connector's (before and after it), on a shared machine, and one of
    them was slowed by other work (vllm_ttft.md: 1653-4490 ms, median 2810), so only the fastest
    runs, the least disturbed, compare across processes; miss and hit alternate in one process
    and compare at any statistic."""
    ref, vllm = data["reference"], data["vllm"]
    fig, (a, b) = _figure("Time to first token: cache hit vs miss", ref["machine"],
                          f"{ref['source']}, {vllm['source']}", 2)
    rows = sorted(ref["rows"], key=lambda r: r["tokens"])
    xs = [r["tokens"] for r in rows]
    for key, label, color in (("miss_ms", "miss (full prefill)", "#d62728"), ("hit_ms", "hit (load, bypass)", "#1f77b4")):
        med = [r[key][0] for r in rows]
        a.errorbar(xs, med, yerr=[[m - r[key][1] for m, r in zip(med, rows)], [r[key][2] - m for m, r in zip(med, rows)]],
                   marker="o", capsize=3, label=label, color=color)
    for x, r in zip(xs, rows):
        a.annotate(f"{r['miss_ms'][0] / r['hit_ms'][0]:.0f}x", (x, r["hit_ms"][0]), textcoords="offset points",
                   xytext=(0, 9), ha="center", fontsize=8)
    a.set_yscale("log")
    a.set_xscale("log", base=2)
    a.set_xticks(xs, [str(x) for x in xs])
    a.set_xlabel("prompt length, tokens")
    a.set_ylabel("TTFT, ms (median, min-max; log)")
    a.set_title("reference engine (58M), agent API, file store")
    _legend_below(fig, a, 2)
    a.grid(alpha=0.3, which="both")
    present = [(k, n, c) for k, n, c in VLLM_CASES if k in vllm["cases"]]
    for i, (key, _name, color) in enumerate(present):
        m, lo, hi = vllm["cases"][key]
        b.bar(i, lo, yerr=[[0], [hi - lo]], capsize=3, color=color)
        b.plot([i], [m], marker="o", color="black", markersize=4, linestyle="none")
        b.annotate(f"{lo:.0f} ms\n(median {m:.0f})", (i, hi), textcoords="offset points", xytext=(0, 4),
                   ha="center", fontsize=7)
    b.set_xticks(range(len(present)), [n for _, n, _ in present], fontsize=8)
    b.set_ylim(0, max(vllm["cases"][k][2] for k, _, _ in present) * 1.35)
    b.set_ylabel("TTFT, ms")
    b.set_title(f"vLLM CPU 0.32 (99M Llama), {vllm['tokens']} tokens", fontsize=10)
    b.text(0.5, 0.97, textwrap.fill("bar: fastest run, dot: median, whisker: slowest. Fastest runs compare: "
                                    "the no-connector runs are other engine processes, one slowed by other work "
                                    "on the machine", 70),
           transform=b.transAxes, ha="center", va="top", fontsize=7, color="0.3")
    b.grid(axis="y", alpha=0.3)
    return fig


def plot_paged(data: dict[str, Any], out: Path) -> Path:
    return _save(paged_figure(data), out / "paged.png")


#: The paged figure's series, in order: (scope, op, legend label).
PAGED_SERIES = (("prompt", "gather", "whole prompt, gather"), ("prompt", "scatter", "whole prompt, scatter"),
                ("chunk", "gather", "per chunk, gather (save)"), ("chunk", "load", "per chunk, load"))
PAGED_TARGET = 0.7


def paged_figure(data: dict[str, Any]) -> Any:
    """The paged-copy figure: a bar per layout and series; the target is a line in the legend
    (a label on the plot sat over the last layout's bars)."""
    fig, ax = _figure("Paged KV copies as a fraction of memcpy (one thread; 1.0 = memcpy)", data["machine"],
                      data["source"])
    layouts = list(dict.fromkeys(r["layout"] for r in data["rows"]))
    width = 0.8 / len(PAGED_SERIES)
    for j, (scope, op, label) in enumerate(PAGED_SERIES):
        vals = {r["layout"]: r["ratio"] for r in data["rows"] if r["scope"] == scope and r["op"] == op}
        xs = [i + (j - (len(PAGED_SERIES) - 1) / 2) * width for i, lay in enumerate(layouts) if lay in vals]
        ax.bar(xs, [vals[lay] for lay in layouts if lay in vals], width, label=label)
    ax.axhline(PAGED_TARGET, color="0.3", linestyle="--", linewidth=1, label=f"target {PAGED_TARGET:g}")
    ax.set_xticks(range(len(layouts)), [textwrap.fill(lay, 18) for lay in layouts], fontsize=7)
    ax.set_ylabel("GB/s relative to memcpy of the same bytes")
    ax.set_ylim(0, 1.0)
    _legend_below(fig, ax, 3)
    ax.grid(axis="y", alpha=0.3)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plot benchmarks/results/ as PNG files.")
    ap.add_argument("--results", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")
    ap.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default: the results directory)")
    args = ap.parse_args(argv)
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    for name, load, plot in (("peer_lmcache", peer_data, plot_peer), ("ttft", ttft_data, plot_ttft),
                             ("paged", paged_data, plot_paged)):
        path = plot(load(args.results), out)
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
