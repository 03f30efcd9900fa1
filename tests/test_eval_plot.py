"""The Pareto chart of `lowbit eval`: the frontier by hand, memory at the stated context and batch,
and a real PNG from rows (KL 0 rows included, which a log axis cannot show directly)."""

from __future__ import annotations

import pytest

from lowbit.runtime.eval.plot import frontier, memory_bytes, plot


def test_frontier_by_hand():
    # (memory, KL): b is dominated by a (more memory, more KL); d ties c's memory with more KL;
    # e is the cheapest; f the most faithful
    pts = {"a": (100, 0.01), "b": (150, 0.02), "c": (200, 0.005), "d": (200, 0.006), "e": (50, 0.3), "f": (600, 0.0)}
    names = list(pts)
    assert [names[i] for i in frontier(list(pts.values()))] == ["e", "a", "c", "f"]
    assert frontier([(1, 1), (1, 1)]) == [0, 1]  # equal points dominate neither


def test_memory_is_weights_plus_kv_for_batch_times_ctx():
    assert memory_bytes({"weight_bytes": 1000, "kv_bytes_per_token": 10}, ctx=4096, batch=2) == 1000 + 10 * 4096 * 2


def test_chart_is_written(tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    rows = [{"weights": w, "kv": kv, "weight_bytes": wb, "kv_bytes_per_token": kvb, "kl_mean": kl}
            for w, kv, wb, kvb, kl in [("fp32 (reference)", "f16", 500e6, 23040, 0.0), ("auto", "f16", 98e6, 23040, 0.0),
                                       ("auto", "k8v4", 98e6, 9540, 0.004), ("bnb-nf4", "f16", 92e6, 23040, 0.25),
                                       ("llama.cpp (GGUF)", "q8_0/q4_0", 97e6, 9360, 0.011)]]
    out = tmp_path / "pareto.png"
    best = plot(rows, out, ctx=4096, batch=1)
    # the reference is dominated by the lossless relayout (same KL 0, a fifth of the memory)
    assert [(r["weights"], r["kv"]) for r in best] == [("llama.cpp (GGUF)", "q8_0/q4_0"), ("auto", "k8v4"),
                                                       ("auto", "f16")]
    img = mpimg.imread(out)
    assert img.shape[0] > 400 and img.shape[1] > 600


def _doc(rows, ppl=20.0, ctx=512):
    return {"model": "m.gguf", "text": "t.txt", "ctx": ctx, "windows": 40, "reference": {"ppl": ppl},
            "rows": [{"weights": w, "kv": kv, "weight_bytes": 100, "kv_bytes_per_token": 1, "kl_mean": kl}
                     for w, kv, kl in rows]}


def test_merge_keeps_each_pair_once_and_refuses_different_runs(tmp_path):
    import json

    from lowbit.runtime.eval.plot import merge

    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(_doc([("ref", "f16", 0.0), ("auto", "f16", 0.0), ("auto", "k8v4", 0.004)])))
    b.write_text(json.dumps(_doc([("ref", "f16", 0.0), ("auto", "k4v4", 0.03)])))
    c.write_text(json.dumps(_doc([("ref", "f16", 0.0)], ctx=256)))
    _, rows = merge([a, b])
    assert [(r["weights"], r["kv"]) for r in rows] == [("ref", "f16"), ("auto", "f16"), ("auto", "k8v4"),
                                                       ("auto", "k4v4")]
    with pytest.raises(ValueError, match="different model, text or windows"):
        merge([a, c])


def test_eval_plot_command_merges_runs_into_one_chart(tmp_path, capsys):
    import json

    from lowbit.runtime.cli.main import main

    def full(rows):  # rows as `lowbit eval --out` writes them
        doc = _doc(rows)
        doc["reference"].update(ppl_stderr=0.5, tokens=10240)
        for r in doc["rows"]:
            r.update(bits_per_weight=8.0, ppl=20.0, ppl_stderr=0.5, dppl_pct=0.0, kl_p99=r["kl_mean"] * 5,
                     kl_max=r["kl_mean"] * 9, top1_pct=99.0, tokens=10240, decode_tps=None)
        return doc

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "chart.png"
    a.write_text(json.dumps(full([("fp32 (reference)", "f16", 0.0), ("int8", "f16", 0.003)])))
    b.write_text(json.dumps(full([("fp32 (reference)", "f16", 0.0), ("auto", "k8v4", 0.005)])))
    assert main(["eval", "plot", str(a), str(b), "-o", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("| fp32 (reference) | f16 |") == 1 and "| int8 | f16 |" in table and "| auto | k8v4 |" in table
    assert out.stat().st_size > 10_000
    # a run of another text is refused with one line
    b.write_text(json.dumps({**full([("auto", "k4v4", 0.03)]), "text": "other.txt"}))
    assert main(["eval", "plot", str(a), str(b), "-o", str(out)]) == 1
    assert "different model, text or windows" in capsys.readouterr().err
