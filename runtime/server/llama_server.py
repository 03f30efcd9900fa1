"""llama-server's own endpoints on the port, for the clients written against it: /infill (editor
autocomplete: llama.vim, llama.vscode) and rerank (/v1/rerank and /rerank, the Jina/Cohere shape RAG
pipelines call).

/infill builds the fill-in-the-middle prompt (server/fim.py) from `input_prefix`, `input_suffix`,
`input_extra` and `prompt` (the middle typed so far), then runs it on the completions path, answered in
llama-server's /completion shape: `content`, `stop`, `stop_type`, token counts; streamed as SSE objects
of the same shape, the last one with `stop: true`.

Rerank scores each document by the cosine of its embedding with the query's: the model's final hidden
states, pooled as /v1/embeddings pools them (`--pooling`), in one prefill of the query and every
document. An LLM has no relevance head; a dedicated reranker (a cross-encoder) is not a model lowbit loads.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from lowbit.runtime.engine.embedder import embed
from lowbit.runtime.server.deps import frontend, require_key
from lowbit.runtime.server.errors import bad_request
from lowbit.runtime.server.fim import fim_prompt
from lowbit.runtime.server.sse import sse_response

router = APIRouter(dependencies=[Depends(require_key)])

# llama-server's /infill and /completion fields → the completions body's (the rest pass as they are)
_RENAMED = {"n_predict": "max_tokens"}
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "stop", "max_tokens", "n_predict", "stream", "logit_bias")
STOP_TYPES = {"stop": "eos", "length": "limit"}


def _infill_request(fe, served, body: dict):
    """An /infill body → the Parsed completion of its FIM prompt (on the parse's worker thread)."""
    for key in ("input_prefix", "input_suffix", "prompt"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad_request(f"{key} must be a string", key)
    ids = fim_prompt(served.tokenizer, body.get("input_prefix") or "", body.get("input_suffix") or "",
                     body.get("prompt") or "", body.get("input_extra"), limit=served.max_model_len - 1)
    out = {_RENAMED.get(k, k): v for k, v in body.items() if k in _SAMPLING}
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 0:  # llama-server's -1: no limit
        del out["max_tokens"]
    return served.parser.completion({**out, "model": served.model_name, "prompt": ids})


@router.post("/infill")
async def infill(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    req = await fe.parse(request, _infill_request, fe, served)
    events = await fe.start(served, req, f"infill-{uuid.uuid4().hex}")
    if req.stream:
        return sse_response(_infill_chunks(events, served.model_name, len(req.prompt_ids)))
    try:
        text, finish, n = "", None, 0
        async for _, d in events:
            text, finish, n = text + d.text, d.finish_reason or finish, n + len(d.token_ids)
    finally:
        await events.aclose()
    return _completion(served.model_name, text, finish, n, len(req.prompt_ids))


def _completion(model: str, content: str, finish: str | None, predicted: int, evaluated: int,
                stop: bool = True) -> dict:
    """llama-server's /completion object."""
    out = {"content": content, "stop": stop, "model": model, "tokens_predicted": predicted,
           "tokens_evaluated": evaluated}
    if stop:
        out["stop_type"] = STOP_TYPES.get(finish, "none")
    return out


async def _infill_chunks(events, model: str, evaluated: int) -> AsyncIterator[bytes]:
    try:
        n = 0
        async for _, d in events:
            n += len(d.token_ids)
            if d.text:
                yield _sse(_completion(model, d.text, None, n, evaluated, stop=False))
            if d.finish_reason is not None:
                yield _sse(_completion(model, "", d.finish_reason, n, evaluated))
    finally:
        await events.aclose()


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


# ---- rerank ---------------------------------------------------------------------------------------------

def _rerank_request(fe, served, body: dict) -> tuple[list[list[int]], list[str], int, bool]:
    """A rerank body → (the query's and each document's ids, the documents' texts, top_n, return_documents)."""
    query, docs = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query:
        raise bad_request("query must be a non-empty string", "query")
    if isinstance(docs, list):
        docs = [d.get("text") if isinstance(d, dict) else d for d in docs]
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) and d for d in docs):
        raise bad_request("documents must be a non-empty list of non-empty strings (or {\"text\": ...})",
                          "documents")
    top_n = body.get("top_n", len(docs))
    if not (isinstance(top_n, int) and not isinstance(top_n, bool) and top_n >= 1):
        raise bad_request(f"top_n must be an int >= 1, got {top_n!r}", "top_n")
    ret = body.get("return_documents", True)
    if not isinstance(ret, bool):
        raise bad_request("return_documents must be a boolean", "return_documents")
    texts, _ = served.parser.embeddings({"input": [query, *docs]})  # tokenized and bounded as embeddings are
    return texts, docs, min(top_n, len(docs)), ret


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    ids, docs, top_n, ret = await fe.parse(request, _rerank_request, fe, served)
    vectors = await fe.one_pass(served, "rerank", "documents", lambda model: embed(model, ids, served.pooling))
    scores = (vectors[1:].float() @ vectors[0].float()).cpu()  # [documents]: cosines, the vectors unit-norm
    order = torch.argsort(scores, descending=True, stable=True)[:top_n].tolist()
    results = [{"index": i, "relevance_score": float(scores[i]), **({"document": {"text": docs[i]}} if ret else {})}
               for i in order]
    n = sum(map(len, ids))
    return JSONResponse({"object": "list", "model": served.model_name, "results": results,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
