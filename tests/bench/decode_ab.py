"""Single-stream decode of the default model, engine and verified greedy, for comparing two commits.

    python tests/bench/decode_ab.py [--tokens 128] [--runs 3] [--threads 2]

Prints one line: the medians over --runs (and every run) of engine decode tok/s (greedy, fast
kernels, k8v4, end tokens ignored) and verified greedy tok/s (what `lowbit run --temperature 0` runs,
its decode_tok_s), both after decode_prefill.py's 20-token prompt. It imports whichever lowbit is on
the path, in the current layout or in the one before runtime/ had sub-packages, so the commit before
a change can be run beside it, processes alternated:

    git worktree add /tmp/old OLD && mkdir -p /tmp/oldpkg/lowbit
    for d in runtime models quant kernels tui; do ln -s /tmp/old/$d /tmp/oldpkg/lowbit/$d; done
    for r in 1 2 3 4 5 6; do
      PYTHONPATH=/tmp/oldpkg python tests/bench/decode_ab.py; python tests/bench/decode_ab.py
    done
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_prefill import DEFAULT_PROMPT, cpu_name  # noqa: E402


def _measures(n: int):
    """(load, engine decode tok/s, verified greedy tok/s) for the lowbit on the path."""
    try:
        import dataclasses

        from lowbit.runtime.cli.run import _engine_run
        from lowbit.runtime.engine.config import EngineConfig
        from lowbit.runtime.engine.engine import Engine
        from lowbit.runtime.engine.sampler import SamplingParams
        from lowbit.runtime.engine.speculative import VERIFIED_GREEDY
        from lowbit.runtime.load.loader import load
        from lowbit.runtime.load.registry import resolve

        def engine(lm):
            return Engine(lm.model, lm.tokenizer, EngineConfig(kv_memory=64 << 20))

        def verified(lm, prompt):
            cfg = dataclasses.replace(EngineConfig(), kv_format="f32", speculative=VERIFIED_GREEDY)
            return _engine_run(lm, prompt, SamplingParams(temperature=0, max_tokens=n), cfg, lambda t: None)[0]
    except ImportError:  # runtime/ before its sub-packages: the contiguous-cache loop verified greedy
        from lowbit.runtime.engine import Engine
        from lowbit.runtime.generate import generate
        from lowbit.runtime.loader import load
        from lowbit.runtime.registry import resolve
        from lowbit.runtime.sampler import Sampler, SamplingParams

        def engine(lm):
            return Engine(lm.model, lm.tokenizer, kv_memory=64 << 20)

        def verified(lm, prompt):
            return generate(lm.model, lm.tokenizer, prompt, n, Sampler(SamplingParams(temperature=0)))

    def engine_tps(lm, prompt, tokens=n) -> float:
        e = engine(lm)
        e.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
        e.step()  # the prompt and the first token
        t0, made = time.perf_counter(), 0
        while e.has_work():
            made += sum(len(d.token_ids) for d in e.step())
        return made / (time.perf_counter() - t0)

    return (lambda: load(str(resolve("smollm2-135m")), progress=False), engine_tps,
            lambda lm, prompt: verified(lm, prompt).decode_tok_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    load, engine_tps, verified_tps = _measures(a.tokens)
    lm = load()
    prompt = lm.tokenizer.encode(DEFAULT_PROMPT, add_special=False)
    engine_tps(lm, prompt, 4), verified_tps(lm, prompt)  # warm-up
    e, v = [], []
    for _ in range(a.runs):
        e.append(engine_tps(lm, prompt))
        v.append(verified_tps(lm, prompt))
    print(f"engine {statistics.median(e):.1f} {[round(x, 1) for x in e]} verified {statistics.median(v):.1f} "
          f"{[round(x, 1) for x in v]} ({len(prompt)}-token prompt, {a.tokens} tokens, {a.threads} threads, "
          f"{cpu_name()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
