"""Run one vLLM engine from a JSON spec and print its results as JSON (used by the vLLM tests).

    python tests/vllm_worker.py '<spec json>'     (or @FILE holding the spec json)

Spec: ``model`` (a directory), ``connector`` (``kv_connector_extra_config`` or null for no
connector), ``role`` (vLLM kv_role, default kv_both), ``engine`` (extra ``LLM(...)`` arguments),
``actions``: a list of

* ``{"generate": [[token ids], ...], "max_tokens": 16, "salt": null}``: one ``generate`` call;
  its result is ``{"tokens": [[...]], "cached": [num_cached_tokens...], "seconds": s}``.
* ``{"reset_prefix_cache": true}``: empty vLLM's local prefix cache.
* ``{"metrics": true}``: ``{"metrics": {name: value}}`` of vLLM's counters and gauges (needs
  ``"engine": {"disable_log_stats": false}``).
* ``{"wait": "NAME"}``: print ``WAITING NAME`` and block until a line arrives on stdin.

The last line printed is ``RESULT <json>`` with ``{"results": [...], "startup": s}``. Each
engine runs in its own process (vLLM needs a ``__main__`` guard and cannot host two engines).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(spec: dict) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import vllm_model
    from vllm import LLM, SamplingParams

    kwargs = vllm_model.engine_kwargs(spec["model"], **spec.get("engine", {}))
    if spec.get("connector") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm_v1",
            kv_role=spec.get("role", "kv_both"), kv_connector_extra_config=spec["connector"])
    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - start
    results = []
    for action in spec.get("actions", []):
        if "generate" in action:
            params = SamplingParams(temperature=0, max_tokens=action.get("max_tokens", 16), ignore_eos=True,
                                    detokenize=False)
            prompts = []
            for ids in action["generate"]:
                p = {"prompt_token_ids": ids}
                if action.get("salt"):
                    p["cache_salt"] = action["salt"]
                prompts.append(p)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                            "cached": [o.num_cached_tokens or 0 for o in outs],
                            "seconds": time.perf_counter() - t})
        elif action.get("metrics"):
            values: dict[str, float] = {}
            for m in llm.get_metrics():
                if getattr(m, "value", None) is not None and isinstance(m.value, (int, float)):
                    values[m.name] = values.get(m.name, 0.0) + m.value
            results.append({"metrics": values})
        elif action.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        elif "wait" in action:
            print(f"WAITING {action['wait']}", flush=True)
            sys.stdin.readline()
    return {"results": results, "startup": startup, "pid": os.getpid()}


if __name__ == "__main__":
    arg = sys.argv[1]
    out = main(json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg))
    print("RESULT " + json.dumps(out), flush=True)
