"""The engine's decode step under concurrency, per instruction set and per lever, side by side in one run.

    python tests/bench/engine_step.py [--model PATH] [--streams 16] [--threads 2] [--steps 40]
                                      [--isas avx2,avx512] [--attention]

N streams (half input-grounded prompts from the shipped WikiText excerpt, half open-ended chat; see
speculative.py) are prefilled through the engine (k8v4 cache), then decode steps cycle through the
modes compared, one step each, so all share the machine's noise and the same growing contexts
(on a shared VM, runs of the same command in separate processes differed by up to 30%):

- one mode per instruction set of --isas (default: every one this CPU runs), lowbit's C kernels
  throughout — the AVX2 row is what an AVX2-only CPU runs, bit for bit the same tokens;
- with --attention, also the plain-torch paged attention that the C kernel replaced (the step's
  pages gathered and dequantized together, GATHER_PAGES, then SDPA per sequence), on the best set.

Prints the median step time and tok/s of each mode. Wall clock around engine.step().
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from speculative import OPEN_ENDED, grounded_prompts  # noqa: E402

from decode_prefill import cpu_name  # noqa: E402

from lowbit.kernels import cpu_native  # noqa: E402
from lowbit.models.backend import torch_backend  # noqa: E402
from lowbit.runtime.engine.config import EngineConfig  # noqa: E402
from lowbit.runtime.engine.engine import Engine  # noqa: E402
from lowbit.runtime.engine.sampler import SamplingParams  # noqa: E402
from lowbit.runtime.load.loader import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the default model)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed, shared by the modes (default 40)")
    ap.add_argument("--isas", default=None, help="instruction sets to compare (default: all this CPU runs)")
    ap.add_argument("--attention", action="store_true", help="also time the plain-torch paged attention")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    best = cpu_native.native()
    if best is None:
        sys.exit("lowbit's C kernels do not build here: nothing to compare")
    isas = args.isas.split(",") if args.isas else best.isas
    # one model per mode, each built on its backend (the kernels are the backend's choice), all
    # stepping the same engine, pool and requests in turn
    modes = [(isa, torch_backend(best.with_isa(isa))) for isa in isas]  # (label, backend)
    if args.attention:
        modes.append((f"{best.isa}, gathered + SDPA", dataclasses.replace(torch_backend(best), native=None)))
    models = {label: load(args.model, progress=False, backend=b).model for label, b in modes}
    lm = load(args.model, progress=False)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(kv_format="k8v4", kv_memory=256 << 20))
    half = args.streams // 2
    prompts = grounded_prompts(args.streams - half) + [OPEN_ENDED[i % len(OPEN_ENDED)] for i in range(half)]
    for p in prompts:
        ids = lm.tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=args.steps + 1000, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(s.num_tokens - s.num_computed > 1 for s in sched.running):
        engine.step()  # prefill every stream first
    ctx = [s.num_tokens for s in sched.running]
    times = {label: [] for label, _ in modes}
    for i in range(args.steps):
        label, _ = modes[i % len(modes)]
        engine.model = engine.runner.model = models[label]
        t0 = time.perf_counter()
        engine.step()
        times[label].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items() if v}
    print(f"{args.streams} streams decoding (contexts {min(ctx)}-{max(ctx)} tokens at the start), "
          f"{args.threads} threads, {args.steps} steps cycled over {len(modes)} modes; CPU {cpu_name()}")
    for m, t in med.items():
        print(f"  {m:<28} median step {t * 1e3:7.1f} ms   {args.streams / t:6.1f} tok/s")


if __name__ == "__main__":
    main()
