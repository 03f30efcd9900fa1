"""The engine: continuous batching over the paged, quantized KV pool.

One loop, as DESIGN.md draws it: `batch = scheduler.schedule(); out = runner.run(batch);
scheduler.postprocess(batch, out)`, here `Engine.step()`. Requests join and leave at every step;
each step's sampled tokens come back as `Delta`s (text, ids, logprobs, finish reason, usage).
`AsyncEngine` runs steps on a background thread and hands each request an async stream.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import torch

from lowbit.models.attention import PagedBatch
from lowbit.quant.kv import DEFAULT_KV_FORMAT, parse_kv_format
from lowbit.quant.linear import ExactRows
from lowbit.runtime.block_manager import BlockManager
from lowbit.runtime.detokenizer import StreamDetokenizer
from lowbit.runtime.kv_cache import KVPool
from lowbit.runtime.sampler import SamplingParams, SamplingState, mask_padding, sample_batch
from lowbit.runtime.scheduler import ScheduledSeq, Scheduler, Sequence
from lowbit.runtime.stop import StopMatcher

DEFAULT_KV_MEMORY = 256 << 20  # bytes: 28,137 tokens of the default model in k8v4 (9,540 B/token)


def kv_budget(kv_memory: int | float, device: torch.device) -> int:
    """Bytes for the KV pool: a byte count, or a fraction (0, 1) of the GPU memory free right now
    (after the weights are loaded), as vLLM's --gpu-memory-utilization but of free memory."""
    if isinstance(kv_memory, float) and 0 < kv_memory < 1:
        if device.type != "cuda":
            raise ValueError("a KV memory fraction needs a GPU; on CPU give a size (e.g. 512MiB)")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * kv_memory)
    return int(kv_memory)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class Delta:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # per token: (logprob, [(id, logprob), ...]) when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None  # on the last delta


@dataclass
class _Request:
    seq: Sequence
    state: SamplingState
    detok: StreamDetokenizer
    stops: StopMatcher
    grammar: object | None = None  # runtime.grammar.Grammar: masks each step's logits (structured output)
    cached: int = 0


class Engine:
    def __init__(self, model, tokenizer, kv_format: str = DEFAULT_KV_FORMAT, kv_memory: int | float = DEFAULT_KV_MEMORY,
                 page_size: int = 16, max_num_seqs: int = 16, max_step_tokens: int = 512, max_waiting: int = 256,
                 prefix_caching: bool = True, exact: bool | None = None, max_model_len: int | None = None):
        c = model.config
        if max_model_len is not None and not 0 < max_model_len <= c.max_seq_len:
            raise ValueError(f"the context size must be in 1..{c.max_seq_len} (the model's), got {max_model_len}")
        self.model, self.tok, self.exact = model, tokenizer, exact
        self.max_model_len = max_model_len or c.max_seq_len  # prompt + reply, in tokens
        self.pool = KVPool.from_budget(parse_kv_format(kv_format), c.n_layers, c.n_kv_heads, c.head_dim,
                                       kv_budget(kv_memory, model.device), page_size, model.device)
        self.blocks = BlockManager(self.pool.num_pages, page_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_step_tokens, max_waiting)
        self.requests: dict[str, _Request] = {}
        self._ids = 0

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: list[int] | list[dict], params: SamplingParams, request_id: str | None = None,
                    grammar=None) -> str:
        """Queue a request: token ids, or chat messages ({"role", "content"} dicts) rendered with the
        model's chat template; `grammar` (runtime/grammar.py) constrains its tokens. Raises
        scheduler.QueueFull when the waiting queue is at its bound, and ValueError for a prompt the
        context cannot hold."""
        prompt_ids = (self.tok.encode_chat(prompt, add_generation_prompt=True)
                      if prompt and isinstance(prompt[0], dict) else prompt)
        if not prompt_ids:
            raise ValueError("empty prompt")
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context limit is {limit}")
        if request_id is None:
            self._ids += 1
            request_id = f"req-{self._ids}"
        max_tokens = min(params.max_tokens, limit - len(prompt_ids))
        seq = Sequence(request_id, list(prompt_ids), max_tokens)
        self.scheduler.add(seq)
        self.requests[request_id] = _Request(seq, SamplingState(params, tuple(prompt_ids)),
                                             StreamDetokenizer(self.tok), StopMatcher(params.stop), grammar)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its pages go back at once."""
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return bool(self.scheduler.num_running or self.scheduler.num_waiting)

    def stats(self) -> dict:
        b = self.blocks
        queried = max(1, b.prefix_queried_tokens)
        return {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                "pages_used": b.num_used_pages, "pages_free": b.num_free_pages, "pages_total": self.pool.num_pages,
                "prefix_hit_rate": b.prefix_hits_tokens / queried, "preemptions": self.scheduler.num_preemptions}

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Delta]:
        scheduled = self.scheduler.schedule()
        if not scheduled:  # nothing to run; a sequence the pool cannot hold may have been finished
            return [self._final(q.seq_id, q.finish_reason) for q in self.scheduler.postprocess([], {})
                    if q.seq_id in self.requests]
        logits = self._run(scheduled)  # [R, V] for the sampled sequences, in order
        sampling = [s for s in scheduled if s.sample]
        states = [self.requests[s.seq.seq_id].state for s in sampling]
        mask_padding(logits, self.tok.vocab_size)
        grammars = [self.requests[s.seq.seq_id].grammar for s in sampling]
        for row, g in enumerate(grammars):
            if g is not None:
                g.mask(logits[row])
        results = sample_batch(logits, states) if sampling else []
        for g, r in zip(grammars, results):
            if g is not None:
                g.accept(r.token)
        sampled = {s.seq.seq_id: r.token for s, r in zip(sampling, results)}
        for s in scheduled:  # the prefix-cache hit of a sequence's first chunk, for its usage
            req = self.requests[s.seq.seq_id]
            if s.start == s.seq.num_cached and not s.seq.output_ids:
                req.cached = s.seq.num_cached
        finished = {q.seq_id: q.finish_reason for q in self.scheduler.postprocess(scheduled, sampled)}
        deltas = [self._emit(s.seq.seq_id, r, finished.get(s.seq.seq_id)) for s, r in zip(sampling, results)]
        return deltas + [self._final(rid, why) for rid, why in finished.items()
                         if rid in self.requests and rid not in sampled]

    def _run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        dev = self.model.device
        tokens, positions, rows, prompt_rows = [], [], [], []
        n = 0
        for s in scheduled:
            tokens += s.seq.all_ids[s.start:s.start + s.num_tokens]
            positions += range(s.start, s.start + s.num_tokens)
            prompt_rows += [p < len(s.seq.prompt_ids) for p in range(s.start, s.start + s.num_tokens)]
            n += s.num_tokens
            if s.sample:
                rows.append(n - 1)
        batch = PagedBatch(
            positions=torch.tensor(positions, device=dev),
            slots=torch.tensor([slot for s in scheduled for slot in s.slots], device=dev),
            query_lens=[s.num_tokens for s in scheduled],
            context_lens=[s.start + s.num_tokens for s in scheduled],
            block_tables=[torch.tensor(self.blocks.block_table(s.seq.seq_id), device=dev) for s in scheduled],
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev))
        exact = self.exact
        if exact is None and self.model.backend.name == "torch":
            # CPU kernels differ by path (exact fp32 vs fused bf16): prompt tokens always exact, generated
            # tokens always fast, so a reply does not depend on its batch or on prefix-cache hits
            exact = ExactRows.of(prompt_rows, dev)
        return self.model.forward_paged(torch.tensor(tokens, device=dev), batch, self.pool, exact)

    def _emit(self, rid: str, result, finish: str | None) -> Delta:
        req = self.requests[rid]
        p = req.state.params
        tok = result.token
        req.state.output_ids.append(tok)
        stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tok.eos_ids)
        text = "" if stop_token else req.detok.push(tok)
        text, stopped = req.stops.feed(text)
        if stop_token or stopped:
            finish = "stop"
            if req.seq.status.name != "FINISHED":
                self.scheduler.finish(rid, "stop")
        logprobs = [(result.logprob, result.top_logprobs)] if p.logprobs is not None else []
        delta = Delta(rid, text, [] if stop_token else [tok], logprobs, finish)
        if finish is not None:
            if not stopped:
                delta.text += req.stops.feed(req.detok.flush())[0] + req.stops.flush()
            n_out = len(req.seq.output_ids) - (1 if stop_token else 0)
            delta.usage = Usage(len(req.seq.prompt_ids), n_out, req.cached)
            del self.requests[rid]
        return delta

    def _final(self, rid: str, finish: str) -> Delta:
        """The last delta of a request the scheduler finished without sampling for it this step."""
        req = self.requests.pop(rid)
        text = req.stops.feed(req.detok.flush())[0] + req.stops.flush()
        return Delta(rid, text, [], finish_reason=finish,
                     usage=Usage(len(req.seq.prompt_ids), len(req.seq.output_ids), req.cached))


class AsyncEngine:
    """The engine behind an asyncio API: `generate` yields a request's deltas as steps produce them;
    steps run on one background thread, so the event loop stays free while the model computes."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.last_error: Exception | None = None
        self._thread = threading.Thread(target=self._loop, name="lowbit-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       grammar=None):
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            rid = self.engine.add_request(prompt_ids, params, request_id, grammar)
            self._queues[rid] = (asyncio.get_running_loop(), q)
        self._wake.set()
        try:
            while True:
                delta = await q.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            with self._lock:  # the consumer went away early (client disconnect): free its pages
                if self._queues.pop(rid, None) is not None and rid in self.engine.requests:
                    self.engine.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)
            entry = self._queues.pop(request_id, None)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, Delta(request_id, "", [], finish_reason="abort"))

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                try:
                    deltas = self.engine.step()
                except Exception as e:  # noqa: BLE001 - a failed step ends every request, never hangs them
                    deltas = [Delta(rid, "", [], finish_reason="error") for rid in list(self.engine.requests)]
                    for rid in list(self.engine.requests):
                        self.engine.abort(rid)
                    self.last_error = e
                targets = [(d, self._queues.get(d.request_id)) for d in deltas]
                for d in deltas:
                    if d.finish_reason is not None:
                        self._queues.pop(d.request_id, None)
                if not self.engine.has_work():
                    self._wake.clear()  # under the lock: a request added after this sets it again
            for d, entry in targets:
                if entry is not None:
                    loop, q = entry
                    loop.call_soon_threadsafe(q.put_nowait, d)
