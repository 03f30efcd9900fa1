"""The import direction of DESIGN.md, checked by import-linter's contracts in pyproject.toml:
runtime → models → quant → kernels; inside runtime, cli → server | bench | eval → engine → load,
and bench imports none of the engine; tui imports nothing of ours (it speaks HTTP)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("runtime", "models", "quant", "kernels", "tui")


def test_import_contracts_kept(tmp_path):
    # import-linter finds packages through the filesystem, which an editable install's import hook
    # does not provide, so lay out `lowbit/<subpackage>` as links to the source folders.
    tree = tmp_path / "lowbit"
    tree.mkdir()
    for name in SUBPACKAGES:
        (tree / name).symlink_to(ROOT / name, target_is_directory=True)
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_the_route_contracts_are_there_and_kept(tmp_path):
    """The contracts are in pyproject.toml and import-linter reports each kept (a contract deleted
    from the file fails here, not silently)."""
    tree = tmp_path / "lowbit"
    tree.mkdir()
    for name in SUBPACKAGES:
        (tree / name).symlink_to(ROOT / name, target_is_directory=True)
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    for name in ("runtime -> models -> quant -> kernels", "runtime: cli -> server | bench | eval -> engine -> load",
                 "bench measures any server: it imports none of the engine",
                 "tui speaks HTTP only: it imports nothing of ours"):
        assert f"{name} KEPT" in r.stdout, r.stdout[-2000:]


def test_only_the_backend_picks_the_c_kernels_and_one_decode_path_remains():
    """models/ and runtime/ take lowbit's C kernels from the model's Backend (models/backend.py
    chooses them), and the retired contiguous-cache decode loop is gone for good."""
    import re

    sources = {p.relative_to(ROOT).as_posix(): p.read_text()
               for d in ("models", "runtime") for p in (ROOT / d).rglob("*.py")}
    assert [f for f, s in sources.items() if "cpu_native.native()" in s] == ["models/backend.py"]
    for gone in (r"\bKVCache\b", r"\bContiguousAttention\b", r"\bGraphedDecode\b", r"\bdecode_layers\(",
                 r"\bdecode_attention\("):
        assert not [f for f, s in sources.items() if re.search(gone, s)], gone


def test_the_server_reads_as_routers_over_one_object():
    """Issue 42's shape: no function in runtime/server/ longer than ~60 lines (routes stay short; the
    work is the Frontend's and each dialect's translation)."""
    import ast
    from pathlib import Path

    long = []
    for path in sorted((Path(__file__).parents[1] / "runtime" / "server").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
