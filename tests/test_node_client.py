"""The Node.js client (clients/node/generate.js) agrees with the Python client.

Against the in-memory fake control plane: same adapter-map semantics on the wire and the
same output. Against a real ``loraplane serve`` (when the control plane and worker are
installed): the same greedy text and token ids for the default set, no adapters and an
explicit map. Needs ``node`` and ``npm ci --prefix clients/node``; skipped otherwise.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from clients.client import LoraplaneClient
from tests.fake_control_plane import start_fake
from tests.serve_helpers import HAVE_SERVERS, start_serve, stop_serve

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "clients" / "node"
DEMO = ROOT / "demo" / "adapters"

pytestmark = [
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
    pytest.mark.skipif(not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(),
                       reason="run `npm ci --prefix clients/node` first"),
]


def node_generate(addr: str, *args: str) -> tuple[int, dict]:
    proc = subprocess.run(["node", str(NODE_DIR / "generate.js"), "--addr", addr, *args],
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, (json.loads(lines[-1]) if lines else {})


@pytest.fixture
def fake():
    server, servicer, addr = start_fake()
    yield servicer, addr
    server.stop(None)


def test_node_adapter_maps_on_the_wire(fake):
    servicer, addr = fake
    with LoraplaneClient(addr) as lp:
        lp.add_adapter(DEMO / "shout.gguf")
        lp.add_adapter(DEMO / "sea.gguf")
        lp.set_default({1: 1.0})
    cases = [
        ([], None),
        (["--no-lora"], {}),
        (["--lora", "0=1", "--lora", "1=0.5"], {0: 1.0, 1: 0.5}),
    ]
    for flags, adapters in cases:
        code, out = node_generate(addr, "--prompt", "hi there", "--max-tokens", "4", *flags)
        assert code == 0, out
        with LoraplaneClient(addr) as lp:
            expected = lp.generate("hi there", adapters=adapters, max_tokens=4)
        assert out == {"text": expected.text, "token_ids": list(expected.token_ids)}
    sent = servicer.received.generate
    node_default, py_default, node_empty, py_empty, node_map, py_map = sent
    for node_req, py_req in ((node_default, py_default), (node_empty, py_empty),
                             (node_map, py_map)):
        assert node_req.HasField("adapters") == py_req.HasField("adapters")
        assert list(node_req.adapters.entries) == list(py_req.adapters.entries)
        assert node_req.text == py_req.text and node_req.sampling == py_req.sampling
    assert not node_default.HasField("adapters")
    assert node_empty.HasField("adapters") and not node_empty.adapters.entries


def test_node_prompt_tokens_and_errors(fake):
    servicer, addr = fake
    code, out = node_generate(addr, "--prompt-tokens", "5,6,7", "--max-tokens", "2")
    assert code == 0 and out["token_ids"] == [100, 101]
    assert list(servicer.received.generate[-1].tokens.ids) == [5, 6, 7]
    code, out = node_generate(addr, "--prompt", "x", "--lora", "9=1")
    assert code == 1 and out["error"]["code"] == "NOT_FOUND"
    code, _ = node_generate(addr, "--prompt", "x", "--lora", "3=abc")
    assert code == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    code, out = node_generate(closed, "--prompt", "x")
    assert code == 3 and out["error"]["code"] == "UNAVAILABLE"


# ---- against a real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    proc, addr = start_serve(tmp_path_factory.mktemp("serve-data"), "--slots", "2")
    yield addr
    stop_serve(proc)


@pytest.mark.skipif(not HAVE_SERVERS, reason="control_plane.server / worker.server missing")
@pytest.mark.parametrize("flags,adapters", [
    ([], None),
    (["--no-lora"], {}),
    (["--lora", "0=1"], {0: 1.0}),
    (["--lora", "0=0.5", "--lora", "1=1"], {0: 0.5, 1: 1.0}),
], ids=["default", "no-lora", "shout", "shout+sea"])
def test_node_matches_python_on_a_real_server(real_server, flags, adapters):
    prompt = "Tell me about the weather today."
    code, out = node_generate(real_server, "--prompt", prompt, "--max-tokens", "12", *flags)
    assert code == 0, out
    with LoraplaneClient(real_server) as lp:
        expected = lp.generate(prompt, adapters=adapters, max_tokens=12, temperature=0.0)
    assert out == {"text": expected.text, "token_ids": list(expected.token_ids)}
