"""The OpenAI-compatible HTTP layer: a thin FastAPI app over `AsyncEngine` (DESIGN.md's request and
stream-back steps).

Endpoints: POST /v1/chat/completions (tools and reasoning: server/tools.py, server/reply.py),
POST /v1/completions, POST /v1/embeddings, GET /v1/models, POST /tokenize and /detokenize, GET /health
(503 while the model loads, 200 once it serves), GET /metrics (Prometheus text format); the
Responses API (server/responses.py, stateless) and Ollama's /api/* (server/ollama.py) on the same
engine path.
The route of a request: `RequestParser` (server/request.py) turns the body into prompt ids and one
SamplingParams per choice; each choice becomes an engine request (with its own grammar when
response_format asks for JSON); their delta streams are merged and shaped by `Responder`
(server/response.py) into SSE chunks, or folded into one response. A client that goes away
mid-stream closes the merged stream, which closes every choice's engine stream, and
`AsyncEngine.generate`'s `finally` aborts those requests, freeing their KV pages.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lowbit.runtime.engine.embedder import embed
from lowbit.runtime.engine.scoring import prompt_logprobs
from lowbit.runtime.engine.engine import AsyncEngine, Delta, Usage
from lowbit.runtime.engine.grammar import GrammarCompiler, GrammarError, LazyGrammar
from lowbit.runtime.server.disconnect import CancelOnDisconnect
from lowbit.runtime.server.guard import DEFAULT_MAX_BODY, Guard, origin_policy
from lowbit.runtime.server.errors import APIError, bad_request, install_error_handlers
from lowbit.runtime.server.request import (CHAT_FIELDS, COMPLETION_FIELDS, DETOKENIZE_FIELDS, EMBEDDINGS_FIELDS,
                                          TOKENIZE_FIELDS, Parsed, RequestParser)
from lowbit.runtime.server.response import Responder
from lowbit.runtime.server.tools import lazy_grammar
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.engine.scheduler import QueueFull
from lowbit.runtime.server.metrics import ServerMetrics
from lowbit.runtime.server.ollama import add_ollama_routes
from lowbit.runtime.server.openapi import install_openapi
from lowbit.runtime.server.responses import add_responses_routes


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

def sse_response(body: AsyncIterator[bytes], media_type: str = "text/event-stream") -> StreamingResponse:
    return StreamingResponse(body, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclass
class Core:
    """What the other APIs on the port (server/responses.py, server/ollama.py) reuse from the app."""

    state: "AppState"
    check_key: Callable[[Request], None]
    start: Callable  # async (served, Parsed, request id) -> AsyncIterator[(choice, Delta)]; close it when done
    one_pass: Callable  # async (served, what, param, fn(model)) -> fn's result, between engine steps


class AppState:
    """The app's one piece of state: loading until `ready` is called with what to serve."""

    def __init__(self):
        self.served: Served | None = None
        self.parser: RequestParser | None = None
        self.responder: Responder | None = None
        self.grammars: GrammarCompiler | None = None

    def ready(self, served: Served) -> None:
        self.parser = RequestParser(served.tokenizer, served.model_name, served.max_model_len, served.aliases)
        self.responder = Responder(served.tokenizer, served.model_name, lambda: served.engine.last_error)
        self.grammars = GrammarCompiler(served.tokenizer)
        self.served = served  # last: requests see a fully built state or none

    def require(self) -> Served:
        if self.served is None:
            raise APIError(503, "The model is still loading; retry shortly (GET /health says when it is ready).",
                           "server_error", None, "model_loading", headers={"Retry-After": "2"})
        return self.served


# Browsers may call the port from pages served on this machine, any port (as Ollama allows by default)
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def build_app(served: Served | None = None, api_key: str | None = None,
              cors_origins: list[str] | None = None, bind_host: str | None = None,
              allowed_hosts: list[str] | None = None, max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    """The app; with `served` None it answers 503 until `app.state.lowbit.ready(served)`.
    cors_origins: the origins a browser page may call from (["*"]: any); None: LOCAL_ORIGINS. The
    preflight needs no key (browsers send none); the request itself is checked as any other.
    bind_host, allowed_hosts, max_body: what server/guard.py checks before any route."""
    app = FastAPI(title="lowbit", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    origins = {"allow_origin_regex": LOCAL_ORIGINS} if cors_origins is None else {"allow_origins": cors_origins}
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(Guard, bind_host=bind_host, allowed_hosts=allowed_hosts, max_body=max_body,
                       origin_allowed=origin_policy(LOCAL_ORIGINS, cors_origins))  # inside CORS: its refusals get CORS headers
    app.add_middleware(CORSMiddleware, allow_methods=["*"], allow_headers=["*"], **origins)
    state = app.state.lowbit = AppState()
    created = int(time.time())
    metrics = ServerMetrics(lambda: None if state.served is None else state.served.engine.stats())
    if served is not None:
        state.ready(served)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key (send it as 'Authorization: Bearer <key>').",
                           "authentication_error", None, "invalid_api_key")

    # ---- the engine's streams ---------------------------------------------------------------------

    async def open_choice(engine: AsyncEngine, ids: list[int], params: SamplingParams, rid: str,
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

    async def observed(agen: AsyncIterator[Delta], first: Delta, t0: float, prompt_len: int) -> AsyncIterator[Delta]:
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
            metrics.observe(t0, t_first, time.perf_counter(), prompt_len, n, finish)

    async def merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
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

        async def pump(i: int, s: AsyncIterator[Delta]) -> None:
            try:
                async for d in s:
                    await queue.put((i, d))
                await queue.put((i, end))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
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

    async def one_pass(served: Served, what: str, param: str, fn):
        """fn(model) on a worker thread, between two engine steps: a forward pass of its own (embeddings,
        prompt scoring), which the tensor-parallel ranks would not follow."""
        model = served.engine.engine.model
        if getattr(model, "world", 1) != 1:
            raise APIError(400, f"{what}: not served with --tp yet", "invalid_request_error", param)
        return await asyncio.to_thread(served.engine.exclusive, lambda: fn(model))

    async def echoed(served: Served, req: Parsed, rid: str) -> Delta:
        """The prompt as the first delta of every choice of an `echo` request: its text, and with
        logprobs its tokens' own (scored on the exact path, runtime/engine/scoring.py)."""
        ids, tok = req.prompt_ids, served.tokenizer
        lps = []
        if req.logprobs:
            top = req.params[0].logprobs
            lps = await one_pass(served, "echo with logprobs", "echo",
                                 lambda model: prompt_logprobs(model, ids, top, tok.vocab_size))
        finish = None if req.generate else "length"
        usage = None if req.generate else Usage(len(ids), 0, 0)
        return Delta(rid, tok.decode(ids), list(ids), lps, finish, usage)

    async def echo_first(heads: list[Delta], events: AsyncIterator[tuple[int, Delta]] | None):
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

    async def start(served: Served, req: Parsed, rid: str) -> AsyncIterator[tuple[int, Delta]]:
        """Open every choice of `req` (a refusal raises here, before any byte is sent) → the merged
        (choice, delta) stream. Closing it closes every choice's engine stream, whatever happened:
        closing a finished stream does nothing, closing a suspended one aborts its request and
        frees its pages."""
        t0 = time.perf_counter()
        if req.echo and not req.generate:  # scored, not generated: no engine request at all
            head = await echoed(served, req, rid)
            return echo_first([head] * len(req.params), None)
        grammars = [None] * len(req.params)
        lazy = lazy_grammar(req.tools) if req.tools else None
        try:  # the first compile builds the vocabulary's trie (~0.1 s for 49k tokens): off the event loop
            if req.schema is not None:
                grammars = [await asyncio.to_thread(state.grammars.compile, req.schema) for _ in req.params]
            elif req.lark is not None:
                grammars = [await asyncio.to_thread(state.grammars.compile_lark, req.lark) for _ in req.params]
            elif lazy is not None:
                bodies = [await asyncio.to_thread(state.grammars.compile_lark, lazy[1]) for _ in req.params]
                grammars = [LazyGrammar(lazy[0], b, served.tokenizer) for b in bodies]
        except GrammarError as e:
            tools = req.tools and (req.tools.schema or lazy or req.lark)
            raise bad_request(str(e), "tools" if tools else "response_format") from None
        opened: list[tuple[AsyncIterator[Delta], Delta]] = []

        async def close_all() -> None:
            for agen, _ in opened:
                await agen.aclose()

        try:
            for i, (params, grammar) in enumerate(zip(req.params, grammars)):
                opened.append(await open_choice(served.engine, req.prompt_ids, params, f"{rid}-{i}", grammar))
            events = merged([observed(agen, first, t0, len(req.prompt_ids)) for agen, first in opened])
            if req.echo:
                try:
                    head = await echoed(served, req, rid)
                except BaseException:
                    await events.aclose()
                    raise
                events = echo_first([head] * len(req.params), events)
        except BaseException:
            await close_all()
            raise

        async def closing() -> AsyncIterator[tuple[int, Delta]]:
            try:
                async for item in events:
                    yield item
            finally:
                await events.aclose()
                await close_all()

        return closing()

    async def run(served: Served, req: Parsed, prefix: str):
        rid = f"{prefix}-{uuid.uuid4().hex}"
        events = await start(served, req, rid)
        if not req.stream:
            try:
                return JSONResponse(await state.responder.fold(req, rid, events))
            finally:
                await events.aclose()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for b in state.responder.chunks(req, rid, events):
                    yield b
            finally:
                await events.aclose()

        return sse_response(body())

    async def parse(fn, request: Request, fields: frozenset[str]):
        """fn(the body) on a worker thread: decoding, templating and tokenizing a long prompt take
        seconds that would stall every other request on the event loop."""
        raw = await request.body()
        return await asyncio.to_thread(lambda: fn(state.parser.body(raw, fields)))

    # ---- routes -------------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if state.served is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(served: Served, name: str) -> dict:
        card = {"id": name, "object": "model", "created": created, "owned_by": "lowbit",
                "root": served.model_name, "max_model_len": served.max_model_len}
        if served.formats:
            card["lowbit"] = served.formats
        return card

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        served = state.require()
        return {"object": "list", "data": [model_card(served, n) for n in (served.model_name, *served.aliases)]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request):
        check_key(request)
        served = state.require()
        if model_id not in (served.model_name, *served.aliases):
            raise APIError(404, f"The model '{model_id}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return model_card(served, model_id)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        check_key(request)
        served = state.require()
        texts, fmt = await parse(state.parser.embeddings, request, EMBEDDINGS_FIELDS)
        vectors = await one_pass(served, "embeddings", "input", lambda model: embed(model, texts, served.pooling))
        data = []
        for i, v in enumerate(vectors.cpu()):
            value = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        n = sum(map(len, texts))
        return {"object": "list", "data": data, "model": served.model_name,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        check_key(request)
        served = state.require()
        ids = await parse(state.parser.tokenize, request, TOKENIZE_FIELDS)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_key(request)
        state.require()
        text = await parse(state.parser.detokenize, request, DETOKENIZE_FIELDS)
        return {"prompt": text, "content": text}  # vLLM's name, llama-server's

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        served = state.require()
        req = await parse(state.parser.chat, request, CHAT_FIELDS)
        return await run(served, req, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        served = state.require()
        req = await parse(state.parser.completion, request, COMPLETION_FIELDS)
        return await run(served, req, "cmpl")

    core = Core(state, check_key, start, one_pass)
    add_responses_routes(app, core)
    add_ollama_routes(app, core)
    install_openapi(app)
    return app
