"""The inference API key (``--api-key``) against a real ``loraplane control-plane`` process with
its HTTP front and metrics on (no worker: whether a call passed the key shows in what it
answers): the official ``openai`` client, plain HTTP, gRPC stubs, the Python client and CLI.

- missing or wrong key → HTTP 401 ``invalid_api_key`` / gRPC UNAUTHENTICATED;
- the key → served (``/v1/models`` lists the base model; Generate reaches routing: UNAVAILABLE,
  no live worker);
- the admin token → served wherever the key is (admin ⊇ inference); admin calls still need
  the admin token, not the key;
- ``/health``, ``/metrics``, gRPC health and the worker RPCs never ask for the key.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from loraplane.v1 import common_pb2, control_plane_pb2, control_plane_pb2_grpc, membership_pb2, membership_pb2_grpc
from tests.helpers.live_servers import wait_until
from tests.helpers.serve import free_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "inference-key-1"
ADMIN = "admin-token-1"
BASE = "gemma-3-270m-q4_k_m"


class Plane:
    def __init__(self, proc: subprocess.Popen, grpc_addr: str, http: str, metrics: str) -> None:
        self.proc, self.grpc_addr, self.http, self.metrics = proc, grpc_addr, http, metrics


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def plane(tmp_path_factory, base_model_path: Path):
    tmp = tmp_path_factory.mktemp("api-key")
    grpc_addr, http_addr, metrics_addr = (f"127.0.0.1:{free_port()}" for _ in range(3))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    env.update(PYTHONPATH=str(ROOT), LORAPLANE_API_KEY=API_KEY)  # the key from the environment
    log = tmp / "cp.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "clients.cli", "control-plane", "--addr", grpc_addr),
                *("--data-dir", str(tmp / "data"), "--model", str(base_model_path), "--admin-token", ADMIN),
                *("--http-addr", http_addr, "--metrics-addr", metrics_addr, "--insecure-workers"),
                *("--log-level", "warning"),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    p = Plane(proc, grpc_addr, f"http://{http_addr}", f"http://{metrics_addr}/metrics")
    try:

        def up() -> bool:
            try:
                return _get(p.http + "/health")[0] == 200
            except OSError:
                return proc.poll() is not None  # exited: stop waiting, the assert says why

        assert wait_until(up, timeout=120, interval=0.2) and proc.poll() is None, log.read_text(errors="replace")
        yield p
    finally:
        proc.kill()  # its shutdown is not under test here (and a polite one costs seconds)
        proc.wait(30)


def _openai(plane: Plane, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=plane.http + "/v1", api_key=key, max_retries=0, timeout=60)


def test_http_needs_the_key(plane: Plane) -> None:
    for key in ("wrong-key", API_KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as err:
            _openai(plane, key).models.list()
        assert err.value.status_code == 401
        assert err.value.body["code"] == "invalid_api_key" and err.value.body["type"] == "authentication_error"
        assert err.value.body["message"] == "API key rejected"
    # no Authorization header at all (the openai client always sends one)
    status, body = _get(plane.http + "/v1/models")
    assert status == 401
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer <key>" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        _openai(plane, "wrong").completions.create(model=BASE, prompt="hi", max_tokens=1)


def test_http_key_and_admin_token_are_served(plane: Plane) -> None:
    for key in (API_KEY, ADMIN):
        assert [m.id for m in _openai(plane, key).models.list().data] == [BASE]
        # past the key: routing answers (no live worker yet), not authentication
        with pytest.raises(openai.APIStatusError) as err:
            _openai(plane, key).completions.create(model=BASE, prompt="hi", max_tokens=1)
        assert err.value.status_code == 503


def test_admin_routes_need_the_admin_token_not_the_key(plane: Plane) -> None:
    def load(token: str) -> int:
        req = urllib.request.Request(
            plane.http + "/v1/load_lora_adapter",
            data=json.dumps({"lora_name": "x", "lora_path": "/nonexistent.gguf"}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert load(API_KEY) == 401  # the admin check, after the key passed
    assert load(ADMIN) == 403  # past both checks: the path is refused (no --adapter-dir)


def test_health_and_metrics_stay_open(plane: Plane) -> None:
    assert _get(plane.http + "/health") == (200, b"{}")
    status, body = _get(plane.http + "/metrics")
    assert status == 200 and b"# TYPE" in body
    assert _get(plane.metrics)[0] == 200
    with grpc.insecure_channel(plane.grpc_addr) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_needs_the_key(plane: Plane) -> None:
    with grpc.insecure_channel(plane.grpc_addr) as ch:
        stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
        req = common_pb2.GenerateRequest(text="hi")
        for md in ((), (("authorization", "Bearer wrong"),), (("authorization", f"Basic {API_KEY}"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.ListAdapters(common_pb2.Empty(), metadata=md, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, metadata=md, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for token in (API_KEY, ADMIN):
            md = (("authorization", f"Bearer {token}"),)
            assert list(stub.ListAdapters(common_pb2.Empty(), metadata=md, timeout=10).adapters) == []
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, metadata=md, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # served: no live worker
        # an admin call: the key passes the key check but not the admin one
        with pytest.raises(grpc.RpcError) as err:
            stub.SetDefaultAdapters(common_pb2.AdapterMap(), metadata=(("authorization", f"Bearer {API_KEY}"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "admin token" in err.value.details()
        # worker RPCs carry the worker secret, not the key (this plane: --insecure-workers)
        try:
            membership = membership_pb2_grpc.WorkerMembershipStub(ch)
            membership.RegisterWorker(membership_pb2.WorkerHello(worker_id="", addr=""), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.UNAUTHENTICATED, exc.details()


def test_python_client_and_cli_send_the_key(plane: Plane, monkeypatch) -> None:
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("LORAPLANE_API_KEY", raising=False)
    with LoraplaneClient(plane.grpc_addr, timeout=10) as lp, pytest.raises(LoraplaneError) as err:
        lp.list_adapters()
    assert err.value.code == "UNAUTHENTICATED"
    with LoraplaneClient(plane.grpc_addr, timeout=10, api_key=API_KEY) as lp:
        assert lp.list_adapters() == []
    monkeypatch.setenv("LORAPLANE_API_KEY", API_KEY)
    with LoraplaneClient(plane.grpc_addr, timeout=10) as lp:  # the key from the environment
        assert lp.list_adapters() == []
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "clients.cli", "adapters", "list", "--addr", plane.grpc_addr, "--json"]
    r = subprocess.run([*cmd, "--api-key", API_KEY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout) == {"adapters": []}


@pytest.mark.slow  # needs node and the npm packages, as tests/integration/test_node_client.py
def test_node_client_sends_the_key(plane: Plane) -> None:
    node_dir = ROOT / "clients" / "node"
    if shutil.which("node") is None or not (node_dir / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("node and `npm install --prefix clients/node` are needed (scripts/install.sh --with-node)")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    def node(*flags: str) -> tuple[int, dict]:
        cmd = ["node", str(node_dir / "generate.js"), "--addr", plane.grpc_addr, "--prompt", "hi", *flags]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])

    code, out = node()
    assert code == 1 and out["error"]["code"] == "UNAUTHENTICATED"
    code, out = node("--api-key", API_KEY)
    assert code == 1 and out["error"]["code"] == "UNAVAILABLE"  # served: no live worker


@pytest.mark.slow
def test_tenants_cli_json_and_tenant_keys_pass_for_inference_only(plane: Plane, monkeypatch) -> None:
    """``tenants add/update/list/remove --json`` against the real process (admin token), the
    contract's exit codes for its refusals; the tenant's key then passes the key check on HTTP
    and gRPC (past it: no live worker) but never opens an admin call or route, and is refused
    as soon as the tenant is removed."""
    from click.testing import CliRunner

    from clients.cli.main import cli

    for var in ("LORAPLANE_ADMIN_TOKEN", "LORAPLANE_API_KEY", "LORAPLANE_ADDR"):
        monkeypatch.delenv(var, raising=False)

    def run(*args: str, token: str = ADMIN) -> tuple[int, dict]:
        r = CliRunner().invoke(cli, ["tenants", *args, "--json", "--addr", plane.grpc_addr, "--admin-token", token])
        return r.exit_code, json.loads(r.stdout)

    code, added = run("add", "acme", "--tokens-per-minute", "1000", "--weight", "2")
    key = added.pop("api_key")
    assert code == 0 and key.startswith("lp-") and len(key) == 46
    usage = {"in_flight": 0, "tokens_available": 1000.0, "requests_available": 0.0}
    usage.update(requests_total=0, tokens_total=0, rejected_total=0)
    expected = {"name": "acme", "weight": 2.0, "priority": 0, "max_concurrent": 0, "tokens_per_minute": 1000}
    expected.update(requests_per_minute=0, key_count=1, usage=usage)
    assert added == expected
    assert run("add", "acme") == (1, {"error": {"code": "ALREADY_EXISTS", "message": "tenant 'acme' already exists"}})
    code, err = run("add", " acme")
    assert (code, err["error"]["code"]) == (1, "INVALID_ARGUMENT") and "blank" in err["error"]["message"]
    code, err = run("update", "ghost", "--weight", "3")
    assert (code, err["error"]["code"]) == (1, "NOT_FOUND") and "tenants: acme" in err["error"]["message"]
    code, updated = run("update", "acme", "--max-concurrent", "3")
    assert code == 0 and updated == {**expected, "max_concurrent": 3}
    assert run("list") == (0, {"tenants": [{**expected, "max_concurrent": 3}]})
    code, err = run("list", token=API_KEY)  # the key is not the admin token
    assert (code, err["error"]["code"]) == (1, "UNAUTHENTICATED")
    code, err = run("update", "acme", token=API_KEY)
    assert code == 2 and err["error"]["code"] == "INVALID_ARGUMENT"  # usage: nothing to change

    assert [m.id for m in _openai(plane, key).models.list().data] == [BASE]
    with pytest.raises(openai.APIStatusError) as past:
        _openai(plane, key).completions.create(model=BASE, prompt="hi", max_tokens=1)
    assert past.value.status_code == 503  # routing answered: no live worker
    assert _get(plane.http + "/v1/tenants", key)[0] == 401
    assert json.loads(_get(plane.http + "/v1/tenants", ADMIN)[1])["tenants"][0]["name"] == "acme"
    with grpc.insecure_channel(plane.grpc_addr) as ch:
        stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
        md = (("authorization", f"Bearer {key}"),)
        assert list(stub.ListAdapters(common_pb2.Empty(), metadata=md, timeout=10).adapters) == []
        with pytest.raises(grpc.RpcError) as err_gen:
            list(stub.Generate(common_pb2.GenerateRequest(text="hi"), metadata=md, timeout=10))
        assert err_gen.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err_admin:
            stub.ListTenants(control_plane_pb2.ListTenantsRequest(), metadata=md, timeout=10)
        assert err_admin.value.code() == grpc.StatusCode.UNAUTHENTICATED

    assert run("remove", "acme") == (0, {"name": "acme", "removed": True})
    assert run("remove", "acme")[1]["error"]["code"] == "NOT_FOUND"
    with pytest.raises(openai.AuthenticationError):
        _openai(plane, key).models.list()  # removed through this replica: refused at once


def _cli(*args: str) -> dict:
    """``loraplane <args> --json`` in this process: (exit code, the JSON object printed)."""
    from click.testing import CliRunner

    from clients.cli.main import cli

    r = CliRunner().invoke(cli, [*args, "--json"])
    return {"exit": r.exit_code, **json.loads(r.stdout)}


API_KEY_HINT = "the API key comes from --api-key or $LORAPLANE_API_KEY (--admin-token passes too)"
ADMIN_HINT = "the admin token comes from --admin-token or $LORAPLANE_ADMIN_TOKEN"


def test_cli_auth_errors_name_the_flag_and_variable(plane: Plane, monkeypatch) -> None:
    """UNAUTHENTICATED answers keep the server's message and add where the CLI takes the
    credential it names: --api-key / $LORAPLANE_API_KEY, or --admin-token / $LORAPLANE_ADMIN_TOKEN."""
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("LORAPLANE_API_KEY", raising=False)
    method = "/loraplane.v1.ControlPlane"
    no_key = _cli("adapters", "list", "--addr", plane.grpc_addr)
    assert no_key == {
        "exit": 1,
        "error": {
            "code": "UNAUTHENTICATED",
            "message": f"{method}/ListAdapters needs the API key ('authorization: Bearer <key>') "
            f"('authorization' metadata); {API_KEY_HINT}",
        },
    }
    wrong = _cli("adapters", "list", "--addr", plane.grpc_addr, "--api-key", "wrong")
    assert wrong["error"]["message"] == (
        f"{method}/ListAdapters: API key ('authorization: Bearer <key>') rejected; {API_KEY_HINT}"
    )
    admin = _cli("default", "set", "--clear", "--addr", plane.grpc_addr, "--api-key", API_KEY)
    assert (admin["exit"], admin["error"]["code"]) == (1, "UNAUTHENTICATED")
    assert admin["error"]["message"] == (
        f"{method}/SetDefaultAdapters: admin token ('authorization: Bearer <token>') rejected; {ADMIN_HINT}"
    )


def test_cli_pointed_at_an_http_port_says_so(plane: Plane, monkeypatch) -> None:
    """The HTTP front and the metrics port answer HTTP/1.x: the CLI (exit 3) and the Python
    client say the address is not the gRPC one and name --addr, not "connection failed"."""
    from clients.async_client import AsyncLoraplaneClient
    from clients.channel import HTTP_NOT_GRPC
    from clients.errors import ServerUnreachable

    monkeypatch.setenv("LORAPLANE_API_KEY", API_KEY)
    for url in (plane.http, plane.metrics):
        addr = url.removeprefix("http://").removesuffix("/metrics")
        out = _cli("adapters", "list", "--addr", addr)
        assert out == {
            "exit": 3,
            "error": {"code": "UNAVAILABLE", "message": f"cannot reach loraplane server at {addr}: {HTTP_NOT_GRPC}"},
        }
        with pytest.raises(ServerUnreachable) as err, LoraplaneClient(addr, connect_timeout=10) as lp:
            lp.list_adapters()
        assert err.value.reason == HTTP_NOT_GRPC

        async def list_async(addr: str = addr) -> None:
            async with AsyncLoraplaneClient(addr, connect_timeout=10) as alp:
                await alp.list_adapters()

        with pytest.raises(ServerUnreachable) as err:
            asyncio.run(list_async())
        assert err.value.reason == HTTP_NOT_GRPC
    assert "--addr" in HTTP_NOT_GRPC and "--http-addr" in HTTP_NOT_GRPC
    assert _cli("adapters", "list", "--addr", plane.grpc_addr) == {"exit": 0, "adapters": []}


@pytest.mark.slow  # needs node and the npm packages, as tests/integration/test_node_client.py
def test_node_client_pointed_at_an_http_port_says_so(plane: Plane) -> None:
    """The Node client says what the Python client says of an HTTP/1.x address (exit 3)."""
    from clients.channel import HTTP_NOT_GRPC

    node_dir = ROOT / "clients" / "node"
    if shutil.which("node") is None or not (node_dir / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("node and `npm install --prefix clients/node` are needed (scripts/install.sh --with-node)")
    addr = plane.http.removeprefix("http://")
    cmd = ["node", str(node_dir / "generate.js"), "--addr", addr, "--prompt", "hi", "--api-key", API_KEY]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    message = f"cannot reach loraplane server at {addr}: {HTTP_NOT_GRPC}"
    assert json.loads(r.stdout) == {"error": {"code": "UNAVAILABLE", "message": message}}
