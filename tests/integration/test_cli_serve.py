"""The CLI against a real ``loraplane serve`` (control plane + worker subprocess, CPU).

One server for the module: shout is adapter 0 and sea adapter 1, registered with
--lora-init-without-apply.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.serve import ROOT, start_serve, stop_serve

pytestmark = pytest.mark.slow

PROMPT = "The weather today is"


def cli(addr: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "clients.cli", *args, "--addr", addr],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def cli_json(addr: str, *args: str) -> dict:
    proc = cli(addr, *args, "--json")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    (line,) = proc.stdout.strip().splitlines()
    return json.loads(line)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, addr = start_serve(tmp_path_factory.mktemp("cli-serve"))
    yield proc, addr
    assert stop_serve(proc) == 0


def test_startup_adapters_registered_in_order(server):
    _, addr = server
    listed = cli_json(addr, "adapters", "list")["adapters"]
    assert [(a["id"], a["name"]) for a in listed][:2] == [(0, "shout"), (1, "sea")]
    # --lora-init-without-apply: nothing applied (entries, if listed, are all at scale 0).
    assert all(e["scale"] == 0 for e in cli_json(addr, "default", "get")["adapters"])
    workers = cli_json(addr, "workers", "list")["workers"]
    assert workers and workers[0]["state"] == "alive"


def test_generate_json_contract_shape(server):
    _, addr = server
    out = cli_json(
        addr, "generate", PROMPT, "--max-tokens", "6", "--logprobs", "3", "--prompt-logprobs", "--lora", "0=1"
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
    assert len(out["token_ids"]) == 6 or out["finish_reason"] == "stop"
    assert out["finish_reason"] in ("length", "stop")
    assert len(out["logprobs"]) == len(out["token_ids"])
    for step, token in zip(out["logprobs"], out["token_ids"], strict=True):
        assert step["token_id"] == token and len(step["top"]) == 3
        assert set(step["top"][0]) == {"token_id", "logprob"}
    assert len(out["prompt_logprobs"]) == len(out["prompt_token_ids"])
    assert out["prompt_logprobs"][0] is None
    assert all(set(e) == {"token_id", "logprob"} for e in out["prompt_logprobs"][1:])
    assert [e["token_id"] for e in out["prompt_logprobs"][1:]] == out["prompt_token_ids"][1:]
    assert out["telemetry"]["adapters"] == [{"id": 0, "scale": 1.0}]


def test_adapter_flags_semantics(server):
    _, addr = server
    base = cli_json(addr, "generate", PROMPT, "--max-tokens", "8", "--no-lora")
    default_empty = cli_json(addr, "generate", PROMPT, "--max-tokens", "8")
    zero = cli_json(addr, "generate", PROMPT, "--max-tokens", "8", "--lora", "0=0")
    shout = cli_json(addr, "generate", PROMPT, "--max-tokens", "8", "--lora", "0=1")
    assert base["token_ids"] == default_empty["token_ids"] == zero["token_ids"]
    assert shout["token_ids"] != base["token_ids"]
    tokens = ",".join(map(str, base["prompt_token_ids"]))
    verbatim = cli_json(addr, "generate", "--prompt-tokens", tokens, "--max-tokens", "8", "--no-lora")
    assert verbatim["prompt_token_ids"] == base["prompt_token_ids"]
    assert verbatim["token_ids"] == base["token_ids"]


def test_text_mode_streams_to_stdout(server):
    _, addr = server
    proc = cli(addr, "generate", PROMPT, "--max-tokens", "4", "--no-lora")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tokens generated" in proc.stderr


def test_refusals_exit_1(server):
    _, addr = server
    proc = cli(addr, "adapters", "show", "99", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"]["code"] == "NOT_FOUND"
    proc = cli(addr, "generate", PROMPT, "--lora", "99=1")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip()


def test_default_set_applies_to_requests_without_a_map(server):
    _, addr = server
    shout = cli_json(addr, "generate", PROMPT, "--max-tokens", "6", "--lora", "0=1")
    try:
        current = cli_json(addr, "default", "set", "0=1")
        assert {"id": 0, "scale": 1.0, "name": "shout"} in current["adapters"]
        implicit = cli_json(addr, "generate", PROMPT, "--max-tokens", "6")
        assert implicit["token_ids"] == shout["token_ids"]
        none = cli_json(addr, "generate", PROMPT, "--max-tokens", "6", "--no-lora")
        assert none["token_ids"] != shout["token_ids"]
    finally:
        cli_json(addr, "default", "set", "--clear")


# `loraplane demo --once` (README command 1) runs from the installed wheel: tests/integration/test_wheel.py
