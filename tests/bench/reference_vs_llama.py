"""A saved reference against llama.cpp's own KL (issue 43's held-out check), on the default model.

    python -P tests/bench/reference_vs_llama.py [--text FILE] [--ctx 512] [--chunks 10] [--work DIR]

The default model's weights are written out as an F32 GGUF (`lowbit quantize --weights f32`), llama.cpp's
quantizer makes Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0 files of it, and the F32 file is saved as a reference
(`lowbit eval reference`). Each file is then scored three ways over the same windows (second halves):

- lowbit against the saved reference (top-64 exact + 128 tail draws; what `lowbit eval --reference` prints);
- lowbit's full-vocabulary KL against the F32 model's full log-probs (the figure the estimate must hold
  within its printed interval);
- llama.cpp's KL as `llama-perplexity --kl-divergence` computes it: llama-cpp-python's logits of the F32
  file against its logits of each quantized file (its 8-bit activations included, on both sides).

Prints one row per file and whether the three orderings agree.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lowbit.runtime.bench.client import DEFAULT_TEXT  # noqa: E402
from lowbit.runtime.eval.evaluate import window_logprobs, windows  # noqa: E402
from lowbit.runtime.eval.reference import build_reference  # noqa: E402
from lowbit.runtime.eval.topk_kl import TopkScores  # noqa: E402
from lowbit.runtime.load.loader import load  # noqa: E402
from lowbit.runtime.load.registry import resolve  # noqa: E402
from tests.llama_cpp_source import quantize  # noqa: E402

TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")


def llama_logprobs(path: Path, ctx: int):
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=ctx, n_batch=ctx, logits_all=True, verbose=False, n_threads=2)

    def run(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32)).log_softmax(-1)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--work", default=None, help="folder for the GGUF files (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="lowbit-refcheck-"))
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / "default.F32.gguf"
    if not f32.exists():
        subprocess.run([sys.executable, "-P", "-m", "lowbit.runtime.cli", "quantize", str(resolve(None)),
                        "--weights", "f32", "--out", str(f32)], check=True)
    files = {t: work / f"default.{t}.gguf" for t in TYPES}
    for t, p in files.items():
        if not p.exists():
            quantize(f32, p, t)
    ref = load(str(f32), "auto", progress=False)
    ids = ref.tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"), add_special=False)
    wins = windows(ids, args.ctx, args.chunks)
    saved = build_reference(ref.model, ref.tokenizer, ids, args.ctx, args.chunks)
    half = args.ctx // 2
    base = llama_logprobs(f32, args.ctx)
    # both references' full rows, once (windows x [ctx/2, V] fp32: 0.5 GB each at 10 windows of 512)
    ours = [window_logprobs(ref.model, w, "f16")[half - 1:-1] for w in wins]
    theirs_ref = [base(w)[half - 1:-1] for w in wins]
    del base
    print(f"{len(wins)} windows of {args.ctx} tokens of {Path(args.text).name}; reference {f32.name}\n")
    print("| file | lowbit vs saved ref | lowbit full-logit KL | inside? | llama.cpp KL | lowbit / llama.cpp |")
    print("|---|---:|---:|---|---:|---:|", flush=True)
    rows = {}
    for t, p in files.items():
        cand = load(str(p), "auto", progress=False)
        peer = llama_logprobs(p, args.ctx)
        est, full, theirs = TopkScores(), [], []
        for i, w in enumerate(wins):
            _, rows_i = saved.window(i)
            got = window_logprobs(cand.model, w, "f16")[half - 1:-1]
            est.add(rows_i, got, torch.tensor(w[half:]))
            lp = ours[i].double()
            full.append((lp.exp() * (lp - got.double())).sum(-1))
            b, q = theirs_ref[i].double(), peer(w)[half - 1:-1].double()
            theirs.append((b.exp() * (b - q)).sum(-1))
        s = est.summary()
        e, bound = s["kl_mean"], s["kl_tail_bound"]
        f, ll = float(torch.cat(full).mean()), float(torch.cat(theirs).mean())
        rows[t] = (e, bound, f, ll)
        print(f"| {t} | {e:.5f} ± {bound:.1e} | {f:.5f} | {'yes' if abs(e - f) <= bound else 'NO'} | {ll:.5f} | "
              f"{e / ll:.3f} |", flush=True)
        del cand, peer
    order = [sorted(rows, key=lambda t: rows[t][j]) for j in (0, 2, 3)]
    print(f"\norder (least KL first): saved ref {order[0]}, full {order[1]}, llama.cpp {order[2]}: "
          f"{'agree' if order[0] == order[1] == order[2] else 'DIFFER'}")


if __name__ == "__main__":
    main()
