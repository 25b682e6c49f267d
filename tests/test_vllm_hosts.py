"""What the host's CPU changes on real vLLM CPU engines, shown with and without the connector.

vLLM CPU picks its kernels from the CPU: on Intel CPUs with AMX tiles (Sapphire Rapids and newer)
its ``amx`` attention (VNNI-packed pages: the ``vllm-cpu-amx`` layout) and its own AMX GEMMs for
small weights; AVX-512 or AVX2 kernels elsewhere. Every real-engine test runs whatever the host
has, as a user's engine does; these tests show the host-specific parts:

* vLLM CPU 0.32 itself dies of SIGILL on an AMX host when a fresh engine's first forward is a few
  tokens long: its AMX kernels execute tile instructions without asking Linux for the process's
  tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), which torch's matmuls ask for on their first
  large product. Shown without the connector. A connector makes such a first forward ordinary (a
  fresh reader's first forward is a prefix hit's short suffix), so the connector's worker asks
  first (``worker.allow_amx_tiles``): the same engine with the connector serves it.
* The page layout that records are stored in follows the ISA, so records written on an AMX host
  are a miss on a host without AMX and the other way round (docs/vllm.md, "Which engines share
  records").
"""

from __future__ import annotations

import signal

import pytest
import vllm_model
from oracles import gen
from vllm_engines import run_engine

pytestmark = pytest.mark.vllm


def _host_has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


AMX = _host_has_amx()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama-hosts")))


@pytest.mark.skipif(not AMX, reason="vLLM CPU's AMX kernels run only on a CPU with AMX tiles")
def test_a_short_first_forward_kills_vllm_alone_on_amx_and_not_with_the_connector(model_dir, tmp_path):
    """A fresh engine whose first prompt is 4 tokens: vLLM alone dies of SIGILL (vLLM's own defect;
    if this assertion fails, vLLM fixed it and ``allow_amx_tiles`` can go); with the connector it
    answers, and its layout is the AMX one."""
    first = [gen([vllm_model.prompt(7, 4)], max_tokens=2)]
    alone = run_engine({"model": model_dir, "connector": None, "actions": first}, check=False)
    assert alone["returncode"] == -signal.SIGILL, (alone["returncode"], alone["log"][-2000:])
    served = run_engine({"model": model_dir, "connector": {"store": [f"file://{tmp_path / 'kv'}"]},
                         "actions": first})
    assert len(served["results"][0]["tokens"][0]) == 2
    assert "'vllm-cpu-amx'" in served["log"]  # the worker's start-up line names its layouts
