"""The OpenAI API's base URL of a server, from what a user passes as --base-url (`lowbit bench`, `lowbit chat`)."""

from __future__ import annotations

from urllib.parse import urlsplit

from lowbit.runtime.errors import LowbitError


def api_base(url: str) -> str:
    """The OpenAI API's base URL from what a user passes: `http://host:port` (vLLM's benchmark
    convention, the server's root) means `http://host:port/v1`; a URL with a path (`/v1`, or a
    proxy's `/openai/v1`) is taken as it is. Ollama, llama.cpp's server, vLLM and lowbit all serve
    the API under /v1."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise LowbitError(f"--base-url must be an http:// or https:// URL, got {url!r}")
    if parts.query or parts.fragment:
        raise LowbitError(f"--base-url takes no query or fragment, got {url!r}")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"
