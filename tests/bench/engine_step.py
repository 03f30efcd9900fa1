"""The engine's decode step under concurrency, and one lever's effect on it, side by side in one run.

    python tests/bench/engine_step.py [--model PATH] [--streams 16] [--threads 2] [--steps 40]

N streams (half input-grounded prompts from the shipped WikiText excerpt, half open-ended chat; see
speculative.py) are prefilled through the engine (k8v4 cache), then decode steps alternate between
two ways CPU attention reads the paged cache: lowbit's C kernel attending every one-token row
straight from the quantized pages (kernels/cpu_attention.c, the default where it builds), and the
plain-torch path it replaced — the step's pages gathered and dequantized together (GATHER_PAGES),
then SDPA per sequence. Everything else (matmuls, fused blocks, quantize-on-write) is the same C in
both. Alternating step by step lets both share the machine's noise and the same growing contexts;
prints the median step time of each and their ratio. Wall clock around engine.step().
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from speculative import OPEN_ENDED, grounded_prompts  # noqa: E402

from lowbit.models import attention  # noqa: E402
from lowbit.runtime.engine import Engine  # noqa: E402
from lowbit.runtime.loader import load  # noqa: E402
from lowbit.runtime.sampler import SamplingParams  # noqa: E402


class _AttentionWithoutC:
    """What models/attention.py sees of kernels/cpu_native.py in the comparison steps: no C kernels."""

    @staticmethod
    def native():
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the default model)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed, half per mode (default 40)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load(args.model, progress=False)
    engine = Engine(lm.model, lm.tokenizer, kv_format="k8v4", kv_memory=256 << 20)
    half = args.streams // 2
    prompts = grounded_prompts(args.streams - half) + [OPEN_ENDED[i % len(OPEN_ENDED)] for i in range(half)]
    for p in prompts:
        ids = lm.tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=args.steps + 1000, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(s.num_tokens - s.num_computed > 1 for s in sched.running):
        engine.step()  # prefill every stream first
    c_kernels, times = attention.cpu_native, {"C from pages": [], "gathered + SDPA": []}
    try:
        for i in range(args.steps):
            mode = "gathered + SDPA" if i % 2 else "C from pages"
            attention.cpu_native = _AttentionWithoutC if i % 2 else c_kernels
            t0 = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - t0)
    finally:
        attention.cpu_native = c_kernels
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"{args.streams} streams decoding, {args.threads} threads, {args.steps} steps alternated")
    for m, t in med.items():
        print(f"  attention {m:<16} median step {t * 1e3:7.1f} ms   {args.streams / t:6.1f} tok/s")
    print(f"  C from pages / gathered + SDPA: {med['gathered + SDPA'] / med['C from pages']:.2f}x")


if __name__ == "__main__":
    main()
