"""The OpenAI-compatible HTTP layer: a thin FastAPI app over `AsyncEngine` (DESIGN.md's request and
stream-back steps).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text format).
Responses and errors have OpenAI's shapes; the official `openai` client is the judge
(tests/test_server.py). One code path: the engine's delta stream is either sent as SSE chunks or
folded into one response. A client that goes away mid-stream closes the delta stream, and
`AsyncEngine.generate`'s `finally` aborts the request, freeing its KV pages.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from lowbit.runtime.engine import AsyncEngine, Delta
from lowbit.runtime.sampler import MAX_LOGPROBS, SamplingParams
from lowbit.runtime.scheduler import QueueFull

log = logging.getLogger("lowbit.server")

# fields both endpoints map onto SamplingParams (OpenAI name → SamplingParams name)
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repetition_penalty": "repetition_penalty", "seed": "seed"}
# fields accepted and deliberately without effect here
_IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls", "stream_options"}
_CHAT_FIELDS = {"messages", "model", "stream", "max_tokens", "max_completion_tokens", "n", "stop", "logit_bias",
                "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "functions",
                "function_call", *_SAMPLING, *_IGNORED}
_COMPLETION_FIELDS = {"prompt", "model", "stream", "max_tokens", "n", "stop", "logit_bias", "logprobs", "echo",
                      "best_of", "suffix", *_SAMPLING, *_IGNORED}
_ROLES = ("system", "user", "assistant", "developer")
_PARAMS_FIELDS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "logit_bias", "seed", "max_tokens", "stop", "logprobs"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Gauges read from `AsyncEngine.stats()` at scrape time."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, key, doc in (("lowbit_requests_running", "running", "requests being decoded"),
                               ("lowbit_requests_waiting", "waiting", "requests waiting to be scheduled"),
                               ("lowbit_kv_pages_used", "pages_used", "KV cache pages in use"),
                               ("lowbit_kv_pages_total", "pages_total", "KV cache pages in the pool"),
                               ("lowbit_prefix_cache_hit_rate", "prefix_hit_rate",
                                "share of looked-up prompt tokens served from the prefix cache")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        yield CounterMetricFamily("lowbit_preemptions", "sequences preempted for KV pages", value=s["preemptions"])


class _Metrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("lowbit_time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("lowbit_time_per_output_token_seconds", "time per output token after the first",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("lowbit_e2e_request_latency_seconds", "end-to-end request latency", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("lowbit_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("lowbit_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("lowbit_requests_finished", "requests finished, by reason", ["finish_reason"],
                                registry=r)
        r.register(_EngineCollector(engine))


def build_app(engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int,
              api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="lowbit", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    metrics = _Metrics(engine)

    # ---- errors: always OpenAI's shape, never FastAPI's bare {"detail": ...} ---------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(_bad(str(e.errors()[:1])))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key (send it as 'Authorization: Bearer <key>').",
                           "authentication_error", None, "invalid_api_key")

    async def read_body(request: Request, fields: set[str]) -> dict:
        check_key(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("request body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"The model '{model}' does not exist (this server serves '{model_name}').",
                           "invalid_request_error", "model", "model_not_found")
        if body.get("n") not in (None, 1):
            raise _bad("only n = 1 is supported for now", "n")
        return body

    # ---- request → (prompt ids, SamplingParams) ---------------------------------------------------

    def sampling_params(body: dict, prompt_len: int, max_key: str, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = {}
        for src, dst in _SAMPLING.items():
            if body.get(src) is not None:
                kw[dst] = body[src]
        if kw.get("temperature") is None:
            kw["temperature"] = 1.0  # OpenAI's default
        if kw.get("top_p") is None:
            kw["top_p"] = 1.0
        stop = body.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
                raise _bad("stop must be a string or a list of strings", "stop")
            kw["stop"] = tuple(s for s in stop if s)
        bias = body.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, dict):
                raise _bad("logit_bias must be an object mapping token ids to numbers", "logit_bias")
            try:
                bias = {int(k): v for k, v in bias.items()}
            except (TypeError, ValueError):
                raise _bad("logit_bias keys must be token ids", "logit_bias") from None
            vocab = tokenizer.vocab_size
            bad_ids = [t for t in bias if not 0 <= t < vocab]
            if bad_ids:
                raise _bad(f"logit_bias token id {bad_ids[0]} is outside the vocabulary [0, {vocab})", "logit_bias")
            kw["logit_bias"] = bias
        room = max_model_len - prompt_len
        max_tokens = body.get(max_key)
        if max_key == "max_completion_tokens" and max_tokens is None:
            max_tokens, max_key = body.get("max_tokens"), "max_tokens"
        if max_tokens is not None:
            if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
                raise _bad(f"{max_key} must be an int >= 1, got {max_tokens!r}", max_key)
            if max_tokens > room:
                raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                           f"for the completion). Please reduce the prompt or {max_key}.",
                           max_key, "context_length_exceeded")
            kw["max_tokens"] = max_tokens
        else:
            kw["max_tokens"] = room
        kw["logprobs"] = logprobs
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            msg = str(e)
            name = msg.split(" ", 1)[0]
            param = next((k for k, v in _SAMPLING.items() if v == name), name if name in _PARAMS_FIELDS else None)
            if param == "max_tokens":
                param = max_key
            raise _bad(msg, param) from None

    def check_prompt_len(n: int) -> None:
        if n >= max_model_len:
            raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                       f"has {n} tokens, leaving no room for the completion. Please shorten the prompt.",
                       "messages", "context_length_exceeded")

    def chat_messages(body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list", "messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise _bad(f"messages[{i}] must have a role among {', '.join(_ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                        raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
                    parts.append(p["text"])
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            out.append({"role": role, "content": content})
        return out

    def unsupported(body: dict, endpoint: str) -> None:
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise _bad("response_format other than {\"type\": \"text\"} is not supported yet", "response_format")
        for name in ("tools", "functions"):
            if body.get(name):
                raise _bad(f"{name} are not supported", name)
        if endpoint == "completions":
            if body.get("echo"):
                raise _bad("echo is not supported", "echo")
            if body.get("best_of") not in (None, 1):
                raise _bad("best_of is not supported", "best_of")
            if body.get("suffix"):
                raise _bad("suffix is not supported", "suffix")
        if body.get("stream") not in (None, True, False):
            raise _bad("stream must be a boolean", "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise _bad("stream_options must be an object", "stream_options")

    # ---- the engine's stream --------------------------------------------------------------------

    async def start(ids: list[int], params: SamplingParams, rid: str) -> tuple[AsyncIterator[Delta], Delta]:
        """Open the delta stream and wait for its first delta, so that a refusal is an HTTP error
        rather than a broken stream."""
        agen = engine.generate(ids, params, rid)
        try:
            first = await agen.__anext__()
        except QueueFull as e:
            raise APIError(429, f"The server is overloaded: {e}. Retry shortly.", "server_overloaded", None,
                           "server_overloaded", headers={"Retry-After": "1"}) from None
        except ValueError as e:
            code = "context_length_exceeded" if "context" in str(e) or "capacity" in str(e) else None
            raise _bad(str(e), "messages" if code else None, code) from None
        except BaseException:
            await agen.aclose()
            raise
        return agen, first

    async def deltas(agen, first: Delta, t0: float, prompt_len: int) -> AsyncIterator[Delta]:
        t_first, n, finish = None, 0, "abort"

        def seen(d: Delta) -> None:
            nonlocal t_first, n, finish
            if d.token_ids:
                t_first = t_first or time.perf_counter()
                n += len(d.token_ids)
            if d.finish_reason is not None:
                finish = d.finish_reason

        try:
            seen(first)
            yield first
            if first.finish_reason is None:
                async for d in agen:
                    seen(d)
                    yield d
                    if d.finish_reason is not None:
                        break
        finally:
            await agen.aclose()  # on a client disconnect: AsyncEngine aborts the request
            end = time.perf_counter()
            metrics.finished.labels(finish).inc()
            metrics.prompt_tokens.inc(prompt_len)
            metrics.generation_tokens.inc(n)
            metrics.e2e.observe(end - t0)
            if t_first is not None:
                metrics.ttft.observe(t_first - t0)
                if n > 1:
                    metrics.tpot.observe((end - t_first) / (n - 1))

    def token_str(t: int) -> tuple[str, list[int]]:
        b = tokenizer.token_bytes(t)
        return b.decode("utf-8", errors="replace"), list(b)

    def chat_logprobs(d: Delta) -> list[dict]:
        out = []
        for t, (lp, top) in zip(d.token_ids, d.logprobs):
            s, b = token_str(t)
            tops = []
            for tid, tlp in top:
                ts, tb = token_str(tid)
                tops.append({"token": ts, "logprob": float(tlp), "bytes": tb})
            out.append({"token": s, "logprob": float(lp), "bytes": b, "top_logprobs": tops})
        return out

    def completion_logprobs(d: Delta, offset: int) -> dict:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (l, top) in zip(d.token_ids, d.logprobs):
            s, _ = token_str(t)
            lp["tokens"].append(s)
            lp["token_logprobs"].append(float(l))
            lp["top_logprobs"].append({token_str(tid)[0]: float(tl) for tid, tl in top})
            lp["text_offset"].append(offset)
            offset += len(s)
        return lp

    def usage_dict(u) -> dict:
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    def finish_of(d: Delta) -> str:
        if d.finish_reason == "error":
            err = engine.last_error
            raise APIError(500, f"generation failed: {type(err).__name__}: {err}" if err else "generation failed",
                           "server_error")
        return d.finish_reason if d.finish_reason in ("stop", "length") else "stop"

    def sse(obj: dict | str) -> bytes:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    def stream_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def run(body: dict, ids: list[int], params: SamplingParams, kind: str):
        chat = kind == "chat"
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        now, t0 = int(time.time()), time.perf_counter()
        agen, first = await start(ids, params, rid)
        want_lp = params.logprobs is not None
        stream = deltas(agen, first, t0, len(ids))
        if not body.get("stream"):  # the fold of the same stream
            text, lps, comp_lp, usage, finish = [], [], None, None, "stop"
            async for d in stream:
                text.append(d.text)
                if want_lp:
                    if chat:
                        lps += chat_logprobs(d)
                    else:
                        part = completion_logprobs(d, sum(map(len, text[:-1])))
                        comp_lp = part if comp_lp is None else {k: comp_lp[k] + part[k] for k in part}
                if d.finish_reason is not None:
                    finish, usage = finish_of(d), d.usage
            text = "".join(text)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                          "logprobs": {"content": lps} if want_lp else None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": comp_lp if want_lp else None, "finish_reason": finish}
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": now, "model": model_name, "system_fingerprint": None,
                                 "choices": [choice], "usage": usage_dict(usage) if usage else None})

        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> bytes:
            c = {"id": rid, "object": obj, "created": now, "model": model_name, "system_fingerprint": None,
                 "choices": choices}
            if include_usage:
                c["usage"] = None
            c.update(extra)
            return sse(c)

        async def events() -> AsyncIterator[bytes]:
            offset = 0
            try:
                if chat:
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for d in stream:
                    finish = finish_of(d) if d.finish_reason is not None else None
                    if chat:
                        lp = {"content": chat_logprobs(d)} if want_lp and d.token_ids else None
                        if d.text or lp:
                            yield chunk([{"index": 0, "delta": {"content": d.text}, "logprobs": lp,
                                          "finish_reason": None}])
                        if finish:
                            yield chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}])
                    else:
                        lp = completion_logprobs(d, offset) if want_lp else None
                        offset += len(d.text)
                        if d.text or finish:
                            yield chunk([{"index": 0, "text": d.text, "logprobs": lp, "finish_reason": finish}])
                    if finish:
                        if include_usage and d.usage:
                            yield chunk([], usage=usage_dict(d.usage))
                        break
                yield sse("[DONE]")
            except APIError as e:  # a failure after the stream began: an error event, then close
                yield sse(e.body())
            finally:
                await stream.aclose()

        return stream_response(events())

    # ---- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "lowbit", "root": model_name,
                                            "max_model_len": max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request):
        check_key(request)
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return {"id": model_name, "object": "model", "created": created, "owned_by": "lowbit", "root": model_name,
                "max_model_len": max_model_len}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, _CHAT_FIELDS)
        unsupported(body, "chat")
        messages = chat_messages(body)
        try:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
        except ValueError as e:
            raise _bad(f"cannot render the chat template: {e}", "messages") from None
        check_prompt_len(len(ids))
        lp = body.get("logprobs")
        top = body.get("top_logprobs")
        if lp not in (None, True, False):
            raise _bad("logprobs must be a boolean", "logprobs")
        if top is not None:
            if not lp:
                raise _bad("top_logprobs needs logprobs set to true", "top_logprobs")
            if not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_LOGPROBS):
                raise _bad(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}]", "top_logprobs")
        params = sampling_params(body, len(ids), "max_completion_tokens", (top or 0) if lp else None)
        return await run(body, ids, params, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, _COMPLETION_FIELDS)
        unsupported(body, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < tokenizer.vocab_size for t in ids):
                raise _bad("prompt token ids must lie in the vocabulary", "prompt")
        elif isinstance(prompt, str) and prompt:
            ids = tokenizer.encode(prompt, add_special=True)
        else:
            raise _bad("prompt must be a non-empty string (or one list of token ids)", "prompt")
        if len(ids) >= max_model_len:
            raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                       f"has {len(ids)} tokens, leaving no room for the completion.", "prompt",
                       "context_length_exceeded")
        lp = body.get("logprobs")
        if lp is not None and not (isinstance(lp, int) and not isinstance(lp, bool) and 0 <= lp <= 5):
            raise _bad("logprobs must be an int in [0, 5]", "logprobs")
        params = sampling_params(body, len(ids), "max_tokens", lp)
        return await run(body, ids, params, "completions")

    return app
