"""lowbit vs llama.cpp at a realistic size, where decode is bound by memory: a model with
SmolLM2-1.7B's shapes, side by side in one run, with GB/s against the machine's streaming bandwidth.

    python tests/bench/decode_large.py [--quants Q4_0,Q4_1] [--threads 2] [--reps 3]
                                       [--decode-tokens 48] [--dir DIR] [--json]

The model (made once, then kept in --dir, default the user cache directory's lowbit/bench): random
weights (seed 0, std 0.02, unit norms) in SmolLM2-1.7B's shapes — dim 2048, 24 layers, 32 heads and
32 KV heads of 64, FFN 8192, 49,152-token vocabulary, tied embeddings — written as an f16 GGUF with
gguf's writer, carrying the default model's tokenizer (its metadata copied), then quantized by
llama.cpp's own quantizer (llama_cpp.llama_model_quantize) to each of --quants, the tied embedding
kept at Q8_0 as in the default model. Decode speed depends on the shapes and layouts only.

Per file, both engines load it once; each repetition decodes --decode-tokens greedy tokens after the
same 20-token prompt through lowbit's engine (paged k8v4 cache, what `lowbit run --fast-greedy` and
`serve` use) and through llama.cpp (eval per token, argmax);
medians. GB/s = bytes of weights read per token (every weight once: the tensors each engine holds)
x tok/s; the machine's streaming bandwidth is measured in the same run (torch sum over a 1 GiB
buffer, the same threads, median of 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_prefill import DEFAULT_PROMPT, cpu_name, llama_decode, lowbit_engine_decode  # noqa: E402

FTYPES = {"Q4_0": 2, "Q4_1": 3}  # llama.h LLAMA_FTYPE_MOSTLY_*
GGML_TYPE_Q8_0 = 8


def default_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("lowbit")) / "bench"


def write_f16_model(path: Path, tokenizer_gguf: Path) -> None:
    """SmolLM2-1.7B's shapes, random weights, the default model's tokenizer → an f16 GGUF (real_models.py's
    writer: one tensor at a time)."""
    from real_models import write_f16

    write_f16(path, "1.7b", tokenizer_gguf)


def quantize(src: Path, dst: Path, quant: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = threads
    params.token_embedding_type = GGML_TYPE_Q8_0  # the tied head, as in the default model
    tmp = str(dst) + ".part"
    if llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), params) != 0:
        sys.exit(f"llama.cpp could not quantize {src} to {quant}")
    Path(tmp).rename(dst)


def model_files(directory: Path, quants: list[str], threads: int) -> dict[str, Path]:
    from lowbit.runtime.load.registry import resolve

    directory.mkdir(parents=True, exist_ok=True)
    src = directory / "smollm2-1.7b-shapes.f16.gguf"
    out = {q: directory / f"smollm2-1.7b-shapes.{q}.gguf" for q in quants}
    if not all(p.exists() for p in out.values()) and not src.exists():
        print(f"writing {src} (random weights, ~3.4 GB, once)", file=sys.stderr, flush=True)
        write_f16_model(src, resolve("smollm2-135m"))
    for q, p in out.items():
        if not p.exists():
            print(f"quantizing to {q} with llama.cpp (once)", file=sys.stderr, flush=True)
            quantize(src, p, q, threads)
    return out


def stream_gbs(threads: int) -> float:
    """Bytes per second a reduction over 1 GiB (far larger than any cache) reads, median of 5."""
    x = torch.ones(256 << 20)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quants", default="Q4_0,Q4_1", help="comma-separated: Q4_0, Q4_1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--dir", type=Path, default=None, help="where the model files are made and kept")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    quants = [q.strip() for q in a.quants.split(",") if q.strip()]
    if bad := [q for q in quants if q not in FTYPES]:
        sys.exit(f"unknown quant {bad[0]!r}; choose from {', '.join(FTYPES)}")
    import llama_cpp

    from lowbit.kernels import cpu_native
    from lowbit.runtime.load.loader import load

    torch.set_num_threads(a.threads)
    files = model_files(a.dir or default_dir(), quants, a.threads)
    kernels = cpu_native.native()
    bandwidth = stream_gbs(a.threads)
    n = a.decode_tokens
    results = {}
    for q, path in files.items():
        lm = load(str(path), progress=False)
        prompt = lm.tokenizer.encode(DEFAULT_PROMPT, add_special=False)
        llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + n + 8, n_batch=64, n_threads=a.threads,
                              n_threads_batch=a.threads, verbose=False)
        sizes = {"lowbit": lm.weight_bytes, "llama.cpp": int(llama_cpp.llama_model_size(llm.model))}
        lowbit_engine_decode(lm, prompt, 2), llama_decode(llm, prompt, 2)  # warm-up
        s = {"lowbit engine": [], "llama.cpp": []}
        for _ in range(a.reps):
            s["lowbit engine"].append(lowbit_engine_decode(lm, prompt, n))
            s["llama.cpp"].append(llama_decode(llm, prompt, n))
        med = {k: statistics.median(v) for k, v in s.items()}
        results[q] = {"weight_bytes": sizes, "tok_s": {k: round(v, 2) for k, v in med.items()},
                      "samples": {k: [round(x, 2) for x in v] for k, v in s.items()},
                      "gb_s": {k: round(sizes["llama.cpp" if k == "llama.cpp" else "lowbit"] * v / 1e9, 2)
                               for k, v in med.items()}}
        del lm, llm
    out = {"cpu": cpu_name(), "isa": kernels.isa if kernels else None, "threads": a.threads, "reps": a.reps,
           "decode_tokens": n, "stream_gb_s": round(bandwidth, 2), "models": results}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"CPU {out['cpu']}; lowbit's matmuls on {out['isa']}; {a.threads} threads, {a.reps} reps, "
          f"{n} tokens after a {len(prompt)}-token prompt")
    print(f"streaming read bandwidth (torch sum over 1 GiB): {bandwidth:.1f} GB/s")
    print(f"{'model':<24}{'engine':<20}{'weights MB':>11}{'tok/s':>8}{'GB/s':>7}{'% of bw':>9}{'vs llama.cpp':>14}")
    for q, r in results.items():
        for k, tps in r["tok_s"].items():
            mb = r["weight_bytes"]["llama.cpp" if k == "llama.cpp" else "lowbit"] / 1e6
            print(f"{'1.7B shapes ' + q:<24}{k:<20}{mb:>11.1f}{tps:>8.2f}{r['gb_s'][k]:>7.1f}"
                  f"{100 * r['gb_s'][k] / bandwidth:>8.0f}%{tps / r['tok_s']['llama.cpp']:>13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
