"""HTTP input is bounded before it costs anything, and every refusal is OpenAI's error shape.

One real control plane (in this process, real sockets: gRPC and uvicorn) with the HTTP front,
no worker: a request that reaches routing gets 503, so a 400/413 here proves the request was
refused before routing. ``http_n_ctx=4096`` is what ``serve`` passes for its worker's default
context; the body limit is 8 MiB so the oversize cases stay cheap.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import grpc
import httpx
import pytest

from loraplane.v1 import common_pb2
from tests.helpers.control_plane import ControlPlane, upload, write_adapter

BASE = "base-model"
BODY_LIMIT = 8 * 1024 * 1024
N_CTX = 4096
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def cp(tmp_path_factory, base_model_path: Path):
    from control_plane.server import ControlPlaneConfig

    root = tmp_path_factory.mktemp("http-input")
    server = ControlPlane(
        ControlPlaneConfig(
            addr="127.0.0.1:0",
            data_dir=str(root / "data"),
            model_path=str(base_model_path),
            http_addr="127.0.0.1:0",
            served_model_name=BASE,
            http_max_body_bytes=BODY_LIMIT,
            http_n_ctx=N_CTX,
        )
    )
    server.tmp = root  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(cp):
    with httpx.Client(base_url=f"http://127.0.0.1:{cp.state.http_port}", timeout=60) as client:
        yield client


@pytest.fixture
def encode_calls(cp, monkeypatch):
    """Every call of the base tokenizer's ``encode`` (the one chat prompts go through)."""
    tok = cp.state.registry.base.tokenizer()
    calls: list[int] = []
    original = tok.encode

    def counting(text, *args, **kwargs):
        calls.append(len(text))
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", counting)
    return calls


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def chat(content: str) -> dict:
    return {"model": BASE, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


# ---- body size ----------------------------------------------------------------------------------


def test_300_mb_declared_body_is_413_before_it_is_sent(cp):
    """Headers claiming 300 MB plus 64 KiB of body: the 413 arrives while the client still
    has 299.9 MB to send (old code: waits for the body, the read times out), and reading
    nothing leaves this process's RSS (control plane included) where it was."""
    before = rss_bytes()
    conn = http.client.HTTPConnection("127.0.0.1", cp.state.http_port, timeout=10)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(300 * 1000 * 1000))
    conn.endheaders()
    conn.send(b'{"model": "base-model", "messages": [{"role": "user", "content": "' + b"a" * 65536)
    t0 = time.monotonic()
    resp = conn.getresponse()
    body = json.loads(resp.read())
    elapsed = time.monotonic() - t0
    conn.close()
    assert resp.status == 413 and elapsed < 10
    assert resp.getheader("connection") == "close"
    assert set(body["error"]) == ERROR_KEYS and body["error"]["code"] == "request_too_large"
    assert str(BODY_LIMIT) in body["error"]["message"]
    assert rss_bytes() - before < 50 * 1024 * 1024


def test_chunked_body_over_the_limit_is_413(cp):
    """No Content-Length: the bytes are counted as they arrive; 413 once past the limit."""
    sock = socket.create_connection(("127.0.0.1", cp.state.http_port), timeout=10)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    sock.sendall(head)
    chunk = b"a" * (256 * 1024)
    sent = 0
    try:
        while sent <= BODY_LIMIT + len(chunk):
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sent += len(chunk)
    except OSError:  # the server answered and closed while we were still sending
        pass
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 10:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    except OSError:
        pass
    sock.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b'"request_too_large"' in data


def test_body_limit_flag_default_is_32_mib():
    from control_plane.server import ControlPlaneConfig

    assert ControlPlaneConfig().http_max_body_bytes == 16 * 1024 * 1024


# ---- prompt size before tokenizing --------------------------------------------------------------


def test_4_mb_chat_is_400_at_once_without_tokenizing(api, encode_calls):
    t0 = time.monotonic()
    r = api.post("/v1/chat/completions", json=chat("a" * (4 * 1024 * 1024)))
    elapsed = time.monotonic() - t0
    err = openai_error(r, 400)
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert encode_calls == [] and elapsed < 5


def test_1_mb_chat_is_400_without_tokenizing_when_sized_for_the_workers_context(api, encode_calls):
    r = api.post("/v1/chat/completions", json=chat("héllo " * 200_000))
    assert openai_error(r, 400)["code"] == "context_length_exceeded"
    assert encode_calls == []


def test_small_chat_is_tokenized_and_routed(api, encode_calls):
    """The counter sees the tokenizer when a prompt passes: no worker → 503 from routing."""
    r = api.post("/v1/chat/completions", json=chat("hi"))
    assert openai_error(r, 503)["type"] == "service_unavailable"
    assert len(encode_calls) == 1


def test_completion_text_over_the_limit_is_400_not_retry_later(api):
    r = api.post("/v1/completions", json={"model": BASE, "prompt": "x" * (2 * 1024 * 1024)})
    err = openai_error(r, 400)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")


def test_token_prompt_longer_than_the_context_is_400(api):
    r = api.post("/v1/completions", json={"model": BASE, "prompt": [1] * N_CTX})
    err = openai_error(r, 400)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")


@pytest.mark.parametrize("bad", [-1, 262144, 2**32, 2**70])
def test_token_ids_out_of_range_are_400_naming_the_index(api, bad):
    r = api.post("/v1/completions", json={"model": BASE, "prompt": [2, 5, bad]})
    err = openai_error(r, 400)
    assert err["param"] == "prompt" and err["message"].startswith(f"prompt[2]: token id {bad} ")


# ---- malformed input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", b'{"model": "base-model", "prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"model": "base-model", "prompt": "ok", "stop": ["a", "x\\udfff"]}', "stop.1"),
        (
            "/v1/chat/completions",
            b'{"model": "base-model", "messages": [{"role": "user", "content": "hi \\ud83d"}]}',
            "messages.0.content",
        ),
        ("/v1/load_lora_adapter", b'{"lora_name": "\\ud800", "lora_path": "/x"}', "lora_name"),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(api, path, raw, param):
    r = api.post(path, content=raw, headers={"content-type": "application/json"})
    err = openai_error(r, 400)
    assert (err["param"], err["code"]) == (param, "invalid_unicode")


@pytest.mark.parametrize(
    "raw, headers, message",
    [
        (b"{not json", {"content-type": "application/json"}, "not valid JSON"),
        (b"", {"content-type": "application/json"}, "empty"),
        (b"[1, 2]", {"content-type": "application/json"}, "JSON object"),
        (b'"a string"', {"content-type": "text/plain"}, "JSON object"),
        (b'{"model": "m", "prompt": "\xff"}', {"content-type": "application/json"}, "not valid UTF-8"),
        (b"[" * 100_000, {"content-type": "application/json"}, "not valid JSON"),
        (b'{"model": "m", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", {}, "not valid JSON"),
    ],
)
def test_body_parse_errors_are_openai_400s(api, raw, headers, message):
    err = openai_error(api.post("/v1/completions", content=raw, headers=headers), 400)
    assert message in err["message"] and err["code"] == "invalid_json"


def test_a_body_of_millions_of_tiny_values_is_refused_before_parsing(api, monkeypatch):
    """8 MB of ``[],`` (2.8 M empty lists, under the body limit): 400 ``too_many_items`` from a
    byte count, without ``json.loads`` ever running on it."""
    import control_plane.http.schemas as schemas

    parsed: list[int] = []
    real_loads = schemas.json.loads
    monkeypatch.setattr(schemas.json, "loads", lambda text, *a, **kw: parsed.append(len(text)) or real_loads(text))
    pad = b"[]," * (8 * 1024 * 1024 // 3 - 20)
    raw = b'{"model": "base-model", "prompt": "hi", "x": [' + pad + b"[]]}"
    err = openai_error(api.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "too_many_items" and str(schemas.MAX_JSON_VALUES) in err["message"], err
    assert [n for n in parsed if n > 1_000_000] == []  # (the json module is shared: small loads are ours)
    # a prompt of 1 048 576 token ids (the most a request may hold) still passes the count
    ids = b'{"model": "base-model", "max_tokens": 1, "prompt": [' + b"1," * (1024 * 1024 - 1) + b"1]}"
    r = api.post("/v1/completions", content=ids, headers={"content-type": "application/json"})
    assert r.status_code == 400 and openai_error(r, 400)["code"] == "context_length_exceeded", r.text[:300]
    assert len([n for n in parsed if n > 1_000_000]) == 1


def test_unknown_routes_and_methods_are_openai_errors(api):
    assert openai_error(api.get("/v1/nothing"), 404)["code"] == "not_found"
    err = openai_error(api.get("/v1/completions"), 405)
    assert err["code"] == "method_not_allowed" and "POST" in err["message"]


def test_bad_content_length_is_400(cp):
    """A Content-Length of non-ASCII digits never reaches the app as a number (uvicorn refuses
    it; `BodySizeLimit` would too)."""
    sock = socket.create_connection(("127.0.0.1", cp.state.http_port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: \xd9\xa3\r\n\r\n")
    data = sock.recv(65536)
    sock.close()
    assert data.split(b" ", 2)[1] in (b"400",), data[:200]


# ---- ids and names -----------------------------------------------------------------------------


def test_ids_are_ascii_digits_within_uint32(cp, api):
    adapter = upload(cp.stub, write_adapter(cp.tmp / "ids.gguf", seed=31), name="ids")
    three = f"adapter:{adapter.id}".replace(str(adapter.id), "".join(chr(0x660 + int(d)) for d in str(adapter.id)))
    r = api.post("/v1/completions", json={"model": three, "prompt": "x"})
    assert openai_error(r, 404)["param"] == "model"
    for huge in ("adapter:12345678901234567890", "adapter:99999999999"):
        assert openai_error(api.post("/v1/completions", json={"model": huge, "prompt": "x"}), 404)
        r = api.post("/v1/unload_lora_adapter", json={"lora_name": huge})
        assert openai_error(r, 404)["type"] == "not_found_error"
    r = api.post("/v1/unload_lora_adapter", json={"lora_name": three})
    openai_error(r, 404)
    assert adapter.id in [a.id for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters]


def test_models_lists_every_id_once_even_for_rows_that_predate_the_rule(cp, api):
    """A row named like the base model (written before the naming rule) is listed as
    ``adapter:<id>``; the base name resolves to the base model. Runs before the test below
    tries (and fails) to register more such names."""
    path = write_adapter(cp.tmp / "old.gguf", seed=33)
    import hashlib

    rec, _ = cp.state.store.insert(
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(), name=BASE, metadata={}, content=path, source=str(path)
    )
    ids = [m["id"] for m in api.get("/v1/models").json()["data"]]
    assert [r.name for r in cp.state.registry.list()].count(BASE) == 1
    assert len(ids) == len(set(ids)) and ids[0] == BASE and f"adapter:{rec.id}" in ids


def test_adapter_names_cannot_shadow_the_base_model(cp, api):
    path = write_adapter(cp.tmp / "shadow.gguf", seed=32)
    for name in (BASE, f"{BASE}:x", "adapter:7"):
        with pytest.raises(grpc.RpcError) as err:
            upload(cp.stub, path, name=name)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
    r = api.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": str(path)})
    err400 = openai_error(r, 400)
    assert BASE in err400["message"]


# ---- limits that follow the live workers' context --------------------------------------------


def test_prompt_limits_follow_the_largest_live_workers_n_ctx(start_control_plane, monkeypatch):
    """A stand-alone control plane (no ``http_n_ctx``: the model's training context, 32 768
    tokens for Gemma 3) sizes prompts by what its live workers report: with one worker of
    ``n_ctx`` 64, a chat over 63 × the longest piece bytes is refused before the template or
    the tokenizer runs, and a prompt of 64 token ids before routing; once the worker leaves,
    the training context applies again."""
    from control_plane.http.deps import max_piece_bytes
    from tests.helpers.scripted_worker import ScriptedMember

    cp = start_control_plane(http_addr="127.0.0.1:0", served_model_name=BASE)
    tok = cp.state.registry.base.tokenizer()
    calls: list[int] = []
    original = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **kw: calls.append(len(text)) or original(text, *a, **kw))
    limit = 63 * max_piece_bytes(tok)
    with httpx.Client(base_url=f"http://127.0.0.1:{cp.state.http_port}", timeout=60) as api:
        over = chat("a" * (limit + 1))
        r = api.post("/v1/chat/completions", json=over)
        assert r.status_code != 400 or openai_error(r, 400)["code"] != "context_length_exceeded"
        assert calls, "without a worker the training context applies: this prompt is tokenized"
        calls.clear()
        w = ScriptedMember("small-ctx", cp.addr)
        w.leave()
        w.hello.n_ctx = 64
        w.join()
        try:
            err = openai_error(api.post("/v1/chat/completions", json=over), 400)
            assert err["code"] == "context_length_exceeded" and str(limit) in err["message"], err
            assert calls == []
            ids = {"model": BASE, "prompt": [1] * 64, "max_tokens": 1}
            err = openai_error(api.post("/v1/completions", json=ids), 400)
            assert err["code"] == "context_length_exceeded", err
        finally:
            w.close()


def test_stop_rules_name_what_is_wrong(api):
    err = openai_error(api.post("/v1/completions", json={"model": BASE, "prompt": "x", "stop": [""]}), 400)
    assert err["param"] == "stop" and "must not be empty" in err["message"], err
    err = openai_error(api.post("/v1/completions", json={"model": BASE, "prompt": "x", "stop": ["a"] * 17}), 400)
    assert err["param"] == "stop" and "at most 16 strings (got 17)" in err["message"], err
