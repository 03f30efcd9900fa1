"""The engine-facing path every API on the port shares: one `Frontend` per app, at
`app.state.lowbit`, over the model being served.

A route reads it in call order: `require` (503 while the model loads), `parse` (the body → a
`Parsed` request, on a worker thread), then `reply` (OpenAI's shapes) or `start` (the merged
(choice, delta) stream another dialect shapes itself). `start` opens one engine request per choice
(with its own grammar when response_format or tools ask for one); their delta streams are merged,
and closing the merged stream closes every choice's engine stream, so a client that goes away
mid-stream aborts its requests and frees their KV pages (`AsyncEngine.generate`'s `finally`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from lowbit.runtime.engine.engine import AsyncEngine, Delta, Usage
from lowbit.runtime.engine.grammar import GrammarCompiler, GrammarError, LazyGrammar
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.engine.scheduler import QueueFull
from lowbit.runtime.engine.scoring import prompt_logprobs
from lowbit.runtime.engine.think_budget import ThinkBudget
from lowbit.runtime.server.body import decode_json
from lowbit.runtime.server.chat_response import Responder
from lowbit.runtime.server.errors import APIError, bad_request
from lowbit.runtime.server.metrics import ServerMetrics
from lowbit.runtime.server.model_pool import ModelPool, keep_alive_seconds
from lowbit.runtime.server.request import Parsed, RequestParser
from lowbit.runtime.server.sse import sse_response
from lowbit.runtime.server.tools import lazy_grammar


@dataclass
class Served:
    """What the app serves once the model is loaded."""

    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    formats: dict | None = None  # weights / kv_cache / device, listed under "lowbit" in /v1/models
    aliases: tuple[str, ...] = ()  # more names requests may use for the model (--served-model-name A B)
    pooling: str = "mean"  # /v1/embeddings: runtime/engine/embedder.py POOLINGS
    # the sampling a request that omits it gets: the model's own defaults under `lowbit serve`'s flags
    # (runtime/cli/engine_args.py sampling_defaults); empty: OpenAI's
    sampling: dict = field(default_factory=dict)
    # what reads its requests and writes its replies: the model's tokenizer decides both
    parser: RequestParser = field(init=False, repr=False)
    responder: Responder = field(init=False, repr=False)
    grammars: GrammarCompiler = field(init=False, repr=False)

    def __post_init__(self):
        self.parser = RequestParser(self.tokenizer, self.model_name, self.max_model_len, self.aliases, self.sampling)
        self.responder = Responder(self.tokenizer, self.model_name, lambda: self.engine.last_error)
        self.grammars = GrammarCompiler(self.tokenizer)


class Frontend:
    """The app's one piece of state: loading until `ready` is called with what to serve."""

    def __init__(self, api_key: str | None = None):
        self.api_key = api_key  # None: no key asked (server/deps.py require_key)
        self.started = time.time()  # the models' `created` (OpenAI) and `modified_at` (Ollama)
        self.pool: ModelPool | None = None  # the models offered (server/model_pool.py); None while loading
        self.metrics = ServerMetrics(lambda: None if self.served is None else self.served.engine.stats())
        self._memo: dict = {}  # key → (id of the served model, what `memo` computed from it)

    def ready(self, served: Served) -> None:
        """Serve this one model (`lowbit serve MODEL`)."""
        self.offer(ModelPool.of(served))

    def offer(self, pool: ModelPool) -> None:
        """Serve the pool's models (`lowbit serve --models ...`), its default one loaded or loading."""
        pool.on_change = lambda what, name: self.metrics.model_events.labels(what, name).inc()
        self.pool = pool  # last: requests see a fully built state or none

    @property
    def served(self) -> Served | None:
        """The default model, when it is loaded."""
        return None if self.pool is None else self.pool.loaded_default()

    @property
    def parser(self) -> RequestParser | None:
        served = self.served
        return None if served is None else served.parser

    @property
    def responder(self) -> Responder | None:
        served = self.served
        return None if served is None else served.responder

    def require(self) -> ModelPool:
        """The models offered; 503 while the server starts (the default model loading)."""
        if self.pool is None:
            raise APIError(503, "The model is still loading; retry shortly (GET /health says when it is ready).",
                           "server_error", None, "model_loading", headers={"Retry-After": "2"})
        return self.pool

    async def model(self, request: Request, keep_alive: float | None = None) -> Served:
        """The model the request's body names (its `model`; none: the default), loaded on demand
        (server/model_pool.py), kept for its `keep_alive` (Ollama's) if it gives one. The body is decoded
        on a worker thread; `parse` decodes it again there."""
        self.require()
        raw = await request.body()
        name, asked = await asyncio.to_thread(_model_named, raw) if raw else (None, None)
        return await self.pool.get(name, keep_alive_seconds(asked) if keep_alive is None else keep_alive)

    def memo(self, key: str, served: Served, fn):
        """fn(), computed once per served model: what walking the model's tensors tells (Ollama's card,
        server/ollama_card.py) is not worth walking them again per request. Held by the model's id,
        not the model, so that a replaced model is not kept alive."""
        held = self._memo.get(key)
        if held is None or held[0] != id(served):
            held = self._memo[key] = (id(served), fn())
        return held[1]

    # ---- the request ----------------------------------------------------------------------------------

    async def parse(self, request: Request, fn, *args, fields: frozenset[str] | None = None, served=None):
        """fn(*args, the body) on a worker thread: decoding, templating, tokenizing and checking a long
        prompt take seconds that would stall every other request (and stream) on the event loop.
        fields: the body's known fields, for `RequestParser.body` (which checks the model it names);
        None: any JSON object, an empty body being {} (Ollama's bodies: the route checks the model).
        served: the model whose parser checks the body (default: the default model's)."""
        raw = await request.body()
        parser = self.parser if served is None else served.parser
        return await asyncio.to_thread(
            lambda: fn(*args, json_object(raw) if fields is None else parser.body(raw, fields)))

    async def body(self, request: Request, fields: frozenset[str] | None = None) -> dict:
        """The body alone, decoded on a worker thread as `parse` decodes it."""
        return await self.parse(request, _itself, fields=fields)

    # ---- the reply: OpenAI's shapes -------------------------------------------------------------------

    async def reply(self, served: Served, req: Parsed, prefix: str):
        """`req` run: one JSON response, or SSE chunks when it streams (server/chat_response.py)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        events = await self.start(served, req, rid)
        if not req.stream:
            try:
                return JSONResponse(await served.responder.fold(req, rid, events))
            finally:
                await events.aclose()
        return sse_response(self._chunks(served.responder, req, rid, events))

    async def _chunks(self, responder: Responder, req: Parsed, rid: str, events) -> AsyncIterator[bytes]:
        try:
            async for b in responder.chunks(req, rid, events):
                yield b
        finally:
            await events.aclose()

    # ---- the engine's streams -------------------------------------------------------------------------

    async def start(self, served: Served, req: Parsed, rid: str) -> AsyncIterator[tuple[int, Delta]]:
        """Open every choice of `req` (a refusal raises here, before any byte is sent) → the merged
        (choice, delta) stream. Closing it closes every choice's engine stream, whatever happened:
        closing a finished stream does nothing, closing a suspended one aborts its request and
        frees its pages."""
        t0 = time.perf_counter()
        if req.echo and not req.generate:  # scored, not generated: no engine request at all
            head = await self._echoed(served, req, rid)
            return _echo_first([head] * len(req.params), None)
        grammars = await self._grammars(served, req)
        if req.reasoning_budget is not None:  # the think block closed for the model once it spends the budget
            grammars = [ThinkBudget(req.reasoning_budget, req.think, req.in_think, served.tokenizer, g)
                        for g in grammars]
        opened: list[tuple[AsyncIterator[Delta], Delta]] = []
        try:
            for i, (params, grammar) in enumerate(zip(req.params, grammars)):
                opened.append(await _open_choice(served.engine, req.prompt_ids, params, f"{rid}-{i}", grammar))
            events = _merged([self._observed(agen, first, t0, len(req.prompt_ids)) for agen, first in opened])
            if req.echo:
                try:
                    head = await self._echoed(served, req, rid)
                except BaseException:
                    await events.aclose()
                    raise
                events = _echo_first([head] * len(req.params), events)
        except BaseException:
            await _close_all(opened)
            raise
        return _closing(events, opened)

    async def _grammars(self, served: Served, req: Parsed) -> list:
        """One grammar per choice (None: unconstrained), from response_format, a Lark grammar or tools.
        The first compile builds the vocabulary's trie (~0.1 s for 49k tokens): off the event loop."""
        lazy = lazy_grammar(req.tools) if req.tools else None
        try:
            if req.schema is not None:
                return [await asyncio.to_thread(served.grammars.compile, req.schema) for _ in req.params]
            if req.lark is not None:
                return [await asyncio.to_thread(served.grammars.compile_lark, req.lark) for _ in req.params]
            if lazy is not None:
                bodies = [await asyncio.to_thread(served.grammars.compile_lark, lazy[1]) for _ in req.params]
                return [LazyGrammar(lazy[0], b, served.tokenizer) for b in bodies]
        except GrammarError as e:
            tools = req.tools and (req.tools.schema or lazy or req.lark)
            raise bad_request(str(e), "tools" if tools else "response_format") from None
        return [None] * len(req.params)

    async def _observed(self, agen: AsyncIterator[Delta], first: Delta, t0: float,
                        prompt_len: int) -> AsyncIterator[Delta]:
        """One choice's deltas, recorded in the metrics when it ends (finished, failed or dropped)."""
        t_first, n, finish = None, 0, "abort"
        try:
            d = first
            while True:
                if d.token_ids:
                    t_first = t_first or time.perf_counter()
                    n += len(d.token_ids)
                if d.finish_reason is not None:
                    finish = d.finish_reason
                yield d
                if d.finish_reason is not None:
                    return
                d = await agen.__anext__()
        finally:
            await agen.aclose()  # on a client disconnect: AsyncEngine aborts the request
            self.metrics.observe(t0, t_first, time.perf_counter(), prompt_len, n, finish)

    async def _echoed(self, served: Served, req: Parsed, rid: str) -> Delta:
        """The prompt as the first delta of every choice of an `echo` request: its text, and with
        logprobs its tokens' own (scored on the exact path, runtime/engine/scoring.py)."""
        ids, tok = req.prompt_ids, served.tokenizer
        lps = []
        if req.logprobs:
            top = req.params[0].logprobs
            lps = await self.one_pass(served, "echo with logprobs", "echo",
                                      lambda model: prompt_logprobs(model, ids, top, tok.vocab_size))
        finish = None if req.generate else "length"
        usage = None if req.generate else Usage(len(ids), 0, 0)
        return Delta(rid, tok.decode(ids), list(ids), lps, finish, usage)

    async def one_pass(self, served: Served, what: str, param: str, fn):
        """fn(model) on a worker thread, between two engine steps: a forward pass of its own (embeddings,
        prompt scoring), which the tensor-parallel ranks would not follow."""
        model = served.engine.engine.model
        if getattr(model, "world", 1) != 1:
            raise APIError(400, f"{what}: not served with --tp yet", "invalid_request_error", param)
        return await asyncio.to_thread(served.engine.exclusive, lambda: fn(model))

    # ---- what /v1/models says -------------------------------------------------------------------------

    def model_card(self, name: str) -> dict:
        """/v1/models' entry for `name` (an offer or an alias): its context and formats once loaded."""
        canonical = self.pool.name_of(name)
        held = self.pool.loaded.get(canonical)
        card = {"id": name, "object": "model", "created": int(self.started), "owned_by": "lowbit", "root": canonical,
                "status": {"value": "loaded" if held is not None else "unloaded"}}  # llama-server's router mode
        if held is not None:
            card["max_model_len"] = held.served.max_model_len
            if held.served.formats:
                card["lowbit"] = held.served.formats
        return card


def _model_named(raw: bytes) -> tuple[str | None, object]:
    """(the `model` a JSON body names or None, its Ollama `keep_alive`); (None, None) for a body that is not
    a JSON object (`parse` says what is wrong with it)."""
    try:
        body = json_object(raw)
    except APIError:
        return None, None
    name = body.get("model") or body.get("name")  # `name`: older Ollama clients' field
    return (name if isinstance(name, str) and name else None), body.get("keep_alive")


def _itself(body: dict) -> dict:
    return body


def json_object(raw: bytes) -> dict:
    """A body that must be a JSON object, an empty one read as {} (as Ollama reads it)."""
    body = decode_json(raw) if raw.strip() else {}
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


# ---- the streams `start` builds: no state of their own ------------------------------------------------

async def _open_choice(engine: AsyncEngine, ids: list[int], params: SamplingParams, rid: str,
                       grammar) -> tuple[AsyncIterator[Delta], Delta]:
    """Open one choice's delta stream and wait for its first delta, so that a refusal is an HTTP
    error rather than a broken stream."""
    agen = engine.generate(ids, params, rid, grammar)
    try:
        first = await agen.__anext__()
    except QueueFull as e:
        raise APIError(429, f"The server is overloaded: {e}. Retry shortly.", "server_overloaded", None,
                       "server_overloaded", headers={"Retry-After": "1"}) from None
    except ValueError as e:
        code = "context_length_exceeded" if "context" in str(e) or "capacity" in str(e) else None
        raise bad_request(str(e), "messages" if code else None, code) from None
    except BaseException:
        await agen.aclose()
        raise
    return agen, first


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) in arrival order; closing this closes every choice's stream."""
    if len(streams) == 1:  # the common case, without tasks
        try:
            async for d in streams[0]:
                yield 0, d
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()
    tasks = [asyncio.create_task(_pump(i, s, queue, end)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, d = await queue.get()
            if d is end:
                left -= 1
            elif isinstance(d, Exception):
                raise d
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()  # a task mid-stream closes its stream, which aborts its engine request
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _pump(i: int, s: AsyncIterator[Delta], queue: asyncio.Queue, end: object) -> None:
    """Choice i's deltas onto the queue `_merged` reads, then `end` (or the exception that ended it)."""
    try:
        async for d in s:
            await queue.put((i, d))
        await queue.put((i, end))
    except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
        await queue.put((i, e))


async def _echo_first(heads: list[Delta], events: AsyncIterator[tuple[int, Delta]] | None):
    """Each choice's echoed prompt, then the engine's events (closed with this stream)."""
    try:
        for i, d in enumerate(heads):
            yield i, d
        if events is not None:
            async for item in events:
                yield item
    finally:
        if events is not None:
            await events.aclose()


async def _close_all(opened: list[tuple[AsyncIterator[Delta], Delta]]) -> None:
    for agen, _ in opened:
        await agen.aclose()


async def _closing(events: AsyncIterator[tuple[int, Delta]],
                   opened: list[tuple[AsyncIterator[Delta], Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """`events`, closing it and every opened choice's stream when this stream closes."""
    try:
        async for item in events:
            yield item
    finally:
        await events.aclose()
        await _close_all(opened)
