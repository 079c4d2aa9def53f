"""The Node.js client (clients/node/generate.js) agrees with the Python client, against the
real control plane and worker (the shared ``live_server``): the same greedy text and token ids
for the default set, no adapters and an explicit map, the same prompt-token handling and the
same exit codes.

Needs ``node`` (>= 18) and ``npm install --prefix clients/node`` (``scripts/install.sh
--with-node`` does it). When either is missing these tests FAIL, not skip: CI must not lose
the Node client's coverage silently.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from clients.client import LoraplaneClient
from tests.helpers.live_servers import nonzero, restored_default

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "clients" / "node"
PROMPT = "Tell me about the weather today."
MAX_TOKENS = "5"


@pytest.fixture(scope="session", autouse=True)  # session: checked before live_server starts
def node_installed() -> None:
    """Fail (never skip) every test here when node or the npm packages are missing."""
    if shutil.which("node") is None:
        pytest.fail(
            "node is not installed: the Node client tests need node >= 18 on PATH "
            "(then run `scripts/install.sh --with-node`)",
            pytrace=False,
        )
    missing = [p for p in ("@grpc/grpc-js", "@grpc/proto-loader") if not (NODE_DIR / "node_modules" / p).is_dir()]
    if missing:
        pytest.fail(
            f"npm packages {missing} are missing from {NODE_DIR / 'node_modules'}: "
            "run `npm install --prefix clients/node` (or `scripts/install.sh "
            "--with-node`)",
            pytrace=False,
        )


def node_generate(addr: str, *args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        ["node", str(NODE_DIR / "generate.js"), "--addr", addr, *args], capture_output=True, text=True, timeout=300
    )
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, (json.loads(lines[-1]) if lines else {"stderr": proc.stderr})


@pytest.fixture
def lp(live_server):
    with LoraplaneClient(live_server.addr, timeout=300) as client:
        yield client


def test_node_matches_python_for_default_empty_and_explicit_maps(live_server, lp, fixtures_dir):
    adapters = fixtures_dir / "adapters"
    shout = lp.add_adapter(adapters / "shout.gguf").id
    sea = lp.add_adapter(str(adapters / "sea.gguf"), server_path=True).id
    cases = {
        "default": ([], None),
        "no-lora": (["--no-lora"], {}),
        "map": (["--lora", f"{shout}=0.5", "--lora", f"{sea}=1"], {shout: 0.5, sea: 1.0}),
    }
    got = {}
    with restored_default(lp):
        assert nonzero(lp.set_default({shout: 1.0})) == {shout: 1.0}
        for case, (flags, amap) in cases.items():
            code, out = node_generate(live_server.addr, "--prompt", PROMPT, "--max-tokens", MAX_TOKENS, *flags)
            assert code == 0, (case, out)
            expected = lp.generate(PROMPT, adapters=amap, max_tokens=int(MAX_TOKENS))
            assert out == {"text": expected.text, "token_ids": list(expected.token_ids)}, case
            got[case] = out
    # no map → the default set (shout, upper case); --no-lora → the base model
    assert got["default"]["token_ids"] != got["no-lora"]["token_ids"]
    assert got["default"]["text"] == got["default"]["text"].upper()


def test_node_prompt_tokens_and_errors(live_server, lp):
    addr = live_server.addr
    code, out = node_generate(addr, "--prompt-tokens", "2,596", "--no-lora", "--max-tokens", "2")
    assert code == 0, out
    expected = lp.generate(prompt_tokens=[2, 596], adapters={}, max_tokens=2)
    assert out == {"text": expected.text, "token_ids": list(expected.token_ids)}
    unknown = str(10**6)
    code, out = node_generate(addr, "--prompt", "x", "--lora", f"{unknown}=1")
    assert code == 1 and out["error"]["code"] == "NOT_FOUND" and unknown in out["error"]["message"]
    code, _ = node_generate(addr, "--prompt", "x", "--lora", "3=abc")
    assert code == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    code, out = node_generate(closed, "--prompt", "x")
    assert code == 3 and out["error"]["code"] == "UNAVAILABLE"
