"""Run one vLLM engine from a JSON spec and print its results as JSON (used by the vLLM tests).

    python tests/vllm_worker.py '<spec json>'     (or @FILE holding the spec json)

Spec: ``model`` (a directory), ``connector`` (``kv_connector_extra_config`` or null for no
connector), ``connector_module`` (where ``KVStoreConnector`` is, default ``connectors.vllm_v1``;
``tests.vllm_dump_connector`` writes the KV it saves and loads to files), ``role`` (vLLM kv_role,
default kv_both), ``engine`` (extra ``LLM(...)`` arguments),
``actions``: a list of

* ``{"generate": [[token ids], ...], "max_tokens": 16, "salt": null, "logprobs": null}``: one
  ``generate`` call (a prompt may be ``{"ids": [token ids], "images": [seed, ...]}``: with
  ``vllm_multimodal.image``s); its result is ``{"tokens": [[...]], "cached": [num_cached_tokens...],
  "seconds": s}``, with ``"logprobs"`` (per prompt, per generated token, the top ``logprobs``
  candidates and the chosen one as ``[[token, logprob], ...]``, best first) when asked.
* ``{"reset_prefix_cache": true}``: empty vLLM's local prefix cache.
* ``{"engine_info": true}`` (in-process engines only): ``{"kv_cache_groups": [[spec type,
  sliding window or attention chunk, layers], ...], "num_blocks": n, "block_size": b (the first
  group's), "kvstore": {metric: total}}``
  with kvstore's counters of tokens loaded and saved, of bypassed requests and of corrupt records.
* ``{"metrics": true}``: ``{"metrics": {name: value}}`` of vLLM's counters and gauges (needs
  ``"engine": {"disable_log_stats": false}``).
* ``{"wait": "NAME"}``: print ``WAITING NAME`` and block until a line arrives on stdin.
* ``{"steps": [[token ids], ...], "max_tokens": 16, "abort": [i, ...], "abort_after": k}``: add
  the prompts to the engine and step it by hand, aborting requests ``abort`` after ``k`` steps
  (and printing ``WAITING NAME`` after ``pause_after`` steps, ``"pause": "NAME"``);
  ``{"tokens": [[...] or null for aborted], "steps": n, "seconds": s}``.
* ``{"mixed": {"streams": [[ids]...], "stream_tokens": n, "arrivals": [[ids]...], "arrival_tokens": m,
  "first_arrival": k, "every": j}}``: decode streams run while requests arrive, one every ``j``
  steps from step ``k``; ``{"added": {id: t}, "token_times": {id: [t, ...]}, "tokens": {id: [...]}}``
  (seconds from the start; benchmarks/bench_vllm_mixed.py).

The last line printed is ``RESULT <json>`` with ``{"results": [...], "startup": s}``. Each
engine runs in its own process (vLLM needs a ``__main__`` guard and cannot host two engines).

    python tests/vllm_worker.py --serve SOCKET    (the engine server of tests/vllm_engines.py)
    python tests/vllm_worker.py --openai ARGS...  (vLLM's OpenAI server with ARGS, this module its
                                                   ``__main__``)
"""

from __future__ import annotations

import gc
import json
import os
import signal
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
            kv_connector="KVStoreConnector", kv_connector_module_path=spec.get("connector_module", "connectors.vllm_v1"),
            kv_role=spec.get("role", "kv_both"), kv_connector_extra_config=spec["connector"])
    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - start
    # The engine's objects live until the process ends: the full collections vLLM runs at its
    # shutdown (two, about 0.4 s each over them) need not walk them (gc.freeze: see
    # _import_what_engines_import). Nothing of kvstore's waits for a cyclic collection.
    gc.freeze()
    results = []
    for action in spec.get("actions", []):
        if "generate" in action:
            params = SamplingParams(temperature=0, max_tokens=action.get("max_tokens", 16), ignore_eos=True,
                                    detokenize=False, logprobs=action.get("logprobs"))
            prompts = []
            for ids in action["generate"]:
                p = {"prompt_token_ids": ids}
                if isinstance(ids, dict):  # {"ids": [...], "images": [seed, ...]}: tests/vllm_multimodal.py
                    import vllm_multimodal

                    images = [vllm_multimodal.image(seed) for seed in ids["images"]]
                    p = {"prompt_token_ids": ids["ids"],
                         "multi_modal_data": {"image": images[0] if len(images) == 1 else images}}
                if action.get("salt"):
                    p["cache_salt"] = action["salt"]
                prompts.append(p)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "cached": [o.num_cached_tokens or 0 for o in outs],
                      "seconds": time.perf_counter() - t}
            if action.get("logprobs"):
                result["logprobs"] = [_top_logprobs(o.outputs[0].logprobs) for o in outs]
            results.append(result)
        elif action.get("metrics"):
            values: dict[str, float] = {}
            for m in llm.get_metrics():
                if getattr(m, "value", None) is not None and isinstance(m.value, (int, float)):
                    values[m.name] = values.get(m.name, 0.0) + m.value
            results.append({"metrics": values})
        elif action.get("metrics_kvstore"):  # kvstore's own counters (in-process engines only)
            from kvstore.connectors.vllm.scheduler import live_schedulers
            from kvstore.metrics.catalog import LOAD_DECISIONS

            inputs = [s.cost.inputs() for s in live_schedulers()]
            results.append({"kvstore": {"/".join(k): v for k, v in sorted(LOAD_DECISIONS._values.items())},
                            "cost_inputs": inputs})
        elif action.get("engine_info"):
            results.append(_engine_info(llm))
        elif "mixed" in action:
            results.append(_mixed(llm, action["mixed"], SamplingParams))
        elif "steps" in action:
            results.append(_step_by_hand(llm, action, SamplingParams))
        elif action.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        elif "wait" in action:
            print(f"WAITING {action['wait']}", flush=True)
            sys.stdin.readline()
    return {"results": results, "startup": startup, "pid": os.getpid()}


def _top_logprobs(steps) -> list[list[list[float]]]:
    """Per generated token, its top candidates as ``[[token, logprob], ...]``, best first."""
    return [sorted(([int(t), float(lp.logprob)] for t, lp in step.items()), key=lambda c: -c[1])
            for step in steps or ()]


def _engine_info(llm) -> dict:
    from kvstore.metrics.catalog import BYPASSED, CORRUPT, TOKENS_LOADED, TOKENS_SAVED

    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    groups = [[type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None)
               or getattr(g.kv_cache_spec, "attention_chunk_size", None) or 0, len(g.layer_names)]
              for g in config.kv_cache_groups]
    return {"kv_cache_groups": groups, "num_blocks": config.num_blocks,
            "block_size": int(config.kv_cache_groups[0].kv_cache_spec.block_size),
            "kvstore": {"tokens_loaded": TOKENS_LOADED.total(), "tokens_saved": TOKENS_SAVED.total(),
                        "bypassed": BYPASSED.total(), "corrupt": CORRUPT.total()}}


def _mixed(llm, spec: dict, sampling_params) -> dict:
    engine = llm.llm_engine
    start = time.perf_counter()
    added: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}

    def add(rid: str, ids: list[int], n: int) -> None:
        params = sampling_params(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        added[rid] = time.perf_counter() - start
        times[rid] = []

    for i, ids in enumerate(spec["streams"]):
        add(f"stream-{i}", ids, spec["stream_tokens"])
    arrivals = list(enumerate(spec["arrivals"]))
    step = 0
    while engine.has_unfinished_requests() or arrivals:
        if arrivals and step >= spec["first_arrival"] + arrivals[0][0] * spec["every"]:
            i, ids = arrivals.pop(0)
            add(f"arrival-{i}", ids, spec["arrival_tokens"])
        outs = engine.step()
        now = time.perf_counter() - start
        for out in outs:
            got = list(out.outputs[0].token_ids)
            times[out.request_id] += [now] * (len(got) - len(times[out.request_id]))
            tokens[out.request_id] = got
        step += 1
    return {"added": added, "token_times": times, "tokens": tokens, "steps": step}


def _step_by_hand(llm, action: dict, sampling_params) -> dict:
    engine = llm.llm_engine
    params = sampling_params(temperature=0, max_tokens=action.get("max_tokens", 16), ignore_eos=True,
                             detokenize=False)
    ids = [f"req-{i}" for i in range(len(action["steps"]))]
    for rid, tokens in zip(ids, action["steps"]):
        engine.add_request(rid, {"prompt_token_ids": tokens}, params)
    aborted = {ids[i] for i in action.get("abort", [])}
    tokens: dict[str, list[int]] = {}
    steps = 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        if steps == action.get("abort_after", -1) and aborted:
            engine.abort_request(sorted(aborted))
        if steps == action.get("pause_after", -1):
            print(f"WAITING {action.get('pause', 'pause')}", flush=True)
            sys.stdin.readline()
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps > 100000:
            raise RuntimeError("the engine never went idle")
    return {"tokens": [tokens.get(r) for r in ids], "steps": steps, "seconds": time.perf_counter() - t}


# -- the engine server: vLLM imported once, one forked process per engine ----------------------------
def serve(path: str) -> None:
    """Import vLLM once (the most expensive part of a test engine's start) and then fork one
    process per engine.

    A client connects to the Unix socket ``path`` and sends one line, ``{"spec": ..., "env":
    {...}}``. The server forks a supervisor, which forks the engine process and answers
    ``PID <pid>``; the engine process has the connection as its stdin, stdout and stderr, runs
    ``main(spec)`` under exactly ``env`` and exits as a worker started from the command line
    would (its atexit handlers, e.g. the connector's final flush, run). The supervisor then sends
    ``EXIT <status>`` (negative: the signal that ended it) and closes the connection. A request
    ``{"openai": [args], "env": {...}, "log": FILE, "cwd": DIR, "cpus": [...]}`` runs vLLM's OpenAI
    server instead, its output in ``FILE`` (``tests/vllm_engines.OpenAIServer``).

    Forking a process that has imported vLLM is what vLLM does itself on GPUs (its default
    start method is fork; on CPU it spawns its engine core and workers, so a multi-process
    engine still pays their imports). The server holds nothing of an engine: no LLM, no torch
    threads, no store.
    """
    import socket

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import vllm_model  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401

    import connectors.vllm_v1  # noqa: F401  (vLLM still loads it by its module path, from sys.modules)

    _import_what_engines_import()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    print("READY", flush=True)
    while True:
        conn, _ = listener.accept()
        request = json.loads(conn.makefile("rb").readline())
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _supervise(conn, request)  # returns only in the engine process, to run main()
            return
        conn.close()


#: Modules vLLM imports while it builds an engine (its CPU worker and model runner, the attention
#: backends, the model families the tests run), imported once by the engine server instead of once
#: per engine. Importing them starts no thread and touches no device.
_ENGINE_MODULES = (
    "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.workspace", "vllm._aiter_ops",
    "vllm.v1.attention.backends.cpu_attn", "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama", "vllm.model_executor.models.gemma2", "vllm.model_executor.models.gemma3",
    "vllm.model_executor.models.gpt_oss", "vllm.model_executor.models.llama4",
    "vllm.model_executor.models.qwen3_next", "vllm.model_executor.models.nemotron_h",
    "vllm.model_executor.models.deepseek_v2", "vllm.model_executor.models.idefics3",
    "vllm.entrypoints.launchers.api_server.entry",
)


def _import_what_engines_import() -> None:
    """Import ``_ENGINE_MODULES`` (each that exists), then freeze the garbage collector's view of
    every object so far: each engine forked afterwards skips them in the full collections vLLM
    runs while it starts (five of them, about 0.3 s each over the imported modules' objects),
    and shares their pages with the server instead of copying them."""
    import gc
    import importlib

    for name in _ENGINE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another vLLM release: that module's import is paid per engine
            pass
    gc.collect()
    gc.freeze()


def _supervise(conn, request: dict) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        _engine(conn, request)
        return
    conn.sendall(f"PID {pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        conn.sendall(f"EXIT {code}\n".encode())
    finally:
        os._exit(0)


def _engine(conn, request: dict) -> None:
    """The forked process, before it runs: its own session, its streams, exactly ``env``. A
    ``spec`` request writes its output to the connection; an ``openai`` one (vLLM's OpenAI server
    with those arguments) to the file ``log``, in ``cwd``, on the CPUs ``cpus`` (as ``taskset``)."""
    os.setsid()  # a client that gives up kills the engine's whole group (its vLLM processes too)
    if "openai" in request:
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(request["cwd"])
        if request.get("cpus"):
            os.sched_setaffinity(0, request["cpus"])
    else:
        for fd in (0, 1, 2):
            os.dup2(conn.fileno(), fd)
    conn.close()
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(request["env"])
    _ENGINE_REQUEST.append(request)


_ENGINE_REQUEST: list[dict] = []  # set in an engine process forked by serve()


def _run_forked(request: dict) -> None:
    """``main(spec)`` (or vLLM's OpenAI server) in a forked engine process, then exit as the
    command line would, less the interpreter's teardown of every module (seconds, and nothing of
    an engine's contract): the atexit handlers run (vLLM's shutdown, the connector's final flush),
    then the process ends."""
    import atexit
    import threading
    import traceback

    code = 0
    try:
        if "openai" in request:
            _openai_server(request["openai"])
        else:
            print("RESULT " + json.dumps(main(request["spec"])), flush=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # reported like an uncaught exception: exit status 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as at a normal exit: wait for the threads that are not daemons
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _openai_server(args: list[str]) -> None:
    """vLLM's OpenAI server with ``args``, this module its ``__main__`` (vLLM's spawned engine
    processes import it as their ``__mp_main__``)."""
    from vllm.entrypoints.launchers.api_server.entry import main as openai_server

    sys.argv = [str(Path(__file__).resolve()), *args]
    openai_server()


if __name__ == "__main__":
    arg = sys.argv[1]
    if arg == "--openai":
        _openai_server(sys.argv[2:])
        sys.exit(0)
    if arg == "--serve":
        serve(sys.argv[2])  # returns only in a forked engine process
        _run_forked(_ENGINE_REQUEST[0])
    spec = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    print("RESULT " + json.dumps(main(spec)), flush=True)
