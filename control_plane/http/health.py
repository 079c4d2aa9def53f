"""``GET /health`` (an empty JSON object while the process serves) and ``GET /metrics`` (the
control plane's Prometheus exposition; 404 when metrics are off)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from loraplane.control_plane.http.deps import HttpDeps
from loraplane.control_plane.http.errors import OpenAIError


def health_router(deps: HttpDeps) -> APIRouter:
    """The routes probes and scrapers call: ``/health`` and ``/metrics``."""
    router = APIRouter()

    # ``async def``: answered on the event loop itself, never queued behind the worker
    # threads that generation requests occupy (probes stay fast under any load).
    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {}

    @router.get("/metrics")
    async def metrics() -> Response:
        if deps.metrics_text is None:
            raise OpenAIError(404, "metrics are not enabled", type="not_found_error")
        data, content_type = deps.metrics_text()
        return Response(data, media_type=content_type)

    return router
