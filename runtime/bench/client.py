"""`lowbit bench`: TTFT, TPOT, ITL and throughput under concurrency against any OpenAI-compatible
endpoint (lowbit serve, llama.cpp's server, llama-cpp-python's, vLLM, Ollama).

Each request is a streamed `/v1/chat/completions` call with `stream_options.include_usage`, asking
the model to continue a passage of a text file; passages are picked with a fixed seed, so two
servers benched with the same flags get the same prompts. Load is either closed-loop (a fixed
number of requests in flight: `--concurrency 1,4,16` runs one level after another) or open-loop
(Poisson arrivals at `--request-rate`, seeded, optionally capped by `--max-concurrency`). Warm-up
requests run first and are not counted. What the numbers mean: runtime/bench/metrics.py.

A request fails on an HTTP error, a transport error, or a 200 stream that carries `{"error": ...}`;
failures are counted and their first messages listed, never dropped. No success at a level is a
non-zero exit.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from lowbit.runtime.bench.metrics import RequestResult, summarize
from lowbit.runtime.errors import LowbitError

DEFAULT_TEXT = Path(__file__).parents[1] / "data" / "wikitext2_excerpt.txt"
CHARS_PER_TOKEN = 4  # English text in BPE vocabularies, to size passages when no tokenizer is given
# the documented fields of one load level in the result file (README "lowbit bench"), as vLLM names them
RESULT_FIELDS = ("max_concurrency", "request_rate", "num_prompts", "duration", "completed", "failed", "errors",
                 "total_input_tokens", "total_output_tokens", "output_tokens_counted", "request_throughput",
                 "output_throughput", "total_token_throughput",
                 *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                   for s in ("mean", "median", "std", "p90", "p99")))


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    input_len: int = 256  # prompt passage, tokens (estimated without a tokenizer)
    output_len: int = 128  # max_tokens
    num_prompts: int = 32  # per load level
    seed: int = 0
    concurrency: tuple[int, ...] = (1,)
    request_rate: float | None = None  # requests/s, Poisson; None = closed loop
    max_concurrency: int | None = None  # cap for the open loop
    warmup: int = 1
    ignore_eos: bool = False
    text: str = str(DEFAULT_TEXT)
    tokenizer: str | None = None
    slo: dict = field(default_factory=dict)  # metric → seconds
    timeout: float = 600.0


# ---- prompts ------------------------------------------------------------------------------------

def build_prompts(text: str, n: int, input_len: int, seed: int, tokenizer=None) -> list[tuple[str, int]]:
    """n (prompt, prompt tokens of the passage) pairs: passages of `input_len` tokens starting at
    seeded random offsets of the text (wrapping around a short text)."""
    rng = random.Random(seed)
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special=False)
        ids = ids * (1 + input_len // max(1, len(ids)))
        starts = [rng.randrange(max(1, len(ids) - input_len + 1)) for _ in range(n)]
        passages = [(tokenizer.decode(ids[s:s + input_len]), input_len) for s in starts]
    else:
        chars = input_len * CHARS_PER_TOKEN
        body = text * (1 + chars // max(1, len(text)))
        starts = [rng.randrange(max(1, len(body) - chars + 1)) for _ in range(n)]
        passages = [(body[s:s + chars], input_len) for s in starts]
    return [(f"Continue this text:\n\n{p.strip()}", k) for p, k in passages]


# ---- one request --------------------------------------------------------------------------------

def _error_text(status: int | None, body: bytes | str) -> str:
    try:
        obj = json.loads(body)
        msg = obj.get("error", {}).get("message") if isinstance(obj.get("error"), dict) else obj.get("error")
        msg = msg or obj.get("detail") or body
    except (ValueError, AttributeError):
        msg = body
    if isinstance(msg, bytes):
        msg = msg.decode("utf-8", "replace")
    msg = " ".join(str(msg).split())[:200]
    return f"HTTP {status}: {msg}" if status is not None else msg


async def send_one(client, cfg: BenchConfig, model: str, prompt: str, prompt_tokens: int,
                   clock: Callable[[], float], tokenizer=None) -> RequestResult:
    """One streamed chat completion, timed with `clock` (seconds)."""
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": cfg.output_len,
               "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    if cfg.ignore_eos:
        payload["ignore_eos"] = True  # vLLM, llama.cpp's server and lowbit honour it
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    r = RequestResult(ok=False, start=clock(), prompt_tokens=prompt_tokens)
    last = None
    usage = None
    chunks = 0
    try:
        async with client.stream("POST", cfg.base_url + "/chat/completions", json=payload, headers=headers,
                                 timeout=cfg.timeout) as resp:
            if resp.status_code != 200:
                r.error = _error_text(resp.status_code, await resp.aread())
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = clock()
                obj = json.loads(data)
                if obj.get("error"):
                    r.error = "error event mid-stream: " + _error_text(None, json.dumps(obj))
                    return r
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        chunks += 1
                        r.text += content
                        if r.ttft is None:
                            r.ttft = now - r.start
                        else:
                            r.itl.append(now - last)
                        last = now
    except Exception as e:  # noqa: BLE001 - transport errors, bad JSON: a failed request, never a crash
        r.error = f"{type(e).__name__}: {e}"
        return r
    if r.ttft is None:
        r.error = "the stream ended without any content"
        return r
    r.latency = last - r.start
    if usage and usage.get("completion_tokens") is not None:
        r.output_tokens = int(usage["completion_tokens"])
        r.prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens)
    elif tokenizer is not None:
        r.output_tokens, r.counted = len(tokenizer.encode(r.text, add_special=False)), "tokenizer"
    else:
        r.output_tokens, r.counted = chunks, "chunks"
    r.ok = True
    return r


# ---- load ---------------------------------------------------------------------------------------

async def run_level(client, cfg: BenchConfig, model: str, prompts: list[tuple[str, int]], *,
                    concurrency: int | None, clock: Callable[[], float], tokenizer=None,
                    progress=None) -> tuple[list[RequestResult], float]:
    """All prompts at one load level → (results in prompt order, wall time in seconds)."""
    results: list[RequestResult | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await send_one(client, cfg, model, *prompts[i], clock, tokenizer)
        if progress is not None:
            progress.update(1)

    t0 = clock()
    if concurrency is not None:  # closed loop: `concurrency` workers, each sends its next prompt when done
        order = iter(range(len(prompts)))

        async def worker() -> None:
            for i in order:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:  # open loop: Poisson arrivals, optionally capped
        rng = random.Random(cfg.seed)
        cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def arrive(i: int) -> None:
            if cap is None:
                return await one(i)
            async with cap:
                await one(i)

        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(arrive(i)))
            await asyncio.sleep(rng.expovariate(cfg.request_rate))
        await asyncio.gather(*tasks)
    return results, clock() - t0


async def pick_model(client, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        resp = await client.get(cfg.base_url + "/models", headers=headers, timeout=30)
    except Exception as e:  # noqa: BLE001
        raise LowbitError(f"cannot reach {cfg.base_url}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise LowbitError(f"{cfg.base_url}/models: {_error_text(resp.status_code, resp.content)}")
    data = resp.json().get("data") or []
    if not data:
        raise LowbitError(f"{cfg.base_url}/models lists no model: pass --model")
    return data[0]["id"]


async def bench(cfg: BenchConfig, clock: Callable[[], float] = time.perf_counter, transport=None,
                tokenizer=None, show_progress: bool | None = None) -> dict:
    """The whole run: warm-up, then one level per concurrency (or the open-loop rate) → the result
    document (config, environment, one row per level; per-request timings under "requests")."""
    import httpx

    text = Path(cfg.text).read_text(encoding="utf-8", errors="replace")
    prompts = build_prompts(text, cfg.num_prompts, cfg.input_len, cfg.seed, tokenizer)
    levels = [None] if cfg.request_rate is not None else list(cfg.concurrency)
    show = sys.stderr.isatty() if show_progress is None else show_progress
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(transport=transport, limits=limits, timeout=cfg.timeout) as client:
        model = await pick_model(client, cfg)
        warm = build_prompts(text, cfg.warmup, cfg.input_len, cfg.seed + 1, tokenizer)
        for p, k in warm:
            await send_one(client, cfg, model, p, k, clock, tokenizer)
        rows, requests = [], []
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for level in levels:
            progress = _progress(len(prompts), level, cfg, show)
            try:
                results, duration = await run_level(client, cfg, model, prompts, concurrency=level, clock=clock,
                                                     tokenizer=tokenizer, progress=progress)
            finally:
                if progress is not None:
                    progress.close()
            row = {"max_concurrency": level if level is not None else cfg.max_concurrency,
                   "request_rate": cfg.request_rate, "num_prompts": len(prompts)}
            row |= summarize(results, duration, cfg.slo)
            rows.append(row)
            requests.append([{k: v for k, v in asdict(r).items() if k != "text"} | {"tpot": r.tpot} for r in results])
    return {"date": started, "base_url": cfg.base_url, "model": model, "backend": "openai-chat",
            "config": {k: v for k, v in asdict(cfg).items() if k != "api_key"}, "versions": _versions(),
            "results": rows, "requests": requests}


def _progress(total: int, level, cfg: BenchConfig, show: bool):
    if not show:
        return None
    from tqdm import tqdm

    what = f"concurrency {level}" if level is not None else f"{cfg.request_rate} req/s"
    return tqdm(total=total, desc=what, unit="req", file=sys.stderr, leave=False)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("lowbit", "httpx"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out
