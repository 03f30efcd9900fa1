"""What every API's routes depend on: the app's `Frontend` and the bearer-key check (a router
dependency, so that a router's every route is keyed or none is)."""

from __future__ import annotations

import hmac

from fastapi import Request

from lowbit.runtime.server.errors import APIError
from lowbit.runtime.server.frontend import Frontend


def frontend(request: Request) -> Frontend:
    return request.app.state.lowbit


async def require_key(request: Request) -> None:
    """401 unless the request carries the server's API key (when it has one) as a bearer token.
    async: a plain def dependency would hop to a worker thread on every request."""
    key = frontend(request).api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time a wrong key takes tells nothing about how much of it was right
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key (send it as 'Authorization: Bearer <key>').",
                       "authentication_error", None, "invalid_api_key")
