"""`lowbit bench` and `lowbit bench plot` on the command line: flags, the console table, the result
file. The measuring is runtime/bench/client.py's, the numbers' meaning runtime/bench/metrics.py's."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from lowbit.runtime.errors import LowbitError

METRICS_HELP = """metrics (vLLM's definitions; mean, median, std, p90 and p99 of each):
  TTFT   request sent -> first non-empty content chunk
  TPOT   (E2E - TTFT) / (output tokens - 1), per request with 2+ output tokens
  ITL    gaps between successive content chunks, pooled over requests
  E2E    request sent -> last content chunk
  request/s, output tok/s, total tok/s   over the level's wall time
  goodput   requests/s meeting every --slo limit
output tokens come from the server's usage (stream_options.include_usage); a server that sends none
gets them counted with --tokenizer, else one per content chunk, and the result says which."""


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure TTFT, TPOT, ITL and throughput of an OpenAI-compatible server",
                           description="Send streamed chat completions built from passages of a text file to "
                                       "an OpenAI-compatible server, at fixed concurrency levels or a Poisson "
                                       "request rate, and report latency and throughput. `lowbit bench plot "
                                       "RESULTS...` charts result files side by side.",
                           epilog=METRICS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                       help="the server's API URL, its root (http://host:port, as vLLM's benchmark takes it) "
                            "or its /v1 URL (default: $OPENAI_BASE_URL, else http://127.0.0.1:8000/v1)")
    bench.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    bench.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    bench.add_argument("--text", default=None,
                       help="text file whose passages make the prompts (default: a WikiText-2 excerpt shipped "
                            "with lowbit)")
    bench.add_argument("--tokenizer", default=None,
                       help="a lowbit model (alias, .gguf or HF dir) whose tokenizer sizes passages exactly and "
                            "counts output tokens when the server reports no usage (default: ~4 chars per token)")
    bench.add_argument("--input-len", type=int, default=256, help="prompt passage length in tokens (default 256)")
    bench.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (default 128)")
    bench.add_argument("--ignore-eos", action="store_true",
                       help="ask the server to generate --output-len tokens regardless of the end token "
                            "(vLLM, llama.cpp and lowbit honour it)")
    bench.add_argument("--num-prompts", type=int, default=32, help="requests per load level (default 32)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the passage choice and the arrivals (default 0)")
    bench.add_argument("--concurrency", default="1",
                       help="closed loop: requests in flight, a comma list runs a sweep, e.g. 1,4,16 (default 1)")
    bench.add_argument("--request-rate", type=float, default=None,
                       help="open loop instead: Poisson arrivals at this many requests/s")
    bench.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (open loop)")
    bench.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted (default 1)")
    bench.add_argument("--slo", default=None, help="goodput limits in ms, e.g. ttft=500,tpot=50")
    bench.add_argument("--timeout", type=float, default=600, help="seconds per request (default 600)")
    bench.add_argument("--out", "-o", default=None, help="result JSON file (default: bench-<date>.json)")
    bench.add_argument("--label", default=None, help="name of this run in charts (default: the model name)")
    bench.add_argument("--save-detailed", action="store_true", help="keep per-request timings in the result file")
    plot_sub = bench.add_subparsers(dest="bench_command", metavar="plot")
    plot = plot_sub.add_parser("plot", help="chart result files: throughput against TTFT and TPOT",
                               description="One PNG: output tok/s against median and p99 TTFT and TPOT across "
                                           "the load levels, one line per result file.")
    plot.add_argument("results", nargs="+", help="result JSON files of lowbit bench")
    plot.add_argument("--out", "-o", default="bench.png", help="PNG to write (default bench.png)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise LowbitError(f"{flag} takes a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise LowbitError(f"{flag} values must be >= 1, got {text!r}")
    return values


def _config(args):
    from lowbit.runtime.api_url import api_base
    from lowbit.runtime.bench.client import DEFAULT_TEXT, BenchConfig
    from lowbit.runtime.bench.metrics import parse_slo

    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise LowbitError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise LowbitError("--warmup must be >= 0")
    if args.request_rate is not None and not args.request_rate > 0:
        raise LowbitError("--request-rate must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise LowbitError("--max-concurrency must be >= 1")
    text = Path(args.text) if args.text else DEFAULT_TEXT
    if not text.is_file():
        raise LowbitError(f"--text: no such file: {text}")
    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        raise LowbitError(str(e)) from None
    return BenchConfig(base_url=api_base(args.base_url), model=args.model, api_key=args.api_key,
                       input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                       seed=args.seed, concurrency=_ints(args.concurrency, "--concurrency"),
                       request_rate=args.request_rate, max_concurrency=args.max_concurrency, warmup=args.warmup,
                       ignore_eos=args.ignore_eos, text=str(text), tokenizer=args.tokenizer, slo=slo,
                       timeout=args.timeout)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(doc: dict) -> str:
    head = (f"{'load':>10} {'ok':>5} {'fail':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'E2E p50':>9}")
    lines = [f"{doc['model']} at {doc['base_url']} (times in ms)", head]
    for r in doc["results"]:
        load = f"c={r['max_concurrency']}" if r["request_rate"] is None else f"{r['request_rate']:g}/s"
        lines.append(f"{load:>10} {r['completed']:>5} {r['failed']:>5} {r['request_throughput']:>7.2f} "
                     f"{r['output_throughput']:>10.1f} {_ms(r['median_ttft_ms']):>9} {_ms(r['p99_ttft_ms']):>9} "
                     f"{_ms(r['median_tpot_ms']):>9} {_ms(r['p99_tpot_ms']):>9} {_ms(r['median_itl_ms']):>8} "
                     f"{_ms(r['median_e2el_ms']):>9}")
        if "request_goodput" in r:
            lines[-1] += f"  goodput {r['request_goodput']:.2f} req/s"
        if r["output_tokens_counted"] != ["usage"] and r["completed"]:
            lines.append(f"{'':>10} output tokens counted by {', '.join(r['output_tokens_counted'])} "
                         "(the server sent no usage)")
        for e in r["errors"]:
            lines.append(f"{'':>10} failure: {e}")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    if getattr(args, "bench_command", None) == "plot":
        from lowbit.runtime.bench.plot import plot

        try:
            plot([Path(p) for p in args.results], Path(args.out))
        except (OSError, ValueError, KeyError) as e:
            raise LowbitError(f"cannot plot: {e}") from None
        print(args.out)
        return 0
    from lowbit.runtime.bench.client import bench

    cfg = _config(args)
    tokenizer = None
    if cfg.tokenizer:
        from lowbit.runtime.load.registry import resolve
        from lowbit.runtime.load.tokenizer import Tokenizer

        path = resolve(cfg.tokenizer)
        tokenizer = Tokenizer.from_gguf(path) if Path(path).suffix == ".gguf" else Tokenizer.from_hf_dir(path)
    doc = asyncio.run(bench(cfg, tokenizer=tokenizer))
    doc["label"] = args.label or doc["model"]
    if not args.save_detailed:
        doc.pop("requests")
    out = Path(args.out or f"bench-{doc['date'].replace(':', '')}.json")
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"results: {out}", file=sys.stderr)
    if any(r["completed"] == 0 for r in doc["results"]):
        raise LowbitError("no request succeeded at some load level (see the failures above)")
    return 0
