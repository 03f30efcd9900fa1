"""A saved reference (`lowbit eval reference`) and files scored against it (`lowbit eval --reference`), on the
default model. The oracle is the full-vocabulary KL of the same windows, computed here from both models' whole
log-prob rows: the saved file's estimate must lie within its printed 99% interval of it, its floor below it,
and the file must stay small."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from lowbit.runtime.cli.main import main
from lowbit.runtime.eval.candidates import candidate_rows
from lowbit.runtime.eval.evaluate import window_logprobs
from lowbit.runtime.eval.reference import DEFAULT_TAIL_DRAWS, DEFAULT_TOP_K, read
from lowbit.runtime.load.loader import load

pytestmark = pytest.mark.slow
CTX, WINDOWS = 256, 2


@pytest.fixture(scope="module")
def saved(default_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.lbref"
    assert main(["eval", "reference", str(default_gguf), "--ctx", str(CTX), "--chunks", str(WINDOWS),
                 "--out", str(out)]) == 0
    return out


def full_kl(ref_model, model, ids: list[int], kv: str) -> torch.Tensor:
    """KL over the whole vocabulary of one window's scored tokens [n]: the oracle."""
    half = len(ids) // 2
    p = window_logprobs(ref_model, ids, "f16")[half - 1:-1].double()
    q = window_logprobs(model, ids, kv)[half - 1:-1].double()
    return (p.exp() * (p - q)).sum(-1)


def test_the_file_holds_what_it_says_and_stays_small(saved, default_gguf):
    s = read(saved)
    n = WINDOWS * (CTX - CTX // 2)
    assert s.ids.shape == (WINDOWS, CTX) and s.top_ids.shape == (n, DEFAULT_TOP_K)
    assert s.tail_ids.shape == s.tail_lp.shape == (n, DEFAULT_TAIL_DRAWS) and s.log_tail.shape == (n,)
    lm = load(str(default_gguf), "auto", progress=False)
    ids, rows = s.window(1)
    lp = window_logprobs(lm.model, ids, "f16")[CTX // 2 - 1:-1]
    # the saved rows are the model's own: top-k in order, the tail's mass, the draws' log-probs, the next token's
    assert torch.equal(rows["top_ids"].long(), lp.topk(DEFAULT_TOP_K, -1).indices)
    assert torch.allclose(rows["top_lp"], lp.gather(1, rows["top_ids"].long()))
    assert torch.allclose(rows["log_tail"].exp() + rows["top_lp"].exp().sum(-1), torch.ones(len(lp)), atol=1e-5)
    assert torch.allclose(rows["tail_lp"], lp.gather(1, rows["tail_ids"].long()))
    assert not (rows["tail_ids"][:, :, None] == rows["top_ids"][:, None, :]).any()  # draws are from the tail only
    assert torch.allclose(rows["target_lp"], lp.gather(1, torch.tensor(ids[CTX // 2:])[:, None])[:, 0])
    assert s.pieces == [lm.tokenizer.token_bytes(i) for i in range(lm.tokenizer.vocab_size)]
    # the bound: 40 windows of 512 (10,240 scored tokens) in at most 50 MB
    per_token = (saved.stat().st_size - len(b"".join(s.pieces)) - 8 * (len(s.pieces) + 1) - s.ids.numel() * 4) / n
    assert per_token <= (DEFAULT_TOP_K + DEFAULT_TAIL_DRAWS) * 8 + 3 * 4 + 1
    assert 10_240 * per_token + 40 * 512 * 4 + saved.stat().st_size - n * per_token < 50e6


def test_the_command_prints_the_table_and_a_lossless_file_scores_zero(saved, default_gguf, capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert main(["eval", "--reference", str(saved), str(default_gguf), "--weights", "auto,int8", "--kv", "f16",
                 "--no-speed", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "± " in table and "p99.9 KL" in table and "RMS Δp" in table and default_gguf.name in table
    rows = {(r["weights"], r["kv"]): r for r in json.loads(out.read_text())["rows"]}
    lossless = rows[("auto", "f16")]
    assert lossless["kl_mean"] == 0 and lossless["dppl_pct"] == 0 and lossless["top1_pct"] == 100
    assert 0 < rows[("int8", "f16")]["kl_mean"] and rows[("int8", "f16")]["bits_per_weight"] > lossless["bits_per_weight"]


def test_estimates_hold_the_full_kl_within_their_printed_interval(saved, default_gguf):
    s = read(saved)
    held = {w: load(str(default_gguf), w, progress=False) for w in ("int8", "int4-g128")}
    rows = {r.weights: r for r in candidate_rows(s, ["x"], list(held), ["f16"], lambda m, w: held[w])}
    ref = load(str(default_gguf), "f32", progress=False).model  # the oracle's reference: fp32 weights
    for w, lm in held.items():
        full = torch.cat([full_kl(ref, lm.model, s.window(i)[0], "f16") for i in range(WINDOWS)]).mean().item()
        r = rows[w]
        assert abs(r.kl_mean - full) <= r.kl_tail_bound, (w, r.kl_mean, full, r.kl_tail_bound)
        # the interval is narrow enough to rank formats, and the floor (top-k + the log-sum bound) is one
        assert r.kl_lower <= full + 1e-9 and r.kl_tail_bound < 0.2 * full, (w, r)
    assert rows["int8"].kl_mean < rows["int4-g128"].kl_mean


def test_one_candidate_in_memory_at_a_time(saved, default_gguf):
    """The peak is the largest candidate's: each model is gone before the next one loads."""
    s = read(saved)
    s.ids = s.ids[:1]  # one window is enough to see the order of loads
    alive: list[weakref.ref] = []

    def loader(model, w):
        gc.collect()
        assert all(r() is None for r in alive), "the previous candidate is still held"
        lm = load(model, w, progress=False)
        alive.append(weakref.ref(lm.model))
        return lm

    rows = candidate_rows(s, [str(default_gguf)] * 2, ["auto"], ["f16"], loader)
    assert len(rows) == 2 and rows[0].kl_mean == rows[1].kl_mean


def test_refusals_are_one_line(saved, default_gguf, tmp_path, capsys):
    def refused(argv: list[str], says: str) -> None:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("lowbit: error: ") and says in err and err.count("\n") == 1, err

    s = read(saved)

    class Renamed:  # the default model's tokenizer with one token spelled otherwise
        vocab_size = len(s.pieces)

        def token_bytes(self, i):
            return b"<other>" if i == 1000 else s.pieces[i]

    lm = load(str(default_gguf), "int8", progress=False)
    lm.tokenizer = Renamed()
    with pytest.raises(ValueError, match=r"not the reference's .*1 of its 49,152 tokens differ.*id 1000, b'<other>'"):
        candidate_rows(s, ["x"], ["int8"], ["f16"], lambda m, w: lm)
    other = tmp_path / "other.txt"
    other.write_text("Some other text entirely. " * 400)
    refused(["eval", "--reference", str(saved), str(default_gguf), "--text", str(other), "--no-speed"], "is not the text")
    refused(["eval", "--reference", str(default_gguf), "--no-speed"], "not a lowbit reference file")
    refused(["eval", "reference", str(default_gguf), "--out", str(tmp_path / "nope" / "r.lbref")], "no such directory")
    refused(["eval", "reference", str(default_gguf), "--text", str(other), "--ctx", "4096",
             "--out", str(tmp_path / "r.lbref")], "fewer than one window")
