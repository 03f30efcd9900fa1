"""`lowbit eval`: what each weight and KV format costs in quality and saves in memory, measured as
llama.cpp's `llama-perplexity --kl-divergence` measures it.

The text is cut into windows of `ctx` tokens; each window runs through the model in chunks written
to a paged KV pool of the format under test (so attention reads the quantized cache, its own chunk
included), and the second half of each window is scored: negative log-likelihood of the next
token (perplexity), KL divergence of the variant's next-token distribution from the reference's,
and whether both rank the same token first. The reference is the unquantized model (the source
weights dequantized to fp32) with an f16 cache. Reference log-probabilities are computed per window
and dropped once every variant has been compared with them: nothing vocabulary-sized is stored.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.runner import Chunk, Runner
from lowbit.runtime.engine.state_cache import StateCache

PAGE = EngineConfig().page_size  # tokens per KV page, as the engine's


@dataclass
class Variant:
    name: str  # weights layout name
    kv: str  # KV format
    model: object  # models.llama.Llama (None for a peer)
    weight_bytes: int  # bytes held by its weight tensors
    logprobs: object = None  # (window ids) -> log-probs [T, V]; default: lowbit's model through a `kv` pool
    kv_bytes_per_token: int | None = None  # default: the lowbit KV format's

    def window(self, ids: list[int]) -> torch.Tensor:
        return self.logprobs(ids) if self.logprobs is not None else window_logprobs(self.model, ids, self.kv)


@dataclass
class Row:
    weights: str
    kv: str
    weight_bytes: int
    bits_per_weight: float
    kv_bytes_per_token: int
    ppl: float
    ppl_stderr: float
    dppl_pct: float
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_pct: float
    tokens: int
    decode_tps: float | None = None
    # against a saved reference (runtime/eval/topk_kl.py): the candidate file, the tail's bound on the mean
    # KL, llama-perplexity's KL percentiles and Δp (the next token's probability, candidate - reference)
    model: str = ""
    kl_tail_bound: float | None = None  # 2.58 standard errors of the tail's sampled share
    kl_lower: float | None = None  # the top-k exact + the log-sum inequality's floor on the tail
    kl_median: float | None = None
    kl_p90: float | None = None
    kl_p999: float | None = None
    dp_mean: float | None = None
    dp_rms: float | None = None
    dp_p01: float | None = None
    dp_p99: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def window_logprobs(model, ids: list[int], kv: str | list) -> torch.Tensor:
    """log-softmax fp32 [T, V] of every position of one window, in one forward pass (as
    llama-perplexity runs a window with n_batch >= n_ctx) through a paged pool of format `kv` (a name,
    or one KVFormat per KV layer: runtime/eval/attribution.py): the window's K/V are quantized on write
    and every position attends to the quantized cache. Pages are handed out in reverse order, so nothing
    depends on them being contiguous.

    Why one pass: a quantized cache turns the last-bit differences between GEMM blockings into
    whole quantization steps (a code flips at a rounding boundary), so chunking a window changes the
    numbers slightly (64-token chunks against one 512-token pass: mean KL 3e-4 between the two on
    the default model with k8v4, against 5e-3 for k8v4 itself); one pass is also 2x faster."""
    c = model.config
    T = len(ids)
    n_pages = -(-T // PAGE)
    states = StateCache(c, 1, model.device) if c.deltanet is not None else None  # a hybrid model's one slot
    named = isinstance(kv, str)
    pool = KVPool(KV_FORMATS[kv if named else "f16"], c.n_kv_layers, c.n_kv_heads, c.head_dim, num_pages=n_pages,
                  page_size=PAGE, device=model.device, states=states, layer_formats=None if named else list(kv))
    pages = list(range(n_pages))[::-1]
    slots = [pages[p // PAGE] * PAGE + p % PAGE for p in range(T)]
    logits = Runner(model, pool).run([Chunk(ids, 0, slots, pages, logits=T, state_slot=0)], exact=True)  # [T, V]
    return logits.float().log_softmax(-1).cpu()


class Reference:
    """One window's reference log-probs [n, V], with what every variant's comparison reuses: the
    probabilities and the top-1 ids (computed once per window, not once per variant)."""

    def __init__(self, lp: torch.Tensor):
        self.lp, self.p, self.top1 = lp, lp.exp(), lp.argmax(-1)


def perplexity(nll: torch.Tensor) -> tuple[float, float]:
    """exp of the mean NLL [n], and llama-perplexity's uncertainty: the standard error of the mean NLL,
    carried through exp. Every table computes it here, so that a lossless row's ΔPPL is exactly 0."""
    n = nll.numel()
    ppl = math.exp(float(nll.mean()))
    return ppl, ppl * float(nll.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0


class Scores:
    """Running per-token statistics of one variant against the reference."""

    def __init__(self):
        self.nll: list[torch.Tensor] = []
        self.kl: list[torch.Tensor] = []
        self.same_top1 = 0

    def add(self, ref: Reference, got: torch.Tensor, targets: torch.Tensor) -> None:
        """got: log-probs [n, V] predicting targets [n]."""
        self.nll.append(-got.gather(1, targets[:, None])[:, 0].double())
        self.kl.append((ref.p * (ref.lp - got)).sum(-1).clamp_min(0).double())
        self.same_top1 += int((ref.top1 == got.argmax(-1)).sum())

    def summary(self) -> dict:
        nll, kl = torch.cat(self.nll), torch.cat(self.kl)
        n = nll.numel()
        ppl, stderr = perplexity(nll)
        return {"ppl": ppl, "ppl_stderr": stderr, "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
                "kl_max": float(kl.max()), "top1_pct": 100.0 * self.same_top1 / n, "tokens": n}


def windows(ids: list[int], ctx: int, max_windows: int | None) -> list[list[int]]:
    """Consecutive non-overlapping windows of ctx tokens (the tail shorter than ctx is dropped)."""
    out = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    return out[:max_windows] if max_windows else out


def evaluate(reference, variants: list[Variant], ids: list[int], ctx: int = 512, max_windows: int | None = None,
             progress=None) -> tuple[dict, list[Row]]:
    """reference: the fp32 model (f16 cache). → (reference summary, one Row per variant, in order),
    the first being the reference against itself (the noise floor: KL 0, ΔPPL 0)."""
    wins = windows(ids, ctx, max_windows)
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of {ctx}")
    c = reference.config
    ref_scores = Scores()
    scores = [Scores() for _ in variants]
    half = ctx // 2
    for w in wins:
        targets = torch.tensor(w[half:], dtype=torch.long)  # position t predicts token t + 1
        ref = Reference(window_logprobs(reference, w, "f16")[half - 1:-1])  # [ctx - half, V]
        ref_scores.add(ref, ref.lp, targets)
        for v, sc in zip(variants, scores):
            got = ref.lp if v.model is reference and v.kv == "f16" else v.window(w)[half - 1:-1]
            sc.add(ref, got, targets)
        if progress is not None:
            progress.update(1)
    base = ref_scores.summary()
    ref_elems = sum(b.numel() for b in reference.buffers())  # weights as fp32: one element each
    rows = []
    for v, sc in zip(variants, scores):
        s = sc.summary()
        kv_bytes = v.kv_bytes_per_token or KV_FORMATS[v.kv].bytes_per_token(c.n_kv_layers, c.n_kv_heads, c.head_dim)
        rows.append(Row(v.name, v.kv, v.weight_bytes, 8 * v.weight_bytes / ref_elems, kv_bytes, s["ppl"],
                        s["ppl_stderr"], 100 * (s["ppl"] / base["ppl"] - 1), s["kl_mean"], s["kl_p99"], s["kl_max"],
                        s["top1_pct"], s["tokens"]))
    return base, rows


# llama.cpp's cache types: bytes per value (q8_0: 32 values in 34 bytes, q4_0: 32 in 18)
LLAMA_CPP_KV = {"f16": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}  # name → (GGML type, bytes/value)


def llama_cpp_variants(gguf: str, kv_pairs: list[tuple[str, str]], config, ctx: int, threads: int | None = None):
    """The peer: llama-cpp-python on the same GGUF, one Variant per (type_k, type_v) pair, windows fed
    as the same token ids (all positions' logits kept: logits_all). A quantized V cache needs flash
    attention in llama.cpp, so every row uses it."""
    import llama_cpp
    import numpy as np

    out = []
    per_val = config.n_kv_layers * config.n_kv_heads * config.head_dim
    for k, v in kv_pairs:
        llm = llama_cpp.Llama(gguf, n_ctx=ctx, n_batch=ctx, logits_all=True, flash_attn=True, verbose=False,
                              type_k=LLAMA_CPP_KV[k][0], type_v=LLAMA_CPP_KV[v][0], n_threads=threads)

        def run(ids: list[int], llm=llm) -> torch.Tensor:
            llm.reset()
            llm.eval(ids)
            return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32)).log_softmax(-1)  # [T, V]

        out.append(Variant("llama.cpp (GGUF)", f"{k}/{v}", None, int(llama_cpp.llama_model_size(llm.model)), run,
                           round(per_val * (LLAMA_CPP_KV[k][1] + LLAMA_CPP_KV[v][1]))))
    return out


def decode_tps(model, tokenizer, kv: str | list, n: int = 32) -> float:
    """Single-stream decode tok/s through the engine (greedy, fast kernels), after a short prompt. kv: a format
    name, or one KVFormat per KV layer (a recipe's)."""
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sampler import SamplingParams

    named = isinstance(kv, str)
    config = EngineConfig(kv_format=kv if named else "f16", kv_layers=None if named else tuple(f.name for f in kv),
                          kv_memory=16 << 20)
    engine = Engine(model, tokenizer, config)
    engine.add_request(list(range(1, 17)), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine.step()  # the prompt
    t0, made = time.perf_counter(), 0
    while engine.has_work():
        made += sum(len(d.token_ids) for d in engine.step())
    return made / (time.perf_counter() - t0)


def markdown_table(base: dict, rows: list[Row]) -> str:
    head = ("| weights | KV | weight MB | bits/weight | KV B/token | PPL | ΔPPL % | mean KL | p99 KL | max KL | "
            "same top-1 % | decode tok/s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in sorted(rows, key=lambda r: r.kl_mean):
        tps = "-" if r.decode_tps is None else f"{r.decode_tps:.1f}"
        lines.append(f"| {r.weights} | {r.kv} | {r.weight_bytes / 1e6:.1f} | {r.bits_per_weight:.2f} | "
                     f"{r.kv_bytes_per_token:,} | {r.ppl:.3f} ± {r.ppl_stderr:.3f} | {r.dppl_pct:+.2f} | "
                     f"{r.kl_mean:.5f} | {r.kl_p99:.4f} | {r.kl_max:.3f} | {r.top1_pct:.2f} | {tps} |")
    lines.append(f"\nReference (fp32 weights, f16 KV): PPL {base['ppl']:.3f} ± {base['ppl_stderr']:.3f} over "
                 f"{base['tokens']} scored tokens.")
    return "\n".join(lines)
