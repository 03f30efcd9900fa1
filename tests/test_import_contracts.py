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
