"""lowbit beside llama.cpp at the sizes people run: random-weight models in Llama-3-8B's and SmolLM2-1.7B's
shapes, quantized by llama.cpp's own quantizer (tests/bench/real_models.py makes and keeps them), each
side in a process of its own so memory is measured alone.

    python tests/bench/real_sizes.py [--models 8b:Q4_K_M,1.7b:Q4_K_M,1.7b:Q4_0] [--reps 3] [--threads 2]
                                     [--decode-tokens 32] [--dir DIR] [--json OUT]

Per file and repetition, one lowbit process and one llama-cpp-python process (their order alternating
from one repetition to the next), each: load the file (seconds: page cache warm after the first), one
untimed 16-token prompt, then
- time to first token at 16 and at 512 prompt tokens: the prompt submitted → the first token chosen
  (lowbit: its engine, as `lowbit run --raw --fast-greedy` and `serve` run a request; llama.cpp: eval of
  the ids, n_batch = n_ubatch = 512, and the argmax of the last logits); prefill tok/s = 512 / that;
- decode tok/s: --decode-tokens greedy tokens after a 16-token prompt (lowbit: engine steps; llama.cpp:
  eval of one token and argmax each);
- peak RSS (getrusage, the whole process), the weight bytes held, the KV cache's bytes.
The prompts are the same random token ids for both (seed 0, ids 100..40000: no tokenizer in the way).
Medians over the repetitions; GB/s = the weight bytes a token reads (lowbit's count: the k chosen experts
of a mixture, the table but a row) x decode tok/s, against a read stream measured in this process (torch
sum over 1 GiB, the same threads). "lowbit memory bound" is the file's tensor bytes +
lowbit's KV pool + 1 GB, the issue's line. Quote the CPU (printed) with any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_models import default_dir, model_file, parse_models  # noqa: E402

SHORT, LONG = 16, 512


def prompt(n: int, seed: int = 0) -> list[int]:
    import numpy as np
    return [int(t) for t in np.random.default_rng(seed + n).integers(100, 40000, n)]


def lowbit_worker(path: str, threads: int, decode: int) -> dict:
    import torch

    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sampler import SamplingParams
    from lowbit.runtime.load.loader import load

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    lm = load(path, progress=False)
    load_s = time.perf_counter() - t0
    engine = Engine(lm.model, lm.tokenizer, EngineConfig())  # the CLI's defaults: k8v4, the pool sized to the model

    def ttft(ids: list[int], tokens: int = 1) -> tuple[float, float]:
        rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        t0, first, n = time.perf_counter(), None, 0
        while engine.has_work():
            for d in engine.step():
                if d.request_id == rid and d.token_ids:
                    first = first or time.perf_counter()
                    n += len(d.token_ids)
        end = time.perf_counter()
        return first - t0, (n - 1) / (end - first) if n > 1 else 0.0

    ttft(prompt(SHORT, 1))  # warm-up
    out = {"load_s": load_s, "ttft_short_s": ttft(prompt(SHORT))[0], "ttft_long_s": ttft(prompt(LONG))[0],
           "decode_tok_s": ttft(prompt(SHORT, 2), decode + 1)[1], "weight_bytes": lm.weight_bytes,
           "read_bytes": lm.model.bytes_per_token(), "kv_bytes": engine.pool.nbytes}
    return out


def llama_worker(path: str, threads: int, decode: int) -> dict:
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=LONG + decode + 64, n_batch=LONG, n_ubatch=LONG, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0

    def ttft(ids: list[int], tokens: int = 1) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        first = time.perf_counter()
        for _ in range(tokens - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        end = time.perf_counter()
        return first - t0, (tokens - 1) / (end - first) if tokens > 1 else 0.0

    ttft(prompt(SHORT, 1))
    return {"load_s": load_s, "ttft_short_s": ttft(prompt(SHORT))[0], "ttft_long_s": ttft(prompt(LONG))[0],
            "decode_tok_s": ttft(prompt(SHORT, 2), decode + 1)[1],
            "weight_bytes": int(llama_cpp.llama_model_size(llm.model)), "read_bytes": 0, "kv_bytes": 0}


def run_worker(side: str, path: Path, threads: int, decode: int, python: str | None = None) -> dict:
    """One side's measurements in a process of its own (llama.cpp's in `python`'s environment if given)."""
    cmd = [python or sys.executable, "-P", __file__, "--worker", side, "--model", str(path), "--threads",
           str(threads), "--decode-tokens", str(decode)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": str(threads)})
    if r.returncode:
        sys.exit(f"the {side} worker failed on {path.name}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cpu() -> str:
    """The CPU's name and which of the instruction sets that change lowbit's kernels it has."""
    from decode_prefill import cpu_name
    from lowbit.kernels.cpu_native import _cpu_flags

    have = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in _cpu_flags()]
    return f"{cpu_name()} ({', '.join(have) or 'AVX2 only'})"


ROWS = [("time to first token, 16 tokens (s)", "ttft_short_s", "lower"),
        ("time to first token, 512 tokens (s)", "ttft_long_s", "lower"),
        ("prefill, 512 tokens (tok/s)", "prefill_tok_s", "higher"),
        ("decode (tok/s)", "decode_tok_s", "higher"),
        ("load (s)", "load_s", "lower"),
        ("peak RSS (GB)", "peak_rss_gb", "lower"),
        ("weights held (GB)", "weight_gb", "lower"),
        ("decode GB/s of weights a token reads", "gb_s", "higher")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--models", default="8b:Q4_K_M,1.7b:Q4_K_M,1.7b:Q4_0", help="shape:ftype, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--dir", type=Path, default=None, help="where the model files are made and kept")
    ap.add_argument("--json", type=Path, default=None, help="write every sample and median here")
    ap.add_argument("--llama-python", default=None,
                    help="the interpreter of another environment to run llama.cpp's side in (a llama-cpp-python "
                         "built for other instruction sets; it needs numpy and llama-cpp-python only)")
    ap.add_argument("--worker", choices=("lowbit", "llama.cpp"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        out = (lowbit_worker if a.worker == "lowbit" else llama_worker)(a.model, a.threads, a.decode_tokens)
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(out))
        return 0
    from lowbit.kernels import cpu_native
    from lowbit.runtime.load.gguf import gguf_tensor_bytes

    import torch
    from decode_large import stream_gbs

    torch.set_num_threads(a.threads)
    native = cpu_native.native()
    bw = stream_gbs(a.threads)
    print(f"CPU: {cpu()}; lowbit's matmuls on {native.isa if native else 'the plain-torch path'}; {a.threads} "
          f"threads; {a.reps} reps; read stream {bw:.1f} GB/s", flush=True)
    report = {"cpu": cpu(), "isa": native.isa if native else None, "threads": a.threads, "stream_gb_s": bw,
              "models": {}}
    for shape, ftype in parse_models(a.models):
        path = model_file(shape, ftype, a.dir or default_dir(), a.threads)
        samples: dict[str, list[dict]] = {"lowbit": [], "llama.cpp": []}
        for rep in range(a.reps):
            for side in (("lowbit", "llama.cpp") if rep % 2 == 0 else ("llama.cpp", "lowbit")):
                s = run_worker(side, path, a.threads, a.decode_tokens, a.llama_python if side == "llama.cpp" else None)
                samples[side].append(s)
        # the weight bytes a token reads (lowbit's count: k of E experts for a mixture, the whole model for a
        # dense one, less the embedding table but a row) are the file's, the same for both sides
        read = samples["lowbit"][0]["read_bytes"]
        for side, v in samples.items():
            for s in v:
                s |= {"prefill_tok_s": LONG / s["ttft_long_s"], "peak_rss_gb": s["peak_rss"] / 1e9,
                      "weight_gb": s["weight_bytes"] / 1e9, "gb_s": read * s["decode_tok_s"] / 1e9}
        med = {side: {k: statistics.median(x[k] for x in v) for k in v[0]} for side, v in samples.items()}
        tensor_bytes = gguf_tensor_bytes(path)
        bound = (tensor_bytes + med["lowbit"]["kv_bytes"] + 1e9) / 1e9
        report["models"][f"{shape}:{ftype}"] = {"file_tensor_bytes": tensor_bytes, "samples": samples, "median": med,
                                                "lowbit_memory_bound_gb": bound}
        print(f"\n{shape} shapes, {ftype} ({tensor_bytes / 1e9:.2f} GB of tensors); lowbit's KV pool "
              f"{med['lowbit']['kv_bytes'] / 2**20:.0f} MiB; lowbit memory bound {bound:.2f} GB")
        print(f"{'metric':<40}{'lowbit':>10}{'llama.cpp':>11}{'lowbit better by':>18}")
        for label, key, better in ROWS:
            lo, ll = med["lowbit"][key], med["llama.cpp"][key]
            ratio = (ll / lo if better == "lower" else lo / ll) if lo and ll else float("nan")
            print(f"{label:<40}{lo:>10.3f}{ll:>11.3f}{ratio:>17.2f}x")
        print(f"{'decode, % of the read stream':<40}{100 * med['lowbit']['gb_s'] / bw:>9.0f}%"
              f"{100 * med['llama.cpp']['gb_s'] / bw:>10.0f}%")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
