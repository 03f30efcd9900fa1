"""runtime/load/hub.py: `hf:ORG/REPO[:QUANT]` refs, pulled through huggingface_hub — never from the real hub.

A loopback HTTP server (FakeHub, in a thread) answers the part of the hub's API that huggingface_hub
uses here: `GET /api/models/{repo}[/revision/{rev}]` (id, sha, siblings) and `HEAD`/`GET
/{repo}/resolve/{rev}/{file}` (X-Repo-Commit, quoted ETag, Content-Length, Range → 206), with the
hub's `X-Error-Code` headers on 404/401. huggingface_hub reads HF_ENDPOINT and HF_HOME once, at import,
into `huggingface_hub.constants`: in-process tests patch those constants, subprocesses get the env vars.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import constants

from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load import hub
from lowbit.runtime.load.hub_ref import HubRef, pick_gguf, quant_of
from lowbit.runtime.load.registry import list_models, pull, resolve
from tests.helpers import one_line
from tests.test_cli import write_tiny_gguf

LOWBIT = [sys.executable, "-m", "lowbit.runtime.cli"]
SHA = "0123456789abcdef0123456789abcdef01234567"  # the fake repos' commit
LFS_SUFFIXES = (".gguf", ".safetensors")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def etag_of(name: str, data: bytes) -> str:
    """As the hub: sha256 for LFS files, git blob sha1 for the rest."""
    return hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_sha1(data)


# ---- the fake hub --------------------------------------------------------------------------------

@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)  # repos that need `Authorization: Bearer hf_good`
    bad_etag: set[str] = field(default_factory=set)  # files served with an etag their bytes do not hash to
    cut_after: dict[str, int] = field(default_factory=dict)  # file → the next GET drops after n bytes
    hold_after: dict[str, int] = field(default_factory=dict)  # file → the next GET stalls after n bytes
    release: threading.Event = field(default_factory=threading.Event)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    url: str = ""

    def seen(self, method: str, needle: str = "") -> list[dict[str, str]]:
        return [h for m, p, h in list(self.requests) if m == method and needle in p]

    @contextmanager
    def serving(self):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        server.handle_error = lambda request, address: None  # a client that hangs up mid-body is the point
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)  # quick shutdown
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self.url
        finally:
            self.release.set()
            server.shutdown()
            server.server_close()
            thread.join(5)


def _handler(fake: FakeHub):
    api = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")
    resolve_url = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _error(self, code: int, error_code: str, commit: bool = False):
            self.send_response(code)
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", error_code)
            if commit:
                self.send_header("X-Repo-Commit", SHA)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _repo(self, repo_id: str) -> dict[str, bytes] | None:
            if repo_id not in fake.repos:
                self._error(404, "RepoNotFound")
                return None
            if repo_id in fake.gated and self.headers.get("authorization") != "Bearer hf_good":
                self._error(401, "GatedRepo")
                return None
            return fake.repos[repo_id]

        def do_GET(self):
            self._serve(body=True)

        def do_HEAD(self):
            self._serve(body=False)

        def _serve(self, body: bool):
            path = self.path.split("?")[0]
            fake.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
            if m := api.match(path):
                files = self._repo(m.group(1))
                if files is None:
                    return
                data = json.dumps({"id": m.group(1), "sha": SHA,
                                   "siblings": [{"rfilename": f} for f in files]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data if body else b"")
            elif m := resolve_url.match(path):
                files = self._repo(m.group(1))
                if files is not None:
                    self._file(files, m.group(3), body)
            else:
                self._error(404, "RepoNotFound")

        def _file(self, files: dict[str, bytes], name: str, body: bool):
            if name not in files:
                self._error(404, "EntryNotFound", commit=True)
                return
            data = files[name]
            etag = "0" * 64 if name in fake.bad_etag else etag_of(name, data)
            start = 0
            if body and (r := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))):
                start = int(r.group(1))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", SHA)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            rest = data[start:]
            if (n := fake.cut_after.pop(name, None)) is not None:
                self.wfile.write(rest[:n])  # then hang up: the client sees a short body
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if (n := fake.hold_after.pop(name, None)) is not None:
                self.wfile.write(rest[:n])
                self.wfile.flush()
                fake.release.wait(30)  # until the test has killed the client
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(rest)

    return Handler


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> bytes:
    """A complete tiny llama GGUF (~100 KB) that lowbit loads."""
    return write_tiny_gguf(tmp_path_factory.mktemp("hub-tiny") / "tiny.gguf").read_bytes()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends: connection refused


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private HF_HOME and model cache, no token, online; huggingface_hub's constants patched to match."""
    h = tmp_path / "hf"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE",
                "HF_HUB_DISABLE_PROGRESS_BARS", "LOWBIT_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(h))
    monkeypatch.setenv("LOWBIT_MODELS", str(tmp_path / "models"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(h / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(h / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # huggingface_hub's once-a-day agent-detection registry: cached under HF_HOME, kept out of the real one
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(h / ".agent_harnesses.json"), raising=False)
    return h


def point_at(monkeypatch, url: str) -> None:
    """What HF_ENDPOINT=url sets at import: the endpoint and the file-URL template built from it."""
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture
def fake(home, tiny, monkeypatch):
    hub_ = FakeHub()
    hub_.repos["test/tiny"] = {"README.md": b"# tiny\n", "tiny-Q4_K_M.gguf": tiny,
                               "tiny-Q8_0.gguf": tiny + b"\0" * 64}
    with hub_.serving() as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        point_at(monkeypatch, url)
        yield hub_


def run_cli(args, home: Path, endpoint: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    """`python -m lowbit.runtime.cli ARGS` with the env the fixtures set for this process."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    e.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, LOWBIT_MODELS=str(home.parent / "models"), **env)
    return subprocess.run([*LOWBIT, *args], cwd=home.parent, env=e, capture_output=True, text=True, timeout=timeout)


# ---- picking the file (no network) ---------------------------------------------------------------

FILES = ["README.md", "SmolLM2-135M-Instruct-Q4_K_M.gguf", "SmolLM2-135M-Instruct-Q8_0.gguf",
         "SmolLM2-135M-Instruct-IQ2_XXS.gguf", "SmolLM2-135M-Instruct-f16.gguf", "mmproj-model-f16.gguf"]


@pytest.mark.parametrize("name, quant", [("SmolLM2-135M-Instruct-Q4_K_M.gguf", "Q4_K_M"),
                                         ("model.q4_k_m.gguf", "Q4_K_M"),
                                         ("Llama-3.2-1B-Instruct-Q4_0_4_4.gguf", "Q4_0_4_4"),
                                         ("Qwen2.5-0.5B-Instruct-IQ4_XS.gguf", "IQ4_XS"), ("model-bf16.gguf", "BF16"),
                                         ("UD-Q4_K_XL.gguf", "Q4_K_XL"), ("Qwen2-135M.gguf", None)])
def test_quant_token(name, quant):
    assert quant_of(name) == quant


@pytest.mark.parametrize("quant, want", [(None, "SmolLM2-135M-Instruct-Q4_K_M.gguf"),
                                         ("Q8_0", "SmolLM2-135M-Instruct-Q8_0.gguf"),
                                         ("q8_0", "SmolLM2-135M-Instruct-Q8_0.gguf"),
                                         ("iq2_xxs", "SmolLM2-135M-Instruct-IQ2_XXS.gguf"),
                                         ("F16", "SmolLM2-135M-Instruct-f16.gguf"),  # not the mmproj
                                         ("SmolLM2-135M-Instruct-Q8_0.gguf", "SmolLM2-135M-Instruct-Q8_0.gguf")])
def test_pick_by_quant(quant, want):
    assert pick_gguf(FILES, HubRef("o/r", quant), "in o/r") == want


def test_pick_lower_case_names_and_only_gguf():
    assert pick_gguf(["model.q4_k_m.gguf", "model.q8_0.gguf"], HubRef("o/r", None), "") == "model.q4_k_m.gguf"
    assert pick_gguf(["model.q4_k_m.gguf", "model.q8_0.gguf"], HubRef("o/r", "Q8_0"), "") == "model.q8_0.gguf"
    # no Q4_K_M and no quant asked for: the repo's only GGUF, whatever its quant
    assert pick_gguf(["config.json", "model-Q5_K_S.gguf", "mmproj-f16.gguf"], HubRef("o/r", None), "") \
        == "model-Q5_K_S.gguf"


def test_pick_missing_quant_lists_the_quants():
    with pytest.raises(LowbitError) as e:
        pick_gguf(FILES, HubRef("o/r", "Q5_K_M"), "in o/r")
    one_line(e, "hf:o/r:Q5_K_M", "no Q5_K_M", "there: F16, IQ2_XXS, Q4_K_M, Q8_0")
    with pytest.raises(LowbitError) as e:  # an explicit quant never falls back to the only GGUF
        pick_gguf(["model-Q5_K_S.gguf"], HubRef("o/r", "Q4_K_M"), "in o/r")
    one_line(e, "no Q4_K_M", "Q5_K_S")
    with pytest.raises(LowbitError) as e:  # no quant, no Q4_K_M, several GGUFs: which one is not ours to guess
        pick_gguf(["a-Q5_K_S.gguf", "a-Q6_K.gguf"], HubRef("o/r", None), "in o/r")
    one_line(e, "no Q4_K_M", "Q5_K_S, Q6_K")


def test_split_gguf_is_refused():
    files = ["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00002-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"]
    with pytest.raises(LowbitError) as e:
        pick_gguf(files, HubRef("o/r", "Q8_0"), "in o/r")
    one_line(e, "split into 3 files", "llama-gguf-split")


@pytest.mark.parametrize("ref", ["hf:", "hf:justarepo", "hf:a/b/c", "hf:a/b:", "hf:/b"])
def test_bad_ref(ref):
    with pytest.raises(LowbitError) as e:
        hub.parse_ref(ref)
    one_line(e, repr(ref), "hf:ORG/REPO[:QUANT]")


# ---- pulling from the fake hub -------------------------------------------------------------------

def test_pull_default_quant_into_the_hub_cache(fake, home, tiny):
    path = pull("hf:test/tiny")
    assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == tiny
    storage = home / "hub" / "models--test--tiny"
    assert path == storage / "snapshots" / SHA / "tiny-Q4_K_M.gguf"
    assert (storage / "refs" / "main").read_text() == SHA
    assert (storage / "blobs" / hashlib.sha256(tiny).hexdigest()).is_file()
    assert not list(storage.rglob("*.incomplete"))
    assert not fake.seen("GET", "tiny-Q8_0")  # only the picked quant is downloaded


def test_pull_explicit_quant_case_insensitive(fake, tiny):
    path = resolve("hf:test/tiny:q8_0")
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == tiny + b"\0" * 64


def test_pull_only_gguf_when_no_q4_k_m(fake, tiny):
    fake.repos["test/one"] = {"config.json": b"{}", "one-Q6_K.gguf": tiny}
    assert resolve("hf:test/one").name == "one-Q6_K.gguf"


def test_missing_quant_error_lists_quants(fake):
    with pytest.raises(LowbitError) as e:
        pull("hf:test/tiny:Q5_K_M")
    one_line(e, "hf:test/tiny:Q5_K_M", "Q4_K_M, Q8_0")


def test_missing_repo(fake):
    with pytest.raises(LowbitError) as e:
        pull("hf:nobody/nothing")
    one_line(e, "nobody/nothing", "not found", fake.url, "HF_TOKEN")


def test_no_network(home, monkeypatch):
    url = closed_port()
    point_at(monkeypatch, url)
    t0 = time.perf_counter()
    with pytest.raises(LowbitError) as e:
        resolve("hf:test/tiny:Q4_K_M")
    one_line(e, "cannot reach the Hugging Face hub", url, "hf:test/tiny:Q4_K_M")
    assert time.perf_counter() - t0 < 5  # refused is refused: no retry loop


def test_not_cached_without_auto_pull(fake):
    with pytest.raises(LowbitError) as e:
        resolve("hf:test/tiny", auto_pull=False)
    one_line(e, "not in the cache", "lowbit pull hf:test/tiny")
    assert not fake.requests


def test_safetensors_repo_is_a_directory(fake):
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                             "b": "model-00002-of-00002.safetensors"}}
    fake.repos["test/st"] = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}",
                             "tokenizer_config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
                             "model-00001-of-00002.safetensors": b"\1" * 3000,
                             "model-00002-of-00002.safetensors": b"\2" * 2000,
                             "consolidated.safetensors": b"\3" * 5000, "pytorch_model.bin": b"\4" * 10,
                             "onnx/model.onnx": b"\5"}
    d = pull("hf:test/st")
    assert d.is_dir() and (d / "config.json").read_bytes() == b'{"model_type": "llama"}'
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model-00001-of-00002.safetensors",
                                                   "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                                   "tokenizer.json", "tokenizer_config.json"]
    n = len(fake.requests)
    assert resolve("hf:test/st") == d and len(fake.requests) == n  # cached: no network
    got = {m.name: m for m in list_models()}
    assert got["hf:test/st"].format == "safetensors" and got["hf:test/st"].size == 5000
    with pytest.raises(LowbitError) as e:
        pull("hf:test/st:Q4_K_M")
    one_line(e, "no GGUF", "safetensors", "drop :Q4_K_M")


def test_resume_after_a_dropped_connection(fake, tiny, monkeypatch):
    """The connection drops after 40 KB of the first GET; huggingface_hub's http_get asks for the rest
    with a Range header (from the last whole chunk written: 16 KiB chunks here, 10 MiB by default)."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    fake.cut_after["tiny-Q4_K_M.gguf"] = 40_000
    path = pull("hf:test/tiny:Q4_K_M")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(tiny).hexdigest()
    gets = fake.seen("GET", "tiny-Q4_K_M.gguf")
    assert len(gets) == 2 and "range" not in gets[0] and gets[1]["range"] == "bytes=32768-", gets


def test_resume_across_runs(home, tmp_path):
    """Ctrl-C mid-download keeps blobs/<sha256>.incomplete; the next pull asks only for the rest.
    (huggingface_hub itself deletes its partial file on failure.) 12 MB: the client writes 10 MiB chunks."""
    big = os.urandom(12_000_000)
    sha = hashlib.sha256(big).hexdigest()
    fake = FakeHub(repos={"test/big": {"big-Q4_K_M.gguf": big}}, hold_after={"big-Q4_K_M.gguf": 11_000_000})
    part = home / "hub" / "models--test--big" / "blobs" / f"{sha}.incomplete"
    with fake.serving() as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_HOME=str(home), HF_ENDPOINT=url)
        p = subprocess.Popen([*LOWBIT, "pull", "hf:test/big"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not (part.exists() and part.stat().st_size >= constants.DOWNLOAD_CHUNK_SIZE):
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()
                time.sleep(0.02)
            p.send_signal(signal.SIGINT)  # what Ctrl-C does
            out, err = p.communicate(timeout=30)
        finally:
            p.kill()
        assert p.returncode == 130, err
        assert part.stat().st_size == constants.DOWNLOAD_CHUNK_SIZE
        fake.release.set()
        r = run_cli(["pull", "hf:test/big"], home, url)
        assert r.returncode == 0, r.stderr
        path = Path(r.stdout.strip())
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
        assert "resuming big-Q4_K_M.gguf" in r.stderr
        gets = fake.seen("GET", "big-Q4_K_M.gguf")
        assert len(gets) == 2 and gets[1]["range"] == f"bytes={constants.DOWNLOAD_CHUNK_SIZE}-", gets
        assert not part.exists()


def test_hash_mismatch_leaves_nothing(fake, home):
    fake.bad_etag.add("tiny-Q4_K_M.gguf")
    with pytest.raises(LowbitError) as e:
        pull("hf:test/tiny")
    one_line(e, "does not match the hub's hash", "run the pull again")
    blobs = home / "hub" / "models--test--tiny" / "blobs"
    assert not list(blobs.iterdir())


def test_offline_after_pull(fake, tiny, monkeypatch):
    path = pull("hf:test/tiny:Q4_K_M")
    n = len(fake.requests)
    assert resolve("hf:test/tiny:Q4_K_M") == path and resolve("hf:test/tiny") == path
    assert resolve("test/tiny") == path  # a bare repo id in the cache
    assert len(fake.requests) == n  # cached and named exactly: no network at all
    point_at(monkeypatch, closed_port())  # the hub is gone
    assert resolve("hf:test/tiny:Q4_K_M") == path
    said = []
    assert pull("hf:test/tiny:Q4_K_M", progress=said.append) == path  # pull falls back to the cache
    assert "cannot reach the Hugging Face hub" in said[0] and "using the cached" in said[0]
    with pytest.raises(LowbitError) as e:  # not there, and nowhere to get it from
        resolve("hf:test/tiny:Q8_0")
    one_line(e, "cannot reach the Hugging Face hub")


def test_gated_repo_and_token(fake, tiny, monkeypatch):
    fake.repos["test/gated"] = {"g-Q4_K_M.gguf": tiny}
    fake.gated.add("test/gated")
    with pytest.raises(LowbitError) as e:
        pull("hf:test/gated")
    one_line(e, "gated", "HF_TOKEN", "test/gated")
    fake.requests.clear()
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    assert pull("hf:test/gated").read_bytes() == tiny
    for method, needle in (("GET", "/api/models/test/gated"), ("HEAD", "g-Q4_K_M.gguf"), ("GET", "g-Q4_K_M.gguf")):
        seen = fake.seen(method, needle)
        assert seen and all(h.get("authorization") == "Bearer hf_good" for h in seen), (method, needle)


# ---- the CLI, in subprocesses --------------------------------------------------------------------

def test_cli_pull_shows_progress_and_prints_the_path(fake, home):
    r = run_cli(["pull", "hf:test/tiny"], home, fake.url)
    assert r.returncode == 0, r.stderr
    path = home / "hub" / "models--test--tiny" / "snapshots" / SHA / "tiny-Q4_K_M.gguf"
    assert r.stdout == f"{path}\n"
    assert "downloading tiny-Q4_K_M.gguf" in r.stderr
    assert re.search(r"tiny-Q4_K_M\.gguf: 100%\|", r.stderr), r.stderr  # the bar, though stderr is a pipe
    quiet = run_cli(["pull", "hf:test/tiny:Q8_0"], home, fake.url, HF_HUB_DISABLE_PROGRESS_BARS="1")
    assert quiet.returncode == 0 and "%|" not in quiet.stderr, quiet.stderr


def test_cli_errors_are_one_line(fake, home):
    for args, needle in ((["pull", "hf:nobody/nothing"], "not found"),
                         (["pull", "hf:test/tiny:Q3_K_S"], "Q4_K_M, Q8_0")):
        r = run_cli(args, home, fake.url)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        line = r.stderr.rstrip("\n")
        assert "\n" not in line and line.startswith("lowbit: error:") and needle in line, r.stderr
    r = run_cli(["pull", "hf:test/tiny"], home, closed_port())
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot reach the Hugging Face hub" in r.stderr


def test_cli_models_and_info_offline(fake, home):
    assert pull("hf:test/tiny").is_file()
    # LOWBIT_NATIVE=0: the plain-torch path; what is tested is finding and loading the file, not the C kernels
    offline = {"HF_HUB_OFFLINE": "1", "LOWBIT_NATIVE": "0"}
    r = run_cli(["models"], home, closed_port(), **offline)
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()[1:]}
    assert rows["hf:test/tiny:Q4_K_M"][1] == "gguf", r.stdout
    r = run_cli(["info", "hf:test/tiny:Q4_K_M"], home, closed_port(), **offline)  # loads the pulled file
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "format: gguf" in r.stdout and "family: llama" in r.stdout and "layers 2, dim 64" in r.stdout, r.stdout
    r = run_cli(["info", "hf:test/tiny:Q8_0"], home, closed_port(), **offline)
    assert r.returncode == 1 and "HF_HUB_OFFLINE" in r.stderr and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
