"""`lowbit eval` as users run it (the CLI in a subprocess) on the default model, a short run with
bitsandbytes' NF4 and the llama.cpp peer: lossless lowbit weights equal the reference exactly,
llama.cpp's rows exist and sit where llama.cpp is known to sit (its f16 row: mean KL ~3e-3 from
its own kernels), the NF4 row requantizes the Q4_1 file (KL well above 0), and the chart is drawn."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_eval_short_run_with_the_llama_cpp_peer(default_gguf, tmp_path):
    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "eval", "--model", str(default_gguf),
                        "--weights", "auto,bnb-nf4", "--kv", "f16,k8v4", "--ctx", "128", "--chunks", "2", "--no-speed",
                        "--peer", "llama.cpp", "--peer-kv", "f16/f16,q8_0/q4_0", "--out", str(out), "--plot", str(tmp_path / "pareto.png")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    rows = {(row["weights"], row["kv"]): row for row in doc["rows"]}
    assert doc["windows"] == 2 and doc["reference"]["tokens"] == 128
    floor, lossless = rows[("fp32 (reference)", "f16")], rows[("auto", "f16")]
    assert floor["kl_max"] == 0 and floor["dppl_pct"] == 0
    assert lossless["kl_max"] == 0 and lossless["bits_per_weight"] < 6  # Q4_1/Q8_0 kept exactly
    peer = rows[("llama.cpp (GGUF)", "f16/f16")]
    assert 1e-4 < peer["kl_mean"] < 2e-2 and peer["top1_pct"] > 90
    assert rows[("llama.cpp (GGUF)", "q8_0/q4_0")]["kv_bytes_per_token"] == 9360
    assert "| llama.cpp (GGUF) | q8_0/q4_0 |" in r.stdout
    nf4 = rows[("bnb-nf4", "k8v4")]
    # NF4 of the Q4_1 file's values: 4 bits + an fp32 absmax per 64 on the blocks (the Q8_0 table kept)
    assert 1e-2 < nf4["kl_mean"] < 1 and nf4["weight_bytes"] < lossless["weight_bytes"]
    assert "| bnb-nf4 | f16 |" in r.stdout
    assert (tmp_path / "pareto.png").stat().st_size > 10_000
    assert ["auto", "f16"] in doc["plot"]["frontier"] and doc["plot"]["ctx"] == 4096
