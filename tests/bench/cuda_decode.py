"""End-to-end decode on CUDA through the paged engine: prefill, decode with CUDA graphs against eager, greedy replies.

    python tests/bench/cuda_decode.py [--model PATH] [--dtype float16] [--prefill 128] [--steps 256]
                                      [--eager-steps 64] [--batches 1,4,16] [--reps 3] [--gen-tokens 256]
                                      [--out DIR]
    TRITON_INTERPRET=1 python tests/bench/cuda_decode.py --smoke --device cpu      (CPU: code paths only)

Model: with --model, that GGUF through lowbit.runtime.load.loader.load (which needs the gguf and
platformdirs packages). Without it, SmolLM2-135M-Instruct's exact config and layouts — every block
matrix int4-g32 (its GGUF's Q4_1), the tied embedding / LM head int8-g32 (Q8_0) — with seeded
random weights (lowbit.models.synthetic): the GGUF (98 MB) cannot reach every GPU machine, and
decode speed depends only on shapes and layouts. The output says which one ran.

Everything runs the paged path lowbit serves with (runtime/engine: the runner, the engine, its k8v4
KV pool; pure decode steps replayed as CUDA graphs by runtime/engine/cuda_graphs.py unless
EngineConfig(cuda_graphs=False)). Measured, medians over --reps repetitions interleaved across the
variants of each measurement, wall clock around device-synchronized calls:
- prefill: --prefill tokens per sequence as one chunk each through `Runner.run` into a fresh k8v4
  pool (the engine's prefill step less scheduling and sampling; prompt rows exact on CPU, as the
  engine runs them), batch 1 and batch max(--batches) in one forward each (ms, tok/s).
- decode: B concurrent greedy requests (ignore_eos) in one Engine (k8v4, max_num_seqs
  max(--batches)) on random --prefill-token prompts, prefilled untimed, then timed `engine.step()`
  calls (the sampled token goes to the host every step, as in serving): B = 1 (batch-1 decode,
  always measured) and every B in --batches, each in two engines: EngineConfig(cuda_graphs=True)
  (--steps steps; an error where the engine cannot graph) and cuda_graphs=False (eager,
  --eager-steps steps: ~10x slower a step, and tok/s is a rate); tok/s aggregate (tokens / seconds),
  ms per step, and the ratio graphs / eager per B. The script runs on a tree whose EngineConfig
  lacks the field (it imports, and the CPU smoke runs eager only); on CUDA that is one ERROR line and
  exit 1, the eager rows still measured.
- generate, with a tokenizer (--model, or --smoke's byte tokenizer): one request of --gen-tokens
  tokens for PROMPT through runtime/cli/run.py's `_engine_run`, as `lowbit run --temperature 0`
  runs it (verified greedy: an f32 pool and the VERIFIED_GREEDY speculator, the exact model's
  greedy reply drafted by the fast kernels) and as `--fast-greedy` does (plain greedy, k8v4), both
  with the engine's default cuda_graphs (None: graphed where it can be — plain greedy; speculative
  steps run eager); decode tok/s and TTFT as its GenerationResult reports them, and verified
  greedy's draft acceptance.
Each measurement first runs an untimed warm-up of every form it times (compiles the Triton kernels);
--compile-only runs only those warm-ups (gpu_check.sh fills Triton's disk cache with it).
--budget-s: no measurement or repetition starts after that many seconds; skipped ones are listed,
exit status 3. --smoke: a 2-layer dim-64 vocab-256 model, 8-token prefill, 4 steps, batches 1 and 2,
one rep, no warm-ups (--compile-only --smoke runs them), and generate with a byte tokenizer, PROMPT's
first 8 bytes and 8 tokens; on the CPU the "graphs" engine gets cuda_graphs=None (eager there: the
code path only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from lowbit.kernels.triton_import import interpreting, triton
from lowbit.models.backend import select_backend, triton_backend
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.quant.kv import parse_kv_format
from lowbit.runtime.cli.run import _engine_run
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.runner import Chunk, Runner, exact_rows
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.engine.speculative import VERIFIED_GREEDY

PROMPT = "The history of the city of Rome, from its founding to the fall of the Western Empire, is"
TINY = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                   vocab_size=256, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128, tie_embeddings=True)
SYNTHETIC = ("SYNTHETIC weights (seeded random; SmolLM2-135M-Instruct's shapes and layouts: blocks int4-g32 = "
             "Q4_1, tied embedding/head int8-g32 = Q8_0). Speed depends only on shapes and layouts; "
             "the tokens are meaningless.")
KV, PAGE = "k8v4", 16  # the engine's default KV format and page size
VERIFIED_KV = "f32"  # what `lowbit run --temperature 0` pools verified greedy in (runtime/cli/run.py)
MODES = {"greedy": (KV, None), "verified greedy": (VERIFIED_KV, VERIFIED_GREEDY)}  # generate: name → (kv, spec)
GRAPH_MODES = {"graphs": True, "eager": False}  # decode: name → EngineConfig.cuda_graphs
HAS_GRAPHS_FIELD = "cuda_graphs" in {f.name for f in dataclasses.fields(EngineConfig)}


def engine_config(cuda_graphs: bool, device: torch.device, **fields) -> EngineConfig:
    """EngineConfig(cuda_graphs=..., **fields). Off CUDA, True becomes None (eager there: a smoke run's
    code path). A tree without the field: eager is all there is; on CUDA asking for graphs is an error."""
    if not HAS_GRAPHS_FIELD:
        if cuda_graphs and device.type == "cuda":
            raise RuntimeError("EngineConfig has no cuda_graphs field in this tree (runtime/engine/config.py): "
                               "the CUDA-graph decode cannot be measured")
        return EngineConfig(**fields)
    return EngineConfig(cuda_graphs=None if cuda_graphs and device.type != "cuda" else cuda_graphs, **fields)


class SmokeBytes:
    """--smoke's tokenizer: one token per byte (vocab 256, no end token), enough to drive the engine."""

    vocab_size, special_ids, eos_ids = 256, frozenset(), frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def token_bytes(self, i: int) -> bytes:
        return bytes([i])


class TokenIds:
    """What the engine needs of a tokenizer, for the synthetic model's decode runs (random prompt
    ids, no text): every token detokenizes to nothing, none ends a reply."""

    special_ids, eos_ids = frozenset(), frozenset()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def token_bytes(self, i: int) -> bytes:
        return b""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def kv_bytes(kv: str, model, seqs: int, tokens: int) -> int:
    """A KV budget that holds `seqs` sequences of `tokens` tokens each (whole pages), plus 2 pages."""
    c = model.config
    per_token = parse_kv_format(kv).bytes_per_token(c.n_layers, model.kv_heads, c.head_dim)
    return (seqs * -(-tokens // PAGE) + 2) * PAGE * per_token


def build(a, device: torch.device):
    """(model, tokenizer | None, description)."""
    if a.model:
        try:
            from lowbit.runtime.load.loader import load
        except ImportError as e:
            sys.exit(f"--model needs lowbit.runtime.load.loader and its imports ({e}); pip install gguf platformdirs, "
                     "or carry their wheels in .whl/ for gpu_check.sh")
        lm = load(a.model, "auto", progress=False, device=a.device, dtype=a.dtype)
        return lm.model, lm.tokenizer, f"{Path(a.model).name} (real weights, GGUF layouts)"
    from lowbit.models.synthetic import SMOLLM2_135M, random_weights

    if device.type == "cuda":
        backend = select_backend(a.device, a.dtype)
    else:  # the Triton kernels interpreted on the CPU, or torch's CPU kernels
        backend = triton_backend("cpu", a.dtype) if interpreting() else select_backend("cpu")
    config = TINY if a.smoke else SMOLLM2_135M
    with torch.no_grad():
        model = Llama(config, random_weights(config, "int4-g32", "int8-g32", seed=a.seed), backend).eval()
    if a.smoke:
        return model, SmokeBytes(), "SYNTHETIC weights (seeded random; tiny smoke config, byte tokenizer)"
    return model, None, SYNTHETIC


class Bench:
    def __init__(self, a, device: torch.device, model, tokenizer, t0: float):
        self.a, self.device, self.t0 = a, device, t0  # t0: the run's start (the budget counts the model's build)
        self.model, self.tokenizer = model, tokenizer
        self.vocab = model.config.vocab_size if tokenizer is None else min(model.config.vocab_size,
                                                                          tokenizer.vocab_size)
        self.decode_sizes = sorted({1} | set(a.batches))
        self.res: dict = {"prefill": [], "decode": [], "decode_ratio": [], "generate": [], "errors": [],
                          "skipped": []}
        self._engines: dict[str, Engine] = {}  # GRAPH_MODES name → its engine
        # the warm-ups compile; --smoke (nothing timed for real) skips them, --compile-only runs only them
        self.warm = a.compile_only or not a.smoke

    # ---- bookkeeping -----------------------------------------------------------------------------

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

    def interleaved(self, name: str, runs: dict) -> dict:
        """--reps rounds of every run in turn (so the variants share the machine's noise) → each
        run's samples. A round is not started once the budget is spent."""
        samples = {k: [] for k in runs}
        for r in range(self.a.reps):
            if r and self.left_s() <= 0:
                self.res["skipped"].append(f"{name}: reps {r + 1}-{self.a.reps} of {self.a.reps}")
                print(f"{name}: reps {r + 1}-{self.a.reps} skipped, time budget spent", flush=True)
                break
            for k, run in runs.items():
                samples[k].append(run())
        return samples

    # ---- prefill: the runner, a fresh pool ---------------------------------------------------

    def prefill_call(self, B: int):
        """→ a call that prefills B random sequences of --prefill tokens, one chunk each, into a fresh
        k8v4 pool (allocated here, outside the call)."""
        m, T = self.model, self.a.prefill
        c, n = m.config, -(-T // PAGE)
        pool = KVPool(parse_kv_format(KV), c.n_layers, m.kv_heads, c.head_dim, B * n, PAGE, m.device)
        g = torch.Generator().manual_seed(self.a.seed)
        exact = 0  # the engine's prompt rows take the fast kernels (Engine._chunk)
        chunks = []
        for b in range(B):
            pages = list(range(b * n, (b + 1) * n))
            chunks.append(Chunk(torch.randint(0, self.vocab, (T,), generator=g).tolist(), 0,
                                [pages[i // PAGE] * PAGE + i % PAGE for i in range(T)], pages, exact=exact))
        runner = Runner(m, pool)
        rows = exact_rows(chunks, m.device)
        return lambda: runner.run(chunks, rows)

    def prefill(self, warm_only: bool = False) -> None:
        calls = {B: self.prefill_call(B) for B in sorted({1, max(self.a.batches)})}
        if self.warm:
            for call in calls.values():
                call()  # warm-up: compiles
        if warm_only:
            return
        samples = self.interleaved("prefill", {B: (lambda call=call: 1e3 * seconds(call, self.device))
                                               for B, call in calls.items()})
        T = self.a.prefill
        for B, s in samples.items():
            ms = statistics.median(s)
            self.res["prefill"].append({"B": B, "tokens": T, "ms": ms, "tok_s": B * T / ms * 1e3,
                                        "samples_ms": [round(x, 3) for x in s]})
            print(f"prefill B={B} T={T}: {ms:.2f} ms ({B * T / ms * 1e3:.0f} tok/s)", flush=True)

    # ---- decode: engine steps ----------------------------------------------------------------

    def engine(self, mode: str) -> Engine:
        """One engine per GRAPH_MODES name for every decode run: k8v4, room for max(B) sequences of
        prompt + steps with slack, prefix caching off (the prompts are random; no earlier run's pages
        wait to be evicted)."""
        if mode not in self._engines:
            a, B = self.a, max(self.decode_sizes)
            tokens = 2 * a.prefill + max(a.steps, a.eager_steps) + 32
            config = engine_config(GRAPH_MODES[mode], self.device, kv_format=KV, page_size=PAGE, max_num_seqs=B,
                                   kv_memory=kv_bytes(KV, self.model, B, tokens), prefix_caching=False)
            self._engines[mode] = Engine(self.model, self.tokenizer or TokenIds(self.vocab), config)
        return self._engines[mode]

    def decode_modes(self) -> list[str]:
        """The GRAPH_MODES whose engine can be built; an engine that cannot is one error line."""
        modes = []
        for mode in GRAPH_MODES:
            if mode == "graphs" and not HAS_GRAPHS_FIELD and self.device.type != "cuda":
                continue  # CPU, a tree without the field: eager only
            try:
                self.engine(mode)
                modes.append(mode)
            except Exception as e:  # noqa: BLE001 - the other mode is still worth measuring
                msg = f"decode {mode}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if msg not in self.res["errors"]:
                    self.res["errors"].append(msg)
                print(f"{msg}: FAILED", file=sys.stderr, flush=True)  # again as ERROR at the end
        return modes

    def decode_run(self, mode: str, B: int, steps: int, seed: int) -> dict:
        """B requests prefilled untimed, then `steps` timed engine steps → tok/s, ms/step."""
        a, engine = self.a, self.engine(mode)
        g = torch.Generator().manual_seed(seed)
        # more tokens than the timed steps: a request that started decoding while others still
        # prefilled keeps decoding through every timed step; the rest is aborted afterwards
        params = SamplingParams(temperature=0, max_tokens=steps + a.prefill + 16, ignore_eos=True)
        for _ in range(B):
            engine.add_request(torch.randint(0, self.vocab, (a.prefill,), generator=g).tolist(), params)
        sched = engine.scheduler
        while sched.waiting or any(s.num_tokens - s.num_computed > 1 for s in sched.running):
            engine.step()  # every prompt prefilled (and its first token chosen)
        if len(sched.running) != B:
            raise RuntimeError(f"{len(sched.running)} of {B} requests running after the prefill")
        context = sched.running[0].num_tokens
        made = 0

        def run():
            nonlocal made
            for _ in range(steps):
                made += sum(len(d.token_ids) for d in engine.step())

        dt = seconds(run, self.device)
        for rid in list(engine.requests):
            engine.abort(rid)
        if made != B * steps:
            raise RuntimeError(f"{made} tokens from {steps} steps of {B} requests, expected {B * steps}")
        return {"tok_s": made / dt, "ms_per_step": 1e3 * dt / steps, "context": context}

    def decode(self, warm_only: bool = False) -> None:
        a = self.a
        modes = self.decode_modes()
        steps = {"graphs": a.steps, "eager": a.eager_steps}
        if self.warm:
            for mode in modes:
                for B in self.decode_sizes:
                    self.decode_run(mode, B, 2, a.seed)  # warm-up: compiles (and captures) every step shape of B
        if warm_only:
            return
        rounds = iter(range(1, 1 << 30))  # a fresh seed per run: no two runs share a prompt
        samples = self.interleaved("decode", {
            (B, mode): (lambda B=B, mode=mode: self.decode_run(mode, B, steps[mode], a.seed + next(rounds)))
            for B in self.decode_sizes for mode in modes})
        tok_s = {}
        for (B, mode), s in samples.items():
            tok_s[B, mode] = t = statistics.median(x["tok_s"] for x in s)
            graphed = getattr(self._engines[mode].runner, "graphs", None) is not None
            self.res["decode"].append({"B": B, "mode": mode, "cuda_graphs": GRAPH_MODES[mode], "graphed": graphed,
                                       "steps": steps[mode], "tok_s": t, "steps_s": t / B, "ms_per_step": 1e3 * B / t,
                                       "context_start": s[0]["context"],
                                       "samples_tok_s": [round(x["tok_s"], 1) for x in s]})
            what = "" if B == 1 else " aggregate"
            print(f"decode B={B} {mode}: {t:.1f} tok/s{what} ({1e3 * B / t:.3f} ms/step, {steps[mode]} steps"
                  f"{'' if graphed or mode == 'eager' else ', NOT graphed'})", flush=True)
        for B in self.decode_sizes:
            if (B, "graphs") in tok_s and (B, "eager") in tok_s:
                r = tok_s[B, "graphs"] / tok_s[B, "eager"]
                self.res["decode_ratio"].append({"B": B, "graphs_tok_s": tok_s[B, "graphs"],
                                                 "eager_tok_s": tok_s[B, "eager"], "ratio": r})
                print(f"decode B={B} graphs/eager: {r:.2f}x", flush=True)
        self.res["decode_preemptions"] = sum(e.stats()["preemptions"] for e in self._engines.values())

    # ---- generate: one request as `lowbit run` runs it ---------------------------------------

    def generate_run(self, mode: str, ids: list[int], n: int):
        kv, spec = MODES[mode]  # EngineConfig's default cuda_graphs, as `lowbit run` has it
        config = EngineConfig(kv_format=kv, kv_memory=kv_bytes(kv, self.model, 1, len(ids) + n + 32),
                              page_size=PAGE, speculative=spec)
        lm_like = SimpleNamespace(model=self.model, tokenizer=self.tokenizer)
        sync(self.device)
        res, stats = _engine_run(lm_like, ids, SamplingParams(temperature=0, max_tokens=n), config, lambda text: None)
        sync(self.device)
        return res, stats

    def generate(self, warm_only: bool = False) -> None:
        ids = self.tokenizer.encode(PROMPT[:8] if self.a.smoke else PROMPT)
        if self.warm:
            for mode in MODES:  # warm-up: compiles (16 tokens: verified greedy's full 15 drafts once)
                self.generate_run(mode, ids, min(16, self.a.gen_tokens))
        if warm_only:
            return
        samples = self.interleaved("generate", {mode: (lambda mode=mode: self.generate_run(mode, ids,
                                                                                           self.a.gen_tokens))
                                                for mode in MODES})
        for mode, runs in samples.items():
            rs = [r for r, _ in runs]
            tps = statistics.median(r.decode_tok_s for r in rs)
            ttft = statistics.median(r.ttft_s for r in rs)
            row = {"mode": mode, "kv": MODES[mode][0], "decode_tok_s": tps, "ttft_ms": 1e3 * ttft,
                   "tokens": [len(r.token_ids) for r in rs], "finish": rs[0].finish_reason, "prompt_tokens": len(ids),
                   "samples_tok_s": [round(r.decode_tok_s, 1) for r in rs]}
            spec = [s for _, s in runs if s is not None]
            extra = ""
            if MODES[mode][1] is not None:
                drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
                row |= {"drafted": drafted, "accepted": accepted}
                extra = f", {accepted}/{drafted} drafts accepted" if drafted else ", no drafts"
            self.res["generate"].append(row)
            print(f"generate {mode} (kv {MODES[mode][0]}): {tps:.1f} tok/s, TTFT {1e3 * ttft:.1f} ms, "
                  f"{row['tokens']} tokens{extra}", flush=True)

    def measurements(self) -> dict:
        """name → measurement (each takes warm_only)."""
        out = {"prefill": self.prefill, "decode": self.decode}
        if self.tokenizer is not None:
            out["generate"] = self.generate
        return out


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# lowbit decode (paged engine), {m['device']}", "", f"**Weights: {m['weights']}**", "",
             (f"torch {m['torch']}, triton {m['triton']}, backend {m['backend']}, activations {m['dtype']}; "
              f"config {m['config']}; KV {KV} (verified greedy: {VERIFIED_KV}), page {PAGE}; prefill {m['prefill']} "
              f"tokens, {m['steps']} decode steps with CUDA graphs, {m['eager_steps']} eager, median of "
              f"{m['reps']} interleaved reps. Prefill: eager (never graphed); generate: the engine's default "
              "cuda_graphs."), "",
             "## Prefill (runner, fresh pool)", "", "| B | tokens | ms | tok/s | samples ms |",
             "|---:|---:|---:|---:|---|"]
    lines += [f"| {r['B']} | {r['tokens']} | {r['ms']:.2f} | {r['tok_s']:.0f} | {r['samples_ms']} |"
              for r in res["prefill"]]
    lines += ["", "## Decode (engine steps, B concurrent greedy requests)", "",
              "| B | engine | graphed | steps | tok/s (aggregate) | ms/step | context at start | samples tok/s |",
              "|---:|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['B']} | cuda_graphs={r['cuda_graphs']} | {'yes' if r['graphed'] else 'no'} | {r['steps']} | "
              f"{r['tok_s']:.1f} | {r['ms_per_step']:.3f} | {r['context_start']} | {r['samples_tok_s']} |"
              for r in res["decode"]]
    if res["decode_ratio"]:
        lines += ["", "| B | graphs tok/s | eager tok/s | graphs / eager |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['B']} | {r['graphs_tok_s']:.1f} | {r['eager_tok_s']:.1f} | {r['ratio']:.2f}x |"
                  for r in res["decode_ratio"]]
    if res.get("decode_preemptions"):
        lines += ["", f"Preemptions during the decode runs: {res['decode_preemptions']} (the pool was short)."]
    lines += ["", "## Generate (`_engine_run`, one request)", ""]
    if res["generate"]:
        lines += ["| mode | kv | decode tok/s | TTFT ms | tokens | finish | drafts accepted |",
                  "|---|---|---:|---:|---|---|---|"]
        lines += [f"| {r['mode']} | {r['kv']} | {r['decode_tok_s']:.1f} | {r['ttft_ms']:.1f} | {r['tokens']} | "
                  f"{r['finish']} | {'%d/%d' % (r['accepted'], r['drafted']) if 'drafted' in r else '-'} |"
                  for r in res["generate"]]
    else:
        lines += ["Not run: needs a tokenizer, i.e. --model PATH (or --smoke)."]
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
    ap.add_argument("--steps", type=int, default=256, help="timed decode steps with CUDA graphs (default 256)")
    ap.add_argument("--eager-steps", type=int, default=64, help="timed decode steps of the eager engine (default 64)")
    ap.add_argument("--batches", default="1,4,16", help="concurrent requests for the decode, comma list")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=0, help="start no new measurement after this (0: none)")
    ap.add_argument("--out", help="directory for cuda_decode.md and cuda_decode.json")
    ap.add_argument("--compile-only", action="store_true",
                    help="run each measurement's untimed warm-up only (fills Triton's cache); no timing")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps: code paths only")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: unwind, so the outputs get written
    if a.smoke:
        a.prefill, a.steps, a.eager_steps, a.batches, a.reps, a.gen_tokens = 8, 4, 4, "1,2", 1, 8
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda, but torch sees no CUDA GPU (CPU smoke: TRITON_INTERPRET=1 ... --smoke --device cpu)")
    if interpreting() and a.dtype == "bfloat16":
        sys.exit("Triton's interpreter computes bf16 tl.dot wrongly (tests/conftest.py); use --dtype float16")
    a.batches = sorted({int(b) for b in a.batches.split(",") if b})
    if not a.batches or a.batches[0] < 1 or min(a.prefill, a.steps, a.eager_steps, a.reps, a.gen_tokens) < 1:
        sys.exit("--batches, --prefill, --steps, --eager-steps, --reps and --gen-tokens must be >= 1")
    torch.manual_seed(a.seed)

    t_start = t0 = time.perf_counter()
    model, tokenizer, weights = build(a, device)
    print(f"model built in {time.perf_counter() - t0:.1f} s. {weights}", flush=True)
    c = model.config
    need = 2 * a.prefill + max(a.steps, a.eager_steps) + 16
    if need > c.max_seq_len:
        sys.exit(f"--prefill {a.prefill} and --steps {a.steps} need a context of {need}; "
                 f"the model's is {c.max_seq_len}")
    b = Bench(a, device, model, tokenizer, t_start)
    res = b.res
    res["meta"] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                   f"cpu ({'Triton interpreter' if interpreting() else 'torch kernels'})",
                   "torch": torch.__version__, "triton": getattr(triton, "__version__", "-"), "dtype": a.dtype,
                   "weights": weights, "synthetic": not a.model, "prefill": a.prefill, "steps": a.steps,
                   "eager_steps": a.eager_steps, "engine_has_cuda_graphs": HAS_GRAPHS_FIELD,
                   "batches": a.batches, "reps": a.reps, "gen_tokens": a.gen_tokens, "smoke": a.smoke,
                   "backend": model.backend.name, "kv": KV, "page_size": PAGE,
                   "config": {k: getattr(c, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                                         "hidden_dim", "vocab_size", "tie_embeddings")}}

    if a.compile_only:  # fill Triton's disk cache for a later run (gpu_check.sh runs this beside pytest)
        t0, failed = time.perf_counter(), 0
        for name, measure in b.measurements().items():
            try:
                measure(warm_only=True)
            except Exception as e:  # noqa: BLE001 - warm what can be warmed
                traceback.print_exc()
                print(f"ERROR compile {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                failed = 1
        sync(device)
        print(f"compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        return failed

    for name, measure in b.measurements().items():
        b.attempt(name, measure)
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
