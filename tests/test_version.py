"""`lowbit --version`, GET /version (llama-server's) and Ollama's /api/version name the version pyproject.toml
gives the installed package, as `ollama --version` and llama-server do; /version without the API key."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import torch

from tests.helpers import ByteTokenizer, serving
from tests.test_tools import tiny_app

VERSION = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]


def test_the_command_prints_its_version():
    out = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "--version"], capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == f"lowbit {VERSION}", out


def test_the_server_reports_its_version_without_the_key():
    with serving(tiny_app(ByteTokenizer(), api_key="sk-x")) as base:
        v = httpx.get(base + "/version", timeout=30).json()
        assert v["version"] == VERSION and v["torch"] == torch.__version__
        assert v["python"] == ".".join(map(str, sys.version_info[:3]))
        assert httpx.get(base + "/api/version", timeout=30).json()["lowbit"] == VERSION
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 401  # the rest keeps its key
