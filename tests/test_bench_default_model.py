"""`lowbit bench` as users run it (the CLI in a subprocess) against `lowbit serve` on the default
model, at concurrency 1 and 4: every request succeeds and the result file has the documented
fields (runtime/bench/client.py's RESULT_FIELDS, listed in the README) with sensible values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_against_lowbit_serve(lowbit_server, tmp_path):
    from lowbit.runtime.bench.client import RESULT_FIELDS

    base, _, _ = lowbit_server
    out = tmp_path / "result.json"
    # the server's root, as vLLM's benchmark takes it: bench finds the API under /v1
    r = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "bench", "--base-url", base,
                        "--api-key", "sk-acceptance", "--concurrency", "1,4", "--num-prompts", "4",
                        "--input-len", "64", "--output-len", "16", "--ignore-eos", "--out", str(out),
                        "--slo", "ttft=60000"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and doc["base_url"] == base + "/v1"
    assert {"date", "config", "versions", "results", "label"} <= set(doc) and "requests" not in doc
    assert [row["max_concurrency"] for row in doc["results"]] == [1, 4]
    for row in doc["results"]:
        assert set(RESULT_FIELDS) <= set(row)
        assert row["completed"] == 4 and row["failed"] == 0 and row["errors"] == []
        assert row["total_output_tokens"] == 4 * 16 and row["output_tokens_counted"] == ["usage"]
        assert row["total_input_tokens"] > 4 * 64  # the passage plus the chat template's tokens
        for name in RESULT_FIELDS:
            if name.endswith("_ms"):
                assert isinstance(row[name], float) and row[name] >= 0, name
        assert 0 < row["median_ttft_ms"] <= row["median_e2el_ms"]
        assert row["request_goodput"] == row["request_throughput"]  # a 60 s TTFT limit: all meet it
    assert "c=4" in r.stdout and "TTFT p50" in r.stdout  # the console table


def test_bench_exits_non_zero_when_nothing_succeeds(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "bench", "--base-url", "http://127.0.0.1:9/v1",
                        "--model", "x", "--num-prompts", "2", "--warmup", "0", "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "no request succeeded" in r.stderr and "ConnectError" in r.stdout
