"""OpenAI's API on the port: chat completions, completions, embeddings, the models, /tokenize and
/detokenize behind the API key (`router`); /health, /metrics and /version without it (`public`), for load
balancers, Prometheus and bug reports, which send none.

Every route reads its body through `Frontend.parse` (server/request.py's `RequestParser`, on a
worker thread) and generates through `Frontend.reply` (server/frontend.py).
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lowbit.runtime.engine.embedder import embed
from lowbit.runtime.server.deps import frontend, require_key
from lowbit.runtime.server.errors import APIError
from lowbit.runtime.server.request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    EMBEDDINGS_FIELDS,
    TOKENIZE_FIELDS,
)
from lowbit.runtime.version import version_info

public = APIRouter()
router = APIRouter(dependencies=[Depends(require_key)])


@public.get("/health")
async def health(request: Request):
    if frontend(request).pool is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    return {"status": "ok"}


@public.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(generate_latest(frontend(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@public.get("/version")
async def version():
    """llama-server's /version: what runs here (runtime/version.py), as `lowbit --version` prints it."""
    return version_info()


@router.get("/v1/models")
async def models(request: Request):
    """Every model the port offers, loaded or not (Open WebUI's picker lists these)."""
    fe = frontend(request)
    fe.require()
    return {"object": "list", "data": [fe.model_card(name) for name in fe.pool.names()]}


@router.get("/v1/models/{model_id:path}")
async def model_info(model_id: str, request: Request):
    fe = frontend(request)
    fe.require()
    if model_id not in fe.pool.names():
        raise APIError(404, f"The model '{model_id}' does not exist", "invalid_request_error", "model",
                       "model_not_found")
    return fe.model_card(model_id)


@router.post("/models/load")
async def load_model(request: Request):
    """llama-server's router mode: load `model` now (it would load on its first request)."""
    fe = frontend(request)
    served = await fe.model(request)
    return {"success": True, "model": served.model_name}


@router.post("/models/unload")
async def unload_model(request: Request):
    """llama-server's router mode: unload `model` now (its running requests end with an error)."""
    fe = frontend(request)
    fe.require()
    body = await fe.body(request)
    name = fe.pool.name_of(body.get("model") if isinstance(body.get("model"), str) else None)
    return {"success": await fe.pool.unload(name), "model": name}


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    texts, fmt = await fe.parse(request, served.parser.embeddings, served=served, fields=EMBEDDINGS_FIELDS)
    vectors = await fe.one_pass(served, "embeddings", "input", lambda model: embed(model, texts, served.pooling))
    data = []
    for i, v in enumerate(vectors.cpu()):
        value = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    n = sum(map(len, texts))
    return {"object": "list", "data": data, "model": served.model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/tokenize")
async def tokenize(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    ids = await fe.parse(request, served.parser.tokenize, served=served, fields=TOKENIZE_FIELDS)
    return {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    text = await fe.parse(request, served.parser.detokenize, served=served, fields=DETOKENIZE_FIELDS)
    return {"prompt": text, "content": text}  # vLLM's name, llama-server's


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    req = await fe.parse(request, served.parser.chat, served=served, fields=CHAT_FIELDS)
    return await fe.reply(served, req, "chatcmpl")


@router.post("/v1/completions")
async def completions(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    req = await fe.parse(request, served.parser.completion, served=served, fields=COMPLETION_FIELDS)
    return await fe.reply(served, req, "cmpl")
