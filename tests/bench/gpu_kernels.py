"""lowbit's weight-only matmul (kernels/wq_mm.py) vs torch F.linear (cuBLAS) on Llama-7B layers, one GPU.

    python tests/bench/gpu_kernels.py [--layouts int4-g128,...] [--shapes 4096x4096,...] [--m 1,4,16]
                                      [--dtype bfloat16] [--peak-gbs 4800] [--graphs] [--sweep] [--out DIR]
    TRITON_INTERPRET=1 python tests/bench/gpu_kernels.py --smoke      (CPU: code paths only, no timing)

Shapes are OUTxIN, written like torch's weight.shape [N, K]: N = out_features (columns of y),
K = in_features (the reduced dimension). The default set is what lowbit runs for a Llama-7B-shaped
model: 4096x4096 (o, and q/k/v apart), 12288x4096 (q, k, v fused), 11008x4096 (gate or up apart),
22016x4096 (gate + up fused), 4096x11008 (down), 128256x4096 (a Llama-3-sized LM head; 32000x4096 is
Llama-2's, by --shapes). M = rows of x (tokens): 1-16 is decode, 64-2048 prefill.

Each row: y[M, N] = x[M, K] @ W^T with x in --dtype, W in one lowbit layout (random codes and scales
drawn on the device, packed by the loader's wq_pack_int4 / wq_pack_int8), against torch F.linear(x, W)
with W in --dtype (cuBLAS), timed the same way (once per shape and M). lowbit's time is the whole
wq_mm call, as the model pays it (split-K: also its reduction kernel; prefill "dequant": also writing
its W^T copy). Timing, both sides alike:
- --graphs (what gpu_check.sh runs): the calls replayed from one CUDA graph, so the time is the GPU's
  alone, as in the model's graphed decode (a wq_mm call's Python launch costs ~0.1 ms, more than its
  kernels at decode sizes). L2-cold: the graph cycles through several copies of the weight (lowbit's
  packed copies and torch's bf16 copies alike), together >= 3x the L2 (H100/H200: 50 MB; at least 2
  copies, at most --max-copies), so no call finds its weight in L2, as none does in a model, whose
  other layers' weights pass through L2 between two calls of a layer. 4096x4096: int4-g128 8.4 MB a
  copy, 18 copies; bf16 32 MiB, 5; the 128256x4096 LM head: 2 copies each (bf16 1.05 GB a copy).
  Median over replays of replay time / calls in the graph.
- otherwise triton.testing.do_bench's median (L2 cleared before each rep by do_bench itself).
Decode rows (M <= 16) run first for every shape and layout, prefill rows after, so a time budget cut
drops prefill rows first. GB/s counts the bytes a call must move at least: packed weight + scales
(+ mins) + x + y. TFLOP/s = 2*M*N*K / time. % peak = GB/s / --peak-gbs (default by GPU name: H200
4800, H100 SXM 3350, otherwise none). Every layout and shape is checked against wq_mm_ref (fp32) at
--check-m rows; a wrong result exits 1 after the table.
--sweep times LaunchConfigs around choose_config's pick on 4096x4096 int4-g128 for M = 1, 16, 2048
(input for choose_config): the other forms (wq_mm.FORMS), split-K or row-tile height, then pipeline
stages, over whichever of those fields LaunchConfig has, with the same timing. --precompile N
compiles the kernels in N worker processes before timing (Triton's disk cache), so a fresh machine
spends seconds, not minutes, compiling. --budget-s stops starting new rows when exceeded (the
outputs then say which rows were skipped, and the exit status is 3).
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, fields, replace
from functools import partial
from math import ceil
from pathlib import Path

import torch
import torch.nn.functional as F

from lowbit.kernels.triton_import import interpreting, triton
from lowbit.kernels.wq_mm import (
    DECODE_MAX_ROWS,
    FORMS,
    LaunchConfig,
    WQPacked,
    choose_config,
    wq_mm,
    wq_mm_ref,
    wq_pack_int4,
    wq_pack_int8,
)
from lowbit.quant import Int4Weight, parse_weights, quantize_weight
from gpu_timing import graph_ms, peak_gbs_for, rel_err  # noqa: E402  (tests/bench/, the script's own folder)

# (N out, K in) → layer; the first six are the default --shapes (Llama-7B's layers as lowbit runs them)
LAYERS = {(4096, 4096): "o/q/k/v", (12288, 4096): "qkv", (11008, 4096): "gate/up", (22016, 4096): "gate+up",
          (4096, 11008): "down", (128256, 4096): "lm_head", (32000, 4096): "lm_head 32k"}
SHAPES = tuple(LAYERS)[:6]
LAYOUTS = ("int4-g128", "int4-sym-g128", "int4-g32", "int8-g32", "int8")
MS = (1, 2, 4, 8, 16, 64, 256, 2048)
L2_DEFAULT = 50 << 20  # H100 / H200 L2, where the device does not report its own
SWEEP = ("int4-g128", 4096, 4096, (1, 16, 2048))  # layout, N, K, M values
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def build_weight(layout: str, N: int, K: int, device: torch.device, seed: int, quantized: bool) -> WQPacked:
    """quantized: lowbit.quant's quantizer on the CPU (the real path, slow for 7B shapes). Otherwise
    random codes and scales drawn on the device in quant's row-major layout (any code 0..15 or
    -127..127 is valid). Both through the loader's pack functions, so the bench times whatever
    layout wq_pack_* makes (packing runs on the device: transient memory of a few times the codes)."""
    spec = parse_weights(layout)
    g = torch.Generator(device=device if not quantized else "cpu").manual_seed(seed)
    if quantized:
        w = quantize_weight(torch.randn(N, K, generator=g) * 0.02, spec)
        if isinstance(w, Int4Weight):
            return wq_pack_int4(w.codes(), w.scales, w.mins, w.spec.group_size, K).to(device)
        return wq_pack_int8(w.qweight, w.scales, K).to(device)
    group = spec.group_size or K
    Kp = -(-K // group) * group
    G = Kp // group
    rand = lambda *s: torch.rand(*s, generator=g, device=device)  # noqa: E731
    if spec.bits == 4:
        codes = torch.randint(0, 16, (N, Kp), generator=g, device=device, dtype=torch.uint8)  # [N, Kp]
        scales = (rand(N, G) * 0.004 + 0.001).half()  # [N, G]
        mins = None if spec.symmetric else (-7.5 * scales.float() * (0.8 + 0.4 * rand(N, G))).half()
        return wq_pack_int4(codes, scales, mins, group, K)
    q = torch.randint(-127, 128, (N, Kp), generator=g, device=device, dtype=torch.int8)  # [N, Kp]
    scales = rand(N, G) * 2e-4 + 5e-5  # fp32 [N, 1] per channel, else fp16 [N, G]
    return wq_pack_int8(q, scales if spec.group_size == 0 else scales.half(), K)


def tensors_of(w: WQPacked) -> dict[str, torch.Tensor]:
    """The packed weight's tensors by field name (whatever fields WQPacked has)."""
    return {f.name: t for f in fields(w) if isinstance(t := getattr(w, f.name), torch.Tensor)}


def packed_bytes(w: WQPacked) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(w).values())


def clone_packed(w: WQPacked) -> WQPacked:
    """Another copy of w in its own memory (the L2-cold rotation needs distinct addresses, not values);
    dict fields (wq_mm's per-weight split-K workspaces) start empty, as each layer's own would."""
    fresh = {f.name: {} for f in fields(w) if f.init and isinstance(getattr(w, f.name), dict)}
    return replace(w, **{name: t.clone() for name, t in tensors_of(w).items()}, **fresh)


def n_copies(nbytes: int, l2_bytes: int, cap: int) -> int:
    """Copies of an nbytes weight that together hold >= 3x the L2: at least 2, at most cap."""
    return max(2, min(cap, ceil(3 * l2_bytes / max(nbytes, 1))))


def cfg_str(c: LaunchConfig) -> str:
    """form first, then every other field by CONFIG_ABBR (e.g. "mma bm16 sk8 s1 bn64 w4")."""
    d = asdict(c)
    return " ".join([str(d.pop("form", ""))] + [f"{CONFIG_ABBR.get(k, k + '=')}{v}" for k, v in d.items()]).strip()


def bench_ms(calls: list, device: torch.device, warmup: int, rep: int, graphs: bool = False) -> float:
    """calls: one zero-argument callable per weight copy (the same work on different memory).
    graphs: graph_ms over all of them (GPU time, L2-cold by rotation, ~rep ms of replays); else
    do_bench's median of the first (its own L2 flush per rep); one perf_counter call elsewhere (smoke,
    every copy run once first)."""
    if device.type != "cuda":
        for call in calls:
            call()
        t0 = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t0) * 1e3
    if graphs:
        return graph_ms(calls, rep / 10)
    from triton.testing import do_bench

    median = ({"return_mode": "median"} if "return_mode" in inspect.signature(do_bench).parameters
              else {"quantiles": [0.5]})
    r = do_bench(calls[0], warmup=warmup, rep=rep, **median)
    return float(r[0] if isinstance(r, (list, tuple)) else r)


CONFIG_ABBR = {"block_m": "bm", "block_n": "bn", "block_k": "bk", "split_k": "sk", "group_m": "gm",
               "num_warps": "w", "num_stages": "s"}


def cfg_fields() -> set[str]:
    return {f.name for f in fields(LaunchConfig)}


def sweep_candidates(default: LaunchConfig, M: int, smoke: bool) -> tuple[list[LaunchConfig], list[dict]]:
    """Around choose_config's pick, over whichever of these LaunchConfig has (its fields change with
    the kernel; block_n and num_warps are left as chosen: a kernel may fix them to its tile): stage 1
    the other forms (FORMS; no "dequant" for decode) and split-K (decode) or row-tile height
    (prefill); stage 2 tries the num_stages values returned here around the best two."""
    have = cfg_fields()
    stage1 = []
    if "form" in have:
        stage1 += [replace(default, form=f) for f in FORMS
                   if f != default.form and (M > DECODE_MAX_ROWS or f != "dequant")]
    if M <= DECODE_MAX_ROWS and "split_k" in have:
        stage1 += [replace(default, split_k=sk) for sk in (1, 2, 4, 8, 16, 32) if sk != default.split_k]
    if M > DECODE_MAX_ROWS and "block_m" in have and getattr(default, "form", "") != "dequant":
        stage1 += [replace(default, block_m=bm) for bm in (16, 32, 64, 128) if bm != default.block_m]
    variants = [{"num_stages": ns} for ns in (1, 2, 3, 4)] if "num_stages" in have else []
    return (stage1[:2], variants[:1]) if smoke else (stage1, variants)


def _compile_task(task) -> str | None:
    """Worker process: run each launch once so Triton compiles it into its disk cache. Errors are
    returned, not raised: the main process meets (and reports) them again when it times the launch."""
    layout, N, K, Ms, dtype, cfg, seed, quantized = task
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
    try:
        w = build_weight(layout, N, K, device, seed, quantized)
        for M in Ms:
            wq_mm(torch.randn(M, K, device=device).to(DTYPES[dtype]), w, None if cfg is None else LaunchConfig(**cfg))
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


class Run:
    def __init__(self, a, device: torch.device):
        self.a, self.device, self.dtype = a, device, DTYPES[a.dtype]
        self.t0 = time.perf_counter()
        self.bf16: dict[tuple, float] = {}  # (N, K, M) → torch ms
        self.wt: dict[tuple, list[torch.Tensor]] = {}  # (N, K) → torch weight copies [N, K] (this shape's only)
        self.xs: dict[tuple, torch.Tensor] = {}  # (M, K) → activations
        self.rows, self.checks, self.sweep, self.skipped, self.errors = [], [], [], [], []
        self.pool = None

    def left_s(self) -> float:
        return float("inf") if not self.a.budget_s else self.a.budget_s - (time.perf_counter() - self.t0)

    def precompile(self, tasks) -> None:
        if self.a.precompile <= 0 or not tasks or self.left_s() < 10:
            return
        t0 = time.perf_counter()
        try:
            if self.pool is None:
                self.pool = mp.get_context("spawn").Pool(self.a.precompile)
            left = self.left_s()
            errors = [e for e in self.pool.map_async(_compile_task, tasks, chunksize=1).get(
                timeout=None if left == float("inf") else max(5.0, left * 0.6)) if e]
            print(f"precompiled {len(tasks)} launch groups in {self.a.precompile} processes: "
                  f"{time.perf_counter() - t0:.1f} s, {len(errors)} failed{': ' if errors else ''}"
                  + "; ".join(e.splitlines()[0][:160] for e in errors[:3]), flush=True)
        except Exception as e:  # noqa: BLE001 - only a speed-up: the timed runs compile what is missing
            print(f"precompile skipped ({type(e).__name__}: {e}); compiling in-process", flush=True)
            self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None

    def x(self, M: int, K: int) -> torch.Tensor:
        if (M, K) not in self.xs:
            self.xs[(M, K)] = torch.randn(M, K, device=self.device).to(self.dtype)
        return self.xs[(M, K)]

    def copies(self, nbytes: int) -> int:
        """How many copies of a weight the timing rotates: L2-cold with --graphs on CUDA, else 1
        (do_bench flushes L2 itself; the smoke run only proves the code path: 2)."""
        if self.device.type != "cuda":
            return 2
        return n_copies(nbytes, self.a.l2_bytes, self.a.max_copies) if self.a.graphs else 1

    def weight_copies(self, layout: str, N: int, K: int) -> list[WQPacked]:
        w = build_weight(layout, N, K, self.device, self.a.seed, self.a.quantized)
        return [w] + [clone_packed(w) for _ in range(self.copies(packed_bytes(w)) - 1)]

    def torch_ms(self, N: int, K: int, M: int) -> float:
        if (N, K) not in self.wt:
            w = (torch.randn(N, K, device=self.device) * 0.02).to(self.dtype)  # [N, K]
            self.wt[(N, K)] = [w] + [w.clone() for _ in range(self.copies(w.numel() * w.element_size()) - 1)]
        if (N, K, M) not in self.bf16:
            x = self.x(M, K)
            self.bf16[(N, K, M)] = bench_ms([partial(F.linear, x, w) for w in self.wt[(N, K)]], self.device,
                                            self.a.warmup, self.a.rep, self.a.graphs)
        return self.bf16[(N, K, M)]

    def check(self, what: dict, y: torch.Tensor, ref: torch.Tensor) -> bool:
        err = rel_err(y, ref)
        ok = bool(torch.isfinite(y).all()) and err <= self.a.tol
        self.checks.append({**what, "rel_err": float(f"{err:.3g}"), "tol": self.a.tol, "ok": ok})
        if not ok:
            print(f"WRONG RESULT: {what} relative error {err:.3g} > {self.a.tol}", file=sys.stderr, flush=True)
        return ok

    def compile_tasks(self, layouts, shapes, ms, sweep) -> list[tuple]:
        """The table's launches (default configs), and the sweep's first stage if `sweep` is given."""
        a = self.a
        tasks = [(lay, N, K, ms, a.dtype, None, a.seed, a.quantized) for lay in layouts for N, K in shapes]
        if sweep:
            layout, N, K, sweep_ms = sweep
            w = build_weight(layout, N, K, self.device, a.seed, a.quantized)  # for choose_config's picks
            for M in sweep_ms:
                tasks += [(layout, N, K, [M], a.dtype, asdict(c), a.seed, a.quantized)
                          for c in sweep_candidates(choose_config(M, w, self.device, self.dtype), M, a.smoke)[0]]
        return tasks

    def table(self, layouts, shapes, ms) -> None:
        """Decode rows (M <= 16) of every shape and layout first, then the prefill rows: a budget cut
        drops prefill first. One shape's torch copies live while its rows run."""
        self.precompile(self.compile_tasks(layouts, shapes, ms, None))
        print(f"{'layout':<14}{'layer':<12}{'N out':>7}{'K in':>7}{'M':>6}{'lowbit ms':>11}{'torch ms':>10}"
              f"{'ratio':>8}{'GB/s':>8}{'TFLOP/s':>9}{'% peak':>8}{'copies':>8}", flush=True)
        parts = [[m for m in ms if m <= DECODE_MAX_ROWS], [m for m in ms if m > DECODE_MAX_ROWS]]
        for part in (p for p in parts if p):
            for N, K in shapes:
                for layout in layouts:
                    if self.left_s() <= 0:  # not even built
                        self.skipped += [{"layout": layout, "N": N, "K": K, "M": M} for M in part]
                        continue
                    self.weight_rows(layout, self.weight_copies(layout, N, K), part)
                    self.write()  # as it goes: a run killed by a timeout keeps what it measured
                self.wt.clear()  # the 128256x4096 LM head's bf16 copies are 2.1 GB
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def weight_rows(self, layout: str, ws: list[WQPacked], ms) -> None:
        a, w = self.a, ws[0]
        N, K = w.out_features, w.in_features
        for M in ms:
            what = {"layout": layout, "N": N, "K": K, "M": M}
            if self.left_s() <= 0:
                self.skipped.append(what)
                continue
            x = self.x(M, K)
            try:
                if M in a.check_m:
                    self.check(what, wq_mm(x, w), wq_mm_ref(x, w))
                ms_lb = bench_ms([partial(wq_mm, x, wi) for wi in ws], self.device, a.warmup, a.rep, a.graphs)
                ms_t = self.torch_ms(N, K, M)
            except Exception as e:  # noqa: BLE001 - e.g. a launch that cannot be captured: report, measure the rest
                msg = f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                self.errors.append(msg)
                print(f"  row failed: {msg}", file=sys.stderr, flush=True)  # again as ERROR at the end
                continue
            nbytes = packed_bytes(w) + (M * K + M * N) * x.element_size()
            gbs = nbytes / ms_lb / 1e6
            r = {**what, "layer": LAYERS.get((N, K), ""), "lowbit_ms": ms_lb, "torch_ms": ms_t,
                 "speedup": ms_t / ms_lb, "gbs": gbs, "tflops": 2 * M * N * K / ms_lb / 1e9,
                 "pct_peak": None if not a.peak_gbs else 100 * gbs / a.peak_gbs,
                 "torch_gbs": (N * K + M * K + M * N) * x.element_size() / ms_t / 1e6,
                 "bytes": nbytes, "copies": len(ws), "torch_copies": len(self.wt[(N, K)]) if (N, K) in self.wt else 1,
                 "config": cfg_str(choose_config(M, w, self.device, self.dtype))}
            self.rows.append(r)
            pct = "" if r["pct_peak"] is None else f"{r['pct_peak']:.0f}%"
            print(f"{layout:<14}{r['layer']:<12}{N:>7}{K:>7}{M:>6}{ms_lb:>11.4f}{ms_t:>10.4f}"
                  f"{r['speedup']:>7.2f}x{gbs:>8.0f}{r['tflops']:>9.1f}{pct:>8}{len(ws):>4}/{r['torch_copies']:<3}",
                  flush=True)

    def sweep_configs(self, layout: str, N: int, K: int, ms) -> None:
        """Coarse-to-fine (sweep_candidates); every config is checked against the ref before it is timed."""
        a = self.a
        ws = self.weight_copies(layout, N, K)
        w = ws[0]
        for M in ms:
            x, ref = self.x(M, K), wq_mm_ref(self.x(M, K), w)
            default = choose_config(M, w, self.device, self.dtype)
            stage1, variants = sweep_candidates(default, M, a.smoke)
            timed: dict[LaunchConfig, float | None] = {}
            what = {"sweep": layout, "N": N, "K": K, "M": M}
            self.time_configs([default, *stage1], timed, what, ws, x, ref)
            good = sorted((t, cfg_str(c), c) for c, t in timed.items() if t is not None)
            self.time_configs([replace(c, **v) for _, _, c in good[:2] for v in variants], timed, what, ws, x, ref)
            good = sorted((t, cfg_str(c), c) for c, t in timed.items() if t is not None)
            if not good:
                continue
            base = timed.get(default)
            for t, s, c in good:
                self.sweep.append({"layout": layout, "N": N, "K": K, "M": M, "config": asdict(c), "ms": t,
                                   "default": c == default, "vs_default": None if base is None else base / t})
            best_t, best_s, _ = good[0]
            vs = "" if base is None else f"; choose_config {cfg_str(default)}: {base:.4f} ms, best is {base / best_t:.2f}x"
            print(f"sweep {layout} {N}x{K} M={M}: best {best_s}: {best_t:.4f} ms ({len(good)} configs ran{vs})", flush=True)
            for t, s, _ in good[:5]:
                print(f"    {t:.4f} ms  {s}", flush=True)
            self.write()

    def time_configs(self, cfgs, timed: dict, what: dict, ws: list[WQPacked], x: torch.Tensor,
                     ref: torch.Tensor) -> None:
        """Check, then time, each config not yet in `timed` (None: wrong, or failed to compile/launch)."""
        a = self.a
        self.precompile([(what["sweep"], what["N"], what["K"], [what["M"]], a.dtype, asdict(c), a.seed, a.quantized)
                         for c in cfgs if c not in timed])
        for c in cfgs:
            if c in timed or self.left_s() <= 0:
                continue
            try:
                ok = self.check({**what, "config": cfg_str(c)}, wq_mm(x, ws[0], c), ref)
                timed[c] = (bench_ms([partial(wq_mm, x, w, c) for w in ws], self.device, a.warmup, a.rep, a.graphs)
                            if ok else None)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: that config is out
                print(f"  {cfg_str(c)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                timed[c] = None

    def summary(self) -> list[dict]:
        a = self.a

        def pick(layout, ms, key):
            return [r[key] for r in self.rows if r["layout"] == layout and r["M"] in ms and r[key] is not None]

        decode = [m for m in a.m if m <= DECODE_MAX_ROWS]
        goals = [("int4-g128 decode M<=16: mean speedup vs torch", pick("int4-g128", decode, "speedup"), 3.0, "x"),
                 ("int4-g128 M=1: mean % of peak bandwidth", pick("int4-g128", (1,), "pct_peak"), 70.0, "%"),
                 ("int8 (per channel) decode M<=16: mean speedup vs torch", pick("int8", decode, "speedup"), 1.8, "x"),
                 ("int4-g128 prefill M=2048: mean speedup vs torch", pick("int4-g128", (2048,), "speedup"), 0.8, "x")]
        out = []
        for label, vals, target, unit in goals:
            mean = statistics.fmean(vals) if vals else None
            status = "N/A" if mean is None else "PASS" if mean >= target else "MISS"
            out.append({"goal": label, "value": mean, "target": target, "unit": unit, "rows": len(vals),
                        "min": min(vals) if vals else None, "status": status})
        return out

    def meta(self) -> dict:
        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu (Triton interpreter)"
        return {"device": dev, "torch": torch.__version__, "triton": getattr(triton, "__version__", "?"),
                "dtype": self.a.dtype, "peak_gbs": self.a.peak_gbs, "warmup_ms": self.a.warmup, "rep_ms": self.a.rep,
                "weights": ("quantize_weight + wq_pack_*" if self.a.quantized
                            else "random codes and scales on the device + wq_pack_*"),
                "timing": ("one perf_counter call (smoke, not a measurement)" if self.device.type != "cuda" else
                           "median of CUDA-graph replays (GPU time), L2-cold: each graph cycles through weight "
                           f"copies (both sides) totalling >= 3x the {self.a.l2_bytes >> 20} MiB L2, "
                           f"2..{self.a.max_copies} copies" if self.a.graphs
                           else "triton.testing.do_bench median, L2 cleared per rep"),
                "l2_bytes": self.a.l2_bytes, "smoke": self.a.smoke}

    def write(self) -> None:
        if not self.a.out:
            return
        out = Path(self.a.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        (out / "gpu_kernels.json").write_text(json.dumps(
            {"meta": self.meta(), "rows": self.rows, "checks": self.checks, "summary": summary,
             "sweep": self.sweep, "skipped": self.skipped, "errors": self.errors}, indent=1, default=str))
        m = self.meta()
        f = lambda v, p: "" if v is None else f"{v:.{p}f}"
        lines = [f"# lowbit wq_mm vs torch {m['dtype']} F.linear", "",
                 (f"GPU {m['device']}; torch {m['torch']}; triton {m['triton']}; activations {m['dtype']}; "
                  f"timing: {m['timing']} (warmup {m['warmup_ms']} ms, rep {m['rep_ms']} ms); weights: {m['weights']}; "
                  f"peak bandwidth {m['peak_gbs'] or 'unknown'} GB/s."), "",
                 ("N = out features, K = in features (weight.shape [N, K]); y[M, N] = x[M, K] @ W^T. "
                  "ratio = torch ms / lowbit ms (> 1: lowbit faster). GB/s: packed weight + scales + mins + x + y "
                  "over the lowbit time. copies: weight copies the timing rotated, lowbit / torch."), "",
                 "| layout | layer | N (out) | K (in) | M | lowbit ms | torch ms | ratio | GB/s | TFLOP/s | % peak | "
                 "copies | config |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r['layout']} | {r['layer']} | {r['N']} | {r['K']} | {r['M']} | {r['lowbit_ms']:.4f} | "
                  f"{r['torch_ms']:.4f} | {r['speedup']:.2f}x | {r['gbs']:.0f} | {r['tflops']:.1f} | "
                  f"{f(r['pct_peak'], 0)} | {r['copies']}/{r['torch_copies']} | {r['config']} |" for r in self.rows]
        lines += ["", "## Targets" + (" (smoke run: not measurements)" if self.a.smoke else ""), ""]
        lines += [f"- {s['status']}: {s['goal']} = not measured (target >= {s['target']}{s['unit']})" if s["value"] is None
                  else f"- {s['status']}: {s['goal']} = {s['value']:.2f}{s['unit']} (target >= {s['target']}{s['unit']}, "
                  f"{s['rows']} rows, min {s['min']:.2f})" for s in summary]
        bad = [c for c in self.checks if not c["ok"]]
        lines += ["", (f"## Correctness: {len(self.checks) - len(bad)}/{len(self.checks)} checks within "
                       f"relative error {self.a.tol} of wq_mm_ref")] + [f"- WRONG: {c}" for c in bad]
        if self.sweep:
            sw = self.sweep[0]
            lines += ["", f"## Config sweep: {sw['layout']} N={sw['N']} K={sw['K']}", "",
                      "| M | ms | speedup vs choose_config | config |", "|---:|---:|---:|---|"]
            lines += [f"| {s['M']} | {s['ms']:.4f} | {f(s['vs_default'], 2)} | {cfg_str(LaunchConfig(**s['config']))}"
                      f"{' (default)' if s['default'] else ''} |" for s in self.sweep]
        if self.errors:
            lines += ["", f"## Errors: {len(self.errors)} rows", ""] + [f"- {e}" for e in self.errors]
        if self.skipped:
            lines += ["", f"## Skipped for the time budget: {len(self.skipped)} rows", ""] + [f"- {s}" for s in self.skipped]
        (out / "gpu_kernels.md").write_text("\n".join(lines) + "\n")


def ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list (default {','.join(LAYOUTS)})")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="comma list of OUTxIN = NxK, e.g. 11008x4096 = out 11008, in 4096 (gate/up) "
                         f"(default {','.join(f'{n}x{k}' for n, k in SHAPES)})")
    ap.add_argument("--m", type=ints, default=MS, help=f"rows of x, comma list (default {','.join(map(str, MS))})")
    ap.add_argument("--dtype", choices=list(DTYPES), help="activations (default bfloat16; float16 with --smoke)")
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=40, help="do_bench repetition time, ms")
    ap.add_argument("--peak-gbs", type=float, help="peak memory bandwidth, GB/s (default by GPU name)")
    ap.add_argument("--check-m", type=ints, default=(4, 64),
                    help="M values checked against wq_mm_ref (default 4,64: the decode and the tiled launch)")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error (Frobenius) vs wq_mm_ref")
    ap.add_argument("--sweep", action="store_true", help="also sweep LaunchConfigs on 4096x4096 int4-g128")
    ap.add_argument("--graphs", action="store_true",
                    help="time calls replayed from a CUDA graph (GPU time only, as graphed decode pays it), "
                         "L2-cold by rotating weight copies")
    ap.add_argument("--l2-mb", type=float, help="L2 size the rotation defeats, MiB (default: the device's, else 50)")
    ap.add_argument("--max-copies", type=int, default=32, help="most weight copies one timing rotates (default 32)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new row after this many seconds (0: none)")
    ap.add_argument("--precompile", type=int, help="worker processes compiling kernels first (default: min(8, cores/2); 0: off)")
    ap.add_argument("--compile-only", action="store_true",
                    help="only compile (table, and the sweep's first stage with --sweep) into Triton's cache; no timing")
    ap.add_argument("--quantized", action="store_true", help="weights via quantize_weight + wq_pack_* (CPU, slow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="directory for gpu_kernels.md and gpu_kernels.json")
    ap.add_argument("--smoke", action="store_true", help="one 256x256 shape, M 1 and 4, no real timing")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: unwind, so the outputs get written

    cuda = torch.cuda.is_available() and not interpreting()
    if not cuda and not (a.smoke and interpreting()):
        sys.exit("gpu_kernels.py needs a CUDA GPU (or TRITON_INTERPRET=1 with --smoke for a CPU smoke run)")
    device = torch.device("cuda" if cuda else "cpu")
    a.dtype = a.dtype or ("float16" if a.smoke else "bfloat16")
    if interpreting() and a.dtype == "bfloat16":
        sys.exit("Triton's interpreter computes bf16 tl.dot wrongly (tests/conftest.py); use --dtype float16")
    if a.smoke:
        a.shapes, a.m, a.check_m, a.quantized = "256x256", (1, 4), (1, 4), True
    if a.precompile is None:
        # smoke: one worker, to run the code path; CUDA: half the cores, at most 8 (compiles are CPU-bound)
        a.precompile = 1 if a.smoke else max(1, min(8, (os.cpu_count() or 2) // 2))
    if a.peak_gbs is None and cuda:
        a.peak_gbs = peak_gbs_for(torch.cuda.get_device_name(device))
    if a.l2_mb is not None:
        a.l2_bytes = int(a.l2_mb * 2**20)
    else:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if cuda else 0
        a.l2_bytes = l2 or L2_DEFAULT
    a.max_copies = max(2, a.max_copies)
    layouts = [s for s in a.layouts.split(",") if s]
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",") if s]
    for lay in layouts:
        parse_weights(lay)

    torch.manual_seed(a.seed)
    r = Run(a, device)
    sweep = None if not (a.sweep or a.smoke) else ("int4-g128", 256, 256, (1, 16, 32)) if a.smoke else SWEEP
    if a.compile_only:  # fill Triton's disk cache for a later run (gpu_check.sh runs this beside pytest)
        a.precompile = max(1, a.precompile)
        try:
            r.precompile(r.compile_tasks(layouts, shapes, a.m, sweep))
        finally:
            r.close()
        return 0
    try:
        with torch.inference_mode():
            r.table(layouts, shapes, a.m)
            if sweep and r.left_s() > 0:
                r.sweep_configs(*sweep)
            elif sweep:
                print("sweep skipped: time budget spent", flush=True)
    finally:
        r.close()
        r.write()
    if a.smoke:
        print("\nSMOKE RUN: code paths only; the times below are not measurements")
    print(f"\n{r.meta()['device']}, torch {torch.__version__}, triton {r.meta()['triton']}, {a.dtype}, "
          f"peak {a.peak_gbs or 'unknown'} GB/s, {time.perf_counter() - r.t0:.0f} s")
    for s in r.summary():
        v = "not measured" if s["value"] is None else f"{s['value']:.2f}{s['unit']} (min {s['min']:.2f})"
        print(f"{s['status']:<5} {s['goal']}: {v}; target >= {s['target']}{s['unit']}")
    if r.skipped:
        print(f"INCOMPLETE: {len(r.skipped)} rows skipped for the {a.budget_s:.0f} s budget")
    bad = [c for c in r.checks if not c["ok"]]
    print(f"correctness: {len(r.checks) - len(bad)}/{len(r.checks)} checks within {a.tol} of wq_mm_ref")
    for e in r.errors:
        print(f"ERROR {e}")
    if bad:
        print(f"FAILED: {len(bad)} results disagree with wq_mm_ref", file=sys.stderr)
    return 1 if bad or r.errors else 3 if r.skipped else 0


if __name__ == "__main__":
    sys.exit(main())
