"""Control plane against a real server: registration, persistence, default set, auth, paths.

Every test runs a real gRPC server on 127.0.0.1 (port 0) over a real SQLite data dir in
``tmp_path``, validating the fixture adapters against the embedded Gemma 3 270M index.
Membership and routing live in ``test_control_plane_routing.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from control_plane.errors import InvalidArgumentError, NotFoundError
from control_plane.resolution import resolve_adapters
from control_plane.server import parse_lora_scaled
from control_plane.store import MIGRATIONS, SqliteStore
from loraplane.adapter_scales import NO_ADAPTERS
from loraplane.v1 import common_pb2
from tests.helpers.control_plane import ControlPlane, MiB, by_path, default_of, ids_of, rpc_error, upload, write_adapter


@pytest.fixture
def adapters_dir(fixtures_dir: Path) -> Path:
    return fixtures_dir / "adapters"


@pytest.fixture
def start_cp(start_control_plane, adapters_dir: Path):
    """``start_control_plane`` with the fixture adapters folder as the allowed adapter dir."""

    def start(**overrides) -> ControlPlane:
        overrides.setdefault("adapter_dirs", (str(adapters_dir),))
        return start_control_plane(**overrides)

    return start


def stored_files(cp: ControlPlane) -> list[str]:
    return sorted(p.name for p in (Path(cp.config.data_dir) / "adapters").iterdir())


# -- registration ------------------------------------------------------------------------


def test_upload_over_4mib_lists_metadata_and_keeps_file(start_cp, adapters_dir):
    cp = start_cp()
    shout = adapters_dir / "shout.gguf"
    assert shout.stat().st_size > 4 * MiB
    info = upload(cp.stub, shout)
    sha = hashlib.sha256(shout.read_bytes()).hexdigest()
    assert (info.id, info.name, info.sha256, info.arch) == (0, "shout", sha, "gemma3")
    assert info.alpha == 16.0 and list(info.ranks) == [8]
    assert "blk.0.attn_q.weight" in info.target_tensors and len(info.target_tensors) == 7 * 18
    assert info.n_nodes == 6 * 7 * 18 and info.size_bytes > 0
    assert info.default_scale == 0.0  # registered over RPC: not applied by default
    assert Path(info.path) == Path(cp.config.data_dir) / "adapters" / f"{sha}.gguf"
    assert stored_files(cp) == [f"{sha}.gguf"]
    listed = cp.stub.ListAdapters(common_pb2.Empty()).adapters
    assert [a.id for a in listed] == [0] and listed[0] == info
    assert cp.stub.GetAdapter(common_pb2.AdapterRef(id=0)) == info


def test_adapter_0_answers_show_its_id_in_json(start_cp, adapters_dir):
    """Adapter ids start at 0, protobuf's default: every answer that names adapter 0 sets its
    id (``optional``, explicit presence), so JSON printers show ``"id": 0`` after the wire."""
    cp = start_cp()
    info = by_path(cp.stub, adapters_dir / "sea.gguf")
    assert info.id == 0 and info.HasField("id")
    as_json = json.loads(json_format.MessageToJson(info))
    assert (as_json["id"], as_json["name"]) == (0, "sea")
    assert json_format.MessageToDict(cp.stub.ListAdapters(common_pb2.Empty()))["adapters"][0]["id"] == 0
    assert json_format.MessageToDict(cp.stub.GetAdapter(common_pb2.AdapterRef(name="sea")))["id"] == 0
    entries = [common_pb2.AdapterScale(name="sea", scale=0.5)]
    answer = cp.stub.SetDefaultAdapters(common_pb2.AdapterMap(entries=entries))
    assert json_format.MessageToDict(answer) == {"entries": [{"id": 0, "scale": 0.5}]}
    default = cp.stub.GetDefaultAdapters(common_pb2.Empty())
    assert json_format.MessageToDict(default) == {"entries": [{"id": 0, "scale": 0.5}]}


def test_server_path_alora_shows_invocation_text(start_cp, adapters_dir):
    cp = start_cp()
    info = by_path(cp.stub, adapters_dir / "critic_alora.gguf")
    assert info.name == "critic_alora"
    assert list(info.alora_invocation_tokens) == [105, 1179, 725, 107]
    assert info.alora_invocation_text == "<start_of_turn>shout\n"
    assert info.path == str((adapters_dir / "critic_alora.gguf").resolve())
    assert stored_files(cp) == []  # server paths are not copied


def test_name_override_and_duplicate_content_returns_same_id(start_cp, adapters_dir):
    cp = start_cp()
    first = upload(cp.stub, adapters_dir / "sea.gguf", name="waves")
    assert (first.id, first.name) == (0, "waves")
    again = by_path(cp.stub, adapters_dir / "sea.gguf")
    assert again.id == 0 and again.sha256 == first.sha256
    assert upload(cp.stub, adapters_dir / "sea.gguf").id == 0
    assert ids_of(cp.stub) == [0]


def test_bad_adapter_is_refused_and_leaves_nothing(start_cp, tmp_path):
    cp = start_cp()
    bad = write_adapter(tmp_path / "bad.gguf", general_type="model")
    err = rpc_error(upload, cp.stub, bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "general.type" in err.details() and "'model'" in err.details()
    assert "uploaded adapter" in err.details()  # not our temporary file name
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    err = rpc_error(upload, cp.stub, junk)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "GGUF" in err.details()
    assert ids_of(cp.stub) == [] and stored_files(cp) == []
    # A bad server-side file is refused the same way, naming its path.
    bad_dir = tmp_path / "mine"
    bad_dir.mkdir()
    bad2 = write_adapter(bad_dir / "bad2.gguf", general_type="model")
    cp2 = start_cp(data_dir=str(tmp_path / "data2"), adapter_dirs=(str(bad_dir),))
    err = rpc_error(by_path, cp2.stub, bad2)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and str(bad2) in err.details()
    assert ids_of(cp2.stub) == []


def test_empty_stream_and_path_plus_data_are_invalid(start_cp, adapters_dir):
    cp = start_cp()
    err = rpc_error(cp.stub.RegisterAdapter, iter([]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    mixed = iter([common_pb2.AdapterChunk(server_path=str(adapters_dir / "sea.gguf"), data=b"x")])
    err = rpc_error(cp.stub.RegisterAdapter, mixed)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "server_path" in err.details()


def test_upload_over_limit_is_resource_exhausted(start_cp, adapters_dir):
    cp = start_cp(max_upload_bytes=2 * MiB)
    err = rpc_error(upload, cp.stub, adapters_dir / "shout.gguf")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(2 * MiB) in err.details()
    assert ids_of(cp.stub) == [] and stored_files(cp) == []
    assert upload(cp.stub, adapters_dir / "sea.gguf").id == 0  # 1.2 MB fits


# -- server paths --------------------------------------------------------------------------


def test_server_paths_must_stay_inside_adapter_dirs(start_cp, tmp_path, adapters_dir):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "escape.gguf").symlink_to(adapters_dir / "sea.gguf")  # a link pointing outside
    outside = write_adapter(tmp_path / "outside.gguf")
    cp = start_cp(adapter_dirs=(str(mine),))
    for path in (outside, mine / "escape.gguf", mine / ".." / "outside.gguf"):
        err = rpc_error(by_path, cp.stub, path)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, path
        assert str(path) in err.details()
    err = rpc_error(by_path, cp.stub, "relative/sea.gguf")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(by_path, cp.stub, mine / "missing.gguf")
    assert err.code() == grpc.StatusCode.NOT_FOUND and "missing.gguf" in err.details()
    inside = write_adapter(mine / "ok.gguf")
    assert by_path(cp.stub, inside).id == 0
    assert ids_of(cp.stub) == [0]


def test_no_adapter_dirs_refuses_every_server_path(start_cp, adapters_dir):
    cp = start_cp(adapter_dirs=())
    err = rpc_error(by_path, cp.stub, adapters_dir / "sea.gguf")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--adapter-dir" in err.details()


# -- ids, removal, restart -------------------------------------------------------------------


def test_removed_ids_are_never_reused_even_after_restart(start_cp, adapters_dir, tmp_path):
    cp = start_cp()
    for name in ("shout", "sea", "critic_alora"):
        upload(cp.stub, adapters_dir / f"{name}.gguf")
    sea_file = Path(cp.stub.GetAdapter(common_pb2.AdapterRef(id=1)).path)
    cp.stub.UnregisterAdapter(common_pb2.AdapterRef(id=1))
    assert not sea_file.exists()  # the uploaded copy goes with the registration
    assert upload(cp.stub, adapters_dir / "shout_rs.gguf").id == 3
    assert upload(cp.stub, adapters_dir / "sea.gguf").id == 4  # same content, new id
    cp.stop()
    cp = start_cp()
    assert ids_of(cp.stub) == [0, 2, 3, 4]
    assert by_path(cp.stub, adapters_dir / "shout_embd.gguf").id == 5


def test_unregister_unknown_id_lists_registered(start_cp, adapters_dir):
    cp = start_cp()
    upload(cp.stub, adapters_dir / "sea.gguf")
    for call in (
        lambda: cp.stub.UnregisterAdapter(common_pb2.AdapterRef(id=7)),
        lambda: cp.stub.GetAdapter(common_pb2.AdapterRef(id=7)),
    ):
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert "7" in err.details() and "[0]" in err.details()


def test_registrations_ids_and_default_set_survive_restart(start_cp, adapters_dir):
    cp = start_cp()
    for name in ("shout", "sea", "critic_alora"):
        upload(cp.stub, adapters_dir / f"{name}.gguf")
    cp.stub.SetDefaultAdapters(
        common_pb2.AdapterMap(
            entries=[common_pb2.AdapterScale(id=0, scale=0.5), common_pb2.AdapterScale(id=2, scale=1.0)]
        )
    )
    before = list(cp.stub.ListAdapters(common_pb2.Empty()).adapters)
    cp.stop()
    cp = start_cp()
    after = list(cp.stub.ListAdapters(common_pb2.Empty()).adapters)
    assert after == before
    assert default_of(cp.stub) == [(0, 0.5), (1, 0.0), (2, 1.0)]
    assert after[2].alora_invocation_text == "<start_of_turn>shout\n"


# -- start-up flags and the default set -------------------------------------------------------


def test_startup_flags_register_in_order_with_stable_ids(start_cp, adapters_dir):
    flags = dict(
        lora=(str(adapters_dir / "shout.gguf"), str(adapters_dir / "sea.gguf")),
        lora_scaled=(parse_lora_scaled(f"{adapters_dir / 'critic_alora.gguf'}:0.5"),),
    )
    cp = start_cp(**flags)
    assert ids_of(cp.stub) == [0, 1, 2]
    assert [a.name for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters] == ["shout", "sea", "critic_alora"]
    assert default_of(cp.stub) == [(0, 1.0), (1, 1.0), (2, 0.5)]
    assert cp.stub.GetAdapter(common_pb2.AdapterRef(id=2)).default_scale == 0.5
    cp.stop()
    cp = start_cp(**flags)
    assert ids_of(cp.stub) == [0, 1, 2]
    assert default_of(cp.stub) == [(0, 1.0), (1, 1.0), (2, 0.5)]


def test_lora_init_without_apply_reports_scale_zero(start_cp, adapters_dir):
    cp = start_cp(lora=(str(adapters_dir / "shout.gguf"), str(adapters_dir / "sea.gguf")), lora_init_without_apply=True)
    assert default_of(cp.stub) == [(0, 0.0), (1, 0.0)]
    assert [a.default_scale for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters] == [0.0, 0.0]


def test_bad_startup_adapter_refuses_to_start(start_cp, tmp_path):
    bad = write_adapter(tmp_path / "bad.gguf", general_type="model")
    with pytest.raises(InvalidArgumentError, match="general.type"):
        start_cp(lora=(str(bad),))


def test_set_default_set_rules_and_unregister_drops_entry(start_cp, adapters_dir):
    cp = start_cp(lora=(str(adapters_dir / "shout.gguf"),))
    upload(cp.stub, adapters_dir / "sea.gguf")
    out = cp.stub.SetDefaultAdapters(common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=1, scale=0.25)]))
    assert [(e.id, e.scale) for e in out.entries] == [(0, 0.0), (1, 0.25)]  # unnamed → 0
    for entries, code in (
        ([common_pb2.AdapterScale(id=9, scale=1)], grpc.StatusCode.NOT_FOUND),
        ([common_pb2.AdapterScale(id=0, scale=-1)], grpc.StatusCode.INVALID_ARGUMENT),
        ([common_pb2.AdapterScale(id=0, scale=math.nan)], grpc.StatusCode.INVALID_ARGUMENT),
        ([common_pb2.AdapterScale(id=0, scale=1)] * 2, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        err = rpc_error(cp.stub.SetDefaultAdapters, common_pb2.AdapterMap(entries=entries))
        assert err.code() == code and "adapter" in err.details()
    assert default_of(cp.stub) == [(0, 0.0), (1, 0.25)]  # refused changes changed nothing
    cp.stub.UnregisterAdapter(common_pb2.AdapterRef(id=1))
    assert default_of(cp.stub) == [(0, 0.0)]


# -- auth ------------------------------------------------------------------------------------


@pytest.mark.parametrize("via_env", [False, True])
def test_admin_rpcs_need_the_bearer_token(start_cp, adapters_dir, monkeypatch, via_env):
    if via_env:
        monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "s3cret")
        cp = start_cp()
    else:
        monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
        cp = start_cp(admin_token="s3cret")
    sea = adapters_dir / "sea.gguf"
    admin_calls = [
        lambda md: upload(cp.stub, sea, metadata=md),
        lambda md: by_path(cp.stub, sea, metadata=md),
        lambda md: cp.stub.UnregisterAdapter(common_pb2.AdapterRef(id=0), metadata=md),
        lambda md: cp.stub.SetDefaultAdapters(common_pb2.AdapterMap(), metadata=md),
    ]
    for call in admin_calls:
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
            err = rpc_error(call, md)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, md
    ok = [("authorization", "Bearer s3cret")]
    assert upload(cp.stub, sea, metadata=ok).id == 0
    assert (
        cp.stub.SetDefaultAdapters(common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=0, scale=1)]), metadata=ok)
        .entries[0]
        .scale
        == 1.0
    )
    # Reads stay open.
    assert ids_of(cp.stub) == [0] and default_of(cp.stub) == [(0, 1.0)]
    assert cp.stub.GetAdapter(common_pb2.AdapterRef(id=0)).name == "sea"
    cp.stub.ListWorkers(common_pb2.Empty())
    cp.stub.UnregisterAdapter(common_pb2.AdapterRef(id=0), metadata=ok)
    assert ids_of(cp.stub) == []


def test_no_token_configured_leaves_admin_open(start_cp, adapters_dir, monkeypatch):
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    cp = start_cp()
    assert upload(cp.stub, adapters_dir / "sea.gguf").id == 0


# -- health and reflection ---------------------------------------------------------------------


def test_health_serving_and_reflection_lists_services(start_cp):
    cp = start_cp()
    health = health_pb2_grpc.HealthStub(cp.channel)
    for service in ("", "loraplane.v1.ControlPlane", "loraplane.v1.WorkerMembership"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(cp.channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"loraplane.v1.ControlPlane", "grpc.health.v1.Health"} <= names
    assert "loraplane.v1.Worker" not in names  # the control plane does not serve it


# -- store and resolution (units) ----------------------------------------------------------------


def test_store_ids_start_at_zero_and_schema_is_versioned(tmp_path):
    # Both databases: tests/integration/test_store.py. This one pins the SQLite file layout.
    store = SqliteStore(tmp_path / "db.sqlite3")
    assert store.schema_version == len(MIGRATIONS)
    content = tmp_path / "a.gguf"
    content.write_bytes(b"a")
    a, created = store.insert(sha256="a" * 64, name="a", metadata={}, content=content, source=None)
    assert (a.id, created, a.path) == (0, True, str(tmp_path / "adapters" / f"{'a' * 64}.gguf"))
    assert not content.exists()  # the upload's temporary file was moved into place
    store.close()


def test_resolution_rules():
    default = [(0, 1.0), (1, 0.0), (2, 0.5)]
    assert resolve_adapters(None, default).entries == ((0, 1.0), (2, 0.5))  # None → default, zeros dropped
    assert resolve_adapters({}, default) == NO_ADAPTERS  # empty map → exactly nothing
    assert resolve_adapters({1: 2.0, 0: 0.0}, default).entries == ((1, 2.0),)  # exactly the map
    assert resolve_adapters(None, []) == NO_ADAPTERS
    with pytest.raises(NotFoundError, match=r"\[5\].*registered ids: \[0, 1, 2\]"):
        resolve_adapters({5: 1.0}, default)
    with pytest.raises(NotFoundError, match=r"\[5\]"):
        resolve_adapters({5: 0.0}, default)  # unknown even at scale 0
    for bad, text in (
        (-0.5, "adapter 0: scale -0.5 is negative (0 detaches an adapter)"),
        (-1e30, "adapter 0: scale -1e+30 is negative (0 detaches an adapter)"),
        (math.inf, "adapter 0: scale inf is not a finite number"),
        (-math.inf, "adapter 0: scale -inf is not a finite number"),
        (math.nan, "adapter 0: scale nan is not a finite number"),
        (10000.5, "adapter 0: scale 10000.5 is above the limit of 10000"),
    ):
        with pytest.raises(InvalidArgumentError) as err:
            resolve_adapters({0: bad}, default)
        assert str(err.value) == text
    assert resolve_adapters({2: 0.5, 0: 1.0}, default) == resolve_adapters(None, default)  # a set is its own key


def test_parse_lora_scaled():
    assert parse_lora_scaled("/a/b:c.gguf:0.5") == ("/a/b:c.gguf", 0.5)
    for bad in ("/a.gguf", "/a.gguf:x", ":1"):
        with pytest.raises(ValueError):
            parse_lora_scaled(bad)


def test_data_dir_layout(start_cp, adapters_dir):
    cp = start_cp()
    upload(cp.stub, adapters_dir / "sea.gguf")
    data = Path(cp.config.data_dir)
    assert (data / "loraplane.sqlite3").is_file()
    assert not [p for p in os.listdir(data / "adapters") if p.endswith(".part")]
