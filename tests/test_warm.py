"""``kvstore warm``: prompts in, KV in the store, and a fresh engine then hits every warmed prompt.

The acceptance check runs ``kvstore warm`` as its own process (the console script), then builds
a new reference engine over the same store in this process and requires that every warmed
prompt is served entirely from the store, with the same greedy tokens as without the cache.
The server path is checked against a small OpenAI-compatible HTTP server started here that
serves the reference engine with the agent connector, so it exercises the real save path.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.warm import BadLine, Prompt, ServerWarmEngine, WarmEngine, iter_prompts, warm

VOCAB = 256  # the tiny reference preset


def _prompts(n: int, seed: int = 0, lo: int = 20, hi: int = 300) -> list[list[int]]:
    r = random.Random(seed)
    shared = [r.randrange(VOCAB) for _ in range(70)]  # a common system prompt
    return [shared + [r.randrange(VOCAB) for _ in range(r.randrange(lo, hi))] for _ in range(n)]


def _write_jsonl(path: Path, prompts: list[list[int]], extra_lines: list[str] = ()) -> Path:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_token_ids": p}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def _console() -> list[str]:
    script = shutil.which("kvstore", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [script] if script else [sys.executable, "-m", "kvstore.cli"]


def _fresh_engine(store_url: str):
    """A new reference engine + agent over ``store_url``, as a serving replica would build it."""
    from kvstore.connectors.agent import AgentConfig, KVStoreAgent
    from kvstore.reference import PRESETS, ModelRunner

    cfg = PRESETS["tiny"]
    agent = KVStoreAgent(AgentConfig(store=(store_url,), model=cfg.name, model_fingerprint=cfg.fingerprint))
    return ModelRunner(cfg, agent=agent), agent


def _assert_fresh_engine_hits(store_url: str, prompts: list[list[int]]) -> None:
    from kvstore.reference import PRESETS, ModelRunner

    runner, agent = _fresh_engine(store_url)
    plain = ModelRunner(PRESETS["tiny"])
    try:
        for p in prompts:
            cached = runner.generate([p], max_new_tokens=3)
            assert cached.tokens_loaded == len(p) and cached.tokens_computed == 0, (len(p), cached)
            assert cached.bypassed
            assert cached.tokens == plain.generate([p], max_new_tokens=3).tokens
    finally:
        agent.close()


# -- parsing ------------------------------------------------------------------------------------------
def test_lines_are_parsed_and_bad_ones_reported_with_line_numbers():
    lines = [
        '{"prompt_token_ids": [1, 2, 3]}',
        "",
        "not json",
        '{"prompt_token_ids": []}',
        '{"prompt_token_ids": [1, -2]}',
        '{"prompt_token_ids": [1, 2.5]}',
        '{"text": "hello"}',
        '[1, 2]',
        '{"other": 1}',
        '{"prompt_token_ids": [7], "id": "kept-fields-are-ignored"}',
    ]
    items = list(iter_prompts(lines))
    assert items[0] == Prompt(1, (1, 2, 3))
    bad = {i.line: i.reason for i in items if isinstance(i, BadLine)}
    assert sorted(bad) == [3, 4, 5, 6, 7, 8, 9]  # line 2 is blank: not a prompt, not an error
    assert "--tokenizer" in bad[7]
    assert items[-1] == Prompt(10, (7,))


def test_prompts_are_streamed():
    def endless():
        i = 0
        while True:
            i += 1
            yield json.dumps({"prompt_token_ids": [i]})

    it = iter_prompts(endless())
    assert [next(it).tokens for _ in range(3)] == [(1,), (2,), (3,)]


def test_text_prompts_with_a_local_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<s>": 1, "hello": 2, "world": 3, "again": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    from kvstore.warm import Tokenizer

    items = list(iter_prompts(['{"text": "hello world again"}'], tokenizer=Tokenizer(str(tmp_path / "tok"))))
    assert items == [Prompt(1, (1, 2, 3, 4))]
    items = list(iter_prompts(['{"text": "hello"}'], tokenizer=Tokenizer(str(tmp_path / "tok"), add_special_tokens=False)))
    assert items == [Prompt(1, (2,))]


# -- the run, with a fake engine ------------------------------------------------------------------------
class _FakeEngine(WarmEngine):
    name = "fake"

    def __init__(self, concurrency: int = 1, fail_on: set[int] = frozenset(), delay: float = 0.0) -> None:
        self.concurrency = concurrency
        self.fail_on = fail_on
        self.delay = delay
        self.seen: list[tuple[int, ...]] = []
        self.active = self.max_active = 0
        self._lock = threading.Lock()

    def prefill(self, tokens):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.delay)
            if tokens[0] in self.fail_on:
                raise RuntimeError(f"engine refused prompt {tokens[0]}")
            with self._lock:
                self.seen.append(tuple(tokens))
        finally:
            with self._lock:
                self.active -= 1


def test_concurrency_is_bounded_and_input_read_lazily():
    engine = _FakeEngine(concurrency=3, delay=0.01)
    read = []

    def lines():
        for i in range(40):
            read.append(i)
            yield json.dumps({"prompt_token_ids": [i, 1]})

    summary = warm(iter_prompts(lines()), engine)
    assert summary.warmed == 40 and summary.tokens == 80 and summary.ok
    assert 1 < engine.max_active <= 3
    assert sorted(t[0] for t in engine.seen) == list(range(40))


def test_failures_are_counted_and_a_dead_engine_stops_the_run():
    engine = _FakeEngine(fail_on={3, 5})
    problems = []
    items = iter_prompts([json.dumps({"prompt_token_ids": [i]}) for i in range(10)])
    summary = warm(items, engine, on_problem=lambda *p: problems.append(p))
    assert summary.failed == 2 and summary.warmed == 8 and not summary.ok
    assert [(line, kind) for line, kind, _ in problems] == [(4, "failed"), (6, "failed")]
    assert "refused prompt 3" in problems[0][2]

    dead = _FakeEngine(fail_on=set(range(100)))
    items = iter_prompts([json.dumps({"prompt_token_ids": [i]}) for i in range(100)])
    summary = warm(items, dead, max_consecutive_failures=5, on_problem=lambda *p: None)
    assert summary.failed == 5 and summary.aborted and summary.prompts < 10


# -- the reference engine ---------------------------------------------------------------------------------
def test_warm_then_a_fresh_engine_hits_every_prompt(tmp_path):
    """Acceptance: `kvstore warm` in its own process, then a fresh engine serves every prompt from the store."""
    store = f"file://{tmp_path}/kv"
    prompts = _prompts(6)
    path = _write_jsonl(tmp_path / "prompts.jsonl", prompts, ["{broken", '{"prompt_token_ids": "x"}'])
    proc = subprocess.run(_console() + ["warm", str(path), "--store", store, "--json", "--engine", "reference"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # two invalid lines make the run not-OK, but it completes
    summary = json.loads(proc.stdout)
    assert summary["warmed"] == 6 and summary["invalid"] == 2 and summary["failed"] == 0
    assert summary["tokens"] == sum(map(len, prompts)) and summary["bytes_written"] > 0
    assert f"{path}:7: invalid:" in proc.stderr and f"{path}:8: invalid:" in proc.stderr
    assert "Traceback" not in proc.stderr
    _assert_fresh_engine_hits(store, prompts)


def test_real_token_ids_on_the_toy_engine_stop_at_once_naming_its_vocabulary_and_the_engines(tmp_path):
    """README's ``kvstore warm prompts.jsonl`` runs the reference engine unless told otherwise:
    another model's token ids fail the first line with what to run instead, not every line."""
    path = _write_jsonl(tmp_path / "prompts.jsonl", [[128000, 9906, 1917], [1, 2, 3], [128000, 40]])
    proc = subprocess.run(_console() + ["warm", str(path), "--store", f"file://{tmp_path}/kv"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{path}:1: failed: token id 128000 is outside the reference engine's vocabulary "
                           f"of {VOCAB} (presets: tiny: {VOCAB}, small: 4096, bench: 32000)"), line
    assert "--engine vllm --model DIR, or --engine server --url URL" in line
    assert "1 prompts: 0 warmed" in proc.stdout and "stopped early: line 1 does not fit the engine" in proc.stdout


def test_rerun_skips_what_is_stored(tmp_path, capsys):
    store = f"file://{tmp_path}/kv"
    prompts = _prompts(5, seed=1)
    first = _write_jsonl(tmp_path / "first.jsonl", prompts[:2])
    assert main(["warm", str(first), "--store", store, "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["warmed"] == 2
    everything = _write_jsonl(tmp_path / "all.jsonl", prompts)
    assert main(["warm", str(everything), "--store", store, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["skipped"], again["warmed"]) == (2, 3)
    assert again["skipped_tokens"] == sum(map(len, prompts[:2]))
    # Nothing rewritten for the skipped prompts; the shared system prompt's chunks were already there.
    assert 0 < again["bytes_written"] < 3 * done["bytes_written"]
    assert main(["warm", str(everything), "--store", store]) == 0
    out = capsys.readouterr().out
    assert "5 skipped" in out and "0 warmed" in out and "tokens/s" in out


def test_bad_options_fail_cleanly(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "p.jsonl", _prompts(1))
    for argv, message in [
        (["warm", str(tmp_path / "missing.jsonl"), "--store", f"file://{tmp_path}/kv"], "cannot read prompts file"),
        (["warm", str(path), "--engine", "server"], "--url"),
        (["warm", str(path), "--engine", "vllm", "--store", "memory://"], "--model"),
        (["warm", str(path), "--store", "bogus://x"], "unknown store scheme"),
        (["warm", str(path), "--store", "memory://", "--preset", "huge"], "--preset"),
        (["warm", str(path), "--engine", "server", "--url", "http://127.0.0.1:1"], "127.0.0.1:1"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)


# -- the server path ---------------------------------------------------------------------------------------
class _ReferenceOpenAIServer:
    """/v1/models and /v1/completions over the reference engine with the agent connector.

    Like a vLLM server with the kvstore connector: token-id prompts, ``max_tokens``, the KV
    saved by the connector. Requests are served one at a time (one engine), as a queue would.
    """

    model_name = "reference-tiny"

    def __init__(self, store_url: str) -> None:
        self.runner, self.agent = _fresh_engine(store_url)
        self.requests = 0
        self.max_prompt = 1000
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": outer.model_name, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions" or body.get("model") != outer.model_name:
                    self._send(404, {"error": {"message": f"model {body.get('model')} not served"}})
                    return
                prompt = body["prompt"]
                if len(prompt) > outer.max_prompt:
                    self._send(400, {"error": {"message": f"prompt of {len(prompt)} tokens is longer than "
                                                          f"the maximum model length {outer.max_prompt}"}})
                    return
                with lock:
                    outer.requests += 1
                    out = outer.runner.generate([prompt], max_new_tokens=body["max_tokens"])
                self._send(200, {"object": "text_completion", "model": outer.model_name,
                                 "choices": [{"index": 0, "text": "", "token_ids": out.tokens[0]}],
                                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"]}})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.agent.close()


@pytest.fixture
def openai_server(tmp_path):
    server = _ReferenceOpenAIServer(f"file://{tmp_path}/server-kv")
    yield server
    server.close()


def test_server_path_warms_through_the_connector(openai_server, tmp_path, capsys):
    store = f"file://{tmp_path}/server-kv"
    prompts = _prompts(6, seed=2)
    too_long = [1] * 1200
    path = _write_jsonl(tmp_path / "p.jsonl", prompts + [too_long])
    rc = main(["warm", str(path), "--engine", "server", "--url", openai_server.url + "/v1", "--concurrency", "3",
               "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    summary = json.loads(captured.out)
    assert summary["warmed"] == 6 and summary["failed"] == 1
    assert summary["engine"]["model"] == "reference-tiny"
    assert f"{path}:7: failed: HTTP 400: prompt of 1200 tokens" in captured.err
    openai_server.agent.flush()
    _assert_fresh_engine_hits(store, prompts)


def test_server_engine_retries_then_reports_an_unreachable_server(openai_server):
    engine = ServerWarmEngine(openai_server.url, concurrency=1, retries=0, timeout=5)
    assert engine.model == "reference-tiny"
    engine.prefill(_prompts(1)[0])
    openai_server.httpd.shutdown()
    openai_server.httpd.server_close()
    with pytest.raises(ConnectionError):
        engine.prefill(_prompts(1)[0])


# -- vLLM: `kvstore warm --engine vllm`, then a fresh vLLM engine that hits every warmed prompt, and a
# second warm that skips them all, is test_vllm_exit.py's warm test (one vLLM import fewer).
