"""The server's Prometheus metrics (`GET /metrics`, prometheus_client's text format): latency
histograms and token counters observed per request, engine gauges read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds: 5 ms (a decode step of a small model) .. 2 min (a long reply on CPU)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Gauges read from `AsyncEngine.stats()` at scrape time; nothing while the model loads."""

    def __init__(self, stats):
        self.stats = stats  # () -> dict | None

    def collect(self):
        s = self.stats()
        if s is None:
            return
        for name, key, doc in (("lowbit_requests_running", "running", "requests being decoded"),
                               ("lowbit_requests_waiting", "waiting", "requests waiting to be scheduled"),
                               ("lowbit_kv_pages_used", "pages_used", "KV cache pages in use"),
                               ("lowbit_kv_pages_total", "pages_total", "KV cache pages in the pool"),
                               ("lowbit_prefix_cache_hit_rate", "prefix_hit_rate",
                                "share of looked-up prompt tokens served from the prefix cache")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        yield CounterMetricFamily("lowbit_preemptions", "sequences preempted for KV pages", value=s["preemptions"])
        if "spec_passes" in s:  # speculative decoding (vLLM's spec_decode counters, by lowbit's names)
            for name, key, doc in (("lowbit_spec_decode_passes", "spec_passes", "target passes that verified drafts"),
                                   ("lowbit_spec_draft_tokens", "spec_drafted", "draft tokens proposed"),
                                   ("lowbit_spec_accepted_tokens", "spec_accepted", "draft tokens accepted")):
                yield CounterMetricFamily(name, doc, value=s[key])
            yield GaugeMetricFamily("lowbit_spec_acceptance_rate", "accepted / proposed draft tokens",
                                    value=s["spec_acceptance_rate"])
            yield GaugeMetricFamily("lowbit_spec_tokens_per_pass", "mean tokens per verifying target pass "
                                    "(accepted drafts + the target's token)", value=s["spec_tokens_per_pass"])


class ServerMetrics:
    def __init__(self, stats):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("lowbit_time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("lowbit_time_per_output_token_seconds", "time per output token after the first",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("lowbit_e2e_request_latency_seconds", "end-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("lowbit_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("lowbit_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("lowbit_requests_finished", "requests finished, by reason", ["finish_reason"],
                                registry=r)
        # models loaded and unloaded on demand (server/model_pool.py), by event ("load", "unload") and model
        self.model_events = Counter("lowbit_model_events", "models loaded and unloaded", ["event", "model"],
                                    registry=r)
        r.register(_EngineCollector(stats))

    def observe(self, t0: float, t_first: float | None, end: float, prompt_len: int, n_out: int, finish: str) -> None:
        """One finished (or aborted) sequence: perf_counter times of its start, first token, end."""
        self.finished.labels(finish).inc()
        self.prompt_tokens.inc(prompt_len)
        self.generation_tokens.inc(n_out)
        self.e2e.observe(end - t0)
        if t_first is not None:
            self.ttft.observe(t_first - t0)
            if n_out > 1:
                self.tpot.observe((end - t_first) / (n_out - 1))
