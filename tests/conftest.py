"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest
import torch

# Tests measure behaviour, not speed; two threads match the CI machine and keep runs comparable.
torch.set_num_threads(min(2, os.cpu_count() or 2))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1), fetched into the model cache by the
    same `lowbit pull` path users take (sha256-checked). LOWBIT_TEST_GGUF overrides it."""
    if os.environ.get("LOWBIT_TEST_GGUF"):
        return Path(os.environ["LOWBIT_TEST_GGUF"])
    from lowbit.runtime.registry import DEFAULT_MODEL, resolve

    return resolve(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_model(default_gguf):
    """The default model loaded once per session with `--weights auto` (lossless layouts)."""
    from lowbit.runtime.loader import load

    return load(str(default_gguf), "auto", progress=False)


@pytest.fixture(scope="session")
def wikitext_excerpt() -> bytes:
    return (Path(__file__).parent / "data" / "wikitext2_test_excerpt.txt").read_bytes()
