"""The FastAPI application: OpenAI-compatible routes over the control plane's own objects.

Routes, one module per concern:
  * ``GET /v1/models`` (`models`);
  * ``POST /v1/completions``, ``POST /v1/chat/completions`` (`completions`; responses and
    server-sent events from `streaming`);
  * ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (`admin`: bearer token when
    one is configured, as on gRPC);
  * ``GET /health``, ``GET /metrics`` (`health`).
Every error is OpenAI's JSON shape (`errors.install_error_handlers`).
"""

from __future__ import annotations

from fastapi import FastAPI

from control_plane.http.admin import admin_router
from control_plane.http.completions import completions_router
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import install_error_handlers
from control_plane.http.health import health_router
from control_plane.http.models import models_router

__all__ = ["HttpDeps", "create_app"]


def create_app(deps: HttpDeps) -> FastAPI:
    """The HTTP front over ``deps`` (no docs or OpenAPI routes); serve it with
    `server.HttpServer`."""
    app = FastAPI(title="loraplane", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.include_router(health_router(deps))
    app.include_router(models_router(deps))
    app.include_router(completions_router(deps))
    app.include_router(admin_router(deps))
    return app
