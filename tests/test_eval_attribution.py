"""`lowbit eval --reference REF MODEL --weights L --attribute`: the KL of each tensor alone at L, and with a
quantized --kv of each layer's K and V alone. On the default model cut to 2 layers (its Q4_1 blocks as stored,
tests/helpers.py truncated) and one window of 128 tokens, so that every part is scored in ~20 s on 2 busy
cores. The oracle for a row is a model built whole (Llama from a plain dict) with that one tensor at L, scored
the same way; the whole default model's figures (210 tensors) are in docs/quality.md."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
import torch

from lowbit.models.backend import select_backend
from lowbit.models.llama import Llama
from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.cli.main import main
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.runner import Chunk, Runner
from lowbit.runtime.eval.attribution import block, first_windows, side_alone, swapped
from lowbit.runtime.eval.candidates import score
from lowbit.runtime.eval.evaluate import window_logprobs
from lowbit.runtime.eval.reference import ROWS, SavedReference, read
from lowbit.runtime.load.gguf_file import GGUFFile
from lowbit.runtime.load.loader import read_weights
from tests.helpers import truncated

pytestmark = pytest.mark.slow
KINDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@pytest.fixture(scope="module")
def cut(default_gguf, tmp_path_factory):
    """(2-layer GGUF, its reference over one window of 128, the CLI's int4-g128 attribution JSON, its stdout,
    the heat map)."""
    d = tmp_path_factory.mktemp("attribution")
    src = truncated(GGUFFile(default_gguf), d / "cut.gguf", 2)
    ref = d / "ref.lbref"
    assert main(["eval", "reference", str(src), "--ctx", "128", "--chunks", "1", "--out", str(ref)]) == 0
    return src, ref, d


@pytest.fixture(scope="module")
def ran(cut):
    """The CLI's int4-g128 attribution of the cut: (its JSON, what it printed, the heat map)."""
    src, ref, d = cut
    out, png, printed = d / "attr.json", d / "heat.png", io.StringIO()
    with redirect_stdout(printed):
        assert main(["eval", "--reference", str(ref), str(src), "--weights", "int4-g128", "--attribute",
                     "--attribute-out", str(out), "--plot", str(png)]) == 0
    return json.loads(out.read_text()), printed.getvalue(), png


def test_the_command_prints_the_table_and_writes_every_row_and_the_heat_map(ran):
    doc, printed, png = ran
    parts = doc["parts"]
    assert sorted((p["layer"], p["kind"]) for p in parts) == sorted((i, k) for i in range(2) for k in KINDS)
    assert doc["baseline"]["kl_mean"] == 0  # the reference-layout model is the reference's own
    assert all(p["kl_mean"] > 0 and p["bytes_saved"] > 0 for p in parts)  # int4-g128 is smaller than Q4_1
    assert doc["sum_kl"] == pytest.approx(sum(p["kl_mean"] for p in parts), rel=1e-12)
    top = max(parts, key=lambda p: p["kl_mean"])
    lines = printed.splitlines()
    first = lines[lines.index(next(x for x in lines if x.startswith("|---"))) + 1]
    assert first.startswith(f"| {top['kind']} | {top['layer']} | ")  # the most sensitive first
    assert "Whole candidate: KL" in printed and "sum of the 14 parts" in printed
    assert "embed: the same layout in both" in printed  # tied table kept at the file's Q8_0 under int4-g128
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_are_models_built_whole_with_that_one_tensor_quantized(ran, cut):
    doc, _, _ = ran
    src, ref, _ = cut
    saved, backend = read(ref), select_backend("auto", "float16")
    config, ref_w = read_weights(src, "auto")
    _, cand_w = read_weights(src, "int4-g128")
    got = {f"layers.{p['layer']}.{p['kind']}": p["kl_mean"] for p in doc["parts"]}
    for name in ("layers.0.wv", "layers.1.w_gate"):
        mixed = {k: cand_w[k] if k == name else ref_w[k] for k in ref_w}  # a plain dict: no Mixed, no swap
        oracle = score(saved, Llama(config, mixed, backend).eval(), ["f16"])[0]["kl_mean"]
        assert got[name] == pytest.approx(oracle, abs=1e-9)


def test_unswapped_and_swapped_back_models_score_exactly_zero(cut):
    src, ref, _ = cut
    saved, backend = read(ref), select_backend("auto", "float16")
    config, ref_w = read_weights(src, "auto")
    model = Llama(config, ref_w, backend).eval()
    assert score(saved, model, ["f16"])[0]["kl_mean"] == 0
    original, fused = model.layers[1], model.fused_layers
    with swapped(model, 1, block(model, 1, ref_w)):  # the same block rebuilt from the same weights
        assert model.layers[1] is not original
        assert score(saved, model, ["f16"])[0]["kl_mean"] == 0
    assert model.layers[1] is original and model.fused_layers is fused


def test_a_pool_of_per_layer_formats_quantizes_only_its_one_side(cut):
    """K of layer 0 alone at k4v4's 4 bits: its codes are the uniform k4v4 pool's (layer 0 reads the embeddings,
    the same either way), every other side is f16's own values, attention then reads un-rotated keys, and a
    per-layer list of one format is that format, bit for bit."""
    src, ref, _ = cut
    config, ref_w = read_weights(src, "auto")
    model = Llama(config, ref_w, select_backend("auto", "float16")).eval()
    ids = read(ref).window(0)[0][:48]

    def run(fmt, layers=None):
        pool = KVPool(KV_FORMATS[fmt], config.n_kv_layers, config.n_kv_heads, config.head_dim, num_pages=3,
                      page_size=16, layer_formats=layers)
        Runner(model, pool).run([Chunk(ids, 0, list(range(48)), [0, 1, 2], logits=48)], exact=True)
        return pool

    mixed, k4v4, f16 = run("f16", side_alone(config, KV_FORMATS["k4v4"], 0, "K")), run("k4v4"), run("f16")
    assert mixed.rot is not None and mixed.side(0, "k").bits == 4 and mixed.side(0, "v").bits == 16
    for t in ("codes", "scales", "mins"):
        assert torch.equal(getattr(mixed.side(0, "k"), t), getattr(k4v4.side(0, "k"), t))
    assert torch.equal(mixed.side(0, "v").data, f16.side(0, "v").data)
    assert mixed.side(1, "k").bits == mixed.side(1, "v").bits == 16
    assert not torch.equal(mixed.side(1, "k").data, f16.side(1, "k").data)  # layer 1 saw layer 0's quantized keys
    assert torch.equal(window_logprobs(model, ids, "k8v4"), window_logprobs(model, ids, [KV_FORMATS["k8v4"]] * 2))


def test_kv_sides_alone_at_k4v4(cut, capsys):
    src, ref, d = cut
    out = d / "kv.json"
    assert main(["eval", "--reference", str(ref), str(src), "--kv", "k4v4", "--attribute",
                 "--attribute-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted((p["layer"], p["kind"]) for p in doc["parts"]) == [(0, "K"), (0, "V"), (1, "K"), (1, "V")]
    # the oracle: the whole model run over a pool with that one side quantized (no replayed layers)
    config, ref_w = read_weights(src, "auto")
    model = Llama(config, ref_w, select_backend("auto", "float16")).eval()
    oracle = score(read(ref), model, [side_alone(config, KV_FORMATS["k4v4"], 1, "V")])[0]["kl_mean"]
    row = next(p for p in doc["parts"] if (p["layer"], p["kind"]) == (1, "V"))
    assert row["kl_mean"] == pytest.approx(oracle, abs=1e-9)
    # 3 KV heads x (f16's 128 bytes - 4 bits' 32 + scale and min per 32: 40) per side and token
    assert all(p["bytes_saved"] == 3 * (128 - 40) and 0 < p["kl_mean"] < doc["whole"]["kl_mean"] for p in doc["parts"])
    assert "| KV side | layer |" in capsys.readouterr().out


def test_first_windows_keeps_their_rows(cut):
    s = read(cut[1])
    rows = {k: torch.cat([getattr(s, k)] * 2) for k in ROWS}
    two = SavedReference(torch.cat([s.ids, s.ids.flip(1)]), **rows, pieces=s.pieces, meta={**s.meta, "windows": 2})
    one = first_windows(two, 1)
    assert torch.equal(one.ids, s.ids) and all(torch.equal(getattr(one, k), getattr(s, k)) for k in ROWS)
    assert one.meta["windows"] == 1 and first_windows(two, 5) is two


def test_refusals_are_one_line(cut, tmp_path, capsys):
    src, ref, _ = cut

    def refused(argv: list[str], says: str) -> None:
        assert main(["eval", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("lowbit: error: ") and says in err and err.count("\n") == 1, err

    refused(["--reference", str(ref), str(src), str(src), "--weights", "int8", "--attribute"], "one candidate")
    refused(["--reference", str(ref), str(src), "--weights", "int8,int4-g128", "--attribute"], "one candidate")
    refused(["--reference", str(ref), str(src), "--kv", "f16,k8v4", "--attribute"], "one candidate")
    refused(["--model", str(src), "--weights", "int8", "--attribute"], "--attribute needs --reference")
    refused(["--reference", str(ref), str(src), "--weights", "int8", "--attribute-out", "a.json"],
            "go with --attribute")
    refused(["--reference", str(ref), str(src), "--attribute"], "nothing to attribute")
    refused(["--reference", str(ref), str(src), "--weights", "int8", "--attribute", "--attribute-windows", "0"],
            "--attribute-windows must be >= 1")
    refused(["--reference", str(ref), str(src), "--weights", "int8", "--attribute", "--plot",
             str(tmp_path / "nope" / "h.png")], "no such directory")
