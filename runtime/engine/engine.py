"""The engine: continuous batching over the paged, quantized KV pool.

One loop, as DESIGN.md draws it: `batch = scheduler.schedule(); out = runner.run(batch);
scheduler.postprocess(batch, out)`, here `Engine.step()` (the runner: runtime/engine/runner.py).
Requests join and leave at every step; each step's sampled tokens come back as `Delta`s (text, ids,
logprobs, finish reason, usage).
`AsyncEngine` runs steps on a background thread and hands each request an async stream.

With a speculator (runtime/engine/speculative.py) a step first asks it for drafts for every sequence
ready to decode, runs each such sequence's pending token and drafts as one chunk, verifies the
drafts against the target's logits at every position of the chunk, and emits the accepted run
plus the target's own token: one step may then stream several tokens of a request. Verified
greedy (`lowbit run --temperature 0`) is such a speculator: the model's own fast kernels draft and
every row of the request runs exactly, so its reply is the exact model's greedy reply.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from lowbit.quant.kv import parse_kv_format
from lowbit.runtime.engine.config import DEFAULT_KV_MEMORY, EngineConfig
from lowbit.runtime.engine.cuda_graphs import decode_graphs
from lowbit.runtime.engine.detokenizer import StreamDetokenizer
from lowbit.runtime.engine.kv_cache import KVPool, bytes_per_token
from lowbit.runtime.engine.pages import PageManager
from lowbit.runtime.engine.runner import Chunk, Runner, exact_rows
from lowbit.runtime.engine.sampler import SampleResult, SamplingParams, SamplingState, mask_padding, results, sample_batch
from lowbit.runtime.engine.scheduler import QueueFull, ScheduledSeq, Scheduler, Sequence, Status
from lowbit.runtime.engine.speculative import (MAX_K, DraftProposer, FastDrafter, NgramProposer, Proposal, SpecStats,
                                               verify)
from lowbit.runtime.engine.state_cache import StateCache
from lowbit.runtime.engine.state_pool import StateSlots
from lowbit.runtime.engine.stop import StopMatcher

def kv_budget(kv_memory: int | float | None, device: torch.device, token_bytes: int = 0, context: int = 0,
              page_size: int = 16, state_bytes: int = 0) -> int:
    """Bytes for the KV pool: a byte count, a fraction (0, 1) of the GPU memory free right now (after
    the weights are loaded), as vLLM's --gpu-memory-utilization but of free memory, or None: what the
    model needs for one whole context (`context` tokens of `token_bytes` each, plus a page), at least
    DEFAULT_KV_MEMORY, at most half the memory free now where that is less (as Ollama and llama-server
    choose a context from memory; the rest stays for activations and other programs). state_bytes: a hybrid
    model's recurrent-state slots, which the budget holds besides the pages (None: on top of the context)."""
    if kv_memory is None:
        want = max(DEFAULT_KV_MEMORY, token_bytes * page_size * (-(-context // page_size) + 1)) + state_bytes
        return min(want, max(DEFAULT_KV_MEMORY, free_memory(device) // 2))
    if isinstance(kv_memory, float) and 0 < kv_memory < 1:
        if device.type != "cuda":
            raise ValueError("a KV memory fraction needs a GPU; on CPU give a size (e.g. 512MiB)")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * kv_memory)
    return int(kv_memory)


def free_memory(device: torch.device) -> int:
    """Bytes free now: the GPU's, or the machine's available memory (Linux MemAvailable; else free pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return DEFAULT_KV_MEMORY * 2


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    spec: SpecStats | None = None  # speculative decoding's counts for this request, when it speculated


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
    spec_k: int = 0  # most drafts per step (0: no speculation)
    exact: bool = False  # every row on the exact path (verified greedy), not only the prompt's
    spec: SpecStats = field(default_factory=SpecStats)


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), draft_model=None):
        """config.speculative: proposals for every request (a request may ask for fewer or none); a
        `draft` config needs `draft_model`, a model sharing the target's vocabulary, whose KV pool
        gets the same budget as the target's."""
        c, e = model.config, config
        if e.max_model_len is not None and not 0 < e.max_model_len <= c.max_seq_len:
            raise ValueError(f"the context size must be in 1..{c.max_seq_len} (the model's), got {e.max_model_len}")
        self.model, self.tok, self.config, self.exact = model, tokenizer, e, e.exact
        self.max_model_len = e.max_model_len or c.max_seq_len  # prompt + reply, in tokens
        # model.kv_heads: the heads this process caches (all of them, or one tensor-parallel rank's share)
        fmt = parse_kv_format(e.kv_format)
        layer_formats = None  # kv_layers: each KV layer's own format (`fmt` then only names the pool)
        if e.kv_layers is not None:
            if len(e.kv_layers) != c.n_kv_layers:
                raise ValueError(f"kv_layers names {len(e.kv_layers)} KV formats; the model has {c.n_kv_layers} "
                                 "KV layers (one format each)")
            layer_formats = [parse_kv_format(name) for name in e.kv_layers]
        # a hybrid model (Qwen3.5): pages for its attention layers only, and a recurrent-state slot for each
        # sequence that may run (runtime/engine/state_pool.py), paid out of the same budget
        token_bytes = bytes_per_token(fmt, c.n_kv_layers, model.kv_heads, c.head_dim, layer_formats)
        state_bytes = c.state_bytes * e.max_num_seqs
        budget = kv_budget(e.kv_memory, model.device, token_bytes, self.max_model_len, e.page_size, state_bytes)
        if state_bytes and budget - state_bytes < token_bytes * e.page_size:
            raise ValueError(f"a KV budget of {budget} bytes holds the recurrent state of {e.max_num_seqs} sequences "
                             f"({state_bytes} bytes) and no KV page; give more --kv-memory or fewer sequences")
        states = StateCache(c, e.max_num_seqs, model.device) if state_bytes else None
        self.pool = KVPool.from_budget(fmt, c.n_kv_layers, model.kv_heads, c.head_dim, budget - state_bytes,
                                       e.page_size, model.device, states, layer_formats)
        self.runner = Runner(model, self.pool, decode_graphs(model, self.pool, e, self.max_model_len))
        # graphed decode steps pad with rows writing to the pool's last page: kept from every sequence.
        # No prefix cache for a hybrid model: a cached page serves attention's K/V but not the recurrent state
        # of the tokens before it, which is kept for no one (runtime/engine/state_pool.py; the cost of a repeated
        # prefix is measured in tests/test_hybrid.py)
        self.blocks = PageManager(self.pool.num_pages - (self.runner.graphs is not None), e.page_size,
                                  e.prefix_caching and states is None)
        self.slots = StateSlots(e.max_num_seqs) if states is not None else None
        self.scheduler = Scheduler(self.blocks, e.max_num_seqs, e.max_step_tokens, e.max_waiting, self.slots)
        self.requests: dict[str, _Request] = {}
        self._ids = 0
        self.speculative, self.proposer, self.spec = e.speculative, None, SpecStats()
        if e.speculative is not None and e.speculative.method == "ngram":
            self.proposer = NgramProposer(e.speculative)
        elif e.speculative is not None and e.speculative.method == "verify":
            self.proposer = FastDrafter(self.runner, self.blocks, tokenizer.vocab_size, frozenset(tokenizer.eos_ids),
                                        self.slots)
        elif e.speculative is not None:
            if draft_model is None:
                raise ValueError("speculative decoding with a draft model needs the draft model")
            if draft_model.config.vocab_size != c.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is not the "
                                 f"target's ({c.vocab_size}); a draft must share the target's tokenizer")
            d = draft_model.config
            if d.deltanet is not None:  # its cache is cut back to a common prefix each round: pages only
                raise ValueError(f"a hybrid model ({d.arch}: recurrent layers) cannot be the draft model; use a "
                                 "transformer draft, or ngram")
            # the draft's own layers, all in kv_format (kv_layers are the target's)
            self.proposer = DraftProposer(draft_model, tokenizer.vocab_size, fmt, kv_budget(
                e.kv_memory, draft_model.device, fmt.bytes_per_token(d.n_layers, draft_model.kv_heads, d.head_dim),
                self.max_model_len, e.page_size), e.page_size)
        self._proposals: dict[str, Proposal] = {}

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: list[int] | list[dict], params: SamplingParams, request_id: str | None = None,
                    grammar=None, spec_k: int | None = None) -> str:
        """Queue a request: token ids, or chat messages ({"role", "content"} dicts) rendered with the
        model's chat template; `grammar` (runtime/engine/grammar.py) constrains its tokens (and turns
        speculation off for it); spec_k: most drafts per step for this request (default: the
        engine's k; 0: none). Raises
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
        k = (self.speculative.k if spec_k is None else spec_k) if self.proposer is not None else 0
        if not 0 <= k <= MAX_K:
            raise ValueError(f"spec_k must be in 0..{MAX_K}, got {k}")
        # verified greedy verifies greedy requests only: a sampled one decodes on the fast kernels
        verified = isinstance(self.proposer, FastDrafter) and params.greedy and grammar is None
        if isinstance(self.proposer, FastDrafter) and not verified:
            k = 0
        max_tokens = min(params.max_tokens, limit - len(prompt_ids))
        seq = Sequence(request_id, list(prompt_ids), max_tokens, prefix_cache=not verified)
        self.scheduler.add(seq)
        self.requests[request_id] = _Request(seq, SamplingState(params, tuple(prompt_ids)),
                                             StreamDetokenizer(self.tok, params.skip_special_tokens),
                                             StopMatcher(params.stop), grammar,
                                             spec_k=0 if grammar is not None else k, exact=verified)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its pages go back at once."""
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
            if self.proposer is not None:
                self.proposer.release(request_id)

    def describe_pool(self) -> str:
        """One line on the KV pool, what a command says at start: its format, size, tokens it holds, and the
        flag that changes it."""
        p, gib = self.pool, 1 << 30
        size = f"{p.nbytes / gib:.2f} GiB" if p.nbytes >= gib else f"{p.nbytes >> 20} MiB"
        states = "" if p.states is None else (f" with the recurrent state of {p.states.num_slots} sequences "
                                              f"({p.states.nbytes >> 20} MiB)")
        counts = Counter(f.name for f in p.formats)  # in layer order of first use
        name = next(iter(counts)) if len(counts) == 1 else \
            "per layer (" + ", ".join(f"{n} x{k}" for n, k in counts.items()) + ")"
        return (f"KV cache {name}: {size}{states}, {self.blocks.num_pages * p.page_size:,} tokens (the context is "
                f"{self.max_model_len:,}; --kv-memory sets the size)")

    def has_work(self) -> bool:
        return bool(self.scheduler.num_running or self.scheduler.num_waiting)

    def stats(self) -> dict:
        b = self.blocks
        queried = max(1, b.prefix_queried_tokens)
        out = {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
               "pages_used": b.num_used_pages, "pages_free": b.num_free_pages, "pages_total": b.num_pages,
               "prefix_hit_rate": b.prefix_hits_tokens / queried, "preemptions": self.scheduler.num_preemptions}
        if self.proposer is not None:
            out |= self.spec.as_dict()
        return out

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Delta]:
        self._propose()
        scheduled = self.scheduler.schedule()
        self._drop_unscheduled_drafts(scheduled)
        if not scheduled:  # nothing to run; a sequence the pool cannot hold may have been finished
            return self._released([self._final(q.seq_id, q.finish_reason)
                                   for q in self.scheduler.postprocess([], {}) if q.seq_id in self.requests])
        logits = self._run(scheduled)  # [R, V]: one row per sampled sequence, 1 + drafts for a speculating one
        mask_padding(logits, self.tok.vocab_size)
        sampling = [s for s in scheduled if s.sample]
        plain, spec, rows, at = [], [], [], 0
        for s in sampling:
            (spec if s.num_drafts else plain).append(s)
            rows.append(slice(at, at + 1 + s.num_drafts))
            at += 1 + s.num_drafts
        chosen: dict[str, list[SampleResult]] = {}
        plain_rows = [r.start for s, r in zip(sampling, rows) if not s.num_drafts]
        if plain:
            chosen |= self._sample(plain, logits[plain_rows])
        for s, r in zip(sampling, rows):
            if s.num_drafts:
                chosen[s.seq.seq_id] = self._verify(s, logits[r])
        for s in scheduled:  # the prefix-cache hit of a sequence's first chunk, for its usage
            req = self.requests[s.seq.seq_id]
            if s.start == s.seq.num_cached and not s.seq.output_ids:
                req.cached = s.seq.num_cached
        sampled = {sid: res[-1].token for sid, res in chosen.items()}
        finished = {q.seq_id: q.finish_reason for q in self.scheduler.postprocess(scheduled, sampled)}
        deltas = [self._emit(s.seq.seq_id, chosen[s.seq.seq_id], finished.get(s.seq.seq_id)) for s in sampling]
        deltas += [self._final(rid, why) for rid, why in finished.items() if rid in self.requests and rid not in sampled]
        return self._released(deltas)

    def _released(self, deltas: list[Delta]) -> list[Delta]:
        """The draft model's pages of every request these deltas finish go back."""
        if self.proposer is not None:
            for d in deltas:
                if d.finish_reason is not None:
                    self.proposer.release(d.request_id)
        return deltas

    def _sample(self, items: list[ScheduledSeq], logits: torch.Tensor) -> dict[str, list[SampleResult]]:
        """One token for each sequence not speculating this step: logits [len(items), V]."""
        states = [self.requests[s.seq.seq_id].state for s in items]
        grammars = [self.requests[s.seq.seq_id].grammar for s in items]
        for row, g in enumerate(grammars):
            if g is not None:
                g.mask(logits[row])
        out = sample_batch(logits, states)
        for g, r in zip(grammars, out):
            if g is not None:
                g.accept(r.token)
        return {s.seq.seq_id: [r] for s, r in zip(items, out)}

    # ---- speculation ---------------------------------------------------------------------------

    def _propose(self) -> None:
        """Drafts for every running sequence that is ready to decode and speculates; they join its
        pending token in this step's chunk. A sequence never drafts past its max_tokens."""
        self._proposals = {}
        if self.proposer is None:
            return
        items = []
        for seq in self.scheduler.running:
            req = self.requests.get(seq.seq_id)
            if req is None or not req.spec_k or seq.num_drafts or seq.num_tokens - seq.num_computed != 1:
                continue
            k = min(req.spec_k, seq.max_tokens - len(seq.output_ids) - 1)
            if k > 0:
                items.append((seq.seq_id, seq.all_ids, k, req.state))
        if items:
            self._proposals = {sid: p for sid, p in self.proposer.propose(items).items() if p.drafts}
        for sid, p in self._proposals.items():
            self.scheduler.add_drafts(sid, p.drafts)

    def _drop_unscheduled_drafts(self, scheduled: list[ScheduledSeq]) -> None:
        """Drafts the scheduler did not place with their sequence this step are forgotten."""
        placed = {s.seq.seq_id for s in scheduled if s.num_drafts}
        for sid in list(self._proposals):
            if sid not in placed:
                seq = self.scheduler.seqs.get(sid)
                if seq is not None:
                    self.scheduler.drop_drafts(seq)
                del self._proposals[sid]

    def _verify(self, s: ScheduledSeq, logits: torch.Tensor) -> list[SampleResult]:
        """logits [1 + drafts, V] of one speculating sequence → the accepted drafts and the target's
        token, as sampled results; the rejected drafts are rolled back."""
        sid = s.seq.seq_id
        req, proposal = self.requests[sid], self._proposals[sid]
        v = verify(logits, proposal, req.state)
        self.scheduler.resolve_drafts(sid, v.accepted)
        if self.pool.states is not None:  # the recurrent state keeps the pending token and the accepted drafts
            self.pool.states.keep(s.seq.state_slot, v.accepted + 1)
        req.spec.add(len(proposal.drafts), v.accepted)
        self.spec.add(len(proposal.drafts), v.accepted)
        n = req.state.params.logprobs
        return results(v.processed, torch.tensor(v.tokens, device=v.processed.device), [n] * len(v.tokens))

    def _run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        chunks = [self._chunk(s) for s in scheduled]
        exact = self.exact
        if exact is None and not self.model.backend.per_row_exact:
            # CUDA: a step's activations share one dtype, so a step with exact rows runs exact throughout
            exact = any(c.exact for c in chunks)
        return self.runner.run(chunks, exact if exact is not None else exact_rows(chunks, self.model.device))

    def _chunk(self, s: ScheduledSeq) -> Chunk:
        """A scheduled sequence's tokens this step; a sampled one wants logits at its last position and
        at every draft's (verification needs them all).

        Its exact rows: all of a verified-greedy request's, none of any other's. Prompt tokens take the fast
        kernels as generated ones do: their rows are the same at every M (kernels/exact_mm.py takes_exact),
        so a reply does not depend on its batch, its prompt's chunking or prefix-cache hits."""
        end = s.start + s.num_tokens
        exact = s.num_tokens if self.requests[s.seq.seq_id].exact else 0
        return Chunk(s.seq.all_ids[s.start:end], s.start, s.slots, self.blocks.block_table(s.seq.seq_id),
                     logits=1 + s.num_drafts if s.sample else 0, one_by_one=s.num_drafts > 0, exact=exact,
                     state_slot=s.seq.state_slot)

    def _emit(self, rid: str, chosen: list[SampleResult], finish: str | None) -> Delta:
        """One delta for the tokens a step chose for a request (one, or an accepted speculative run
        and the target's token). A stop token or stop string ends the request at that token: any
        later token of the run is dropped."""
        req = self.requests[rid]
        p = req.state.params
        ids, text, logprobs, stop_token, stopped = [], "", [], False, False
        for result in chosen:
            tok = result.token
            req.state.output_ids.append(tok)
            stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tok.eos_ids)
            piece, stopped = req.stops.feed("" if stop_token else req.detok.push(tok))
            text += piece
            if not stop_token:
                ids.append(tok)
            if p.logprobs is not None:
                logprobs.append((result.logprob, result.top_logprobs))
            if stop_token or stopped:
                finish = "stop"
                if req.seq.status is not Status.FINISHED:
                    self.scheduler.finish(rid, "stop")
                break
        delta = Delta(rid, text, ids, logprobs, finish)
        if finish is not None:
            if not stopped:
                delta.text += req.stops.feed(req.detok.flush())[0] + req.stops.flush()
            n_out = len(req.state.output_ids) - (1 if stop_token else 0)
            delta.usage = Usage(len(req.seq.prompt_ids), n_out, req.cached, req.spec if req.spec.passes else None)
            del self.requests[rid]
        return delta

    def _final(self, rid: str, finish: str) -> Delta:
        """The last delta of a request the scheduler finished without sampling for it this step."""
        req = self.requests.pop(rid)
        text = req.stops.feed(req.detok.flush())[0] + req.stops.flush()
        return Delta(rid, text, [], finish_reason=finish,
                     usage=Usage(len(req.seq.prompt_ids), len(req.seq.output_ids), req.cached,
                                 req.spec if req.spec.passes else None))


class AsyncEngine:
    """The engine behind an asyncio API: `generate` yields a request's deltas as steps produce them;
    steps run on one background thread, so the event loop stays free while the model computes."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.last_error: Exception | None = None
        self._closed = False  # close(): the step thread ends, so the model's memory can go
        self._thread = threading.Thread(target=self._loop, name="lowbit-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       grammar=None):
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._closed:  # unloaded between the request's lookup and now: the client may retry
                raise QueueFull("the model was unloaded")
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

    def exclusive(self, fn):
        """fn() between two steps, the engine paused meanwhile (a blocking call: run it on a worker
        thread). The model's C kernels keep per-pool state, so only one forward pass runs at a time."""
        with self._lock:
            return fn()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)
            entry = self._queues.pop(request_id, None)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, Delta(request_id, "", [], finish_reason="abort"))

    def shutdown(self) -> int:
        """End every request now (the server is stopping): each stream gets a "shutdown" finish, which
        the server answers as an error. → how many were running."""
        with self._lock:
            entries = list(self._queues.items())
            self._queues.clear()
            for rid, _ in entries:
                if rid in self.engine.requests:
                    self.engine.abort(rid)
        for rid, (loop, q) in entries:
            loop.call_soon_threadsafe(q.put_nowait, Delta(rid, "", [], finish_reason="shutdown"))
        return len(entries)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def close(self) -> None:
        """End every request (as `shutdown` does) and the step thread: the engine is unloaded."""
        self.shutdown()
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            if self._closed:
                return
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
