"""Decode attention on one GPU: lowbit's paged attention over a quantized KV pool against f16 SDPA.

    python tests/bench/gpu_attention.py [--heads 32/8/128,32/32/128,9/3/64] [--batches 1,8]
                                        [--contexts 1024,8192,32768] [--formats k8v4,f16,k8v8]
                                        [--one-pass k8v4] [--budget-s S] [--out DIR]
    TRITON_INTERPRET=1 python tests/bench/gpu_attention.py --smoke      (CPU: code paths only, no timing)

One decode step of one layer: S sequences, one new query row each, attending over `context` cached
tokens. lowbit: `lowbit.kernels.paged_attention.paged_attention` with max_query_len=1 (the split-KV
decode kernels, as the engine's graphed decode calls them) over one layer of a KVPool
(runtime/engine/kv_cache.py) in each --formats (k8v4 is the engine's default; f16 and k8v8 beside
it), pages scattered over the pool (a random permutation: a pool that has served a while), q as
models/attention.py passes it (fp32 where both sides rotate — k8v4, k8v8 —, else fp16; the
rotation matmuls around the call are not timed). --one-pass formats also time the single-pass
kernel (the prefill path: split_rows all -1) on the same pool: what split-KV replaced for decode.
Baseline: torch.nn.functional.scaled_dot_product_attention (torch's choice of backend) on
contiguous fp16 K/V [S, Hkv, context, D] holding the same number of tokens; GQA as decode does it
without copies: q [S, H, D] viewed as [S, Hkv, H/Hkv, D], the H/Hkv query heads of a KV head
attending as rows (no mask is needed for one new token). Heads (--heads H/Hkv/D): Llama-3-8B's
32/8/128 (GQA), Llama-2-7B's 32/32/128 (MHA), the default model's 9/3/64.

Timing: the calls replayed from one CUDA graph (GPU time, median of replays, as gpu_kernels.py
--graphs times its rows), L2-cold: the graph cycles through copies of the KV (pool layers for
lowbit, K/V tensors for SDPA) totalling >= 3x the L2 (50 MB on H100/H200; 1 copy once the KV alone
is >= 4x it, at most --max-copies), as a model's step reads every layer's KV between two calls of
a layer. (Pessimistic for the default model at short contexts: all 30 of its layers' k8v4 KV at 1k
tokens, 9.4 MB, would fit in L2.) GB/s: the KV bytes a call must read (codes + scales + mins of
S x context tokens x Hkv heads, KVFormat.side_bytes) over its time; SDPA's: 4 x D bytes per token
and head. Each format is checked against paged_attention_ref at the smallest context <= --check-ctx
(f16 also against SDPA on the same pages); a wrong result exits 1. --budget-s: no case starts
after that many seconds, the rest are listed as skipped, exit status 3. --compile-only runs every
kernel once on the smallest context (fills Triton's disk cache; gpu_check.sh runs it beside
pytest). --smoke: 4/2/16 heads, contexts 20 and 37, batches 1 and 2, pages of 16.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from lowbit.kernels.paged_attention import batch_tensors, paged_attention, paged_attention_ref
from lowbit.kernels.triton_import import interpreting, triton
from lowbit.quant.kv import KVFormat, parse_kv_format
from lowbit.runtime.engine.kv_cache import KVPool
from gpu_timing import graph_ms, peak_gbs_for, rel_err  # noqa: E402  (tests/bench/, the script's own folder)

HEADS = ((32, 8, 128), (32, 32, 128), (9, 3, 64))  # (H, Hkv, D)
HEAD_NAMES = {(32, 8, 128): "llama3-8b", (32, 32, 128): "llama2-7b", (9, 3, 64): "smollm2-135m"}
PAGE = 16  # the engine's page size
L2_DEFAULT = 50 << 20  # H100 / H200 L2, where the device does not report its own


def n_copies(nbytes: int, l2_bytes: int, cap: int) -> int:
    """KV copies that together hold >= 3x the L2: 1 once one copy is >= 4x it (a streaming read that
    large evicts its own start before the next call), else at least 2, at most cap."""
    if nbytes >= 4 * l2_bytes:
        return 1
    return max(2, min(cap, math.ceil(3 * l2_bytes / max(nbytes, 1))))


def time_ms(calls: list, device: torch.device, rep_ms: float) -> float:
    """graph_ms on CUDA (~rep_ms of replays); elsewhere (smoke) every call once, then one timed."""
    if device.type == "cuda":
        return graph_ms(calls, rep_ms / 10)
    for call in calls:
        call()
    t0 = time.perf_counter()
    calls[0]()
    return (time.perf_counter() - t0) * 1e3


def fill_(pool: KVPool, gen: torch.Generator) -> None:
    """Every layer's sides filled in place with valid random values: codes of any value, scales
    0.01-0.02, mins -0.16..-0.08 (int4 values ~N(0, 0.05)), fp16 data N(0, 1)."""
    for layer in range(pool.n_layers):
        for side in (pool.side(layer, "k"), pool.side(layer, "v")):
            for name, t in side.tensors().items():
                if name == "data":
                    t.normal_(generator=gen)
                elif name == "codes":
                    t.random_(-127, 128, generator=gen) if t.dtype == torch.int8 else t.random_(0, 256, generator=gen)
                elif name == "scales":
                    t.uniform_(0.01, 0.02, generator=gen)
                else:
                    t.uniform_(-0.16, -0.08, generator=gen)


def kv_read_bytes(fmt: KVFormat, S: int, ctx: int, Hkv: int, D: int) -> int:
    """Bytes one decode call must read: both sides of S x ctx tokens x Hkv heads."""
    return S * ctx * Hkv * (fmt.side_bytes("k", D) + fmt.side_bytes("v", D))


class Bench:
    def __init__(self, a, device: torch.device):
        self.a, self.device = a, device
        self.t0 = time.perf_counter()
        self.gen = torch.Generator(device=device).manual_seed(a.seed)
        self.rows, self.checks, self.skipped, self.errors = [], [], [], []

    def left_s(self) -> float:
        return float("inf") if not self.a.budget_s else self.a.budget_s - (time.perf_counter() - self.t0)

    def copies(self, nbytes: int) -> int:
        if self.device.type != "cuda":
            return 2  # smoke: the rotation's code path
        return n_copies(nbytes, self.a.l2_bytes, self.a.max_copies)

    def batch(self, S: int, ctx: int):
        """The decode batch: S sequences at `ctx` cached tokens (this step's included), their pages a
        random permutation of the pool's P = S x ceil(ctx / PAGE) pages."""
        n = -(-ctx // PAGE)
        perm = torch.randperm(S * n, generator=torch.Generator().manual_seed(self.a.seed + ctx))
        tables = [perm[s * n:(s + 1) * n] for s in range(S)]
        cu, ctxs, bt = batch_tensors([1] * S, [ctx] * S, tables, self.device)
        positions = torch.full((S,), ctx - 1, dtype=torch.int64, device=self.device)  # [S]
        return S * n, (cu, ctxs, positions, bt)

    def case(self, heads: tuple[int, int, int], S: int, ctx: int, check: bool, compile_only: bool) -> None:
        """SDPA once, then every format (and its single-pass variant) for one (heads, S, ctx)."""
        a, dev = self.a, self.device
        H, Hkv, D = heads
        P, bt = self.batch(S, ctx)
        q16 = torch.randn(S, H, D, generator=self.gen, device=dev).half()  # [S, H, D]
        where = {"heads": f"{H}/{Hkv}/{D}", "model": HEAD_NAMES.get(heads, ""), "S": S, "context": ctx}
        sdpa_bytes = S * ctx * Hkv * D * 2 * 2
        sdpa_ms = None
        if not compile_only:
            kv = [torch.randn(2, S, Hkv, ctx, D, generator=self.gen, device=dev).half()
                  for _ in range(self.copies(sdpa_bytes))]  # [K|V, S, Hkv, ctx, D] per copy
            q4 = q16.view(S, Hkv, H // Hkv, D)  # [S, Hkv, H/Hkv, D]: a KV head's query heads as rows
            sdpa_ms = time_ms([partial(F.scaled_dot_product_attention, q4, c[0], c[1]) for c in kv], dev, a.rep)
            sdpa_copies = len(kv)
            del kv
        for name in a.formats:
            fmt = parse_kv_format(name)
            nbytes = kv_read_bytes(fmt, S, ctx, Hkv, D)
            R = 1 if compile_only else self.copies(nbytes)
            pool = KVPool(fmt, R, Hkv, D, P, PAGE, dev)  # R layers: the copies the timing rotates
            fill_(pool, self.gen)
            rotated = fmt.rotates(D) and fmt.k_bits < 16 and fmt.v_bits < 16
            q = q16.float() if rotated else q16  # as models/attention.py passes it
            # split-KV: every row attends alone (a decode step); one-pass: no row does (split_rows all
            # -1), so the prefill kernel takes them all, one program per sequence and KV head
            one_pass = {"max_query_len": 2, "split_rows": torch.full((S,), -1, dtype=torch.int32, device=dev)}
            variants = {"split-KV": {"max_query_len": 1}, **({"one-pass": one_pass} if name in a.one_pass else {})}
            calls = {v: [partial(paged_attention, q, pool.side(i, "k"), pool.side(i, "v"), *bt, PAGE, **kw)
                         for i in range(R)] for v, kw in variants.items()}
            if compile_only:
                for cs in calls.values():
                    cs[0]()
                continue
            if check:
                self.check(where | {"kv": name}, pool, q, bt, calls)
            ms = {v: time_ms(cs, dev, a.rep) for v, cs in calls.items()}
            gbs = nbytes / ms["split-KV"] / 1e6
            row = where | {"kv": name, "lowbit_ms": ms["split-KV"], "one_pass_ms": ms.get("one-pass"),
                           "sdpa_ms": sdpa_ms, "speedup": sdpa_ms / ms["split-KV"], "kv_bytes": nbytes,
                           "gbs": gbs, "pct_peak": None if not a.peak_gbs else 100 * gbs / a.peak_gbs,
                           "sdpa_bytes": sdpa_bytes, "sdpa_gbs": sdpa_bytes / sdpa_ms / 1e6,
                           "copies": R, "sdpa_copies": sdpa_copies}
            self.rows.append(row)
            one = "" if row["one_pass_ms"] is None else f"{row['one_pass_ms']:.4f}"
            pct = "" if row["pct_peak"] is None else f"{row['pct_peak']:.0f}%"
            print(f"{where['heads']:<11}{S:>3}{ctx:>7} {name:<6}{ms['split-KV']:>10.4f}{one:>10}{sdpa_ms:>10.4f}"
                  f"{row['speedup']:>7.2f}x{nbytes / 2**20:>9.1f}{gbs:>8.0f}{pct:>7}{R:>4}/{sdpa_copies:<3}",
                  flush=True)
            del pool, calls

    def check(self, what: dict, pool: KVPool, q: torch.Tensor, bt: tuple, calls: dict) -> None:
        """Layer 0 against paged_attention_ref (both fp32: a few ulps); f16 also against SDPA on the
        same pages gathered contiguous (its fp16 output: ~1e-3)."""
        k, v = pool.side(0, "k"), pool.side(0, "v")
        ref = paged_attention_ref(q, k, v, *bt, PAGE)
        got = {variant: cs[0]() for variant, cs in calls.items()}
        outs = [(f"{variant} vs paged_attention_ref", y, ref, self.a.tol) for variant, y in got.items()]
        if k.bits == 16 and v.bits == 16:
            S, H, D = q.shape
            ctx = int(bt[1][0])
            pages = bt[3].long()  # [S, n]
            kv = [t.data[pages].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :ctx] for t in (k, v)]  # [S, Hkv, ctx, D]
            sdpa = F.scaled_dot_product_attention(q.view(S, k.n_kv_heads, -1, D), *kv).view(S, H, D)
            outs.append(("split-KV vs SDPA on the same pages", got["split-KV"], sdpa, 2e-2))
        for label, y, r, tol in outs:
            err = rel_err(y, r)
            ok = bool(torch.isfinite(y).all()) and err <= tol
            self.checks.append(what | {"check": label, "rel_err": float(f"{err:.3g}"), "tol": tol, "ok": ok})
            if not ok:
                print(f"WRONG RESULT: {what} {label}: relative error {err:.3g} > {tol}", file=sys.stderr, flush=True)

    def run(self, compile_only: bool = False) -> None:
        a = self.a
        check_ctx = max([c for c in a.contexts if c <= a.check_ctx] or [min(a.contexts)])
        contexts = [min(a.contexts)] if compile_only else a.contexts
        for heads in a.heads:
            for S in a.batches:
                for ctx in contexts:
                    what = {"heads": "/".join(map(str, heads)), "S": S, "context": ctx}
                    if self.left_s() <= 0:
                        self.skipped.append(what)
                        continue
                    try:
                        self.case(heads, S, ctx, ctx == check_ctx, compile_only)
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory: report, measure the rest
                        msg = f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                        self.errors.append(msg)
                        print(f"  case failed: {msg}", file=sys.stderr, flush=True)  # again as ERROR at the end
                    finally:
                        if self.device.type == "cuda":
                            torch.cuda.empty_cache()
                    self.write()  # as it goes: a run killed by a timeout keeps what it measured

    def meta(self) -> dict:
        a = self.a
        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu (Triton interpreter)"
        return {"device": dev, "torch": torch.__version__, "triton": getattr(triton, "__version__", "?"),
                "page_size": PAGE, "peak_gbs": a.peak_gbs, "l2_bytes": a.l2_bytes, "smoke": a.smoke,
                "timing": ("one perf_counter call (smoke, not a measurement)" if self.device.type != "cuda" else
                           f"median of CUDA-graph replays (GPU time, ~{a.rep} ms a case), L2-cold: KV copies "
                           f"totalling >= 3x the {a.l2_bytes >> 20} MiB L2 (1 copy when one is >= 4x it)")}

    def write(self) -> None:
        if not self.a.out:
            return
        out = Path(self.a.out)
        out.mkdir(parents=True, exist_ok=True)
        m = self.meta()
        (out / "gpu_attention.json").write_text(json.dumps(
            {"meta": m, "rows": self.rows, "checks": self.checks, "skipped": self.skipped, "errors": self.errors},
            indent=1, default=str))
        f = lambda v, p: "" if v is None else f"{v:.{p}f}"  # noqa: E731
        lines = ["# lowbit paged decode attention vs torch SDPA (f16, contiguous K/V)", "",
                 (f"GPU {m['device']}; torch {m['torch']}; triton {m['triton']}; pages of {PAGE}; timing: "
                  f"{m['timing']}; peak bandwidth {m['peak_gbs'] or 'unknown'} GB/s."
                  + (" SMOKE RUN: not measurements." if self.a.smoke else "")), "",
                 ("One decode step of one layer: S sequences, one query row each, over `context` cached tokens. "
                  "lowbit ms: paged_attention, max_query_len=1 (split-KV); one-pass ms: the single-pass kernel "
                  "(split_rows all -1). speedup = SDPA ms / lowbit ms. GB/s and % peak: KV bytes read (MB column) "
                  "over the lowbit time. copies: KV copies rotated, lowbit / SDPA."), "",
                 "| heads H/Hkv/D | model | S | context | KV | lowbit ms | one-pass ms | SDPA f16 ms | speedup | KV MB "
                 "| GB/s | % peak | SDPA GB/s | copies |",
                 "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['heads']} | {r['model']} | {r['S']} | {r['context']} | {r['kv']} | {r['lowbit_ms']:.4f} | "
                  f"{f(r['one_pass_ms'], 4)} | {r['sdpa_ms']:.4f} | {r['speedup']:.2f}x | "
                  f"{r['kv_bytes'] / 2**20:.1f} | {r['gbs']:.0f} | {f(r['pct_peak'], 0)} | {r['sdpa_gbs']:.0f} | "
                  f"{r['copies']}/{r['sdpa_copies']} |" for r in self.rows]
        bad = [c for c in self.checks if not c["ok"]]
        lines += ["", f"## Correctness: {len(self.checks) - len(bad)}/{len(self.checks)} checks within tolerance", ""]
        lines += [f"- WRONG: {c}" for c in bad]
        for key, title in (("errors", "Errors"), ("skipped", "Skipped for the time budget")):
            if getattr(self, key):
                lines += ["", f"## {title}: {len(getattr(self, key))}", ""] + [f"- {e}" for e in getattr(self, key)]
        (out / "gpu_attention.md").write_text("\n".join(lines) + "\n")


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--heads", default=",".join("/".join(map(str, h)) for h in HEADS),
                    help="comma list of H/Hkv/D (default 32/8/128,32/32/128,9/3/64)")
    ap.add_argument("--batches", type=ints, default=[1, 8], help="sequences per step, comma list (default 1,8)")
    ap.add_argument("--contexts", type=ints, default=[1024, 8192, 32768],
                    help="cached tokens per sequence, comma list (default 1024,8192,32768)")
    ap.add_argument("--formats", default="k8v4,f16,k8v8", help="KV formats (quant/kv.py), comma list")
    ap.add_argument("--one-pass", default="k8v4", help="formats also timed on the single-pass kernel ('' : none)")
    ap.add_argument("--rep", type=float, default=40, help="GPU ms of graph replays per timing (default 40)")
    ap.add_argument("--peak-gbs", type=float, help="peak memory bandwidth, GB/s (default by GPU name)")
    ap.add_argument("--l2-mb", type=float, help="L2 size the rotation defeats, MiB (default: the device's, else 50)")
    ap.add_argument("--max-copies", type=int, default=512, help="most KV copies one timing rotates (default 512)")
    ap.add_argument("--check-ctx", type=int, default=1024, help="check at the largest context <= this (default 1024)")
    ap.add_argument("--tol", type=float, default=1e-3, help="max relative error (Frobenius) vs paged_attention_ref")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new case after this many seconds (0: none)")
    ap.add_argument("--compile-only", action="store_true",
                    help="run each kernel once at the smallest context (fills Triton's cache); no timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="directory for gpu_attention.md and gpu_attention.json")
    ap.add_argument("--smoke", action="store_true", help="4/2/16 heads, contexts 20 and 37, batches 1 and 2")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: unwind, so the outputs get written

    cuda = torch.cuda.is_available() and not interpreting()
    if not cuda and not (a.smoke and interpreting()):
        sys.exit("gpu_attention.py needs a CUDA GPU (or TRITON_INTERPRET=1 with --smoke for a CPU smoke run)")
    device = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        a.heads, a.batches, a.contexts, a.check_ctx = "4/2/16", [1, 2], [20, 37], 37
    a.heads = [tuple(int(v) for v in h.split("/")) for h in a.heads.split(",") if h]
    a.formats = [f for f in a.formats.split(",") if f]
    a.one_pass = {f for f in a.one_pass.split(",") if f}
    for f in a.formats:
        parse_kv_format(f)
    if any(len(h) != 3 or h[0] % h[1] for h in a.heads) or not a.batches or not a.contexts:
        sys.exit("--heads entries are H/Hkv/D with Hkv dividing H; --batches and --contexts must not be empty")
    a.peak_gbs = a.peak_gbs or (peak_gbs_for(torch.cuda.get_device_name(device)) if cuda else None)
    if a.l2_mb is not None:
        a.l2_bytes = int(a.l2_mb * 2**20)
    else:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if cuda else 0
        a.l2_bytes = l2 or L2_DEFAULT
    torch.manual_seed(a.seed)

    b = Bench(a, device)
    if a.compile_only:
        with torch.inference_mode():
            b.run(compile_only=True)
        if cuda:
            torch.cuda.synchronize()
        print(f"compiled in {time.perf_counter() - b.t0:.1f} s" + (f"; {len(b.errors)} failed" if b.errors else ""))
        return 1 if b.errors else 0
    print(f"{'heads':<11}{'S':>3}{'ctx':>7} {'KV':<6}{'lowbit ms':>10}{'1-pass ms':>10}{'SDPA ms':>10}{'speedup':>8}"
          f"{'KV MB':>9}{'GB/s':>8}{'% peak':>7}{'copies':>8}", flush=True)
    try:
        with torch.inference_mode():
            b.run()
    finally:
        b.write()
    m = b.meta()
    print(f"\n{m['device']}, torch {m['torch']}, triton {m['triton']}, peak {a.peak_gbs or 'unknown'} GB/s, "
          f"{time.perf_counter() - b.t0:.0f} s" + ("; SMOKE RUN: code paths only, the times are not measurements"
                                                  if a.smoke else ""))
    for r in b.rows:
        if r["S"] == max(a.batches) and r["context"] == max(a.contexts) and r["kv"] == a.formats[0]:
            print(f"attention {r['heads']} S={r['S']} ctx={r['context']} {r['kv']}: {r['lowbit_ms']:.4f} ms, "
                  f"{r['speedup']:.2f}x SDPA, {r['gbs']:.0f} GB/s")
    if b.skipped:
        print(f"INCOMPLETE: {len(b.skipped)} cases skipped for the {a.budget_s:.0f} s budget")
    for e in b.errors:
        print(f"ERROR {e}", file=sys.stderr)
    bad = [c for c in b.checks if not c["ok"]]
    print(f"correctness: {len(b.checks) - len(bad)}/{len(b.checks)} checks within tolerance")
    if bad:
        print(f"FAILED: {len(bad)} results disagree with their reference", file=sys.stderr)
    return 1 if bad or b.errors else 3 if b.skipped else 0


if __name__ == "__main__":
    sys.exit(main())
