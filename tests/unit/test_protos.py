"""The gRPC contract in ``protos/`` is usable from other languages and lint-clean.

- ``buf lint`` (buf's STANDARD rules, ``buf.yaml``) when ``buf`` is installed; whether it is or
  not, the same rules are checked here on the descriptors ``protoc`` (grpcio-tools) builds,
  with exactly the exceptions ``buf.yaml`` declares (each commented there);
- every file carries the same ``go_package``, ``java_package``, ``java_multiple_files`` and
  ``csharp_namespace`` (no ``ControlPlaneOuterClass`` in Java, Go code generation works);
- ``buf format`` leaves the files as they are (when ``buf`` is installed);
- the public ``ControlPlane`` service has no worker RPCs; ``WorkerMembership`` has them, and
  ``control_plane.proto`` defines no message its service does not use (the worker-only ones
  live in ``membership.proto``);
- the adapter id fields of answers are proto3 ``optional`` (explicit presence: id 0 shows in
  JSON printers) with their field numbers and types unchanged;
- the ``.proto`` files are package data (``loraplane/v1/*.proto``: they ship in the wheel, at
  the import paths they use) and match ``protos/`` byte for byte.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
FILES = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
EXCEPTED = {"SERVICE_SUFFIX", "RPC_REQUEST_STANDARD_NAME", "RPC_RESPONSE_STANDARD_NAME", "RPC_REQUEST_RESPONSE_UNIQUE"}
"""The rules buf.yaml excepts: each would rename a service or a message on the wire."""

PASCAL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
LOWER_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
UPPER_SNAKE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
FILE_OPTIONS = {
    "go_package": "github.com/loraplane/loraplane/gen/go/loraplane/v1;loraplanev1",
    "java_package": "ai.loraplane.v1",
    "java_multiple_files": True,
    "csharp_namespace": "Loraplane.V1",
}


@pytest.fixture(scope="module")
def descriptors(tmp_path_factory) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path_factory.mktemp("protos") / "set.pb"
    args = ["protoc", f"-I{PROTOS}", f"--descriptor_set_out={out}", "--include_source_info", *FILES]
    assert protoc.main(args) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_buf_yaml_uses_standard_with_only_wire_breaking_exceptions() -> None:
    config = yaml.safe_load((ROOT / "buf.yaml").read_text())
    assert config["version"] == "v2"
    assert config["modules"] == [{"path": "protos"}]
    assert config["lint"]["use"] == ["STANDARD"]
    assert set(config["lint"]["except"]) == EXCEPTED
    assert "ignore" not in config["lint"] and "ignore_only" not in config["lint"]
    text = (ROOT / "buf.yaml").read_text()
    for rule in EXCEPTED:  # each exception comes with the comment saying why
        before = text[: text.index(f"- {rule}")].rstrip().splitlines()
        assert any(line.strip().startswith("#") for line in before[-6:]), rule


BUF_MISSING = "buf is not installed (npm install -g @bufbuild/buf)"


def test_buf_lint() -> None:
    buf = shutil.which("buf")
    if buf is None:
        pytest.skip(f"{BUF_MISSING}; the rules are checked by the tests below")
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_format_leaves_the_protos_unchanged() -> None:
    """``buf format -d`` prints nothing and exits 0: the files are as buf's formatter writes them
    (``buf format -w protos`` fixes them; then ``scripts/gen_protos.py`` copies them)."""
    buf = shutil.which("buf")
    if buf is None:
        pytest.skip(f"{BUF_MISSING}: the format check needs it")
    result = subprocess.run(
        [buf, "format", "-d", "--exit-code", "protos"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def _messages(fd):
    def walk(messages, prefix):
        for m in messages:
            yield prefix + m.name, m
            yield from walk(m.nested_type, prefix + m.name + ".")

    yield from walk(fd.message_type, "")


def _enums(fd):
    yield from fd.enum_type
    for _, m in _messages(fd):
        yield from m.enum_type


def test_standard_rules_hold(descriptors) -> None:
    """buf STANDARD's rules (https://buf.build/docs/lint/rules/), less `EXCEPTED`."""
    problems: list[str] = []
    packages = {fd.package for fd in descriptors.file}
    for fd in descriptors.file:
        where = fd.name
        directory = where.rsplit("/", 1)[0]
        if fd.syntax not in ("proto3", "editions"):
            problems.append(f"{where}: SYNTAX_SPECIFIED")
        if not fd.package:
            problems.append(f"{where}: PACKAGE_DEFINED")
        if directory != fd.package.replace(".", "/"):
            problems.append(f"{where}: PACKAGE_DIRECTORY_MATCH ({fd.package})")
        if not re.search(r"\.v\d+((alpha|beta)\d*)?$", fd.package):
            problems.append(f"{where}: PACKAGE_VERSION_SUFFIX")
        if not all(LOWER_SNAKE.match(part) for part in fd.package.split(".")):
            problems.append(f"{where}: PACKAGE_LOWER_SNAKE_CASE")
        if not LOWER_SNAKE.match(where.rsplit("/", 1)[1].removesuffix(".proto")):
            problems.append(f"{where}: FILE_LOWER_SNAKE_CASE")
        if fd.public_dependency or fd.weak_dependency:
            problems.append(f"{where}: IMPORT_NO_PUBLIC / IMPORT_NO_WEAK")
        used = {t.lstrip(".") for _, m in _messages(fd) for f in m.field if f.type_name for t in [f.type_name]} | {
            t.lstrip(".") for s in fd.service for r in s.method for t in (r.input_type, r.output_type)
        }
        by_file = {d.name: d for d in descriptors.file}
        for dep in fd.dependency:
            defined = {f"{by_file[dep].package}.{name}" for name, _ in _messages(by_file[dep])}
            if not used & defined:
                problems.append(f"{where}: IMPORT_USED ({dep})")
        for name, m in _messages(fd):
            if not PASCAL.match(m.name):
                problems.append(f"{where}: MESSAGE_PASCAL_CASE {name}")
            for f in m.field:
                if not LOWER_SNAKE.match(f.name):
                    problems.append(f"{where}: FIELD_LOWER_SNAKE_CASE {name}.{f.name}")
                if f.label == descriptor_pb2.FieldDescriptorProto.LABEL_REQUIRED:
                    problems.append(f"{where}: FIELD_NOT_REQUIRED {name}.{f.name}")
            for o in m.oneof_decl:
                if not LOWER_SNAKE.match(o.name.lstrip("_")):
                    problems.append(f"{where}: ONEOF_LOWER_SNAKE_CASE {name}.{o.name}")
        for e in _enums(fd):
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", e.name).upper() + "_"
            if not PASCAL.match(e.name):
                problems.append(f"{where}: ENUM_PASCAL_CASE {e.name}")
            if e.value[0].number != 0:
                problems.append(f"{where}: ENUM_FIRST_VALUE_ZERO {e.name}")
            if not e.value[0].name.endswith("_UNSPECIFIED"):
                problems.append(f"{where}: ENUM_ZERO_VALUE_SUFFIX {e.name}")
            for v in e.value:
                if not UPPER_SNAKE.match(v.name) or not v.name.startswith(prefix):
                    problems.append(f"{where}: ENUM_VALUE_UPPER_SNAKE_CASE / ENUM_VALUE_PREFIX {v.name}")
        for s in fd.service:
            if not PASCAL.match(s.name):
                problems.append(f"{where}: SERVICE_PASCAL_CASE {s.name}")
            for r in s.method:
                if not PASCAL.match(r.name):
                    problems.append(f"{where}: RPC_PASCAL_CASE {s.name}.{r.name}")
    assert len(packages) == 1, f"DIRECTORY_SAME_PACKAGE / PACKAGE_SAME_*: {packages}"
    assert problems == []


def test_every_file_has_the_same_language_options(descriptors) -> None:
    """PACKAGE_SAME_GO_PACKAGE / _JAVA_PACKAGE / _JAVA_MULTIPLE_FILES / _CSHARP_NAMESPACE, and
    what other languages need: Java classes per message (no ``ControlPlaneOuterClass``)."""
    outer = set()
    for fd in descriptors.file:
        got = {name: getattr(fd.options, name) for name in FILE_OPTIONS}
        assert got == FILE_OPTIONS, fd.name
        assert fd.options.java_outer_classname.endswith("Proto"), fd.name
        outer.add(fd.options.java_outer_classname)
    assert len(outer) == len(descriptors.file)
    symbols = {m.name for fd in descriptors.file for m in fd.message_type} | {
        s.name + suffix for fd in descriptors.file for s in fd.service for suffix in ("", "Grpc")
    }
    assert not outer & symbols  # an outer class named like a message would not compile


def test_worker_rpcs_are_in_their_own_service(descriptors) -> None:
    services = {
        f"{fd.package}.{s.name}": (fd.name, [m.name for m in s.method]) for fd in descriptors.file for s in fd.service
    }
    assert services["loraplane.v1.WorkerMembership"] == (
        "loraplane/v1/membership.proto",
        ["RegisterWorker", "Heartbeat", "FetchAdapter"],
    )
    control_plane_file, public = services["loraplane.v1.ControlPlane"]
    assert control_plane_file == "loraplane/v1/control_plane.proto"
    assert not {"RegisterWorker", "Heartbeat", "FetchAdapter"} & set(public)
    assert "Generate" in public and "ListAdapters" in public


def _used_messages(descriptors, service: str) -> set[str]:
    """Full names of the messages ``service``'s RPCs take or return, and every message their
    fields reach."""
    by_name = {f"{fd.package}.{name}": m for fd in descriptors.file for name, m in _messages(fd)}
    [svc] = [s for fd in descriptors.file for s in fd.service if f"{fd.package}.{s.name}" == service]
    todo = [t.lstrip(".") for r in svc.method for t in (r.input_type, r.output_type)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        todo += [f.type_name.lstrip(".") for f in by_name[name].field if f.type_name]
    return seen


def test_control_plane_proto_defines_only_what_its_service_uses(descriptors) -> None:
    """Worker-only messages (heartbeats, holdings, adapter fetches) live with the service that
    uses them, ``membership.proto``; ``WorkerPaging``, in both, in ``common.proto``."""
    by_file = {fd.name: fd for fd in descriptors.file}
    defined = {f"loraplane.v1.{name}" for name, _ in _messages(by_file["loraplane/v1/control_plane.proto"])}
    assert defined - _used_messages(descriptors, "loraplane.v1.ControlPlane") == set()
    membership = {name for name, _ in _messages(by_file["loraplane/v1/membership.proto"])}
    assert membership == {
        "WorkerHello",
        "WorkerHoldings",
        "HeldAdapter",
        "AdapterPagingCount",
        "FetchAdapterRequest",
        "WorkerAck",
    }
    assert by_file["loraplane/v1/membership.proto"].dependency == ["loraplane/v1/common.proto"]
    assert "WorkerPaging" in {name for name, _ in _messages(by_file["loraplane/v1/common.proto"])}


ANSWER_IDS = {
    ("AdapterInfo", "id"),
    ("AdapterScale", "id"),
    ("AdapterResidency", "id"),
    ("HeldAdapter", "id"),
    ("AdapterPagingCount", "adapter_id"),
}
"""The adapter id fields of answers and reports: ``optional`` so that id 0 is printed."""


def test_answer_ids_have_explicit_presence_on_the_same_wire(descriptors) -> None:
    """Each is ``optional uint32`` field 1 (the number and type it always had: the wire is
    unchanged) in a synthetic oneof (explicit presence)."""
    fields = {(name, f.name): (m, f) for fd in descriptors.file for name, m in _messages(fd) for f in m.field}
    for key in ANSWER_IDS:
        message, field = fields[key]
        assert (field.number, field.type, field.proto3_optional) == (1, field.TYPE_UINT32, True), key
        assert message.oneof_decl[field.oneof_index].name == f"_{field.name}", key


def test_adapter_id_0_shows_in_json() -> None:
    """``MessageToJson`` (as grpcurl / buf curl / protojson) prints adapter 0's id once set,
    and a parsed copy keeps it: the answers servers build set it (``id=0`` is present)."""
    from google.protobuf import json_format

    from loraplane.v1 import common_pb2, membership_pb2

    amap = common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=0, scale=1.0)])
    assert json_format.MessageToDict(amap) == {"entries": [{"id": 0, "scale": 1.0}]}
    again = common_pb2.AdapterMap.FromString(amap.SerializeToString())
    assert again.entries[0].HasField("id")
    info = common_pb2.AdapterInfo(id=0, name="shout")
    assert json_format.MessageToDict(info) == {"id": 0, "name": "shout"}
    hello = membership_pb2.WorkerHello(
        holdings=membership_pb2.WorkerHoldings(adapters=[membership_pb2.HeldAdapter(id=0, sha256="ab")]),
        adapter_paging=[membership_pb2.AdapterPagingCount(adapter_id=0, page_ins=2)],
    )
    assert json_format.MessageToDict(hello, preserving_proto_field_name=True) == {
        "holdings": {"adapters": [{"id": 0, "sha256": "ab"}]},
        "adapter_paging": [{"adapter_id": 0, "page_ins": "2"}],
    }
    # a name entry carries no id (the Python client sends one or the other)
    from clients.wire import adapter_map

    assert json_format.MessageToDict(adapter_map({"sea": 0.5, 0: 1.0})) == {
        "entries": [{"id": 0, "scale": 1.0}, {"name": "sea", "scale": 0.5}]
    }


def test_the_protos_ship_as_package_data() -> None:
    """``loraplane/v1/*.proto`` (package data, in the wheel) is exactly ``protos/``, so
    ``protoc -I <site-packages>`` resolves every import of an installed copy."""
    shipped = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "loraplane" / "v1").glob("*.proto"))
    assert shipped == FILES
    for name in FILES:
        assert (ROOT / name).read_bytes() == (PROTOS / name).read_bytes(), name
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.proto" in pyproject["tool"]["setuptools"]["package-data"]["loraplane.v1"]
