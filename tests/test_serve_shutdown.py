"""`lowbit serve` stopping and starting as a process: SIGTERM drains (503 to new requests, running
streams end with an error event and [DONE] within --shutdown-timeout, exit 0); a taken port is one
line and exit 1. The default model, a real subprocess, as users run it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import free_port


def _start(default_gguf, port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lowbit.runtime.cli", "serve", str(default_gguf), "--port",
                             str(port), "--kv-memory", "64MiB", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "not ready in 120 s"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)


LONG = [{"role": "user", "content": "Write a very long story."}]
NO_EOT = {"2": -100}  # 2: the model's end of turn, kept out

# (route, body, how a line of its stream is read) for the three streaming APIs lowbit serves
STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": LONG, "max_tokens": 4000, "stream": True, "logit_bias": NO_EOT}),
    "responses": ("/v1/responses", {"input": LONG, "max_output_tokens": 4000, "stream": True,
                                    "logit_bias": NO_EOT}),
    # Ollama's options have no logit_bias: a raw count, which greedy decoding carries on for thousands of tokens
    "ollama": ("/api/generate", {"prompt": ", ".join(map(str, range(1, 21))) + ",", "raw": True,
                                 "stream": True, "options": {"num_predict": 4000, "temperature": 0}}),
}


def _assert_ended_by_shutdown(api: str, lines: list[str]) -> None:
    """Each API's own way of saying a stream failed, with lowbit's server_shutdown reason."""
    if api == "chat":  # an OpenAI error event, then [DONE] so clients that read to it stop
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "server_shutdown", lines[-3:]
    elif api == "responses":  # the Responses API's terminal event: response.failed with the error
        event = json.loads(lines[-1].removeprefix("data: "))
        assert event["type"] == "response.failed", lines[-3:]
        assert event["response"]["status"] == "failed" and event["response"]["error"]["code"] == "server_shutdown"
    else:  # Ollama: a last NDJSON line holding "error"
        assert "shutting down" in json.loads(lines[-1])["error"], lines[-3:]


@pytest.mark.parametrize("second_signal", [False, True], ids=["deadline", "second-signal"])
def test_sigterm_ends_running_streams_with_an_error_and_done_then_exits_0(default_gguf, second_signal):
    port = free_port()
    proc = _start(default_gguf, port, "--shutdown-timeout", "2")
    base = f"http://127.0.0.1:{port}"
    lines: dict[str, list[str]] = {api: [] for api in STREAMS}
    started = {api: threading.Event() for api in STREAMS}

    def stream(api):
        route, body = STREAMS[api]
        if api == "ollama":
            body = {**body, "model": default_gguf.name}  # Ollama names the model; lowbit serves the file's name
        with httpx.stream("POST", base + route, json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line and not line.startswith("event:"):
                    lines[api].append(line)
                    started[api].set()

    threads = [threading.Thread(target=stream, args=(api,)) for api in STREAMS]
    for t in threads:
        t.start()
    try:
        for api, ev in started.items():
            assert ev.wait(60), f"{api}: no first chunk"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"]
        if second_signal:
            proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(timeout=15)
            assert not t.is_alive()
        ended = time.monotonic() - t0
        assert ended < (1.5 if second_signal else 2 + 1.5), ended
        for api in STREAMS:
            _assert_ended_by_shutdown(api, lines[api])
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_taken_port_is_one_line_and_exit_1(default_gguf):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "serve", str(default_gguf), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "in use" in r.stderr and str(port) in r.stderr, r.stderr
