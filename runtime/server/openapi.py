"""The OpenAPI schema of the routes lowbit serves (GET /openapi.json).

The routes read raw bodies (`request: Request`) so that request.py can answer OpenAI-shaped 400s,
so FastAPI generates no request bodies. This adds, per POST route, a permissive JSON body (known
fields typed as OpenAI/Ollama type them, anything else allowed) and the responses the route gives,
so that schema-driven fuzzers (tests/test_schemathesis.py) can exercise the server."""

from __future__ import annotations

from fastapi import FastAPI

_STR_OR_LIST = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_MESSAGES = {"type": "array", "items": {"type": "object", "additionalProperties": True, "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "developer", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}}
_SAMPLING = {"model": {"type": "string"}, "stream": {"type": "boolean"}, "max_tokens": {"type": "integer", "minimum": 1},
             "temperature": {"type": "number"}, "top_p": {"type": "number"}, "n": {"type": "integer"},
             "stop": _STR_OR_LIST, "logprobs": {"type": "boolean"}, "seed": {"type": "integer"}}
_BODIES = {
    "/v1/chat/completions": {"messages": _MESSAGES, "top_logprobs": {"type": "integer"}, **_SAMPLING},
    "/v1/completions": {"prompt": _STR_OR_LIST, "echo": {"type": "boolean"}, **_SAMPLING},
    "/v1/embeddings": {"model": {"type": "string"}, "input": _STR_OR_LIST,
                       "encoding_format": {"type": "string", "enum": ["float", "base64"]}},
    "/tokenize": {"model": {"type": "string"}, "prompt": {"type": "string"}, "messages": _MESSAGES},
    "/detokenize": {"model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer"}}},
    "/v1/responses": {"model": {"type": "string"}, "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                      "stream": {"type": "boolean"}, "max_output_tokens": {"type": "integer", "minimum": 1}},
    "/api/chat": {"model": {"type": "string"}, "messages": _MESSAGES, "stream": {"type": "boolean"}},
    "/api/generate": {"model": {"type": "string"}, "prompt": {"type": "string"}, "stream": {"type": "boolean"}},
    "/api/show": {"model": {"type": "string"}}, "/api/embed": {"model": {"type": "string"}, "input": _STR_OR_LIST},
    "/api/embeddings": {"model": {"type": "string"}, "prompt": {"type": "string"}},
}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_STREAMS = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}


def install_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for path, ops in schema.get("paths", {}).items():
            error = _OLLAMA_ERROR if path.startswith("/api/") else _OPENAI_ERROR
            for method, op in ops.items():
                if method == "post":
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                        "type": "object", "additionalProperties": True, "properties": _BODIES.get(path, {})}}}}
                ok = {"application/json": {"schema": {}}}
                if path in _STREAMS or path in ("/api/chat", "/api/generate"):
                    ok["text/event-stream" if path in _STREAMS else "application/x-ndjson"] = {"schema": {}}
                op["responses"] = {"200": {"description": "OK", "content": ok},
                                   "4XX": {"description": "Refused",
                                           "content": {"application/json": {"schema": error}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
