"""The port under a hostile but fair client: a non-streamed request stops when its client leaves,
malformed bodies are 400s on a connection that stays open, an oversized body is a 413 before it is
read, cross-site requests are refused. A real uvicorn server over the tiny model of test_server.py."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx
import pytest

from lowbit.runtime.engine.engine import AsyncEngine
from lowbit.runtime.server.app import Served, build_app
from tests.helpers import serving
from tests.test_server import CTX, KEY, NAME, NO_EOS, ByteTokenizer, slow_tiny_engine

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def server():
    engine = slow_tiny_engine(step_s=0.05)  # ~100 tokens of room at 50 ms a step: a 5 s reply
    app = build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, CTX), api_key=KEY, max_body=MAX_BODY)
    with serving(app) as base:
        yield engine, base


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_non_streamed_request_stops_when_its_client_leaves(server):
    engine, base = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logit_bias": NO_EOS}
    aborts = _metric(base, 'lowbit_requests_finished_total{finish_reason="abort"}')
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s of a ~5 s reply
        httpx.post(base + "/v1/chat/completions", json=body, headers=AUTH, timeout=1.0)
    left = time.monotonic()
    while (engine.requests or engine.blocks.num_used_pages) and time.monotonic() - left < 1.0:
        time.sleep(0.01)
    assert not engine.requests and engine.blocks.num_used_pages == 0, "still generating for nobody"
    tokens = _metric(base, "lowbit_generation_tokens_total")
    time.sleep(0.3)
    assert _metric(base, "lowbit_generation_tokens_total") == tokens  # the token counter stopped
    assert _metric(base, 'lowbit_requests_finished_total{finish_reason="abort"}') == aborts + 1


DEEP = b"[" * 2000 + b"]" * 2000
MALFORMED = [  # (body bytes, the param or words the error names)
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode(), "surrogate"),
    (b'{"model": "' + NAME.encode() + b'", "messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}', "UTF-8"),
    (json.dumps({"model": "x\udc00", "messages": [{"role": "user", "content": "hi"}]}).encode(), "surrogate"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": ' + DEEP + b"}", "nests"),
    (DEEP, "nests"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "range"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": 0}', "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": 1}', "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}', "logprobs"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": [f"s{i}" for i in range(10_000)]}).encode(),
     "stop"),
]


@pytest.mark.parametrize("raw,named", MALFORMED, ids=[m[1] + str(i) for i, m in enumerate(MALFORMED)])
def test_malformed_bodies_are_400_on_a_connection_that_stays_open(server, raw, named):
    host, port = server[1].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=raw, headers=AUTH)
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 400, err
        assert named.lower() in (err["message"] + str(err["param"])).lower(), err
        assert r.getheader("connection") != "close"
        sock = conn.sock
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "ab", "max_tokens": 2}), headers=AUTH)
        r2 = conn.getresponse()
        assert r2.status == 200 and json.loads(r2.read())["choices"][0]["text"] is not None
        assert conn.sock is sock  # the same connection answered the next request
    finally:
        conn.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_an_oversized_body_is_413_before_it_is_read_and_health_answers(server):
    base = server[1]
    host, port = base.removeprefix("http://").split(":")
    rss0 = _rss()
    healthy, stop = [], threading.Event()

    def probe():
        while not stop.is_set():
            t = time.monotonic()
            healthy.append((httpx.get(base + "/health", timeout=5).status_code, time.monotonic() - t))
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        size = 40 << 20
        t0 = time.monotonic()
        with socket.create_connection((host, int(port))) as s:  # 40 MB announced, 1 MB sent
            try:
                s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode() + b"{" + b" " * (1 << 20))
            except BrokenPipeError:  # the server answered from the headers and closed before the 1 MB was in
                pass
            head = s.recv(65536).decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head
        assert time.monotonic() - t0 < 1.0
        # no Content-Length: chunks counted as they arrive
        chunks = (b" " * (1 << 20) for _ in range(40))
        r = httpx.post(base + "/v1/chat/completions", content=chunks, headers=AUTH, timeout=10)
        assert r.status_code == 413 and "max-body" in r.json()["error"]["message"]
    finally:
        stop.set()
        prober.join()
    assert healthy and all(code == 200 and dt < 1.0 for code, dt in healthy)
    assert _rss() < rss0 * 1.1


def test_dns_rebinding_and_cross_site_posts_are_refused(server):
    base = server[1]
    body = json.dumps({"prompt": "ab", "max_tokens": 2})
    r = httpx.post(base + "/v1/completions", content=body, headers={**AUTH, "Host": "attacker.example:8000"})
    assert r.status_code == 403 and "allowed-hosts" in r.json()["error"]["message"]
    r = httpx.get(base + "/v1/models", headers={**AUTH, "Host": "rebind.attacker.example"})
    assert r.status_code == 403
    # a page's "simple request" (no preflight): text/plain from another origin
    plain = {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain;charset=UTF-8"}
    r = httpx.post(base + "/v1/completions", content=body, headers={**plain, "Origin": "https://evil.example"})
    assert r.status_code == 403
    r = httpx.post(base + "/v1/completions", content=body, headers=plain)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    # each dialect's clients read the refusal in their own error shape: Anthropic's, Ollama's
    r = httpx.post(base + "/v1/messages", content=body, headers=plain)
    assert r.status_code == 415 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/api/chat", content=body, headers={**AUTH, "Host": "attacker.example:8000"})
    assert r.status_code == 403 and "allowed-hosts" in r.json()["error"]
    # this machine's names and pages still work
    for host in ("localhost", "127.0.0.1", "[::1]"):
        r = httpx.post(base + "/v1/completions", content=body, headers={**AUTH, "Host": host})
        assert r.status_code == 200, (host, r.text)
    r = httpx.post(base + "/v1/completions", content=body, headers={**AUTH, "Origin": "http://localhost:3000"})
    assert r.status_code == 200


def test_allowed_hosts_and_wide_binds():
    from lowbit.runtime.server.guard import Guard

    g = Guard(None, "127.0.0.1", ["myhost.lan"], MAX_BODY, lambda o: False)
    assert g.host_ok("myhost.lan:8000") and g.host_ok("localhost:8000") and g.host_ok("127.0.0.1")
    assert not g.host_ok("other.lan")
    assert Guard(None, "0.0.0.0", None, MAX_BODY, lambda o: False).host_ok("192.168.1.5:8000")
    assert not Guard(None, "0.0.0.0", ["a.lan"], MAX_BODY, lambda o: False).host_ok("b.lan")
    assert Guard(None, "127.0.0.1", ["*"], MAX_BODY, lambda o: False).host_ok("anything")
