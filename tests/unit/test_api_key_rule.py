"""The HTTP front's API-key rule in-process (`control_plane.http.api_key.ApiKeyAuth` over the
fakes of `tests.helpers.http_fakes`): which paths are open, what passes, what the admin routes still
want. The same rule across real processes, gRPC and the clients: tests/integration/test_api_key.py."""

from __future__ import annotations

import pytest

from control_plane.http.api_key import ApiKeyAuth
from tests.helpers.http_fakes import Front, call_app


@pytest.mark.parametrize(
    "path, method, authorization, status",
    [
        ("/v1/models", "GET", None, 401),
        ("/v1/models", "GET", "Bearer k", 200),
        ("/v1/models", "GET", "bearer  k ", 200),  # scheme in any case, blanks stripped
        ("/v1/models", "GET", "Bearer admin", 200),  # the admin token passes wherever the key does
        ("/v1/models", "GET", "Basic k", 401),
        ("/v1/models", "GET", "Bearer kk", 401),
        ("/no/such/route", "GET", None, 401),  # guarded by default: nothing is learnt without the key
        ("/health", "GET", None, 200),
        ("/ping", "GET", None, 200),
        ("/ping", "POST", None, 200),
        ("/version", "GET", None, 200),
        ("/metrics", "GET", None, 200),
        ("/v1/load_lora_adapter", "POST", "Bearer k", 401),  # the admin routes still want the admin token
    ],
)
def test_api_key_rule(path, method, authorization, status):
    app = ApiKeyAuth(Front(admin_token="admin").app, api_key="k", admin_token="admin")
    r = call_app(
        app,
        method,
        path,
        {"lora_name": "x", "lora_path": "/x"},
        {"authorization": authorization} if authorization else {},
    )
    assert r.status == status, r.body
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"
