"""The ``loraplane`` CLI: usage errors (2), unreachable server (3), server refusals (1), JSON
shapes, help for every command. Client commands run against the real control
plane with one real worker (the shared ``live_server`` fixture) and, for the admin token, a
real control plane with a token (``admin_control_plane``)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from clients.cli.main import cli
from clients.cli.server_commands import startup_adapters
from clients.client import LoraplaneClient
from tests.helpers.control_plane import write_adapter
from tests.helpers.live_servers import restored_default

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEMO_SHOUT = ROOT / "loraplane" / "demo" / "adapters" / "shout.gguf"


def closed_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run(*args: str, env: dict | None = None):
    result = CliRunner().invoke(cli, list(args), env=env)
    assert "Traceback" not in result.output, result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


# ---- usage errors: exit 2 ------------------------------------------------------------------

USAGE_ERRORS = [
    ["generate", "hello", "--prompt-tokens", "1,2"],
    ["generate"],
    ["generate", "hello", "--lora", "3=abc"],
    ["generate", "hello", "--lora", "=1"],
    ["generate", "hello", "--lora", "shout=1", "--lora", "shout=0.5"],
    ["generate", "hello", "--lora", "3"],
    ["generate", "hello", "--lora", "-1=1"],
    ["generate", "hello", "--lora", "1=inf"],
    ["generate", "hello", "--lora", "1=1", "--lora", "1=0.5"],
    ["generate", "hello", "--lora", "0=1", "--no-lora"],
    ["generate", "--prompt-tokens", "1,x"],
    ["generate", "--prompt-tokens", ","],
    ["generate", "--prompt-tokens", "4294967296"],
    ["generate", "hello", "--lora", "4294967296=1"],
    ["generate", "hello", "--seed", str(2**64)],
    ["adapters", "remove", "-1"],
    ["generate", "hello", "--max-tokens", "0"],
    ["generate", "hello", "--temperature", "-1"],
    ["adapters", "add", "/no/such/file.gguf"],
    ["adapters", "frobnicate"],
    ["default", "set"],
    ["default", "set", "0=x"],
    ["default", "set", "=1"],
    ["default", "set", "0=1", "--clear"],
    ["nosuchcommand"],
    ["serve", "--batching", "fast"],
    ["serve", "--lora-scaled", "x.gguf"],
    ["control-plane", "--lora", "/no/such/adapter.gguf"],
    ["worker", "--device", "tpu"],
    ["worker", "--control-plane", "nohostport"],
    ["convert-peft", "/no/such/dir", "-o", "x.gguf"],
    ["export-lora", "--lora", "a.gguf", "-o", "x.gguf"],
    ["tenants", "add", "acme", "--key", ""],  # an empty key (unset variable), never a generated one
]


@pytest.mark.parametrize("args", USAGE_ERRORS, ids=lambda a: " ".join(a))
def test_usage_errors_exit_2(args):
    result = run(*args)
    assert result.exit_code == 2, (args, result.output)
    assert result.stdout == ""


# Usage errors honour --json: the CONTRACT's error object on stdout, still exit 2.
JSON_USAGE_ERRORS = [
    (["adapters", "show", "--json"], "loraplane adapters show: Missing argument"),
    (["--json", "adapters", "show"], "loraplane adapters show: Missing argument"),
    (["generate", "hello", "--max-tokens", "0", "--json"], "loraplane generate: Invalid value for '--max-tokens'"),
    (["workers", "list", "--json", "--no-such-flag"], "loraplane workers list: No such option '--no-such-flag'"),
    (["--json", "nosuchcommand"], "loraplane: No such command 'nosuchcommand'"),
    (["default", "set", "--json"], "loraplane default set: give ID=SCALE"),
]


@pytest.mark.parametrize(
    ("args", "message"), JSON_USAGE_ERRORS, ids=lambda a: " ".join(a) if isinstance(a, list) else ""
)
def test_usage_errors_honour_json(args, message):
    result = CliRunner().invoke(cli, args, prog_name="loraplane")
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 2, (args, result.output)
    assert result.stderr == ""
    out = json.loads(result.stdout)
    assert list(out) == ["error"] and sorted(out["error"]) == ["code", "message"]
    assert out["error"]["code"] == "INVALID_ARGUMENT"
    assert out["error"]["message"].startswith(message), out


def test_usage_error_json_from_a_real_process():
    proc = _subprocess("adapters", "show", "--json")
    assert proc.returncode == 2 and proc.stderr == ""
    err = json.loads(proc.stdout)["error"]
    assert err["code"] == "INVALID_ARGUMENT" and err["message"].startswith("loraplane adapters show: Missing argument")
    plain = _subprocess("adapters", "show")  # without --json: click's usage text on stderr, as before
    assert plain.returncode == 2 and plain.stdout == "" and "Usage: loraplane adapters show" in plain.stderr


def test_bad_lora_value_names_the_problem():
    result = run("generate", "hi", "--lora", "3=abc")
    assert result.exit_code == 2
    assert "--lora" in result.stderr and "abc" in result.stderr


# ---- unreachable: exit 3 -------------------------------------------------------------------

CLIENT_CALLS = [
    ["generate", "hello"],
    ["generate", "--prompt-tokens", "2,3", "--no-lora"],
    ["adapters", "list"],
    ["adapters", "show", "0"],
    ["adapters", "show", "abc"],  # a name: resolved by the control plane
    ["adapters", "pin", "shout"],
    ["adapters", "add", str(DEMO_SHOUT)],
    ["adapters", "remove", "0"],
    ["default", "get"],
    ["default", "set", "0=1"],
    ["default", "set", "shout=1"],
    ["generate", "hello", "--lora", "shout=1"],
    ["workers", "list"],
    ["tenants", "list"],
    ["tenants", "add", "acme", "--tokens-per-minute", "100"],
    ["tenants", "update", "acme", "--weight", "2"],
    ["tenants", "remove", "acme"],
]


@pytest.mark.parametrize("args", CLIENT_CALLS, ids=lambda a: " ".join(a))
def test_unreachable_exit_3_json(args):
    result = run(*args, "--addr", closed_addr(), "--json")
    assert result.exit_code == 3, result.output
    err = json.loads(result.stdout)["error"]
    assert err["code"] == "UNAVAILABLE" and "cannot reach" in err["message"]


def test_unreachable_exit_3_text_goes_to_stderr():
    result = run("workers", "list", "--addr", closed_addr())
    assert result.exit_code == 3
    assert result.stdout == ""
    assert "cannot reach" in result.stderr


def test_addr_from_environment():
    addr = closed_addr()
    result = run("adapters", "list", "--json", env={"LORAPLANE_ADDR": addr})
    assert result.exit_code == 3
    assert addr in json.loads(result.stdout)["error"]["message"]


# ---- help ----------------------------------------------------------------------------------


def _all_command_paths(group: click.Group, prefix=()):
    for name, command in group.commands.items():
        yield (*prefix, name)
        if isinstance(command, click.Group):
            yield from _all_command_paths(command, (*prefix, name))


ALL_COMMANDS = [()] + list(_all_command_paths(cli))


def test_every_contract_command_exists():
    paths = {" ".join(p) for p in ALL_COMMANDS}
    for name in [
        "generate",
        "adapters list",
        "adapters show",
        "adapters add",
        "adapters remove",
        "default get",
        "default set",
        "workers list",
        "serve",
        "control-plane",
        "worker",
        "convert-peft",
        "export-lora",
        "bench",
        "demo",
    ]:
        assert name in paths


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p) or "loraplane")
def test_help(path):
    result = run(*path, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


# ---- against the real control plane and worker (the shared ``live_server``) ---------------


@pytest.fixture
def addr(live_server) -> str:
    return live_server.addr


@pytest.fixture
def adapters_dir(fixtures_dir) -> Path:
    return fixtures_dir / "adapters"


@pytest.fixture
def lp(addr):
    with LoraplaneClient(addr, timeout=300) as client:
        yield client


def run_json(*args: str, env: dict | None = None) -> dict:
    result = run(*args, "--json", env=env)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def test_generate_json_shape(addr):
    out = run_json(
        "generate", "ab", "--addr", addr, "--max-tokens", "3", "--no-lora", "--logprobs", "2", "--prompt-logprobs"
    )
    assert list(out) == [
        "text",
        "token_ids",
        "prompt_token_ids",
        "finish_reason",
        "telemetry",
        "logprobs",
        "prompt_logprobs",
    ]
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length" and out["text"]
    assert out["prompt_token_ids"][0] == 2  # BOS added to a text prompt
    assert out["telemetry"]["prompt_tokens"] == len(out["prompt_token_ids"])
    assert out["telemetry"]["adapters"] == []
    assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"]
    first = out["logprobs"][0]
    assert set(first) == {"token_id", "logprob", "top"} and len(first["top"]) == 2
    assert set(first["top"][0]) == {"token_id", "logprob"}
    assert first["top"][0]["token_id"] == first["token_id"]  # greedy
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1]["token_id"] == out["prompt_token_ids"][1]
    assert len(out["prompt_logprobs"]) == len(out["prompt_token_ids"])


def test_generate_json_without_logprob_flags_has_no_logprob_keys(addr):
    out = run_json("generate", "a", "--addr", addr, "--no-lora", "--max-tokens", "2")
    assert "logprobs" not in out and "prompt_logprobs" not in out


def test_generate_adapter_flags_select_the_adapters(addr, lp, adapters_dir):
    """No flag → the default set; --no-lora → the base model; --lora → that map;
    --prompt-tokens → those ids verbatim."""
    shout = run_json("adapters", "add", str(adapters_dir / "shout.gguf"), "--addr", addr)["id"]
    prompt, n = "Tell me about the weather today.", "4"
    with restored_default(lp):
        run_json("default", "set", f"{shout}=1", "--addr", addr)
        default = run_json("generate", prompt, "--addr", addr, "--max-tokens", n)
        explicit = run_json("generate", prompt, "--addr", addr, "--max-tokens", n, "--lora", f"{shout}=1")
        base = run_json("generate", prompt, "--addr", addr, "--max-tokens", n, "--no-lora")
    assert default["token_ids"] == explicit["token_ids"] != base["token_ids"]
    assert default["telemetry"]["adapters"] == [{"id": shout, "scale": 1.0}]
    assert base["telemetry"]["adapters"] == []
    ids = ",".join(map(str, base["prompt_token_ids"]))
    verbatim = run_json("generate", "--prompt-tokens", ids, "--addr", addr, "--max-tokens", n, "--no-lora")
    assert verbatim["prompt_token_ids"] == base["prompt_token_ids"]
    assert verbatim["token_ids"] == base["token_ids"]


def test_generate_text_mode_streams_then_telemetry(addr):
    expected = run_json("generate", "a", "--addr", addr, "--no-lora", "--max-tokens", "2")
    result = run("generate", "a", "--addr", addr, "--no-lora", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert result.stdout == expected["text"] + "\n"
    assert "graph reused" in result.stderr


def test_server_refusal_exit_1(addr, adapters_dir):
    unknown = str(10**6)
    result = run("adapters", "show", unknown, "--addr", addr, "--json")
    assert result.exit_code == 1, result.output
    err = json.loads(result.stdout)["error"]
    assert err["code"] == "NOT_FOUND" and unknown in err["message"]
    result = run("generate", "x", "--lora", f"{unknown}=1", "--addr", addr)
    assert result.exit_code == 1
    assert "NOT_FOUND" in result.stderr and unknown in result.stderr and result.stdout == ""
    outside = adapters_dir.parent / "README.md"
    result = run("adapters", "add", str(outside), "--server-path", "--addr", addr, "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["error"]["code"] == "PERMISSION_DENIED"


def test_admin_commands_json(addr, lp, adapters_dir, tmp_path):
    # a small adapter only this test registers, so its name and removal are ours to check
    tiny = write_adapter(tmp_path / "tiny.gguf", seed=7201)
    added = run_json("adapters", "add", str(tiny), "--name", "cli-tiny", "--addr", addr)
    tiny_id = added["id"]
    assert len(added["sha256"]) == 64 and added["name"] == "cli-tiny"
    assert added["sha256"] == hashlib.sha256(tiny.read_bytes()).hexdigest()
    assert added["arch"] == "gemma3" and added["ranks"] == [2]
    listed = run_json("adapters", "list", "--addr", addr)
    assert tiny_id in [a["id"] for a in listed["adapters"]]
    assert run_json("adapters", "show", str(tiny_id), "--addr", addr) == added

    sea = run_json("adapters", "add", str(adapters_dir / "sea.gguf"), "--server-path", "--addr", addr)
    assert sea["sha256"] == hashlib.sha256((adapters_dir / "sea.gguf").read_bytes()).hexdigest()

    def attached(doc: dict) -> dict:
        return {a["id"]: a["scale"] for a in doc["adapters"] if a["scale"] != 0}

    with restored_default(lp):
        set_doc = run_json("default", "set", f"{tiny_id}=0.5", f"{sea['id']}=1", "--addr", addr)
        assert attached(set_doc) == {tiny_id: 0.5, sea["id"]: 1.0}
        assert attached(run_json("default", "get", "--addr", addr)) == attached(set_doc)
        assert attached(run_json("default", "set", "--clear", "--addr", addr)) == {}

    workers = run_json("workers", "list", "--addr", addr)["workers"]
    assert any(w["state"] == "alive" for w in workers)
    assert run_json("adapters", "remove", str(tiny_id), "--addr", addr) == {"id": tiny_id, "removed": True}
    assert run("adapters", "show", str(tiny_id), "--addr", addr).exit_code == 1
    for args in (["adapters", "list"], ["workers", "list"], ["default", "get"]):
        assert run(*args, "--addr", addr).exit_code == 0


def test_admin_token_flag_and_env(admin_control_plane, monkeypatch):
    addr, token = admin_control_plane.addr, admin_control_plane.admin_token
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    for extra in ([], ["--admin-token", "wrong-token"]):
        refused = run("default", "set", "--clear", "--addr", addr, "--json", *extra)
        assert refused.exit_code == 1, refused.output
        assert json.loads(refused.stdout)["error"]["code"] == "UNAUTHENTICATED"
    assert run("default", "get", "--addr", addr).exit_code == 0  # reads stay open
    ok = run("default", "set", "--clear", "--addr", addr, "--admin-token", token)
    assert ok.exit_code == 0, ok.output
    ok = run("default", "set", "--clear", "--addr", addr, env={"LORAPLANE_ADMIN_TOKEN": token})
    assert ok.exit_code == 0, ok.output


def test_python_m_clients_cli_against_the_server(addr):
    proc = _subprocess(
        "generate", "--prompt-tokens", "2,596", "--no-lora", "--max-tokens", "2", "--addr", addr, "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_token_ids"] == [2, 596] and len(out["token_ids"]) == 2


# ---- server/tool commands without servers --------------------------------------------------


def test_startup_adapters_keep_command_line_order():
    raw = ["--lora", "a", "--lora-scaled", "b:0.5", "--model", "m", "--lora=c", "--lora-scaled=d:2"]
    got = startup_adapters(raw, ["a", "c"], [("b", 0.5), ("d", 2.0)])
    assert got == [("a", 1.0), ("b", 0.5), ("c", 1.0), ("d", 2.0)]


def test_convert_peft_bad_folder_exit_1(tmp_path):
    result = run("convert-peft", str(tmp_path), "-o", str(tmp_path / "out.gguf"))
    assert result.exit_code == 1, result.output
    assert "adapter_config.json" in result.stderr


# ---- a real process ------------------------------------------------------------------------


def _subprocess(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("LORAPLANE_ADDR", None)
    env.pop("COLUMNS", None)  # rich's default width off a terminal: 80
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_tables_keep_every_cell_when_piped(addr):
    """Off a terminal (stdout is a pipe here) tables keep their natural width: full worker ids,
    addresses and model paths, full adapter names, no "…" and no fold at 80 columns."""
    workers = run_json("workers", "list", "--addr", addr)["workers"]
    assert workers
    proc = _subprocess("workers", "list", "--addr", addr)
    assert proc.returncode == 0, proc.stderr
    for w in workers:
        for value in (w["worker_id"], w["addr"], w["model"]):
            assert value in proc.stdout, (value, proc.stdout)
    assert "…" not in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) > 80  # wider than the old 80-column cut
    adapters = run_json("adapters", "list", "--addr", addr)["adapters"]
    proc = _subprocess("adapters", "list", "--addr", addr)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    for ad in adapters:
        assert ad["name"] in proc.stdout and ad["sha256"][:12] in proc.stdout


def test_python_m_clients_cli_unreachable():
    proc = _subprocess("generate", "hello", "--addr", closed_addr(), "--json")
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["error"]["code"] == "UNAVAILABLE"


def test_python_m_clients_cli_usage_and_help():
    proc = _subprocess("generate", "--lora", "3=abc", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    proc = _subprocess("--help")
    assert proc.returncode == 0 and "generate" in proc.stdout


def test_console_script_installed():
    script = Path(sys.executable).with_name("loraplane")
    assert script.exists(), "loraplane console script not installed (pip install -e .)"
    proc = subprocess.run(
        [str(script), "workers", "list", "--addr", closed_addr(), "--json"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3 and "Traceback" not in proc.stderr


# ---- messages that say what is wrong --------------------------------------------------------

GGUF_OR_PEFT = "expected an adapter .gguf file or a PEFT folder holding adapter_config.json"


@pytest.mark.parametrize(
    ("args", "flag", "expected"),
    [
        (
            ["adapters", "add", "{dir}"],
            "FILE",
            f"'{{dir}}' is a directory, without adapter_config.json: {GGUF_OR_PEFT}",
        ),
        (
            ["control-plane", "--lora", "{dir}"],
            "--lora/--lora-scaled",
            "'{dir}' is a directory, without adapter_config.json: ",
        ),
        (
            ["export-lora", "--model", str(DEMO_SHOUT), "--lora", "{dir}", "-o", "x.gguf"],
            "--lora",
            "'{dir}' is a directory: expected an adapter .gguf file",
        ),
        (["adapters", "add", "{dir}/none.gguf"], "FILE", f"'{{dir}}/none.gguf' does not exist: {GGUF_OR_PEFT}"),
    ],
    ids=["add", "control-plane", "export-lora", "missing"],
)
def test_adapter_path_errors_say_what_is_wrong(tmp_path, args, flag, expected):
    """A folder that exists is "a directory" (not "does not exist"); a missing file still is."""
    result = run(*(a.format(dir=tmp_path) for a in args))
    assert result.exit_code == 2, result.output
    assert f"Error: Invalid value for {flag}: {expected.format(dir=tmp_path)}" in result.stderr, result.stderr
    assert "does not exist" not in result.stderr or "none.gguf" in result.stderr


def test_python_client_add_adapter_names_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        LoraplaneClient(closed_addr()).add_adapter(tmp_path)
    assert str(err.value) == f"'{tmp_path}' is a directory, without adapter_config.json: {GGUF_OR_PEFT}"


def test_default_and_workers_show_names(addr, lp, adapters_dir):
    """``default get`` / ``default set`` add ``name`` to each entry, ``workers list`` adds
    ``adapters: [{"id", "name"}]`` beside ``adapter_ids``; the tables show the names."""
    sea = lp.add_adapter(str(adapters_dir / "sea.gguf"), server_path=True)
    names = {a.id: a.name for a in lp.list_adapters()}
    lp.generate("x", adapters={sea.id: 1.0}, max_tokens=1)  # the worker holds sea now
    with restored_default(lp):
        set_doc = run_json("default", "set", f"{sea.name}=0.5", "--addr", addr)
        assert {"id": sea.id, "scale": 0.5, "name": sea.name} in set_doc["adapters"]
        got = run_json("default", "get", "--addr", addr)
        assert got == set_doc
        assert got["adapters"] == [
            {"id": e.id, "scale": e.scale, "name": names[e.id]} for e in lp.get_default().entries
        ]
        table = run("default", "get", "--addr", addr)
        assert table.exit_code == 0
        [row] = [line for line in table.stdout.splitlines() if f" {sea.name} " in line]
        assert row.split() == ["│", str(sea.id), "│", sea.name, "│", "0.5", "│"]
    workers = run_json("workers", "list", "--addr", addr)["workers"]
    for w in workers:
        assert w["adapters"] == [{"id": i, "name": names[i]} for i in w["adapter_ids"]]
    assert any({"id": sea.id, "name": sea.name} in w["adapters"] for w in workers)
    table = run("workers", "list", "--addr", addr)
    assert f"{sea.id} ({sea.name})" in table.stdout
