"""The Node.js client (clients/node/generate.js) agrees with the Python client, against the
real control plane and worker (the shared ``live_server``): the same greedy text and token ids
for the default set, no adapters and an explicit map, the same prompt-token handling and the
same exit codes; adapters by name (``{sea: 1}``, ``--lora sea=1``) run the adapter so named and
an unknown name is NOT_FOUND; the ``npm pack`` tarball installed outside the checkout loads the
protos it ships.

Needs ``node`` (>= 18) and ``npm install --prefix clients/node`` (``scripts/install.sh
--with-node`` does it). When either is missing these tests FAIL, not skip: CI must not lose
the Node client's coverage silently.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest

from clients.client import LoraplaneClient
from tests.helpers.live_servers import nonzero, restored_default

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "clients" / "node"
PROMPT = "Tell me about the weather today."
MAX_TOKENS = "5"
PROTO_FILES = sorted(p.relative_to(ROOT / "protos").as_posix() for p in (ROOT / "protos").rglob("*.proto"))


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


LIBRARY_SCRIPT = """
const lp = require(process.argv[1]);
const [addr, prompt, cases] = process.argv.slice(2);
(async () => {
  const out = {};
  for (const [label, adapters] of Object.entries(JSON.parse(cases))) {
    try {
      const r = await lp.generate(addr, { prompt, adapters, maxTokens: 3 });
      out[label] = { adapters: r.telemetry.adapters.map((a) => [a.id, a.scale]), token_ids: r.token_ids };
    } catch (err) {
      out[label] = { code: err.code, message: err.details };
    }
  }
  process.stdout.write(JSON.stringify(out));
})();
"""
"""Runs ``generate(addr, {adapters})`` of the library (argv: module, addr, prompt, {label: adapters})
for each case: the resolved adapters the worker ran with (telemetry) or the error."""


def node_library(module: Path, addr: str, cases: dict, cwd: Path = ROOT) -> dict:
    proc = subprocess.run(
        ["node", "-e", LIBRARY_SCRIPT, str(module), addr, PROMPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_node_library_names_adapters_like_the_server(live_server, lp, fixtures_dir):
    """``{sea: 1}`` runs sea and ``{shout: 1}`` shout (the `name` of AdapterScale, resolved by the
    control plane), ``{"<id>": 1}`` runs that id, and an unknown name is NOT_FOUND naming it."""
    shout = lp.add_adapter(fixtures_dir / "adapters" / "shout.gguf")
    sea = lp.add_adapter(str(fixtures_dir / "adapters" / "sea.gguf"), server_path=True)
    assert shout.id != sea.id  # one of them is not id 0 (what a name used to run)
    got = node_library(
        NODE_DIR / "loraplane.js",
        live_server.addr,
        {"sea": {sea.name: 1}, "shout": {shout.name: 0.5}, "sea by id": {str(sea.id): 1}, "nope": {"nope": 1}},
    )
    assert got["sea"]["adapters"] == [[sea.id, 1]]
    assert got["shout"]["adapters"] == [[shout.id, 0.5]]
    assert got["sea by id"] == got["sea"]
    expected = lp.generate(PROMPT, adapters={sea.name: 1.0}, max_tokens=3)
    assert got["sea"]["token_ids"] == list(expected.token_ids)
    assert got["nope"]["code"] == "NOT_FOUND"
    assert got["nope"]["message"].startswith("no adapter is named 'nope' (names: ")


def test_node_cli_lora_by_name(live_server, lp, fixtures_dir):
    sea = lp.add_adapter(str(fixtures_dir / "adapters" / "sea.gguf"), server_path=True)
    flags = ["--max-tokens", MAX_TOKENS, "--lora", f"{sea.name}=1"]
    code, out = node_generate(live_server.addr, "--prompt", PROMPT, *flags)
    assert code == 0, out
    expected = lp.generate(PROMPT, adapters={sea.name: 1.0}, max_tokens=int(MAX_TOKENS))
    assert out == {"text": expected.text, "token_ids": list(expected.token_ids)}
    code, out = node_generate(live_server.addr, "--prompt", "x", "--lora", "nope=1")
    assert code == 1 and out["error"]["code"] == "NOT_FOUND", out
    assert out["error"]["message"].startswith("no adapter is named 'nope'")
    code, out = node_generate(live_server.addr, "--prompt", "x", "--lora", f"{2**32}=1")
    assert code == 2 and out == {"stderr": out["stderr"]}
    assert f'--lora: "{2**32}=1": adapter id {2**32} is out of range (0..4294967295)' in out["stderr"]


def test_installed_node_package_finds_its_protos(live_server, lp, fixtures_dir, tmp_path):
    """``npm pack`` ships the protos in the package folder; the package installed outside a
    checkout (``node_modules/loraplane-node-client``, its dependencies beside it) loads them
    from there and generates by name."""
    pack = subprocess.run(
        ["npm", "pack", "--json", "--pack-destination", str(tmp_path)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pack.returncode == 0, pack.stderr
    [packed] = json.loads(pack.stdout)
    assert {f"protos/{name}" for name in PROTO_FILES} <= {f["path"] for f in packed["files"]}
    assert not (NODE_DIR / "protos").exists()  # postpack removed the copy from the checkout
    app = tmp_path / "app"
    with tarfile.open(tmp_path / packed["filename"]) as tar:  # npm tarballs hold package/...
        for member in tar.getmembers():  # what the "data" filter checks, on Pythons without it (< 3.11.4)
            assert member.name.startswith("package/") and ".." not in member.name.split("/"), member.name
            assert member.isfile() or member.isdir(), member.name
        if hasattr(tarfile, "data_filter"):
            tar.extractall(app / "node_modules", filter="data")
        else:
            tar.extractall(app / "node_modules")
    installed = app / "node_modules" / "loraplane-node-client"
    (app / "node_modules" / "package").rename(installed)
    (app / "node_modules" / "@grpc").symlink_to(NODE_DIR / "node_modules" / "@grpc")
    where = subprocess.run(
        ["node", "-e", "process.stdout.write(require('loraplane-node-client').findProtoRoot())"],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout == str(installed / "protos")
    sea = lp.add_adapter(str(fixtures_dir / "adapters" / "sea.gguf"), server_path=True)
    got = node_library(installed / "loraplane.js", live_server.addr, {"sea": {sea.name: 1}}, cwd=app)
    assert got["sea"]["adapters"] == [[sea.id, 1]]
