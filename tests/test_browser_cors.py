"""CORS judged by a real browser: headless Chromium (Debian's `chromium`) opens a page served from
another loopback origin, whose script calls /v1/chat/completions with fetch (a JSON body and a
Bearer key, so the browser sends a preflight first). With the page's origin allowed the call
succeeds; with it not allowed the browser blocks it; the key is still required on the real request."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading

import httpx
import pytest

from tests.helpers import serving
from tests.test_server import ByteTokenizer
from tests.test_tools import tiny_app

KEY = "sk-browser"

PAGE = """<!doctype html><html><body><pre id="out">running</pre><script>
async function main() {
  let outcome;
  try {
    const r = await fetch(%(api)s + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json", %(auth)s},
      body: JSON.stringify({model: "tiny", messages: [{role: "user", content: "hi"}], max_tokens: 4})});
    const body = await r.json();
    outcome = {ok: true, status: r.status, role: body.choices ? body.choices[0].message.role : null,
               error: body.error ? body.error.code : null};
  } catch (e) {
    outcome = {ok: false, error: e.name + ": " + e.message};
  }
  document.getElementById("out").textContent = JSON.stringify(outcome);
  await fetch("/result", {method: "POST", body: JSON.stringify(outcome)});  // same origin: always allowed
}
main();
</script></body></html>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "this test needs a real browser: install Debian's chromium (apt-get update && apt-get install -y chromium)"
    return path


def browse(api: str, tmp_path, key: str | None = KEY) -> dict:
    """Open the page from http://localhost:<its own port> in headless Chromium → what its fetch saw."""
    result, got = {}, threading.Event()
    auth = f'"Authorization": "Bearer {key}"' if key else '"X-Nothing": "1"'
    page = (PAGE % {"api": json.dumps(api), "auth": auth}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page)

        def do_POST(self):
            result.update(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()
            got.set()

        def log_message(self, *args):
            pass

    pages = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    browser = subprocess.Popen([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
                                f"http://localhost:{pages.server_address[1]}/"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert got.wait(90), "the page never reported (did Chromium start?)"
    finally:
        browser.kill()
        browser.wait()
        pages.shutdown()
    return result


def prompt_tokens(api: str) -> float:
    """The prompt tokens the server has run (its /metrics): did a request reach the engine?"""
    line = next(x for x in httpx.get(api + "/metrics").text.splitlines() if x.startswith("lowbit_prompt_tokens_total"))
    return float(line.split()[1])


def test_allowed_origin_calls_the_port_and_the_key_still_counts(tmp_path):
    # the default: pages from localhost / 127.0.0.1 on any port
    with serving(tiny_app(ByteTokenizer(), 128, api_key=KEY)) as api:
        assert browse(api, tmp_path / "a") == {"ok": True, "status": 200, "role": "assistant", "error": None}
        ran = prompt_tokens(api)
        assert ran > 0
        # no key: the preflight passes, the request is refused, and the page can read why
        assert browse(api, tmp_path / "b", key=None) == {"ok": True, "status": 401, "role": None,
                                                         "error": "invalid_api_key"}
        assert prompt_tokens(api) == ran  # refused before the engine


def test_disallowed_origin_is_blocked_by_the_browser(tmp_path):
    with serving(tiny_app(ByteTokenizer(), 128, api_key=KEY, cors_origins=["http://allowed.example"])) as api:
        seen = browse(api, tmp_path)
        assert seen == {"ok": False, "error": "TypeError: Failed to fetch"}
        assert prompt_tokens(api) == 0  # the preflight failed, so the browser never sent the request
