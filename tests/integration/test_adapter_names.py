"""Adapter names and aliases through a real control plane (gRPC and HTTP on real sockets, a real
SQLite data dir; no worker: nothing here generates): the one resolver every API shares
(`control_plane.resolution.find_adapter`), the all-digit rule, ambiguous names, and vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` lifecycle (already loaded → 400, known
content under a new name → an alias, unloading drops the name unloaded). Serving an alias
through the ``openai`` client and the CLI by name are in ``test_http_api.py`` (they need a
worker)."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
import structlog

from loraplane.v1 import common_pb2, control_plane_pb2
from tests.helpers.control_plane import ControlPlane, rpc_error, upload, write_adapter

BASE = "base-model"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def cp(tmp_path_factory, base_model_path: Path):
    from control_plane.server import ControlPlaneConfig

    root = tmp_path_factory.mktemp("adapter-names")
    (root / "ad").mkdir()
    server = ControlPlane(
        ControlPlaneConfig(
            addr="127.0.0.1:0",
            data_dir=str(root / "data"),
            model_path=str(base_model_path),
            http_addr="127.0.0.1:0",
            served_model_name=BASE,
            adapter_dirs=(str(root / "ad"),),
        )
    )
    server.tmp = root / "ad"  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(cp):
    with httpx.Client(base_url=f"http://127.0.0.1:{cp.state.http_port}", timeout=60) as client:
        yield client


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def ref(**kw) -> common_pb2.AdapterRef:
    return common_pb2.AdapterRef(**kw)


def models(api) -> dict[str, int]:
    """``/v1/models``: model id → adapter id (the base model → -1)."""
    return {m["id"]: m.get("adapter_id", -1) for m in api.get("/v1/models").json()["data"]}


def test_grpc_by_name_by_id_and_digits_are_ids(cp):
    a = upload(cp.stub, write_adapter(cp.tmp / "alpha.gguf", seed=1), name="alpha")
    b = upload(cp.stub, write_adapter(cp.tmp / "beta.gguf", seed=2), name="beta")
    assert cp.stub.GetAdapter(ref(name="alpha")) == cp.stub.GetAdapter(ref(id=a.id)) == a
    assert cp.stub.GetAdapter(ref(name=str(b.id))).name == "beta"  # ASCII digits: an id
    assert cp.stub.GetAdapter(ref(name=f"adapter:{b.id}")).name == "beta"
    err = rpc_error(cp.stub.GetAdapter, ref(name="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no adapter is named 'nope'" in err.details()
    assert "'alpha'" in err.details() and "'beta'" in err.details()
    err = rpc_error(cp.stub.GetAdapter, ref(id=b.id, name="alpha"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"adapter given both as id {b.id} and as name 'alpha'; give one"
    pinned = cp.stub.PinAdapter(control_plane_pb2.PinRequest(name="beta", pinned=True))
    assert (pinned.id, pinned.pinned) == (b.id, True)
    cp.stub.PinAdapter(control_plane_pb2.PinRequest(name="beta", pinned=False))
    scales = common_pb2.AdapterMap(
        entries=[common_pb2.AdapterScale(name="beta", scale=0.5), common_pb2.AdapterScale(id=a.id, scale=1.0)]
    )
    now = cp.stub.SetDefaultAdapters(scales)
    assert sorted((e.id, e.scale, e.name) for e in now.entries) == [(a.id, 1.0, ""), (b.id, 0.5, "")]
    twice = common_pb2.AdapterMap(
        entries=[common_pb2.AdapterScale(name="alpha", scale=1), common_pb2.AdapterScale(id=a.id, scale=1)]
    )
    err = rpc_error(cp.stub.SetDefaultAdapters, twice)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"adapter {a.id} is listed more than once" in err.details()
    cp.stub.SetDefaultAdapters(common_pb2.AdapterMap())


def test_all_digit_names_are_refused_and_embedded_ones_dropped(cp, api):
    path = write_adapter(cp.tmp / "digits.gguf", seed=3)
    err = rpc_error(upload, cp.stub, path, name="123")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter name '123' is all digits" in err.details()
    r = api.post("/v1/load_lora_adapter", json={"lora_name": "0042", "lora_path": str(path)})
    assert "adapter name '0042' is all digits" in openai_error(r, 400)["message"]
    embedded = write_adapter(cp.tmp / "embedded.gguf", seed=4, name="77")
    with structlog.testing.capture_logs() as logs:
        info = upload(cp.stub, embedded)
    assert info.name == ""
    dropped = [e for e in logs if e["event"] == "adapter_name_dropped"]
    assert [e["name"] for e in dropped] == ["77"] and "all digits" in dropped[0]["reason"]
    assert f"adapter:{info.id}" in models(api)
    cp.stub.UnregisterAdapter(ref(id=info.id))


def test_names_with_control_characters_are_refused(cp, api):
    """NUL (which PostgreSQL text cannot store: INTERNAL there before), newline and tab in a
    requested name are refused up front on gRPC and HTTP, whether the content is new (a new
    adapter) or known (an alias), and nothing is registered."""
    fresh = write_adapter(cp.tmp / "ctrl.gguf", seed=70)
    known = write_adapter(cp.tmp / "ctrl-known.gguf", seed=71)
    upload(cp.stub, known, name="ctrl-known")
    before = [(a.id, a.name, list(a.aliases)) for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters]
    for name, code in (("a\x00b", "U+0000"), ("a\nb", "U+000A"), ("\tx", "U+0009")):
        for path in (fresh, known):
            err = rpc_error(upload, cp.stub, path, name=name)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert f"holds the control character {code}" in err.details()
            r = api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert f"holds the control character {code}" in openai_error(r, 400)["message"]
    after = [(a.id, a.name, list(a.aliases)) for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters]
    assert after == before


def test_a_name_several_adapters_share_is_ambiguous_everywhere(cp, api):
    """Names embedded in files are not keys: two files both named ``twin`` register (no name
    asked for), and every API then refuses the name, listing both ids."""
    one = upload(cp.stub, write_adapter(cp.tmp / "twin1.gguf", seed=5, name="twin"))
    two = upload(cp.stub, write_adapter(cp.tmp / "twin2.gguf", seed=6, name="twin"))
    ids = [one.id, two.id]
    err = rpc_error(cp.stub.GetAdapter, ref(name="twin"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"adapter name 'twin' is ambiguous: adapters {ids} answer to it; name one by id"
    err = rpc_error(cp.stub.SetDefaultAdapters, common_pb2.AdapterMap(entries=[{"name": "twin", "scale": 1.0}]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and str(ids) in err.details()
    r = api.post("/v1/completions", json={"model": "twin", "prompt": "x"})
    assert openai_error(r, 400)["message"] == (
        f"The model name 'twin' is ambiguous: adapters {ids} share it; name one as 'adapter:<id>'"
    )
    r = api.post("/v1/unload_lora_adapter", json={"lora_name": "twin"})
    assert str(ids) in openai_error(r, 400)["message"]
    listed = models(api)
    assert "twin" not in listed and listed[f"adapter:{one.id}"] == one.id and listed[f"adapter:{two.id}"] == two.id
    # and a new registration cannot take a name that is in use
    err = rpc_error(upload, cp.stub, write_adapter(cp.tmp / "twin3.gguf", seed=7), name="twin")
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and str(ids) in err.details()
    for i in ids:
        cp.stub.UnregisterAdapter(ref(id=i))


def test_grpc_register_known_content_under_a_new_name_is_an_alias(cp, api):
    path = write_adapter(cp.tmp / "gamma.gguf", seed=8)
    other = write_adapter(cp.tmp / "delta.gguf", seed=9)
    first = upload(cp.stub, path, name="gamma")
    alias = upload(cp.stub, path, name="gamma-2")
    assert (alias.id, alias.name, list(alias.aliases)) == (first.id, "gamma", ["gamma-2"])
    assert upload(cp.stub, path, name="gamma-2") == alias  # a retried registration: unchanged
    assert upload(cp.stub, path) == alias  # no name: the same adapter, as before
    err = rpc_error(upload, cp.stub, other, name="gamma-2")  # another adapter's alias
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.details() == f"adapter name 'gamma-2' is taken by adapter(s) [{first.id}]; pick another name"
    d = upload(cp.stub, other, name="delta")
    err = rpc_error(upload, cp.stub, path, name="delta")  # known content, a name another holds
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert cp.stub.GetAdapter(ref(name="gamma-2")) == alias
    assert [a.aliases for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters if a.id == first.id] == [["gamma-2"]]
    listed = models(api)
    assert listed["gamma"] == listed["gamma-2"] == first.id
    # gRPC removes the adapter by any of its names, all names with it
    cp.stub.UnregisterAdapter(ref(name="gamma-2"))
    assert "gamma" not in models(api) and "gamma-2" not in models(api)
    cp.stub.UnregisterAdapter(ref(id=d.id))


def test_http_load_unload_follow_vllm(cp, api):
    auth: dict[str, str] = {}
    path = write_adapter(cp.tmp / "rnd.gguf", seed=10)
    other = write_adapter(cp.tmp / "other.gguf", seed=11)

    def load(name: str, p: Path) -> httpx.Response:
        return api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(p)}, headers=auth)

    def unload(name: str) -> httpx.Response:
        return api.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=auth)

    r = load("rnd", path)
    assert r.status_code == 200, r.text
    rid = cp.stub.GetAdapter(ref(name="rnd")).id
    assert r.text == f"Success: LoRA adapter 'rnd' added successfully (id {rid})."
    for again in (path, other, cp.tmp / "missing.gguf"):  # whatever the path: nothing is read
        assert openai_error(load("rnd", again), 400) == {
            "message": "The lora adapter 'rnd' has already been loaded.",
            "type": "invalid_request_error",
            "param": "lora_name",
            "code": "lora_already_loaded",
        }
    r = load("rnd2", path)  # the same content under a new name: an alias, served at once
    assert r.status_code == 200
    assert r.text == f"Success: LoRA adapter 'rnd2' added successfully (alias of adapter {rid})."
    r = load("rnd3", path)
    assert openai_error(load("rnd2", other), 400)["message"] == "The lora adapter 'rnd2' has already been loaded."
    entries = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    for name in ("rnd", "rnd2", "rnd3"):
        assert (entries[name]["adapter_id"], entries[name]["aliases"]) == (rid, ["rnd2", "rnd3"])
    assert cp.stub.GetAdapter(ref(id=rid)).aliases == ["rnd2", "rnd3"]
    # model resolution (no worker here: past resolution a request meets 503, not 404)
    assert api.post("/v1/completions", json={"model": "rnd2", "prompt": "x", "max_tokens": 1}).status_code == 503
    # unloading an alias drops that name only
    r = unload("rnd2")
    assert r.status_code == 200
    assert r.text == f"Success: LoRA adapter 'rnd2' removed successfully (adapter {rid} stays as 'rnd')."
    assert openai_error(api.post("/v1/completions", json={"model": "rnd2", "prompt": "x"}), 404)["param"] == "model"
    assert "rnd2" not in models(api) and models(api)["rnd"] == rid
    # unloading the name while an alias remains: the oldest alias becomes the name
    r = unload("rnd")
    assert r.text == f"Success: LoRA adapter 'rnd' removed successfully (adapter {rid} stays as 'rnd3')."
    now = cp.stub.GetAdapter(ref(id=rid))
    assert (now.name, list(now.aliases)) == ("rnd3", [])
    assert load("rnd", path).text == f"Success: LoRA adapter 'rnd' added successfully (alias of adapter {rid})."
    assert unload("rnd").status_code == 200
    # the last name: the adapter is unregistered
    r = unload("rnd3")
    assert r.text == f"Success: LoRA adapter 'rnd3' removed successfully (id {rid})."
    assert rid not in [a.id for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters]
    assert openai_error(unload("rnd3"), 404)["type"] == "not_found_error"


def test_the_same_store_row_survives_a_restart_with_its_aliases(cp, tmp_path, base_model_path):
    """Aliases live in the store: a control plane reopened on the data dir serves them."""
    from control_plane.server import ControlPlaneConfig

    data = tmp_path / "data"
    path = write_adapter(tmp_path / "eps.gguf", seed=12)
    cfg = dict(addr="127.0.0.1:0", data_dir=str(data), model_path=str(base_model_path), served_model_name=BASE)
    first = ControlPlane(ControlPlaneConfig(**cfg))
    try:
        upload(first.stub, path, name="eps")
        info = upload(first.stub, path, name="eps-alias")
    finally:
        first.stop()
    again = ControlPlane(ControlPlaneConfig(**cfg))
    try:
        assert again.stub.GetAdapter(ref(name="eps-alias")) == info
        assert list(info.aliases) == ["eps-alias"]
    finally:
        again.stop()


def test_racing_loads_of_one_new_name_give_one_200(cp, api):
    """Several ``/v1/load_lora_adapter`` calls for one new ``lora_name`` at once (different
    files, or the same file): each passes the "is the name free" check before any inserts (a
    barrier in the real store forces that interleaving), yet exactly one gets 200 and the
    others vLLM's 400, and the name then serves exactly one adapter, never an ambiguous one."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    store = cp.state.registry.store
    real_insert = store.insert
    barrier = threading.Barrier(2, timeout=30)

    def insert_after_both_checked(**kw):
        barrier.wait()
        return real_insert(**kw)

    def race(name: str, paths: list[Path]) -> list[httpx.Response]:
        barrier.reset()
        store.insert = insert_after_both_checked
        try:
            with ThreadPoolExecutor(len(paths)) as ex:
                return list(
                    ex.map(
                        lambda p: api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(p)}),
                        paths,
                    )
                )
        finally:
            del store.insert  # the instance attribute goes; the class's method is back

    before = {a.id for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters}
    for name, paths in (
        ("raced", [write_adapter(cp.tmp / f"race{i}.gguf", seed=40 + i) for i in range(2)]),
        ("raced-same", [write_adapter(cp.tmp / "race-same.gguf", seed=50)] * 2),
    ):
        answers = race(name, paths)
        assert sorted(r.status_code for r in answers) == [200, 400], [r.text for r in answers]
        loser = next(r for r in answers if r.status_code == 400)
        assert openai_error(loser, 400)["message"] == f"The lora adapter '{name}' has already been loaded."
        owner = cp.stub.GetAdapter(ref(name=name))  # one owner: not ambiguous
        assert owner.name == name and list(owner.aliases) == []
        assert api.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1}).status_code == 503
    # the losing different-content registration was undone: one new adapter per name
    after = {a.id for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters}
    assert len(after - before) == 2


def test_an_alias_loaded_while_the_last_name_is_unloaded_keeps_serving(cp, api):
    """vLLM's lifecycle under a race: ``unload A`` (A is the adapter's only name) and ``load C``
    of the same files interleave so that C is added as an alias after the unload looked the
    adapter up and before it removed it (a hook on the real store's delete forces that). The
    adapter had no name left, so C becomes its name (never an alias of a nameless adapter): the
    load answered 200 "(id N)", N stays and serves C; A is gone."""
    path = write_adapter(cp.tmp / "unload-race.gguf", seed=90)
    load = lambda name: api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})  # noqa: E731
    assert load("ur-a").status_code == 200
    aid = cp.stub.GetAdapter(ref(name="ur-a")).id
    store = cp.state.registry.store
    real_delete = store.delete
    answers: list[httpx.Response] = []

    def alias_loaded_first(adapter_id, **kw):
        answers.append(load("ur-c"))  # from the same thread: the unload holds no store lock here
        return real_delete(adapter_id, **kw)

    store.delete = alias_loaded_first
    try:
        r = api.post("/v1/unload_lora_adapter", json={"lora_name": "ur-a"})
    finally:
        del store.delete
    assert [a.text for a in answers] == [f"Success: LoRA adapter 'ur-c' added successfully (id {aid})."]
    assert r.status_code == 200, r.text
    assert r.text == f"Success: LoRA adapter 'ur-a' removed successfully (adapter {aid} stays as 'ur-c')."
    now = cp.stub.GetAdapter(ref(name="ur-c"))
    assert (now.id, now.name, list(now.aliases)) == (aid, "ur-c", [])
    assert "ur-a" not in models(api) and models(api)["ur-c"] == aid
    assert api.post("/v1/completions", json={"model": "ur-c", "prompt": "x", "max_tokens": 1}).status_code == 503
    r = api.post("/v1/unload_lora_adapter", json={"lora_name": "ur-c"})  # its last name: the adapter goes
    assert r.status_code == 200, r.text
    with pytest.raises(grpc.RpcError) as err:
        cp.stub.GetAdapter(ref(id=aid))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_names_over_256_bytes_are_refused_naming_the_limit(cp, api):
    """1 MB names were stored and repeated in every ``/v1/models`` answer; a name is now at most
    256 UTF-8 bytes on gRPC and HTTP (the CLI's ``adapters add --name`` is gRPC), and the
    refusal repeats 256 characters of it."""
    path = write_adapter(cp.tmp / "long.gguf", seed=80)
    for name, n_bytes in (("x" * 257, 257), ("é" * 129, 258), ("n" * 1_000_000, 1_000_000)):
        err = rpc_error(upload, cp.stub, path, name=name)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"has {n_bytes} bytes (UTF-8); the limit is 256" in err.details() and len(err.details()) < 400
        r = api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        message = openai_error(r, 400)["message"]
        assert f"has {n_bytes} bytes (UTF-8); the limit is 256" in message and len(message) < 400
    longest = upload(cp.stub, path, name="é" * 128)  # 256 bytes: at the limit
    assert longest.name == "é" * 128
    cp.stub.UnregisterAdapter(ref(id=longest.id))


def test_scales_above_1e4_are_refused_naming_the_adapter_and_the_limit(cp, api):
    """A scale of 1e30 was served (NaN logits: pad tokens); every way a scale enters refuses
    one above 1e4: the default set, a gRPC request's map, an HTTP request's ``lora``."""
    a = upload(cp.stub, write_adapter(cp.tmp / "scaled.gguf", seed=81), name="scaled")
    for scale in (1e30, 10000.5):
        bad = common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=a.id, scale=scale)])
        err = rpc_error(cp.stub.SetDefaultAdapters, bad)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == f"adapter {a.id}: scale {scale:g} is above the limit of 10000"
        req = common_pb2.GenerateRequest(text="x", adapters=bad)
        err = rpc_error(lambda r=req: list(cp.stub.Generate(r, timeout=30)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "above the limit of 10000" in err.details()
        body = {"model": BASE, "prompt": "x", "max_tokens": 1, "lora": [{"id": a.id, "scale": scale}]}
        message = openai_error(api.post("/v1/completions", json=body), 400)["message"]
        assert message == f"adapter {a.id}: scale {scale:g} is above the limit of 10000"
    ok = common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=a.id, scale=10000.0)])
    assert [(e.id, e.scale) for e in cp.stub.SetDefaultAdapters(ok).entries if e.scale] == [(a.id, 10000.0)]
    cp.stub.SetDefaultAdapters(common_pb2.AdapterMap())
    cp.stub.UnregisterAdapter(ref(id=a.id))


def test_a_100_kb_model_id_or_name_is_echoed_cut_to_256_characters(cp, api):
    for model in ("m" * 100_000, "7" * 100_000, "adapter:" + "7" * 100_000):
        message = openai_error(api.post("/v1/completions", json={"model": model, "prompt": "x"}), 404)["message"]
        assert message.startswith(f"The model '{model[:255]}…' does not exist"), message[:300]
        assert len(message) < 2000
    err = rpc_error(cp.stub.GetAdapter, ref(name="q" * 100_000))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details().startswith(f"no adapter is named '{'q' * 255}…' (names: ")
