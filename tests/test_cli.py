"""The ``loraplane`` CLI: usage errors (2), unreachable server (3), server refusals (1), JSON
shapes (CONTRACT.md), help for every command. Client commands run against an in-memory fake
control plane; nothing here needs a model."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from clients.cli import cli
from clients.cli_server import startup_adapters
from tests.fake_control_plane import start_fake

ROOT = Path(__file__).resolve().parent.parent
DEMO_SHOUT = ROOT / "demo" / "adapters" / "shout.gguf"


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


@pytest.fixture
def fake():
    server, servicer, addr = start_fake()
    yield servicer, addr
    server.stop(None)


# ---- usage errors: exit 2 ------------------------------------------------------------------

USAGE_ERRORS = [
    ["generate", "hello", "--prompt-tokens", "1,2"],
    ["generate"],
    ["generate", "hello", "--lora", "3=abc"],
    ["generate", "hello", "--lora", "abc=1"],
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
    ["adapters", "show", "abc"],
    ["adapters", "add", "/no/such/file.gguf"],
    ["adapters", "frobnicate"],
    ["default", "set"],
    ["default", "set", "0=x"],
    ["default", "set", "0=1", "--clear"],
    ["nosuchcommand"],
    ["serve", "--batching", "fast"],
    ["serve", "--lora-scaled", "x.gguf"],
    ["control-plane", "--lora", "/no/such/adapter.gguf"],
    ["worker", "--device", "tpu"],
    ["worker", "--control-plane", "nohostport"],
    ["convert-peft", "/no/such/dir", "-o", "x.gguf"],
    ["export-lora", "--lora", "a.gguf", "-o", "x.gguf"],
]


@pytest.mark.parametrize("args", USAGE_ERRORS, ids=lambda a: " ".join(a))
def test_usage_errors_exit_2(args):
    result = run(*args)
    assert result.exit_code == 2, (args, result.output)
    assert result.stdout == ""


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
    ["adapters", "add", str(DEMO_SHOUT)],
    ["adapters", "remove", "0"],
    ["default", "get"],
    ["default", "set", "0=1"],
    ["workers", "list"],
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
    for name in ["generate", "adapters list", "adapters show", "adapters add",
                 "adapters remove", "default get", "default set", "workers list", "serve",
                 "control-plane", "worker", "convert-peft", "export-lora", "bench", "demo"]:
        assert name in paths


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p) or "loraplane")
def test_help(path):
    result = run(*path, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


# ---- against the fake control plane --------------------------------------------------------


def test_generate_json_shape(fake):
    servicer, addr = fake
    result = run("generate", "ab", "--addr", addr, "--json", "--max-tokens", "3",
                 "--logprobs", "2", "--prompt-logprobs")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert list(out) == ["text", "token_ids", "prompt_token_ids", "finish_reason", "telemetry",
                         "logprobs", "prompt_logprobs"]
    assert out["text"] == "<t100><t101><t102>" and out["token_ids"] == [100, 101, 102]
    assert out["prompt_token_ids"] == [2, 97, 98] and out["finish_reason"] == "length"
    assert out["telemetry"]["prompt_tokens"] == 3
    assert set(out["logprobs"][0]) == {"token_id", "logprob", "top"}
    assert out["logprobs"][0]["top"][1] == {"token_id": 101, "logprob": -0.5}
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1] == {"token_id": 97, "logprob": -0.5}
    assert len(out["prompt_logprobs"]) == len(out["prompt_token_ids"])
    assert not servicer.received.generate[0].HasField("adapters")


def test_generate_json_without_logprob_flags_has_no_logprob_keys(fake):
    _, addr = fake
    out = json.loads(run("generate", "a", "--addr", addr, "--json").stdout)
    assert "logprobs" not in out and "prompt_logprobs" not in out


def test_generate_adapter_flags_on_the_wire(fake):
    servicer, addr = fake
    run("adapters", "add", str(DEMO_SHOUT), "--addr", addr)
    run("adapters", "add", str(DEMO_SHOUT.with_name("sea.gguf")), "--addr", addr)
    assert run("generate", "a", "--addr", addr, "--no-lora", "--json").exit_code == 0
    assert run("generate", "a", "--addr", addr, "--lora", "1=0.5", "--json").exit_code == 0
    assert run("generate", "--prompt-tokens", "5,6", "--addr", addr, "--json").exit_code == 0
    no_lora, one, tokens = servicer.received.generate
    assert no_lora.HasField("adapters") and not no_lora.adapters.entries
    assert [(e.id, e.scale) for e in one.adapters.entries] == [(1, 0.5)]
    assert list(tokens.tokens.ids) == [5, 6] and not tokens.HasField("adapters")


def test_generate_text_mode_streams_then_telemetry(fake):
    _, addr = fake
    result = run("generate", "a", "--addr", addr, "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert result.stdout == "<t100><t101>\n"
    assert "graph reused" in result.stderr


def test_server_refusal_exit_1(fake):
    _, addr = fake
    result = run("adapters", "show", "7", "--addr", addr, "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {
        "error": {"code": "NOT_FOUND", "message": "adapter 7 is not registered"}}
    result = run("generate", "x", "--lora", "5=1", "--addr", addr)
    assert result.exit_code == 1
    assert "NOT_FOUND" in result.stderr and result.stdout == ""


def test_admin_commands_json(fake, tmp_path):
    _, addr = fake
    added = json.loads(run("adapters", "add", str(DEMO_SHOUT), "--name", "shout",
                           "--addr", addr, "--json").stdout)
    assert added["id"] == 0 and len(added["sha256"]) == 64 and added["name"] == "shout"
    listed = json.loads(run("adapters", "list", "--addr", addr, "--json").stdout)
    assert [a["id"] for a in listed["adapters"]] == [0]
    shown = json.loads(run("adapters", "show", "0", "--addr", addr, "--json").stdout)
    assert shown == added
    assert json.loads(run("default", "set", "0=0.5", "--addr", addr, "--json").stdout) == {
        "adapters": [{"id": 0, "scale": 0.5}]}
    assert json.loads(run("default", "get", "--addr", addr, "--json").stdout) == {
        "adapters": [{"id": 0, "scale": 0.5}]}
    assert json.loads(run("default", "set", "--clear", "--addr", addr, "--json").stdout) == {
        "adapters": []}
    workers = json.loads(run("workers", "list", "--addr", addr, "--json").stdout)["workers"]
    assert workers[0]["state"] == "alive"
    assert json.loads(run("adapters", "remove", "0", "--addr", addr, "--json").stdout)[
        "removed"] is True
    for args in (["adapters", "list"], ["workers", "list"], ["default", "get"],
                 ["adapters", "show", "0"]):
        assert run(*args, "--addr", addr).exit_code in (0, 1)


def test_admin_token_flag_and_env():
    server, servicer, addr = start_fake(admin_token="tok")
    try:
        refused = run("default", "set", "--clear", "--addr", addr, "--json")
        assert refused.exit_code == 1
        assert json.loads(refused.stdout)["error"]["code"] == "UNAUTHENTICATED"
        ok = run("default", "set", "--clear", "--addr", addr, "--admin-token", "tok")
        assert ok.exit_code == 0
        ok = run("default", "set", "--clear", "--addr", addr,
                 env={"LORAPLANE_ADMIN_TOKEN": "tok"})
        assert ok.exit_code == 0
    finally:
        server.stop(None)


# ---- server/tool commands without servers --------------------------------------------------


def test_startup_adapters_keep_command_line_order():
    raw = ["--lora", "a", "--lora-scaled", "b:0.5", "--model", "m", "--lora=c",
           "--lora-scaled=d:2"]
    got = startup_adapters(raw, ["a", "c"], [("b", 0.5), ("d", 2.0)])
    assert got == [("a", 1.0), ("b", 0.5), ("c", 1.0), ("d", 2.0)]


@pytest.mark.skipif(importlib.util.find_spec("bench.__main__") is not None,
                    reason="bench is installed")
def test_bench_missing_exit_1():
    result = run("bench", "--quick")
    assert result.exit_code == 1 and "bench not installed" in result.stderr


def test_convert_peft_bad_folder_exit_1(tmp_path):
    result = run("convert-peft", str(tmp_path), "-o", str(tmp_path / "out.gguf"))
    assert result.exit_code == 1, result.output
    assert "adapter_config.json" in result.stderr


# ---- a real process ------------------------------------------------------------------------


def _subprocess(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("LORAPLANE_ADDR", None)
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


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
    if not script.exists():
        pytest.skip("loraplane console script not installed (pip install -e .)")
    proc = subprocess.run([str(script), "workers", "list", "--addr", closed_addr(), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
