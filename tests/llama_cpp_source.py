"""llama.cpp's own HF → GGUF converter, from the llama-cpp-python sdist of the installed version.

The wheel carries the library but not `convert_hf_to_gguf.py`; the sdist vendors the whole llama.cpp
tree. `pip download --no-binary` fetches it (76 MB, ~40 s once) and the converter with its matching
gguf-py is unpacked into lowbit's cache, so later runs start at once. Each model file a test needs is
then made the way users' files are made: transformers' checkpoint → this converter → llama.cpp's
quantizer. Nothing is copied into the project.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")  # templates: real chat formats


def cache_dir() -> Path:
    from platformdirs import user_cache_path

    return Path(os.environ.get("LOWBIT_CACHE") or user_cache_path("lowbit")) / "test-tools"


def converter_dir() -> Path:
    """The vendored llama.cpp directory holding convert_hf_to_gguf.py and gguf-py/, fetched once."""
    version = importlib.metadata.version("llama_cpp_python")
    root = cache_dir() / f"llama_cpp_python-{version}"
    tree = root / "llama.cpp"
    if all((tree / w).exists() for w in WANTED):
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary",
                            ":all:", "--no-deps", "-d", tmp],
                           capture_output=True, text=True, timeout=900)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip download of the llama-cpp-python {version} sdist failed: {r.stderr[-2000:]}")
        prefix = f"{sdists[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        part = root / "llama.cpp.part"
        if part.exists():  # left by a run that stopped half-way
            import shutil

            shutil.rmtree(part)
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and any(m.name[len(prefix):].startswith(w) for w in WANTED)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(part, members=members, filter="data")
        if tree.exists():  # an older cache without some of WANTED
            import shutil

            shutil.rmtree(tree)
        part.rename(tree)
    return tree


def convert(tree: Path, hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """convert_hf_to_gguf.py on a checkpoint directory, with the gguf-py it was released with."""
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    r = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
                        "--outtype", outtype], capture_output=True, text=True, env=env, timeout=600, cwd=tree)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir.name}: {r.stderr[-3000:]}")
    return out


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    """llama.cpp's quantizer (llama_model_quantize) with its defaults for `ftype` (Q4_K_M, Q8_0, …)."""
    import ctypes

    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    return dst
