"""The HTTP app: FastAPI over `AsyncEngine` (DESIGN.md's request and stream-back steps), one router
per API, all over one `Frontend` (server/frontend.py) at `app.state.lowbit`.

APIs on the port: OpenAI's (server/openai.py: chat completions with tools and reasoning, completions,
embeddings, models, /tokenize, /detokenize; /health, 503 while the model loads, and /metrics in
Prometheus' text format), OpenAI's Responses API (server/responses_api.py, stateless), Anthropic's
Messages API (server/anthropic_api.py: /v1/messages and count_tokens, Claude Code's) and Ollama's
/api/* (server/ollama.py), llama-server's /infill and rerank (server/llama_server.py), all on the same
engine path. Around every route: CORS, the host, origin
and body-size guard (server/guard.py), cancellation when the client goes away
(server/disconnect.py), and OpenAI-shaped errors (server/errors.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from lowbit.runtime.server import anthropic_api, llama_server, ollama, openai, responses_api
from lowbit.runtime.server.anthropic_reply import anthropic_error
from lowbit.runtime.server.disconnect import CancelOnDisconnect
from lowbit.runtime.server.errors import install_error_handlers
from lowbit.runtime.server.frontend import Frontend, Served
from lowbit.runtime.server.guard import DEFAULT_MAX_BODY, Guard, origin_policy
from lowbit.runtime.server.openapi import install_openapi

__all__ = ["LOCAL_ORIGINS", "Served", "build_app"]

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
                       origin_allowed=origin_policy(LOCAL_ORIGINS, cors_origins),
                       shapes=(("/v1/messages", anthropic_error), ("/api/", ollama.error_body)))  # inside CORS: its refusals get CORS headers
    app.add_middleware(CORSMiddleware, allow_methods=["*"], allow_headers=["*"], **origins)
    fe = app.state.lowbit = Frontend(api_key)
    if served is not None:
        fe.ready(served)
    # the order routes were always added in: the OpenAPI schema lists them so
    for router in (openai.public, openai.router, responses_api.router, ollama.public, ollama.router,
                   llama_server.router, anthropic_api.router):
        app.include_router(router)
    install_openapi(app)
    return app
