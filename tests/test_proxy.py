"""``kvstore proxy`` against small fake OpenAI servers (real HTTP servers in this process, aiohttp):
the P/D hand-off, streaming relayed as it comes, pools and health checks, the fallback to a decode
server when the prefill pool is down, and OpenAI-style errors. The real-engine run is
``test_disagg_vllm.py``."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")
from aiohttp import web

from kvstore.errors import ConfigError
from kvstore.proxy.app import RunningProxy, decode_body, prefill_body
from kvstore.proxy.pools import Pool, ProxyConfig

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_prefill_cached_tokens": 7,
          "kvstore": {"v": 1, "tokens": 64}}


class FakeServer:
    """A fake vLLM OpenAI server in a thread: records every body it gets; a prefill server answers
    with ``PARAMS``; ``status`` sets what its generate endpoints answer, ``healthy`` its /health."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict] = []
        self.status = 200
        self.healthy = True
        self.health_checks = 0
        self.delay = 0.0
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
            self.port = self.runner.addresses[0][1]
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def health(self, request):
        self.health_checks += 1
        return web.Response(status=200 if self.healthy else 503)

    async def models(self, request):
        return web.json_response({"data": [{"id": self.name}]})

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} says {self.status}"}}, status=self.status)
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(3):
                await out.write(f"data: {json.dumps({'server': self.name, 'i': i})}\n\n".encode())
                await asyncio.sleep(0.01)
            await out.write(b"data: [DONE]\n\n")
            return out
        answer = {"server": self.name, "choices": [{"text": "x"}]}
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = PARAMS
        return web.json_response(answer)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def post(url: str, body, *, raw: bytes | None = None) -> tuple[int, bytes]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", "X-Request-Id": "r1"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def servers():
    made: list = []

    def make(*names: str) -> list[FakeServer]:
        out = [FakeServer(n) for n in names]
        made.extend(out)
        return out

    yield make
    for s in made:
        s.close()


@pytest.fixture
def proxies():
    made: list[RunningProxy] = []

    def make(prefill, decode, **kw) -> RunningProxy:
        p = RunningProxy(ProxyConfig(prefill=tuple(prefill), decode=tuple(decode), health_interval=0.05, **kw))
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def test_the_prefill_gets_one_token_and_the_decode_gets_its_params(servers, proxies):
    p, d = servers("P", "D")
    proxy = proxies([p.url], [d.url])
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "min_tokens": 4, "temperature": 0, "n": 1,
            "kv_transfer_params": {"do_remote_prefill": True, "forged": 1}}
    status, raw = post(proxy.url + "/v1/completions", body)
    assert status == 200 and json.loads(raw)["server"] == "D"
    (to_p,), (to_d,) = p.bodies, d.bodies
    assert to_p["max_tokens"] == 1 and to_p["stream"] is False and "min_tokens" not in to_p
    assert to_p["kv_transfer_params"] == {"do_remote_decode": True}  # the client's params never travel
    assert to_p["prompt"] == [1, 2, 3]
    want = {k: v for k, v in PARAMS.items() if k != "remote_prefill_cached_tokens"}
    assert to_d == {**body, "kv_transfer_params": want}
    assert proxy.proxy.stats.prefilled == 1 and proxy.proxy.stats.fallbacks == 0


def test_a_streaming_chat_is_relayed_chunk_by_chunk(servers, proxies):
    p, d = servers("P", "D")
    proxy = proxies([p.url], [d.url])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 9}
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln for ln in r.read().decode().split("\n") if ln]
    assert lines == [f"data: {json.dumps({'server': 'D', 'i': i})}" for i in range(3)] + ["data: [DONE]"]
    (to_p,), (to_d,) = p.bodies, d.bodies
    assert to_p["stream"] is False and to_p["max_completion_tokens"] == 1 and "stream_options" not in to_p
    assert to_d["stream"] is True and to_d["kv_transfer_params"]["kvstore"] == PARAMS["kvstore"]


def test_with_the_prefill_pool_down_the_decode_server_prefills(servers, proxies):
    (d,) = servers("D")
    proxy = proxies([dead_url()], [d.url])
    for _ in range(3):
        status, raw = post(proxy.url + "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert status == 200 and json.loads(raw)["server"] == "D"
    assert all("kv_transfer_params" not in b for b in d.bodies)
    assert proxy.proxy.stats.fallbacks == 3
    assert not proxy.proxy.prefill.backends[0].healthy
    health = json.loads(urllib.request.urlopen(proxy.url + "/health", timeout=5).read())
    assert health["prefill"][0]["healthy"] is False and health["decode"][0]["healthy"] is True


def test_a_prefill_server_error_falls_back_and_a_bad_request_is_the_clients(servers, proxies):
    p, d = servers("P", "D")
    proxy = proxies([p.url], [d.url], prefill_timeout=0.5)
    p.status = 500
    status, raw = post(proxy.url + "/v1/completions", {"prompt": [1]})
    assert status == 200 and "kv_transfer_params" not in d.bodies[-1]
    p.status = 400
    status, raw = post(proxy.url + "/v1/completions", {"prompt": [1]})
    assert status == 400 and json.loads(raw)["error"]["message"] == "P says 400"
    assert len(d.bodies) == 1  # the bad request never reached the decode server
    p.status, p.delay = 200, 2.0  # slower than prefill_timeout
    status, _ = post(proxy.url + "/v1/completions", {"prompt": [1]})
    assert status == 200 and "kv_transfer_params" not in d.bodies[-1]
    assert proxy.proxy.stats.fallbacks == 2


def test_a_decode_server_that_cannot_be_reached_passes_the_request_to_the_next(servers, proxies):
    p, d = servers("P", "D")
    proxy = proxies([p.url], [dead_url(), d.url], policy="round_robin")
    proxy.proxy.decode.backends[0].healthy = True  # not yet found out by a health check
    for _ in range(2):
        status, raw = post(proxy.url + "/v1/completions", {"prompt": [1]})
        assert status == 200 and json.loads(raw)["server"] == "D"


def test_openai_style_errors(servers, proxies):
    proxy = proxies([], [dead_url()])
    status, raw = post(proxy.url + "/v1/completions", None, raw=b"{not json")
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, raw = post(proxy.url + "/v1/completions", [1, 2])
    assert status == 400 and "object" in json.loads(raw)["error"]["message"]
    status, raw = post(proxy.url + "/v1/completions", {"prompt": [1]})
    err = json.loads(raw)["error"]
    assert status == 503 and err == {"message": "no decode server is available", "type": "service_unavailable",
                                      "param": None, "code": 503}
    status, raw = post(proxy.url + "/v1/embeddings", {"input": "x"})
    assert status == 404 and json.loads(raw)["error"]["code"] == 404
    status, raw = post(proxy.url + "/v1/completions", None, raw=b"[" + b"1," * (40 << 20) + b"1]")
    assert status == 413 and json.loads(raw)["error"]["code"] == 413


def test_health_checks_take_a_server_out_and_back(servers, proxies):
    p, d = servers("P", "D")
    proxy = proxies([p.url], [d.url])
    p.healthy = False
    deadline = time.monotonic() + 5
    while proxy.proxy.prefill.backends[0].healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not proxy.proxy.prefill.backends[0].healthy
    post(proxy.url + "/v1/completions", {"prompt": [1]})
    assert p.bodies == []  # out of the pool: not asked
    p.healthy = True
    while not proxy.proxy.prefill.backends[0].healthy and time.monotonic() < deadline + 5:
        time.sleep(0.02)
    post(proxy.url + "/v1/completions", {"prompt": [1]})
    assert len(p.bodies) == 1
    models = json.loads(urllib.request.urlopen(proxy.url + "/v1/models", timeout=5).read())
    assert models == {"data": [{"id": "D"}]}


def test_pools_pick_in_turn_or_the_least_busy():
    rr = Pool("decode", ["http://a", "http://b", "http://c"], "round_robin")
    assert [rr.pick().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    rr.mark(rr.backends[1], False, "down")
    assert [rr.pick().url for _ in range(3)] == ["http://c", "http://a", "http://c"]
    lo = Pool("decode", ["http://a", "http://b"], "least_outstanding")
    lo.backends[0].outstanding = 3
    assert lo.pick().url == "http://b"
    lo.backends[1].outstanding = 5
    assert lo.pick().url == "http://a"
    assert lo.pick(exclude=lo.backends).__class__ is type(None)
    lo.mark(lo.backends[0], False)
    lo.mark(lo.backends[1], False)
    assert lo.pick() is None


def test_bodies_and_config_are_checked():
    assert prefill_body({"prompt": [1], "stream": True, "n": 3, "best_of": 3})["n"] == 1
    kept = decode_body({"prompt": [1]}, PARAMS, report_prefill_cache_hits=True)
    assert kept["kv_transfer_params"]["remote_prefill_cached_tokens"] == 7
    assert "kv_transfer_params" not in decode_body({"prompt": [1], "kv_transfer_params": {"x": 1}}, None)
    with pytest.raises(ConfigError, match="decode server"):
        ProxyConfig(prefill=(), decode=())
    with pytest.raises(ConfigError, match="not an http"):
        ProxyConfig(prefill=("ftp://x",), decode=("http://d:1",))
    with pytest.raises(ConfigError, match="policy"):
        ProxyConfig(prefill=(), decode=("http://d:1",), policy="random")
    with pytest.raises(ConfigError, match="prefill_timeout"):
        ProxyConfig(prefill=(), decode=("http://d:1",), prefill_timeout=0)


def test_the_command_refuses_a_bad_set_up_in_one_line(capsys):
    from kvstore.cli import main

    assert main(["proxy", "--prefill", "http://127.0.0.1:1"]) == 2
    assert "at least one decode server" in capsys.readouterr().err
    assert main(["proxy", "--decode", "localhost:8000"]) == 2
    assert "not an http(s) base URL" in capsys.readouterr().err


def test_the_command_says_where_it_listens_and_a_taken_port_is_one_line():
    import signal
    import subprocess
    import sys

    port = int(dead_url().rsplit(":", 1)[1])
    argv = [sys.executable, "-m", "kvstore", "proxy", "--decode", dead_url(), "--port", str(port)]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line.startswith(f"kvstore proxy: listening on http://127.0.0.1:{port} ("), line
        second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and second.stdout == "", second.stderr
        assert second.stderr.strip() == (f"kvstore proxy: error: cannot listen on 127.0.0.1:{port}: Address already "
                                          "in use (another server has the port: choose another with --port)")
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(30)
        first.stdout.close()
        first.stderr.close()
