"""`lowbit fit`: the knapsack on hand-made parts (its steps computed by hand below), then the command on the
default model cut to 2 layers (its Q4_1 blocks as stored) against a reference of one window of 128 tokens, at
three budgets: each recipe within its budget in bytes the built model holds, its measured KL no worse than the
best uniform layout x KV format that fits (and better at one budget at least), the saved recipe scored again
by `lowbit eval --recipe` to the same figure, served by `lowbit serve --recipe`, and written as a GGUF by
`lowbit quantize --recipe`. The whole default model's
figures are in docs/quality.md ("Fitting a budget")."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import httpx
import pytest
import torch

from lowbit.runtime.cli.main import main
from lowbit.runtime.eval.fit import Item, Option, choose, frontier
from lowbit.runtime.load.gguf_file import GGUFFile
from lowbit.runtime.load.loader import load
from lowbit.runtime.load.recipe import read
from tests.helpers import serve_process, truncated

MIB = 1 << 20


def test_frontier_drops_options_that_buy_nothing():
    opts = [Option("a", 10, 0.5), Option("b", 20, 0.0), Option("c", 15, 0.6), Option("d", 12, 0.5)]
    assert [o.label for o in frontier(opts)] == ["a", "b"]  # c: more bytes, more KL; d: more bytes, same KL


def test_the_knapsack_takes_the_most_kl_per_byte_first():
    a = Item("layers.0.wq", 0, "wq", ("layers.0.wq",), [Option("int4-g128", 10, 0.5), Option("auto", 20, 0.0)])
    b = Item("layers.0.V", 0, "V", (), [Option("4", 5, 0.1), Option("8", 8, 0.02), Option("16", 12, 0.0)])
    # from 15 bytes (both smallest), 15 left: A up 0.5/10 = 0.05 per byte beats B to 8 bits (0.08/3 = 0.027) and
    # to 16 (0.1/7 = 0.014): A (5 left); then B to 8 bits (3 bytes, 2 left); B to 16 needs 4 more: stop
    assert choose([a, b], 30) == 2
    assert (a.chosen.label, b.chosen.label) == ("auto", "8")
    assert choose([a, b], 15) == 0 and (a.chosen.label, b.chosen.label) == ("int4-g128", "4")
    with pytest.raises(ValueError, match="1 bytes more"):
        choose([a, b], 14)


@pytest.fixture(scope="module")
def cut(default_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("fit")
    src = truncated(GGUFFile(default_gguf), d / "cut.gguf", 2)
    ref = d / "ref.lbref"
    assert main(["eval", "reference", str(src), "--ctx", "128", "--chunks", "1", "--out", str(ref)]) == 0
    return src, ref, d


# Of the cut's uniform choices at 8k tokens: int4-g128 + k4v4 is 36.33 MiB, the file's Q4_1 + k4v4 36.67, + k8v4
# 37.89, + f16 44.92. The first budget fits only int4-g128 + k4v4; the second k4v4 at either layout and int4-g128
# + k8v4; the third every layout at k8v8
BUDGETS = ("36.6MiB", "37.7MiB", "40MiB")


@pytest.fixture(scope="module")
def fitted(cut):
    src, ref, d = cut
    out = {}
    for budget in BUDGETS:
        path, printed = d / f"recipe-{budget}.json", io.StringIO()
        with redirect_stdout(printed):
            assert main(["fit", str(src), "--reference", str(ref), "--memory", budget, "--ctx", "8k",
                         "--layouts", "int4-g32,int4-g128", "--data", str(d / "data.json"), "--out", str(path)]) == 0
        out[budget] = (path, json.loads(path.read_text()), printed.getvalue())
    return out


@pytest.mark.slow
def test_each_recipe_fits_its_budget_and_beats_or_ties_the_best_uniform_choice(cut, fitted):
    src = cut[0]
    better = 0
    for budget, (path, doc, printed) in fitted.items():
        limit = float(budget.removesuffix("MiB")) * MIB
        m, p = doc["measured"], doc["predicted"]
        assert m["weight_bytes"] + m["kv_bytes"] <= limit, budget
        # the prediction's bytes are exact: the matrices' own sizes
        assert p["weight_bytes"] == m["weight_bytes"] and p["kv_bytes"] == m["kv_bytes"]
        # what the recipe loads to holds those bytes
        assert load(str(src), recipe=read(path), progress=False).weight_bytes == m["weight_bytes"]
        assert len(doc["kv"]) == 2
        best = m["best_uniform"]
        assert best["bytes"] <= limit
        assert m["kl"] <= best["kl"], (budget, m["kl"], best)
        better += m["kl"] < best["kl"]
        assert f"measured {m['kl']:.5f}" in printed and best["weights"] in printed
    assert better >= 1
    # at the tightest budget only int4-g128 + k4v4 fits; the recipe keeps most matrices at Q4_1 instead
    path, doc, _ = fitted["36.6MiB"]
    assert doc["measured"]["best_uniform"]["weights"] == "int4-g128"
    assert doc["measured"]["kl"] < 0.5 * doc["measured"]["best_uniform"]["kl"]


@pytest.mark.slow
def test_eval_scores_the_saved_recipe_to_the_same_kl(cut, fitted):
    src, ref, d = cut
    path, doc, _ = fitted["36.6MiB"]
    out = d / "eval.json"
    assert main(["eval", "--reference", str(ref), str(src), "--recipe", str(path), "--no-speed", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert (row["weights"], row["kv"]) == ("recipe", "per layer")
    assert row["kl_mean"] == pytest.approx(doc["measured"]["kl"], rel=1e-9, abs=1e-12)  # lowbit's own arithmetic
    assert row["weight_bytes"] == doc["measured"]["weight_bytes"]


@pytest.mark.slow
def test_serve_runs_the_recipe(cut, fitted, tmp_path):
    src = cut[0]
    path = fitted["36.6MiB"][0]
    with serve_process([str(src), "--recipe", str(path), "--kv-memory", "16MiB"], tmp_path / "serve.log",
                       ready_s=180) as (base, _proc):
        models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
        assert models[0]["id"] == src.name
        r = httpx.post(base + "/v1/completions", json={"model": src.name, "prompt": "The capital of France is",
                                                       "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    log = (tmp_path / "serve.log").read_text()
    assert "per layer" in log or "k4v4" in log


@pytest.mark.parametrize("doc, needle", [
    ("not json", "is not JSON"),
    ('{"weights": {}, "kv": []}', "is not a lowbit recipe"),
    ('{"lowbit_recipe": 1, "weights": {"default": "int3"}, "kv": []}', "unknown weight format 'int3'"),
    ('{"lowbit_recipe": 1, "weights": {}, "kv": ["k2v4"]}', "unknown KV cache format 'k2v4'"),
    ('{"lowbit_recipe": 1, "weights": {"layers.7.wq": "int8"}, "kv": []}', "names layers.7.wq, which"),
    ('{"lowbit_recipe": 1, "weights": {}, "kv": ["k8v4"]}', "has 1 KV layer formats"),
])
def test_a_bad_recipe_is_one_line(cut, tmp_path, capsys, doc, needle):
    bad = tmp_path / "r.json"
    bad.write_text(doc)
    assert main(["run", "-m", str(cut[0]), "--recipe", str(bad), "--max-tokens", "1", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_fit_refuses_a_budget_nothing_fits(cut, capsys):
    src, ref, _ = cut
    assert main(["fit", str(src), "--reference", str(ref), "--memory", "1MiB", "--layouts", "int4-g128",
                 "--kv-bits", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "does not fit 1MiB" in err and "more --memory" in err


@pytest.mark.slow
def test_quantize_writes_the_recipe_as_a_gguf_that_scores_the_same_and_llama_cpp_reads(cut, tmp_path):
    """A recipe fitted with layouts GGUF has types for (Q4_0, Q8_0) written by `lowbit quantize --recipe`: each
    file tensor in its weights' layout; the file as stored, with the recipe's KV (k4v4 in every layer at this
    budget), scores the recipe's own measured KL exactly (the blocks are lowbit's codes); llama.cpp reads it as
    lowbit does — mean KL 5.9e-4 between their log-probs on a 29-token prompt, top-1 the same everywhere,
    where the source file before quantizing is 5.2e-3 from llama.cpp's reading: the bound 2e-3 tells them apart."""
    from gguf import GGMLQuantizationType as T

    from tests.helpers import Sequences, llama_cpp_logits

    src, ref, _ = cut
    recipe, out = tmp_path / "r.json", tmp_path / "r.gguf"
    assert main(["fit", str(src), "--reference", str(ref), "--memory", "36.5MiB", "--ctx", "8k",
                 "--layouts", "int4-sym-g32,int8-g32", "--out", str(recipe)]) == 0
    doc = json.loads(recipe.read_text())
    assert set(doc["kv"]) == {"k4v4"} and "int4-sym-g32" in doc["weights"].values()
    assert main(["quantize", str(src), "--recipe", str(recipe), "--out", str(out)]) == 0
    written = {t.name: t.tensor_type for t in GGUFFile(out).tensors}
    source = {t.name: t.tensor_type for t in GGUFFile(src).tensors}
    gguf_name = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
                 "w_up": "ffn_up", "w_down": "ffn_down"}
    want = {"int4-sym-g32": T.Q4_0, "int8-g32": T.Q8_0}
    for key, layout in doc["weights"].items():
        if key != "default":
            _, i, kind = key.split(".")
            assert written[f"blk.{i}.{gguf_name[kind]}.weight"] == want[layout], key
    changed = {n for n in written if written[n] != source[n]}
    assert len(changed) == len(doc["weights"]) - 1  # the rest as stored
    scored = tmp_path / "eval.json"
    assert main(["eval", "--reference", str(ref), str(out), "--kv", "k4v4", "--no-speed", "--out", str(scored)]) == 0
    assert json.loads(scored.read_text())["rows"][0]["kl_mean"] == pytest.approx(doc["measured"]["kl"], rel=1e-9)
    lm = load(str(out), progress=False)
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time, there was a little girl "
                              "who lived in a village near the forest.", add_special=True)
    ours = Sequences(lm.model, 1, len(ids)).step(torch.tensor([ids]))[0].log_softmax(-1)  # [T, V]
    theirs = llama_cpp_logits(out, ids).log_softmax(-1)
    kl = (ours.exp() * (ours - theirs)).sum(-1)
    assert float(kl.mean()) < 2e-3 and float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.slow
def test_quantize_refuses_a_recipe_layout_gguf_has_no_type_for(cut, fitted, tmp_path, capsys):
    path, doc, _ = fitted["36.6MiB"]
    assert "int4-g128" in doc["weights"].values()
    assert main(["quantize", str(cut[0]), "--recipe", str(path), "--out", str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert "layout int4-g128 has no GGUF type" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.gguf").exists()
