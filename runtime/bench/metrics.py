"""What `lowbit bench` reports, computed from per-request timestamps (DESIGN.md, vLLM's definitions):

- TTFT: request sent → first non-empty content chunk.
- TPOT: (E2E − TTFT) / (output tokens − 1), per request with at least 2 output tokens.
- ITL: the gaps between successive content chunks, pooled over all requests.
- E2E latency: request sent → last content chunk.
- request/s, output tok/s, total (prompt + output) tok/s: over the run's wall time.
- goodput: requests/s that met every SLO given (`--slo ttft=500,tpot=50`, milliseconds).

Each is reported as mean, median, std and p90/p99 (numpy's linear-interpolation percentiles),
under `vllm bench serve`'s field names (`mean_ttft_ms`, `p99_tpot_ms`, `output_throughput`, ...).
Pure functions of `RequestResult`s: tests feed them scripted timings and compare with hand-computed
values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (90, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0  # clock at send, seconds
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float | None = None  # E2E, seconds
    prompt_tokens: int = 0  # from the server's usage, else the prompt as the bench counted it
    output_tokens: int = 0
    counted: str = "usage"  # where output_tokens came from: "usage" | "tokenizer" | "chunks"
    error: str | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' → {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    if not spec:
        return {}
    out = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name not in SLO_METRICS:
            raise ValueError(f"--slo: unknown metric {name!r} (one of {', '.join(SLO_METRICS)})")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {part!r} is not metric=milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--slo: {name} must be > 0 ms")
        out[name] = ms / 1000
    return out


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency, "itl": max(r.itl, default=None)}
    return all(values[k] is None or values[k] <= limit for k, limit in slo.items())


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None,
                **{f"p{p}_{name}_ms": None for p in PERCENTILES}}
    ms = np.asarray(seconds, dtype=np.float64) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), **{f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float] | None = None) -> dict:
    """One load level's row: counts, throughputs and latency statistics (field names as vLLM's)."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    row = {"duration": duration, "completed": len(done), "failed": len(failed),
           "errors": sorted({r.error or "unknown error" for r in failed})[:5],
           "total_input_tokens": n_in, "total_output_tokens": n_out,
           "output_tokens_counted": sorted({r.counted for r in done}),
           "request_throughput": len(done) / duration if duration > 0 else None,
           "output_throughput": n_out / duration if duration > 0 else None,
           "total_token_throughput": (n_in + n_out) / duration if duration > 0 else None}
    if slo:
        good = sum(_meets(r, slo) for r in done)
        row["request_goodput"] = good / duration if duration > 0 else None
        row["slo_ms"] = {k: v * 1000 for k, v in slo.items()}
    row |= _stats("ttft", [r.ttft for r in done if r.ttft is not None])
    row |= _stats("tpot", [t for r in done if (t := r.tpot) is not None])
    row |= _stats("itl", [g for r in done for g in r.itl])
    row |= _stats("e2el", [r.latency for r in done if r.latency is not None])
    return row
