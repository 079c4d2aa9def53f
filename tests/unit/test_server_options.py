"""Each server's options beside its config (`control_plane.options`, `worker.options`): every
option names a config field, values become the config, and ``serve`` splits one command line
between the two servers by those names (run with the serve machinery replaced: no process
starts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from clients.cli.server_commands import control_plane_cmd, serve_cmd, worker_cmd
from control_plane.config import ControlPlaneConfig
from control_plane.options import CONTROL_PLANE_OPTIONS, STANDALONE_OPTIONS, control_plane_config
from loraplane.grammar_limits import GrammarLimits
from loraplane.options import GRAMMAR_LIMIT_FIELDS, GRAMMAR_LIMIT_OPTIONS, MODEL_OPTION, option_argv, option_names
from worker.config import Batching, Fairness, PrefixCachePolicy, WorkerConfig
from worker.options import WORKER_OPTIONS, WORKER_RUNTIME_OPTIONS, worker_argv, worker_config


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _params(command: click.Command, args: list[str]) -> dict:
    """The option values ``command`` parses from ``args`` (its callback's keyword arguments)."""
    return dict(command.make_context(command.name, list(args)).params)


def test_every_control_plane_option_names_a_config_field():
    names = option_names((*CONTROL_PLANE_OPTIONS, *STANDALONE_OPTIONS, *GRAMMAR_LIMIT_OPTIONS, MODEL_OPTION))
    strays = [n for n in names if n not in _fields(ControlPlaneConfig) and n not in GRAMMAR_LIMIT_FIELDS]
    assert not strays, f"options without a ControlPlaneConfig field: {strays}"
    assert set(GRAMMAR_LIMIT_FIELDS.values()) == _fields(GrammarLimits)
    assert len(names) == len(set(names)) == 41


def test_every_worker_option_names_a_config_field():
    names = option_names((*WORKER_OPTIONS, MODEL_OPTION, *WORKER_RUNTIME_OPTIONS))
    strays = [n for n in names if n not in _fields(WorkerConfig) and n not in GRAMMAR_LIMIT_FIELDS]
    assert not strays, f"options without a WorkerConfig field: {strays}"
    assert len(names) == len(set(names)) == 32


def test_worker_options_become_the_config(tmp_path):
    params = _params(
        worker_cmd,
        [
            "--slots", "2", "--batching", "compat", "--prefix-cache", "llama", "--fairness", "vtc",
            "--grammar-max-depth", "7", "--adapter-dir", str(tmp_path), "--n-ctx", "512",
            "--no-grammar-warmup", "--control-plane", "cp-a:1, cp-b:2", "--log-level", "debug",
        ],
    )  # fmt: skip
    config = worker_config(params)
    assert config.log_level == "debug"
    assert (config.n_seqs, config.n_ctx_seq, config.control_plane) == (2, 512, "cp-a:1,cp-b:2")
    assert (config.batching, config.prefix_cache, config.fairness) == (
        Batching.COMPAT,
        PrefixCachePolicy.LLAMA,
        Fairness.VTC,
    )
    assert config.grammar_limits == GrammarLimits(max_depth=7)
    assert config.adapter_dirs == (str(tmp_path.resolve()),)
    assert config.grammar_warmup is False
    assert config.queue_limit == WorkerConfig.queue_limit  # not given: the config's default
    assert config.worker_secret is None and config.worker_id == ""
    assert worker_config(_params(worker_cmd, ["--control-plane", "cp:1"])).log_level == "info"


def test_worker_argv_gives_the_worker_the_same_values():
    given = [
        "--model", "base.gguf", "--slots", "3", "--dtype", "bf16", "--max-lora-rank", "8",
        "--drain-timeout", "2.5", "--fairness-output-weight", "3", "--grammar-max-rules", "9",
        "--grammar-warmup", "--metrics-addr", "127.0.0.1:0", "--kv-cache-dtype", "bf16",
    ]  # fmt: skip
    params = _params(worker_cmd, given)
    again = _params(worker_cmd, list(worker_argv(params)))
    assert again == params
    assert params["model_path"] == "base.gguf" and params["drain_timeout_s"] == 2.5
    assert worker_config(params).kv_cache_dtype == "bf16"
    assert worker_argv({"grammar_warmup": False}) == ("--no-grammar-warmup",)
    with pytest.raises(TypeError, match="'max_tools'"):
        worker_argv({"max_tools": 3})  # the control plane's alone


def test_option_argv_repeats_a_repeatable_option():
    option = click.Option(["--adapter-dir", "adapter_dirs"], multiple=True)
    assert option_argv([option], {"adapter_dirs": ("a", "b")}) == ["--adapter-dir", "a", "--adapter-dir", "b"]


def test_control_plane_options_become_the_config(tmp_path):
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    params = _params(
        control_plane_cmd,
        [
            "--addr", "127.0.0.1:0", "--heartbeat-interval", "0.5", "--max-tools", "5",
            "--grammar-max-bytes", "1000", "--max-lora-rank", "16", "--adapter-dir", str(tmp_path),
            "--http-head-timeout", "3",
        ],
    )  # fmt: skip
    config = control_plane_config(params, adapters=[(str(two), 0.5), (str(one), 1.0)])
    assert (config.addr, config.heartbeat_interval_s, config.max_lora_rank) == ("127.0.0.1:0", 0.5, 16)
    assert config.grammar_limits == GrammarLimits(max_bytes=1000, max_tools=5)
    assert config.lora == () and config.lora_scaled == ((str(two), 0.5), (str(one), 1.0))
    assert config.adapter_dirs == (str(tmp_path.resolve()),) and config.http_head_timeout_s == 3.0
    assert config.data_dir == "./loraplane-data" and config.max_threads == ControlPlaneConfig.max_threads
    with pytest.raises(TypeError, match="no_such_field"):
        control_plane_config({"no_such_field": 1}, adapters=[])


def test_serve_splits_its_options_between_the_two_servers(monkeypatch, tmp_path):
    """One ``serve`` command line: the control plane gets its options, the worker's rank bound,
    the worker's grammar bounds and its context; the worker subprocess gets its runtime options,
    never the control plane's."""
    import clients.cli.serve as serve_mod

    seen = {}

    def fake_run_serve(spec, run_control_plane, config, on_ready=None):
        seen["spec"], seen["config"] = spec, config
        return 0

    monkeypatch.setattr(serve_mod, "run_serve", fake_run_serve)
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF")
    args = [
        "--addr", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--max-lora-rank", "8",
        "--grammar-max-depth", "9", "--max-tools", "3", "--n-ctx", "256", "--slots", "2",
        "--heartbeat-interval", "0.25", "--lora-scaled", f"{adapter}:0.5", "--lora", str(adapter),
        "--drain-timeout", "1",
    ]  # fmt: skip
    res = CliRunner().invoke(serve_cmd, args)
    assert res.exit_code == 0, res.output
    config, spec = seen["config"], seen["spec"]
    assert isinstance(config, ControlPlaneConfig)
    assert (config.max_lora_rank, config.http_n_ctx, config.heartbeat_interval_s) == (8, 256, 0.25)
    assert config.grammar_limits == GrammarLimits(max_depth=9, max_tools=3)
    assert config.lora_scaled == ((str(adapter), 0.5), (str(adapter), 1.0))  # command-line order
    assert config.worker_secret and spec.worker_secret == config.worker_secret
    worker = _params(worker_cmd, list(spec.worker_args))
    assert (worker["n_seqs"], worker["n_ctx_seq"], worker["max_lora_rank"], worker["grammar_max_depth"]) == (
        2,
        256,
        8,
        9,
    )
    assert "--max-tools" not in spec.worker_args and "--heartbeat-interval" not in spec.worker_args
    assert spec.worker_stop_grace_s == 16.0  # --drain-timeout + 15 s
    assert Path(config.data_dir) == tmp_path / "data"
