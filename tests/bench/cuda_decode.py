"""End-to-end decode speed on CUDA: the default model's shapes, CUDA graphs vs eager, batch buckets, generate.

    python tests/bench/cuda_decode.py [--model PATH] [--dtype float16] [--prefill 128] [--steps 256]
                                      [--batches 1,4,16] [--reps 3] [--gen-tokens 256] [--out DIR]
    TRITON_INTERPRET=1 python tests/bench/cuda_decode.py --smoke --device cpu      (CPU: code paths only)

Model: with --model, that GGUF through lowbit.runtime.load.loader.load (which needs the gguf and
platformdirs packages). Without it, SmolLM2-135M-Instruct's exact config and layouts — every block
matrix int4-g32 (its GGUF's Q4_1), the tied embedding / LM head int8-g32 (Q8_0) — with seeded
random weights (lowbit.models.synthetic): the GGUF (98 MB) cannot reach every GPU machine, and
decode speed depends only on shapes and layouts. The output says which one ran.

Measured, medians over --reps interleaved repetitions, wall clock around device-synchronized calls:
- prefill: --prefill tokens in one forward, batch 1 and batch max(--batches) (ms, tok/s).
- (a) batch-1 decode steps/s, --steps steps after the prefill: GraphedDecode replaying CUDA graphs
  vs GraphedDecode(use_graphs=False) (same model, cache and buffers; eager launches). Each step's
  argmax is fed back on the device: no host sync inside the loop.
- (b) aggregate tok/s (B x steps / seconds) for each B in --batches, CUDA graphs (eager off CUDA).
- (c) with --model (a tokenizer): generate() of --gen-tokens greedy tokens, verify_greedy False and
  True; decode tok/s and TTFT as GenerationResult reports them.
--budget-s: no measurement starts after that many seconds; skipped ones are listed, exit status 3.
--smoke: a 2-layer dim-64 vocab-256 model, 8-token prefill, 4 steps, batches 1 and 2, one rep, and
(c) with a byte tokenizer and 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from lowbit.kernels.triton_import import interpreting, triton
from lowbit.models.backend import select_backend, triton_backend
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import KVCache, Llama

PROMPT = "The history of the city of Rome, from its founding to the fall of the Western Empire, is"
TINY = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                   vocab_size=256, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128, tie_embeddings=True)
SYNTHETIC = ("SYNTHETIC weights (seeded random; SmolLM2-135M-Instruct's shapes and layouts: blocks int4-g32 = "
             "Q4_1, tied embedding/head int8-g32 = Q8_0). Speed depends only on shapes and layouts; "
             "the tokens are meaningless.")


class SmokeBytes:
    """--smoke's tokenizer: one token per byte (vocab 256, no end token), enough to drive generate()."""

    vocab_size, special_ids, eos_ids = 256, frozenset(), frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def token_bytes(self, i: int) -> bytes:
        return bytes([i])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def decode_loop(step, B: int, start: int, n: int, vocab: int, device: torch.device) -> None:
    """n decode steps of B sequences at positions start.. (cache slots 0..B-1), greedy on the device."""
    tok = torch.randint(0, vocab, (B,), device=device)
    pos = torch.full((B,), start, dtype=torch.long, device=device)
    for _ in range(n):
        tok = step(tok, pos).argmax(-1)  # [B, V] → [B]
        pos += 1


def build(a, device: torch.device):
    """(model, config, tokenizer | None, description)."""
    if a.model:
        try:
            from lowbit.runtime.load.loader import load
        except ImportError as e:
            sys.exit(f"--model needs lowbit.runtime.load.loader and its imports ({e}); pip install gguf platformdirs, "
                     "or carry their wheels in .whl/ for gpu_check.sh")
        try:
            lm = load(a.model, "auto", progress=False, device=a.device, dtype=a.dtype)
        except TypeError as e:
            sys.exit(f"lowbit.runtime.load.loader.load does not take device/dtype yet: {e}")
        return lm.model, lm.config, lm.tokenizer, f"{Path(a.model).name} (real weights, GGUF layouts)"
    from lowbit.models.synthetic import SMOLLM2_135M, random_weights

    if device.type == "cuda":
        backend = select_backend(a.device, a.dtype)
    else:  # the Triton kernels interpreted on the CPU, or torch's CPU kernels
        backend = triton_backend("cpu", a.dtype) if interpreting() else select_backend("cpu")
    config = TINY if a.smoke else SMOLLM2_135M
    with torch.no_grad():
        model = Llama(config, random_weights(config, "int4-g32", "int8-g32", seed=a.seed), backend).eval()
    if a.smoke:
        return model, config, SmokeBytes(), "SYNTHETIC weights (seeded random; tiny smoke config, byte tokenizer)"
    return model, config, None, SYNTHETIC


class Bench:
    def __init__(self, a, device: torch.device):
        self.a, self.device, self.t0 = a, device, time.perf_counter()
        self.res: dict = {"prefill": [], "decode_b1": [], "batches": [], "generate": [], "errors": [], "skipped": []}

    def left_s(self) -> float:
        return float("inf") if not self.a.budget_s else self.a.budget_s - (time.perf_counter() - self.t0)

    def attempt(self, name: str, fn) -> None:
        """Run one measurement; a failure is recorded and the next measurement still runs."""
        if self.left_s() <= 0:
            self.res["skipped"].append(name)
            print(f"{name}: skipped, time budget spent", flush=True)
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report every failure, keep measuring the rest
            traceback.print_exc()
            self.res["errors"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(f"{name}: FAILED ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        finally:
            self.write()  # after every measurement: a run killed by a timeout keeps what it measured

    def write(self) -> None:
        if self.a.out and "meta" in self.res:
            out = Path(self.a.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "cuda_decode.json").write_text(json.dumps(self.res, indent=1, default=str))
            (out / "cuda_decode.md").write_text(markdown(self.res))

    def median(self, fn) -> tuple[float, list[float]]:
        samples = [fn() for _ in range(self.a.reps)]
        return statistics.median(samples), [round(s, 3) for s in samples]

    def prefill(self, model, cache: KVCache, prompt: torch.Tensor) -> None:
        for B in sorted({1, prompt.shape[0]}):
            call = partial(model, prompt[:B], cache.rows(B), 0, last_only=True)
            call()  # compiles; the largest batch also fills every cache slot the decode reads
            ms, samples = self.median(lambda call=call: 1e3 * seconds(call, self.device))
            T = prompt.shape[1]
            self.res["prefill"].append({"B": B, "tokens": T, "ms": ms, "tok_s": B * T / ms * 1e3, "samples_ms": samples})
            print(f"prefill B={B} T={T}: {ms:.2f} ms ({B * T / ms * 1e3:.0f} tok/s)", flush=True)

    def decode_b1(self, paths: dict) -> None:
        a, V = self.a, self.vocab
        runs = {name: partial(decode_loop, step, 1, a.prefill, a.steps, V, self.device) for name, step in paths.items()}
        for step in paths.values():
            decode_loop(step, 1, a.prefill, 2, V, self.device)  # compile / capture
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(a.reps):  # interleaved, so both paths share the machine's noise
            for name, run in runs.items():
                samples[name].append(a.steps / seconds(run, self.device))
        for name, s in samples.items():
            med = statistics.median(s)
            self.res["decode_b1"].append({"path": name, "steps_s": med, "ms_per_step": 1e3 / med,
                                          "samples": [round(x, 1) for x in s]})
            print(f"decode B=1 {name}: {med:.1f} steps/s ({1e3 / med:.3f} ms/step)", flush=True)

    def batch(self, step, path: str, B: int) -> None:
        a = self.a
        decode_loop(step, B, a.prefill, 2, self.vocab, self.device)  # compile / capture this bucket
        run = partial(decode_loop, step, B, a.prefill, a.steps, self.vocab, self.device)
        tok_s, samples = self.median(lambda: B * a.steps / seconds(run, self.device))
        self.res["batches"].append({"B": B, "path": path, "tok_s": tok_s, "steps_s": tok_s / B,
                                    "ms_per_step": 1e3 * B / tok_s, "samples": samples})
        print(f"decode B={B} {path}: {tok_s:.1f} tok/s aggregate ({1e3 * B / tok_s:.3f} ms/step)", flush=True)

    def generate(self, model, tokenizer, verify: bool) -> None:
        from lowbit.runtime.engine.generate import generate
        from lowbit.runtime.engine.sampler import Sampler, SamplingParams

        ids = tokenizer.encode(PROMPT)
        run = partial(generate, model, tokenizer, ids, sampler=Sampler(SamplingParams(temperature=0)),
                      verify_greedy=verify)
        run(max_tokens=16)  # warm-up: compiles and captures
        rs = [run(max_tokens=self.a.gen_tokens) for _ in range(self.a.reps)]
        tps = statistics.median(r.decode_tok_s for r in rs)
        ttft = statistics.median(r.ttft_s for r in rs)
        self.res["generate"].append({"verify_greedy": verify, "decode_tok_s": tps, "ttft_ms": 1e3 * ttft,
                                     "tokens": [len(r.token_ids) for r in rs], "finish": rs[0].finish_reason,
                                     "prompt_tokens": len(ids)})
        print(f"generate verify_greedy={verify}: {tps:.1f} tok/s, TTFT {1e3 * ttft:.1f} ms, "
              f"{[len(r.token_ids) for r in rs]} tokens", flush=True)


def compile_only(a, model, cache: KVCache, prompt: torch.Tensor, eager, batches, tokenizer) -> int:
    """Every launch shape of a later run once: prefills, one eager decode step per bucket, a short
    generate per mode (the same kernels the graphs capture; the graphs themselves are not cached)."""
    t0 = time.perf_counter()
    for B in sorted({1, prompt.shape[0]}):
        model(prompt[:B], cache.rows(B), 0, last_only=True)
    for B in batches:
        decode_loop(eager, B, a.prefill, 1, model.config.vocab_size, prompt.device)
    if tokenizer is not None:
        from lowbit.runtime.engine.generate import generate
        from lowbit.runtime.engine.sampler import Sampler, SamplingParams

        for verify in (False, True):
            generate(model, tokenizer, tokenizer.encode(PROMPT), 4, Sampler(SamplingParams(temperature=0)),
                     verify_greedy=verify)
    sync(prompt.device)
    print(f"compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# lowbit decode, {m['device']}", "", f"**Weights: {m['weights']}**", "",
             (f"torch {m['torch']}, triton {m['triton']}, activations {m['dtype']}; config {m['config']}; "
              f"prefill {m['prefill']} tokens, {m['steps']} decode steps, median of {m['reps']} reps."), "",
             "## Prefill", "", "| B | tokens | ms | tok/s |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['B']} | {r['tokens']} | {r['ms']:.2f} | {r['tok_s']:.0f} |" for r in res["prefill"]]
    lines += ["", "## (a) Batch-1 decode", "", "| path | steps/s | ms/step | samples |", "|---|---:|---:|---|"]
    lines += [f"| {r['path']} | {r['steps_s']:.1f} | {r['ms_per_step']:.3f} | {r['samples']} |" for r in res["decode_b1"]]
    if res.get("graphs_vs_eager"):
        lines += ["", f"CUDA graphs vs eager: {res['graphs_vs_eager']:.2f}x"]
    lines += ["", "## (b) Batch buckets", "", "| B | path | tok/s (aggregate) | ms/step | samples |",
              "|---:|---|---:|---:|---|"]
    lines += [f"| {r['B']} | {r['path']} | {r['tok_s']:.1f} | {r['ms_per_step']:.3f} | {r['samples']} |"
              for r in res["batches"]]
    lines += ["", "## (c) generate", ""]
    if res["generate"]:
        lines += ["| verify_greedy | decode tok/s | TTFT ms | tokens | finish |", "|---|---:|---:|---|---|"]
        lines += [f"| {r['verify_greedy']} | {r['decode_tok_s']:.1f} | {r['ttft_ms']:.1f} | {r['tokens']} | "
                  f"{r['finish']} |" for r in res["generate"]]
    else:
        lines += ["Not run: needs a tokenizer, i.e. --model PATH."]
    for key in ("errors", "skipped"):
        if res[key]:
            lines += ["", f"## {key.capitalize()}", ""] + [f"- {e}" for e in res[key]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", help="GGUF path (default: synthetic SmolLM2-135M-shaped weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda[:N] | cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"], help="CUDA activations")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batches", default="1,4,16", help="batch buckets for (b), comma list")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=0, help="start no new measurement after this (0: none)")
    ap.add_argument("--out", help="directory for cuda_decode.md and cuda_decode.json")
    ap.add_argument("--compile-only", action="store_true", help="run each launch shape once (Triton's cache); no timing")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps: code paths only")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: unwind, so the outputs get written
    if a.smoke:
        a.prefill, a.steps, a.batches, a.reps, a.gen_tokens = 8, 4, "1,2", 1, 8
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda, but torch sees no CUDA GPU (CPU smoke: TRITON_INTERPRET=1 ... --smoke --device cpu)")
    if interpreting() and a.dtype == "bfloat16":
        sys.exit("Triton's interpreter computes bf16 tl.dot wrongly (tests/conftest.py); use --dtype float16")
    batches = sorted({int(b) for b in a.batches.split(",") if b})
    torch.manual_seed(a.seed)

    b = Bench(a, device)
    t0 = time.perf_counter()
    model, config, tokenizer, weights = build(a, device)
    print(f"model built in {time.perf_counter() - t0:.1f} s. {weights}", flush=True)
    b.vocab = config.vocab_size
    res = b.res
    res["meta"] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                   f"cpu ({'Triton interpreter' if interpreting() else 'torch kernels'})",
                   "torch": torch.__version__, "triton": getattr(triton, "__version__", "-"), "dtype": a.dtype,
                   "weights": weights, "synthetic": not a.model, "prefill": a.prefill, "steps": a.steps,
                   "reps": a.reps, "smoke": a.smoke, "backend": model.backend.name,
                   "config": {k: getattr(config, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                                              "hidden_dim", "vocab_size", "tie_embeddings")}}
    try:
        from lowbit.runtime.engine.cuda_graphs import GraphedDecode
    except ImportError as e:
        GraphedDecode = None
        res["errors"].append(f"lowbit.runtime.engine.cuda_graphs: {e} (eager steps call model.decode directly)")

    with torch.inference_mode():
        cache = KVCache.empty(config, max(batches), a.prefill + a.steps, device)
        prompt = torch.randint(0, config.vocab_size, (max(batches), a.prefill), generator=torch.Generator().manual_seed(a.seed))
        if not a.compile_only:
            b.attempt("prefill", partial(b.prefill, model, cache, prompt.to(device)))
        eager, graphed = (lambda t, p: model.decode(t, p, cache.rows(t.shape[0]))), None
        try:
            if GraphedDecode is not None:
                eager = GraphedDecode(model, cache, buckets=tuple(batches), use_graphs=False)
                if device.type == "cuda":
                    graphed = GraphedDecode(model, cache, buckets=tuple(batches), use_graphs=True)
        except Exception as e:  # noqa: BLE001 - an API drift is one error line; eager still measures
            res["errors"].append(f"GraphedDecode: {type(e).__name__}: {e} (eager steps call model.decode directly)")
        paths = {"eager": eager} | ({"cuda graphs": graphed} if graphed is not None else {})
        if a.compile_only:  # fill Triton's disk cache for a later run (gpu_check.sh runs this beside pytest)
            return compile_only(a, model, cache, prompt.to(device), eager, batches, tokenizer)
        b.attempt("decode B=1", partial(b.decode_b1, paths))
        d = {r["path"]: r["steps_s"] for r in res["decode_b1"]}
        if len(d) == 2:
            res["graphs_vs_eager"] = d["cuda graphs"] / d["eager"]
            print(f"CUDA graphs vs eager at B=1: {res['graphs_vs_eager']:.2f}x", flush=True)
        for B in batches:
            path = "cuda graphs" if graphed is not None else "eager"
            b.attempt(f"decode B={B}", partial(b.batch, graphed or eager, path, B))
        if tokenizer is not None:
            for verify in (False, True):
                b.attempt(f"generate verify_greedy={verify}", partial(b.generate, model, tokenizer, verify))
    b.write()
    print(f"\n{weights}\n{res['meta']['device']}, {time.perf_counter() - b.t0:.0f} s"
          + ("; SMOKE RUN: code paths only, the speeds are not measurements" if a.smoke else ""))
    if res["skipped"]:
        print(f"INCOMPLETE: skipped for the {a.budget_s:.0f} s budget: {', '.join(res['skipped'])}")
    for e in res["errors"]:
        print(f"ERROR {e}", file=sys.stderr)
    return 1 if res["errors"] else 3 if res["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())
