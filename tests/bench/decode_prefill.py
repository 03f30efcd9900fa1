"""lowbit vs llama.cpp (llama-cpp-python) on one GGUF, one thread count, one run: CPU speed ratios.

    python tests/bench/decode_prefill.py [--model PATH] [--threads 2] [--reps 3]
                                         [--decode-tokens 128] [--torch-tokens 16] [--text FILE]
                                         [--prompt STR] [--json]

Both engines load the same file once (load seconds reported) and run with the same thread count
(lowbit: torch.set_num_threads; llama.cpp: n_threads = n_threads_batch). Each repetition runs every
measurement for lowbit, then for llama.cpp, so both share the machine's noise; medians and all
samples are reported. Timings are wall clock (time.perf_counter) around the calls, never the
engines' own counters.

- prefill: the first 512 tokens of --text (lowbit's tokenizer, no special tokens) in one call, last
  logits only. lowbit: one chunk of 512 through the runner into a fresh k8v4 pool, as the engine
  prefills a prompt (the integer kernels, blocked over the prompt's rows). llama.cpp: reset(); eval(ids) — reset sets
  n_tokens = 0, so eval drops the whole KV cache and decodes all 512 tokens again in one llama_decode
  (n_batch = n_ubatch = 512).
  tok/s = 512 / seconds.
- decode, engine: what `lowbit run --fast-greedy`, `serve` and `chat` decode with — one greedy
  request through lowbit's engine (paged k8v4 KV cache, every step one C call over the pool), its
  prompt (--prompt, lowbit's tokenizer; same ids for both) prefilled untimed, then --decode-tokens
  steps, end tokens ignored; tok/s = tokens / seconds of those steps. llama.cpp: eval([tok]) and
  argmax of llama_get_logits_ith(ctx, -1) per token (its f16 cache), tok/s = tokens / loop seconds.
- decode, torch only: the engine loop with the C kernels hidden, so every matmul takes the
  plain-torch exact path (what runs where no C compiler is found; "ratio" is against llama.cpp as
  in every row); --torch-tokens steps (default 16: each dequantizes every weight, ~0.4 s).
- decode verified greedy: what `lowbit run --temperature 0` runs (runtime/cli/run.py): the engine
  with an f32 pool and the verifying speculator, the exact model's greedy reply drafted by the fast
  kernels; tok/s = its decode_tok_s (tokens after the first / first-to-last seconds; stops early at
  an end token, tokens reported). Its llama.cpp column is the same plain greedy decode as the engine
  row (llama.cpp has no verify step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = REPO / "tests/data/wikitext2_test_excerpt.txt"
DEFAULT_PROMPT = "The history of the city of Rome, from its founding to the fall of the Western Empire, is"
PREFILL = 512


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), which every figure should be quoted with."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or platform.machine()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def lowbit_prefill(lm, ids):
    from lowbit.runtime.engine.runner import Runner, fresh_pool
    pool, chunks = fresh_pool(lm.model, [list(ids)], logits=[1], kv_format="k8v4")
    Runner(lm.model, pool).run(chunks, None)


def lowbit_engine_decode(lm, prompt, n) -> float:
    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sampler import SamplingParams
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(kv_memory=64 << 20))
    engine.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    engine.step()  # the prompt (and the first token)
    t0, made = time.perf_counter(), 0
    while engine.has_work():
        made += sum(len(d.token_ids) for d in engine.step())
    return made / (time.perf_counter() - t0)


def lowbit_verified(lm, prompt, n) -> tuple[float, int]:
    import dataclasses

    from lowbit.runtime.cli.run import _engine_run
    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.sampler import SamplingParams
    from lowbit.runtime.engine.speculative import VERIFIED_GREEDY
    config = dataclasses.replace(EngineConfig(), kv_format="f32", speculative=VERIFIED_GREEDY)
    r, _ = _engine_run(lm, list(prompt), SamplingParams(temperature=0, max_tokens=n), config, lambda text: None)
    return r.decode_tok_s, len(r.token_ids)


def llama_prefill(llm, ids):
    llm.reset()
    llm.eval(ids)


def llama_decode(llm, prompt, n) -> float:
    import llama_cpp
    def argmax() -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).argmax())
    llm.reset()
    llm.eval(prompt)
    tok = argmax()
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = argmax()
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", help="GGUF path (default: the smollm2-135m alias, pulled if absent)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--torch-tokens", type=int, default=16, help="decode steps of the torch-only row")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="prefill text (first 512 tokens used)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="decode prompt")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    a = ap.parse_args(argv)

    import llama_cpp

    from lowbit.models.backend import torch_backend
    from lowbit.runtime.load.loader import load
    from lowbit.runtime.load.registry import resolve

    path = Path(a.model) if a.model else resolve("smollm2-135m")
    torch.set_num_threads(a.threads)
    from lowbit.kernels import cpu_native
    kernels = cpu_native.native()
    t0 = time.perf_counter()
    lm = load(str(path), progress=False)
    load_lowbit = time.perf_counter() - t0
    lm_torch = load(str(path), progress=False, backend=torch_backend(native=None))  # the torch-only row's
    ids = lm.tokenizer.encode(a.text.read_bytes().decode("utf-8"), add_special=False)[:PREFILL]
    if len(ids) < PREFILL:
        sys.exit(f"{a.text}: only {len(ids)} tokens, need {PREFILL}")
    prompt = lm.tokenizer.encode(a.prompt, add_special=False)
    n = a.decode_tokens
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(str(path), n_ctx=max(PREFILL, len(prompt) + n + 1), n_batch=PREFILL,
                          n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    load_llama = time.perf_counter() - t0

    # warm-up (one-time allocations, kernel selection), not reported
    lowbit_prefill(lm, ids), lowbit_engine_decode(lm, prompt, 4), lowbit_verified(lm, prompt, 4)
    llama_prefill(llm, ids), llama_decode(llm, prompt, 4)

    s = {k: [] for k in ("prefill_lowbit", "prefill_llama", "decode_engine", "decode_lowbit_torch", "decode_llama",
                         "verified_lowbit")}
    verified_tokens = []
    for _ in range(a.reps):
        s["prefill_lowbit"].append(PREFILL / timed(lambda: lowbit_prefill(lm, ids)))
        s["decode_engine"].append(lowbit_engine_decode(lm, prompt, n))
        s["decode_lowbit_torch"].append(lowbit_engine_decode(lm_torch, prompt, a.torch_tokens))
        tps, got = lowbit_verified(lm, prompt, n)
        s["verified_lowbit"].append(tps)
        verified_tokens.append(got)
        s["prefill_llama"].append(PREFILL / timed(lambda: llama_prefill(llm, ids)))
        s["decode_llama"].append(llama_decode(llm, prompt, n))

    med = {k: statistics.median(v) for k, v in s.items()}
    rows = [("prefill 512 tok (tok/s)", "prefill_lowbit", "prefill_llama"),
            ("decode, engine (tok/s)", "decode_engine", "decode_llama"),
            ("decode, torch only", "decode_lowbit_torch", "decode_llama"),
            ("decode verified greedy", "verified_lowbit", "decode_llama")]
    out = {
        "model": path.name, "threads": a.threads, "cpu": cpu_name(), "isa": kernels.isa if kernels else None, "reps": a.reps, "prompt_tokens": len(prompt),
        "decode_tokens": n, "verified_tokens": verified_tokens,
        "load_s": {"lowbit": round(load_lowbit, 3), "llama.cpp": round(load_llama, 3)},
        "metrics": {label: {"lowbit": round(med[lo], 2), "llama.cpp": round(med[ll], 2),
                            "ratio": round(med[lo] / med[ll], 3)} for label, lo, ll in rows},
        "samples": {k: [round(x, 2) for x in v] for k, v in s.items()},
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"model {path.name}, threads {a.threads}, reps {a.reps}, torch {torch.__version__}, "
          f"llama-cpp-python {llama_cpp.__version__}")
    print(f"CPU {cpu_name()}; lowbit's matmuls on {out['isa'] or 'plain torch (no C kernels)'}")
    print(f"load seconds: lowbit {load_lowbit:.2f}, llama.cpp {load_llama:.2f}")
    print(f"{'metric':<27}{'lowbit':>10}{'llama.cpp':>12}{'ratio':>9}")
    for label, lo, ll in rows:
        print(f"{label:<27}{med[lo]:>10.1f}{med[ll]:>12.1f}{med[lo] / med[ll]:>8.2f}x")
    print(f"decode: {len(prompt)}-token prompt, {n} tokens; verified greedy produced {verified_tokens} tokens")
    print("samples (tok/s):")
    for k, v in s.items():
        print(f"  {k:<16} " + "  ".join(f"{x:.1f}" for x in v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
