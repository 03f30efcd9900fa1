"""Speculative decoding's speed-up, single stream, side by side in one run.

    python tests/bench/speculative.py [--model PATH] [--threads 2] [--max-tokens 128] [--k 4]
                                      [--reps 1] [--json OUT]

Two targets of the same model file: `auto` (the GGUF's own Q4_1/Q8_0 layouts) and `bf16` (its
weights dequantized to bf16, the "full-precision target" case). For each target, each mode runs
every prompt of two sets, greedy, through the engine (one request at a time, k8v4 cache):

- baseline: no speculation;
- ngram: `--speculative ngram,k=K` (prompt lookup);
- self-draft: `--speculative draft=self:int4-g128,k=K` (bf16 target only: an int4 copy of the
  target's own weights drafts; for the `auto` target it would only requantize Q4_1 to int4).

Prompt sets: input-grounded (rewrite, copy-edit, summarize a passage of the shipped WikiText
excerpt: replies copy long runs of the prompt) and open-ended chat. Decode tok/s per request =
(output tokens - 1) / (last token time - first token time), wall clock around engine.step(); the
table shows medians over requests, the ratio to the baseline of the same target and set, the
acceptance rate, tokens per target pass (passes that verified drafts), tokens per engine step
(for prompt lookup, the speed-up a free verification pass would give: its ceiling for this model
and these prompts), and whether every greedy reply equals the baseline's token for token. Modes
alternate per prompt (baseline, ngram, self-draft, next prompt ...) so they share the machine's
noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lowbit.runtime.bench.client import DEFAULT_TEXT
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.load.loader import load
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.engine.speculative import SpecConfig


def grounded_prompts(n: int) -> list[str]:
    text = DEFAULT_TEXT.read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n") if len(p.strip()) > 400 and not p.strip().startswith("=")]
    asks = ["Rewrite the following passage word for word, changing nothing:\n\n{p}",
            "Copy-edit this paragraph: fix any typos and return the whole corrected paragraph.\n\n{p}",
            "Summarize the following passage in a few sentences, reusing its wording:\n\n{p}"]
    return [asks[i % len(asks)].format(p=paras[i][:900]) for i in range(n)]


OPEN_ENDED = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
              "Explain why the sky is blue to a ten-year-old.",
              "What are three good habits for learning a new language?",
              "Describe your ideal weekend in the mountains.",
              "Give me some ideas for a birthday party for my grandmother.",
              "Why do cats purr?"]


def run_one(engine: Engine, ids: list[int], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rid = engine.add_request(ids, params)
    toks, t_first, t_last, spec, steps = [], None, None, None, 0
    while engine.has_work():
        steps += t_first is not None  # decode steps: those after the first token's
        for d in engine.step():
            now = time.perf_counter()
            if d.token_ids:
                t_first, t_last = t_first or now, now
                toks += d.token_ids
            if d.finish_reason and d.request_id == rid and d.usage is not None:
                spec = d.usage.spec
    tps = (len(toks) - 1) / (t_last - t_first) if len(toks) > 1 and t_last > t_first else float("nan")
    return {"tokens": toks, "tps": tps, "drafted": spec.drafted if spec else 0, "accepted": spec.accepted if spec else 0,
            "passes": spec.passes if spec else 0, "decode_steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="drafts per pass (default 4)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set (default 6)")
    ap.add_argument("--targets", default="auto,bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    sets = {"grounded": grounded_prompts(args.prompts), "open-ended": OPEN_ENDED[: args.prompts]}
    rows = []
    for target in args.targets.split(","):
        lm = load(args.model, target, progress=False)
        modes = {"baseline": (None, None), "ngram": (SpecConfig.parse(f"ngram,k={args.k}"), None)}
        if target != "auto":
            draft = load(str(lm.path), "int4-g128", progress=False).model
            modes["self-draft int4-g128"] = (SpecConfig.parse(f"draft=self:int4-g128,k={args.k}"), draft)
        engines = {m: Engine(lm.model, lm.tokenizer, EngineConfig(kv_format="k8v4", kv_memory=64 << 20, speculative=s),
                             draft_model=d) for m, (s, d) in modes.items()}
        for set_name, prompts in sets.items():
            got = {m: [] for m in modes}
            for p in prompts:
                ids = lm.tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)
                for m, engine in engines.items():
                    got[m].append(run_one(engine, ids, args.max_tokens))
            base = statistics.median(r["tps"] for r in got["baseline"])
            for m, rs in got.items():
                tps = statistics.median(r["tps"] for r in rs)
                drafted, accepted, passes, steps = (sum(r[k] for r in rs)
                                                    for k in ("drafted", "accepted", "passes", "decode_steps"))
                same = all(r["tokens"] == b["tokens"] for r, b in zip(rs, got["baseline"]))
                rows.append({"target": target, "set": set_name, "mode": m, "median_decode_tps": tps,
                             "ratio": tps / base, "acceptance": accepted / drafted if drafted else None,
                             "tokens_per_pass": (accepted + passes) / passes if passes else None,
                             # tokens per engine step: the speed-up a free verification pass would give
                             "tokens_per_step": sum(len(r["tokens"]) - 1 for r in rs) / steps if steps else None,
                             "identical_greedy": same, "tokens": sum(len(r["tokens"]) for r in rs),
                             "samples_tps": [r["tps"] for r in rs]})
                r = rows[-1]
                acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
                tpp = "-" if r["tokens_per_pass"] is None else f"{r['tokens_per_pass']:.2f}"
                tps_ = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
                print(f"{target:>5} {set_name:<11} {m:<21} {tps:7.1f} tok/s  {r['ratio']:5.2f}x  accept {acc:>4}  "
                      f"tokens/pass {tpp:>5}  tokens/step {tps_:>5}  identical {'yes' if same else 'NO'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "k": args.k, "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
