"""``GET /health`` (an empty JSON object while the process serves; ``GET``/``POST /ping`` the same,
vLLM's and SageMaker's probe), ``GET /version`` (``{"version"}``, vLLM's) and ``GET /metrics`` (the
control plane's Prometheus exposition; 404 when metrics are off), on the API listener
(`health_router`) and on a listener of their own (`health_app`, served on ``--metrics-addr``):
its own connections, so that probes and scrapers still get in while the API's connection cap
is full."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from starlette.middleware.gzip import GZipMiddleware

from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError, install_error_handlers
from loraplane.version import package_version

MetricsText = Callable[[], tuple[bytes, str]]
"""``() -> (exposition bytes, content type)``."""


def health_router(deps: HttpDeps) -> APIRouter:
    """The routes probes and scrapers call on the API listener: ``/health`` and ``/metrics``."""
    return health_routes(deps.metrics_text)


def health_routes(metrics_text: MetricsText | None) -> APIRouter:
    """``/health``, ``/ping``, ``/version`` and ``/metrics`` over ``metrics_text`` (None:
    ``/metrics`` is 404)."""
    router = APIRouter()
    version = {"version": package_version()}

    # ``async def``: answered on the event loop itself, never queued behind the worker
    # threads that generation requests occupy (probes stay fast under any load).
    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {}

    @router.get("/ping", operation_id="ping_get")
    @router.post("/ping", operation_id="ping_post")
    async def ping() -> dict[str, Any]:
        return {}

    @router.get("/version")
    async def server_version() -> dict[str, str]:
        return version

    @router.get("/metrics")
    async def metrics() -> Response:
        if metrics_text is None:
            raise OpenAIError(404, "metrics are not enabled", type="not_found_error")
        data, content_type = metrics_text()
        return Response(data, media_type=content_type)

    return router


def health_app(metrics_text: MetricsText) -> FastAPI:
    """The application of the ``--metrics-addr`` listener: ``/health`` and ``/metrics`` only
    (every other path 404 in OpenAI's error shape), the exposition gzipped for scrapers that
    accept it, as prometheus-client's own server does."""
    app = FastAPI(title="loraplane health and metrics", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.include_router(health_routes(metrics_text))
    app.add_middleware(GZipMiddleware, minimum_size=1024)
    return app
