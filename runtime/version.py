"""lowbit's version, as `lowbit --version`, GET /version and Ollama's /api/version report it."""

from __future__ import annotations

import platform
from importlib import metadata


def lowbit_version() -> str:
    """The installed package's version (pyproject.toml's), or 0.0.0 when run from a tree never installed."""
    try:
        return metadata.version("lowbit")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def version_info() -> dict:
    """What a bug report needs beside the version: the Python and torch that run it."""
    import torch

    return {"version": lowbit_version(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda}
