"""Clients in other languages: reflection v1 and v1alpha, Go and Java code from the shipped protos.

- A real control plane (``start_control_plane``: this process, real sockets) answers server
  reflection over ``grpc.reflection.v1`` (what grpcurl, Postman, grpcui ask first) and
  ``v1alpha``, listing ``loraplane.v1.ControlPlane`` and ``loraplane.v1.WorkerMembership``;
  the worker RPCs answer only under ``WorkerMembership`` (the old ControlPlane paths are
  UNIMPLEMENTED).
- ``buf curl`` (when buf is installed; the schema from reflection) prints adapter 0's id.
- Slow tier: Go and Java code is generated from the ``.proto`` files the wheel ships
  (``loraplane/v1/*.proto``) with the Debian toolchains (``protoc``, ``protoc-gen-go``,
  ``protoc-gen-go-grpc``, ``grpc_java_plugin``), a minimal client is compiled in each
  (``GO111MODULE=off`` against ``/usr/share/gocode``; ``javac`` against ``/usr/share/java``),
  and the Go client is run against the control plane: its ``protojson`` prints adapter 0's
  id (``optional``: explicit presence), the Java code has ``hasId()``. ``scripts/test.sh`` installs the tools
  when it runs as root; otherwise the tests skip naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from loraplane.third_party import reflection_v1_pb2 as v1_pb2
from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import membership_pb2
from tests.helpers.control_plane import upload

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "loraplane" / "v1").glob("*.proto"))
EXPECTED_SERVICES = {
    "loraplane.v1.ControlPlane",
    "loraplane.v1.WorkerMembership",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}
DEBIAN_PACKAGES = (
    "protobuf-compiler golang-go golang-google-grpc-dev golang-google-protobuf-dev "
    "golang-github-golang-protobuf-1-5-dev protoc-gen-go protoc-gen-go-grpc libgrpc-java libprotobuf-java "
    "protobuf-compiler-grpc-java-plugin default-jdk-headless"
)
"""What scripts/test.sh installs (as root) for the Go and Java tests (golang-github-golang-protobuf
1.5, not 1.3: grpc-go's codec must understand the APIv2 messages protoc-gen-go writes)."""
JAVA_JARS = ("protobuf", "grpc-api", "grpc-stub", "grpc-protobuf", "grpc-protobuf-lite", "grpc-context", "guava")
JAVA_ANNOTATIONS = "geronimo-annotation-1.3-spec"  # javax.annotation.Generated (grpc-java's stubs)


@pytest.fixture(scope="module")
def cp(tmp_path_factory, base_model_path: Path):
    """One real control plane for the module (worker secret set, no worker)."""
    from control_plane.server import ControlPlaneConfig
    from tests.helpers.control_plane import ControlPlane
    from tests.helpers.live_servers import WORKER_SECRET

    data = tmp_path_factory.mktemp("proto-clients") / "data"
    server = ControlPlane(
        ControlPlaneConfig(
            addr="127.0.0.1:0", data_dir=str(data), model_path=str(base_model_path), worker_secret=WORKER_SECRET
        )
    )
    yield server
    server.stop()


def _reflect(addr: str, pb2, service: str, **request) -> list:
    """Send one ServerReflectionRequest over the raw ``service`` path; the responses."""
    with grpc.insecure_channel(addr) as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=pb2.ServerReflectionResponse.FromString,
        )
        return list(call(iter([pb2.ServerReflectionRequest(**request)]), timeout=10))


@pytest.mark.parametrize(
    ("pb2", "service"),
    [(v1_pb2, "grpc.reflection.v1.ServerReflection"), (v1alpha_pb2, "grpc.reflection.v1alpha.ServerReflection")],
)
def test_reflection_lists_both_services(cp, pb2, service: str) -> None:
    [response] = _reflect(cp.addr, pb2, service, list_services="")
    assert {s.name for s in response.list_services_response.service} == EXPECTED_SERVICES


def test_reflection_v1_serves_the_membership_file(cp) -> None:
    from google.protobuf import descriptor_pb2

    [response] = _reflect(
        cp.addr, v1_pb2, "grpc.reflection.v1.ServerReflection", file_containing_symbol="loraplane.v1.WorkerMembership"
    )
    files = {
        fd.name: fd
        for fd in map(
            descriptor_pb2.FileDescriptorProto.FromString, response.file_descriptor_response.file_descriptor_proto
        )
    }
    membership = files["loraplane/v1/membership.proto"]
    assert [m.name for m in membership.service[0].method] == ["RegisterWorker", "Heartbeat", "FetchAdapter"]
    assert membership.options.go_package.endswith(";loraplanev1")
    [error] = _reflect(cp.addr, v1_pb2, "grpc.reflection.v1.ServerReflection", file_containing_symbol="no.Such")
    assert error.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_worker_rpcs_left_the_control_plane_service(cp) -> None:
    old = cp.channel.unary_unary(
        "/loraplane.v1.ControlPlane/Heartbeat",
        request_serializer=membership_pb2.WorkerHello.SerializeToString,
        response_deserializer=membership_pb2.WorkerAck.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        old(membership_pb2.WorkerHello(worker_id="w"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # the same port serves it under WorkerMembership, behind the worker secret
    with pytest.raises(grpc.RpcError) as err:
        cp.membership_stub.Heartbeat(membership_pb2.WorkerHello(worker_id="w"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "/loraplane.v1.WorkerMembership/Heartbeat needs the worker secret" in err.value.details()
    assert cp.stub.ListAdapters(pb.Empty(), timeout=5).adapters is not None


# ---- Go and Java from the shipped protos (slow tier) ---------------------------------------


def _need(*tools: str) -> None:
    """Skip (not root) or fail (root: scripts/test.sh should have installed them) when a tool is missing."""
    missing = [t for t in tools if shutil.which(t) is None and not Path(t).exists()]
    if not missing:
        return
    message = f"missing {', '.join(missing)}: apt-get install {DEBIAN_PACKAGES}"
    if os.geteuid() == 0:
        pytest.fail(message + " (scripts/test.sh installs them when it runs as root)")
    pytest.skip(message + " (needs root; scripts/test.sh does it in CI)")


def _run(args: list[str], **kw) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)
    assert result.returncode == 0, f"{' '.join(args)}\n{result.stdout}\n{result.stderr}"
    return result.stdout


GO_CLIENT = """package main

import (
	"context"
	"fmt"
	"os"
	"time"

	loraplanev1 "github.com/loraplane/loraplane/gen/go/loraplane/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, os.Args[1], grpc.WithInsecure(), grpc.WithBlock())
	if err != nil {
		fmt.Println("dial:", err)
		os.Exit(1)
	}
	defer conn.Close()
	adapters, err := loraplanev1.NewControlPlaneClient(conn).ListAdapters(ctx, &loraplanev1.Empty{})
	if err != nil {
		fmt.Println("ListAdapters:", err)
		os.Exit(1)
	}
	fmt.Printf("adapters=%d\\n", len(adapters.GetAdapters()))
	for _, a := range adapters.GetAdapters() {
		text, _ := protojson.Marshal(a)
		fmt.Printf("has_id=%t json=%s\\n", a.Id != nil, text)
	}
	_, err = loraplanev1.NewWorkerMembershipClient(conn).Heartbeat(ctx, &loraplanev1.WorkerHello{WorkerId: "go"})
	fmt.Printf("heartbeat=%s\\n", status.Code(err))
}
"""


@pytest.mark.slow
def test_go_client_builds_from_the_shipped_protos_and_talks(cp, tmp_path: Path, fixtures_dir: Path) -> None:
    _need(
        "go",
        "protoc",
        "protoc-gen-go",
        "protoc-gen-go-grpc",
        "/usr/share/gocode/src/google.golang.org/grpc",
        "/usr/share/gocode/src/google.golang.org/protobuf",
        "/usr/share/gocode/src/github.com/golang/protobuf/proto/registry.go",  # 1.5 (APIv2 shim), not 1.3
    )
    src = tmp_path / "src"
    src.mkdir()
    _run(["protoc", f"-I{ROOT}", f"--go_out={src}", f"--go-grpc_out={src}", *SHIPPED], cwd=ROOT)
    gen = src / "github.com/loraplane/loraplane/gen/go/loraplane/v1"
    assert sorted(p.name for p in gen.iterdir()) == sorted(
        f"{Path(f).stem}{suffix}.pb.go"
        for f in SHIPPED
        for suffix in ("", "_grpc")
        if suffix == "" or Path(f).stem != "common"
    )
    (src / "lpclient").mkdir()
    (src / "lpclient" / "main.go").write_text(GO_CLIENT)
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": f"{tmp_path}:/usr/share/gocode", "GOFLAGS": ""}
    _run(["go", "build", "-o", str(tmp_path / "lpclient"), "lpclient"], cwd=tmp_path, env=env)
    info = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf")  # the module's only adapter
    assert info.id == 0
    out = _run([str(tmp_path / "lpclient"), cp.addr]).splitlines()
    assert [out[0], out[-1]] == ["adapters=1", "heartbeat=Unauthenticated"] and len(out) == 3
    has_id, _, text = out[1].partition(" json=")
    # protojson prints the optional id even when 0 (it drops implicit-presence zeros)
    assert (has_id, json.loads(text)["id"], json.loads(text)["name"]) == ("has_id=true", 0, "sea")


JAVA_CLIENT = """import ai.loraplane.v1.AdapterList;
import ai.loraplane.v1.AdapterScale;
import ai.loraplane.v1.ControlPlaneGrpc;
import ai.loraplane.v1.Empty;
import ai.loraplane.v1.GenerateRequest;
import ai.loraplane.v1.WorkerHello;
import ai.loraplane.v1.WorkerMembershipGrpc;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;

public final class Client {
  public static void main(String[] args) {
    ManagedChannel channel = ManagedChannelBuilder.forTarget(args[0]).usePlaintext().build();
    AdapterList adapters = ControlPlaneGrpc.newBlockingStub(channel).listAdapters(Empty.getDefaultInstance());
    System.out.println(adapters.getAdaptersCount());
    // adapter ids are optional (explicit presence): id 0 is set, not the default
    System.out.println(AdapterScale.newBuilder().setId(0).build().hasId());
    GenerateRequest request = GenerateRequest.newBuilder().setText("hello").build();
    ControlPlaneGrpc.newBlockingStub(channel).generate(request).forEachRemaining(e -> System.out.println(e));
    WorkerMembershipGrpc.newBlockingStub(channel).heartbeat(WorkerHello.newBuilder().setWorkerId("java").build());
    channel.shutdownNow();
  }
}
"""


@pytest.mark.slow
def test_java_client_compiles_from_the_shipped_protos(tmp_path: Path) -> None:
    jars = [Path(f"/usr/share/java/{name}.jar") for name in (*JAVA_JARS, JAVA_ANNOTATIONS)]
    _need("javac", "protoc", "/usr/bin/grpc_java_plugin", *map(str, jars))
    out = tmp_path / "java"
    out.mkdir()
    _run(
        [
            "protoc",
            f"-I{ROOT}",
            f"--java_out={out}",
            f"--grpc-java_out={out}",
            "--plugin=protoc-gen-grpc-java=/usr/bin/grpc_java_plugin",
            *SHIPPED,
        ],
        cwd=ROOT,
    )
    package = out / "ai" / "loraplane" / "v1"
    names = {p.name for p in package.iterdir()}
    # java_multiple_files: one class per message, services in <Service>Grpc, no OuterClass
    assert {"AdapterInfo.java", "ControlPlaneGrpc.java", "WorkerMembershipGrpc.java", "WorkerGrpc.java"} <= names
    assert {"CommonProto.java", "ControlPlaneProto.java", "MembershipProto.java", "WorkerProto.java"} <= names
    assert not [n for n in names if "OuterClass" in n]
    (tmp_path / "Client.java").write_text(JAVA_CLIENT)
    classes = tmp_path / "classes"
    sources = [str(p) for p in package.glob("*.java")] + [str(tmp_path / "Client.java")]
    _run(["javac", "-nowarn", "-d", str(classes), "-cp", ":".join(map(str, jars)), *sources])
    assert (classes / "Client.class").is_file()
    assert (classes / "ai" / "loraplane" / "v1" / "WorkerMembershipGrpc.class").is_file()


def test_buf_curl_shows_adapter_0_by_reflection(cp, fixtures_dir: Path) -> None:
    """``buf curl`` (schema from the server's reflection, as grpcurl) prints adapter 0's id in
    ListAdapters and GetDefaultAdapters: the id is ``optional`` and the server sets it."""
    buf = shutil.which("buf")
    if buf is None:
        pytest.skip("buf is not installed (npm install -g @bufbuild/buf): the buf curl check needs it")
    info = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf")  # the module's only adapter
    assert info.id == 0

    def curl(method: str) -> dict:
        out = _run(
            [buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", "-d", "{}"]
            + [f"http://{cp.addr}/loraplane.v1.ControlPlane/{method}"]
        )
        return json.loads(out)

    assert [(a["id"], a["name"]) for a in curl("ListAdapters")["adapters"]] == [(0, "sea")]
    assert curl("GetDefaultAdapters") == {"entries": [{"id": 0}]}
