"""The OpenAPI schema of the routes lowbit serves (GET /openapi.json)."""

from __future__ import annotations

from fastapi import FastAPI


def install_openapi(app: FastAPI) -> None:
    """FastAPI's generated schema, as it is."""
