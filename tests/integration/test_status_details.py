"""Errors of any size reach the client: status details are bounded on every server.

A real control plane (``tests.helpers.live_servers.start_control_plane``: this process, real sockets)
whose adapter directory holds the base model: registering the model GGUF as an adapter builds
a 15 KB list of problems, which grpc clients used to replace with ``RESOURCE_EXHAUSTED …
metadata size exceeds soft limit``. Now the client gets INVALID_ARGUMENT with the message's
start and ``… (N more problems)``; the full text is in the log (``status_details_bounded``).
A synthetic huge message (a 20 000-character server path) through the same RPC is bounded
too, and so are the CLI's messages. The interceptor itself is checked on a bare gRPC server
for the paths no servicer takes (an interceptor's refusal, an uncaught exception,
``set_details``).
"""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest
import structlog.testing
from click.testing import CliRunner

from clients.cli.main import cli
from loraplane.interceptors import refusal
from loraplane.status_details import MAX_DETAILS_BYTES, BoundedStatusInterceptor, encoded_size
from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import control_plane_pb2_grpc
from tests.helpers.live_servers import start_control_plane

MODEL_FILE_HINT = "(this looks like a model file, not an adapter)"


@pytest.fixture(scope="module")
def model_dir_control_plane(tmp_path_factory, base_model_path: Path):
    """A control plane whose ``--adapter-dir`` is the base model's folder."""
    cp = start_control_plane(tmp_path_factory.mktemp("bounded") / "data", base_model_path.parent, base_model_path)
    yield cp
    cp.stop()


def _register_by_path(addr: str, path: str) -> grpc.RpcError:
    with grpc.insecure_channel(addr) as channel:
        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterAdapter(iter([pb.AdapterChunk(server_path=path)]), timeout=60)
    return err.value


def test_model_gguf_as_adapter_keeps_its_status_and_message(model_dir_control_plane, base_model_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        err = _register_by_path(model_dir_control_plane.addr, str(base_model_path))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details()[:300])
    details = err.details()
    lines = details.split("\n")
    assert lines[0] == f"{base_model_path}: LoRA adapter rejected (129 problems)"
    assert lines[1] == f"  - general.type: expected 'adapter', found 'model' {MODEL_FILE_HINT}"
    kept = sum(1 for line in lines if line.startswith("  - "))
    assert 0 < kept < 129
    assert lines[-1] == f"  … ({129 - kept} more problems)"
    assert encoded_size(details) <= MAX_DETAILS_BYTES
    # the whole list is in the log
    bounded = [e for e in logs if e["event"] == "status_details_bounded"]
    assert len(bounded) == 1
    assert bounded[0]["code"] == "INVALID_ARGUMENT"
    assert bounded[0]["method"] == "/loraplane.v1.ControlPlane/RegisterAdapter"
    assert bounded[0]["details"].count("\n  - ") == 129
    assert bounded[0]["details"].startswith(lines[0])


def test_a_huge_synthetic_message_is_cut_by_bytes(model_dir_control_plane, base_model_path: Path) -> None:
    path = str(base_model_path.parent / ("x" * 20_000))
    err = _register_by_path(model_dir_control_plane.addr, path)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()[:300]
    details = err.details()
    assert details.startswith(f"server path '{path[:1000]}")
    assert encoded_size(details) <= MAX_DETAILS_BYTES
    head, _, tail = details.rpartition("… (")
    assert tail.endswith(" more bytes)")
    assert int(tail.removesuffix(" more bytes)")) > 15_000


def test_the_cli_prints_the_bounded_message(model_dir_control_plane, base_model_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["adapters", "add", "--addr", model_dir_control_plane.addr, "--server-path", str(base_model_path)]
    )
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert MODEL_FILE_HINT in result.output
    assert "more problems)" in result.output
    assert "RESOURCE_EXHAUSTED" not in result.output


# ---- the interceptor on a bare server: paths that are not a servicer's abort ---------------

HUGE = "problem " * 4000  # 32 000 bytes


class _Refuse(grpc.ServerInterceptor):
    """An inner interceptor refusing with a huge message (as auth or limits refuse)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler_call_details.method.endswith("/Refused"):
            return refusal(handler, grpc.StatusCode.PERMISSION_DENIED, HUGE)
        return handler


def _raise(request, context):
    raise RuntimeError(HUGE)


def _set_details(request, context):
    context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
    context.set_details(HUGE)
    return b""


def _stream_abort(request, context):
    yield b"first"
    context.abort(grpc.StatusCode.ABORTED, "é" * 10_000)  # 3 encoded bytes per UTF-8 byte


@pytest.fixture(scope="module")
def bare_server():
    interceptors = [BoundedStatusInterceptor(), _Refuse()]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
    handlers = {
        "Refused": grpc.unary_unary_rpc_method_handler(_raise),
        "Raise": grpc.unary_unary_rpc_method_handler(_raise),
        "SetDetails": grpc.unary_unary_rpc_method_handler(_set_details),
        "StreamAbort": grpc.unary_stream_rpc_method_handler(_stream_abort),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Bounded", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(None)


@pytest.mark.parametrize(
    ("method", "code", "start"),
    [
        ("Refused", grpc.StatusCode.PERMISSION_DENIED, "problem problem"),
        ("Raise", grpc.StatusCode.UNKNOWN, "Exception calling application: problem problem"),
        ("SetDetails", grpc.StatusCode.FAILED_PRECONDITION, "problem problem"),
    ],
)
def test_every_unary_path_is_bounded(bare_server, method: str, code: grpc.StatusCode, start: str) -> None:
    call = bare_server.unary_unary(f"/test.Bounded/{method}")
    with pytest.raises(grpc.RpcError) as err:
        call(b"", timeout=10)
    assert err.value.code() == code, err.value.details()[:200]
    assert err.value.details().startswith(start)
    assert err.value.details().endswith(" more bytes)")
    assert encoded_size(err.value.details()) <= MAX_DETAILS_BYTES


def test_a_stream_abort_after_messages_is_bounded(bare_server) -> None:
    call = bare_server.unary_stream("/test.Bounded/StreamAbort")
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for m in call(b"", timeout=10):
            got.append(m)
    assert got == [b"first"]
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert err.value.details().startswith("éé")
    assert encoded_size(err.value.details()) <= MAX_DETAILS_BYTES


def test_http_error_bodies_stay_whole(start_control_plane, base_model_path: Path) -> None:
    """The HTTP front calls the registry in-process: its JSON error keeps every problem."""
    import httpx

    cp = start_control_plane(http_addr="127.0.0.1:0", adapter_dirs=(str(base_model_path.parent),))
    r = httpx.post(
        f"http://127.0.0.1:{cp.state.http_port}/v1/load_lora_adapter",
        json={"lora_name": "base-as-adapter", "lora_path": str(base_model_path)},
        timeout=60,
    )
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert MODEL_FILE_HINT in message
    assert message.count("\n  - ") == 129
    assert "more problems" not in message
