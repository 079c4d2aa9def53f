"""The worker's command-line options, beside its config (`worker.config.WorkerConfig`).

Each option's destination is a `WorkerConfig` field (``--slots`` → ``n_seqs``), and its
default, when it shows one, is read from the dataclass; the ``--grammar-max-*`` options fill
``grammar_limits`` (`loraplane.options.GRAMMAR_LIMIT_OPTIONS`). A new config field's flag is
one entry here and nothing in the CLI: `worker_config` passes every value through by name, and
`worker_argv` hands every `WORKER_RUNTIME_OPTIONS` value to the worker subprocess ``serve``
starts (``tests/unit/test_server_options.py`` checks each name is a field).

`WORKER_OPTIONS` belong to a worker process of its own (``loraplane worker``);
`WORKER_RUNTIME_OPTIONS` are what ``loraplane serve`` takes too and forwards. The launcher
(`clients.cli.server_commands`) lists them in its commands.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from loraplane.compute_spec import DEVICE_METAVAR, DTYPE_NAMES, KV_CACHE_DTYPE_NAMES
from loraplane.env import ENV_WORKER_SECRET
from loraplane.options import (
    DEVICE,
    GRAMMAR_LIMIT_OPTIONS,
    MODEL_OPTION,
    HostPortListType,
    HostPortType,
    grammar_limits_of,
    option_argv,
    positive_weight,
)
from worker.config import Batching, Fairness, PrefixCachePolicy, WorkerConfig

ENV_GRAMMAR_WARMUP = "LORAPLANE_GRAMMAR_WARMUP"
"""``0`` / ``false``: workers skip the grammar warm-up unless ``--grammar-warmup`` is given."""

WORKER_OPTIONS = (
    click.Option(
        ["--control-plane", "control_plane"],
        type=HostPortListType(),
        default=None,
        metavar="HOST:PORT[,HOST:PORT…]",
        help="Control plane to register with: one address (a Service) or every replica, "
        "comma-separated (omit: standalone).",
    ),
    click.Option(
        ["--addr"],
        type=HostPortType(),
        default=WorkerConfig.addr,
        show_default=True,
        help="Address to bind (port 0 picks a free port).",
    ),
    click.Option(
        ["--advertise-addr"],
        default=None,
        metavar="HOST:PORT",
        help="Address the control plane should dial (default: the bound one).",
    ),
    click.Option(["--worker-id"], default=WorkerConfig.worker_id, help="Stable worker name (generated when empty)."),
    click.Option(
        ["--adapter-dir", "adapter_dirs"],
        multiple=True,
        type=click.Path(file_okay=False),
        help="Directory whose files LoadAdapter may read by server path (repeatable; "
        "none: server paths are refused, adapters arrive as bytes).",
    ),
    click.Option(
        ["--worker-secret"],
        envvar=ENV_WORKER_SECRET,
        default=None,
        metavar="SECRET",
        help=f"Shared secret with the control plane (env {ENV_WORKER_SECRET}): required on "
        "every Worker RPC and sent on registration/heartbeats.",
    ),
    click.Option(
        ["--metrics-addr"],
        type=HostPortType(),
        default=None,
        metavar="HOST:PORT",
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off).",
    ),
    click.Option(
        ["--metrics-max-adapters"],
        type=click.IntRange(min=0),
        default=None,
        help="Distinct adapter label values in metrics before the rest fold into 'other' (default 64).",
    ),
    click.Option(
        ["--log-level"],
        type=click.Choice(["debug", "info", "warning", "error"]),
        default=None,
        help="Worker log level (default info; debug logs every decode step with its ubatch and time).",
    ),
)
"""Options of a worker process started on its own (``loraplane worker``), before ``--model``."""

FAIRNESS_OPTIONS = (
    click.Option(
        ["--fairness"],
        type=click.Choice([f.value for f in Fairness]),
        default=None,
        help="Admission order across tenants: off = first come, first served (resident "
        "adapters first, bounded bypass); vtc = Virtual Token Counter fair share per tenant, "
        "weighted, strict priority classes, and the queue's places shared between tenants: a "
        "lighter tenant's request takes a heavier one's newest queued place (docs/fairness.md). "
        "Default off.",
    ),
    click.Option(
        ["--fairness-prompt-weight"],
        type=float,
        default=None,
        callback=positive_weight,
        metavar="W",
        help="VTC: virtual tokens charged per prompt token (finite, > 0; default 1).",
    ),
    click.Option(
        ["--fairness-output-weight"],
        type=float,
        default=None,
        callback=positive_weight,
        metavar="W",
        help="VTC: virtual tokens charged per generated token (finite, > 0; default 2).",
    ),
)
"""Fair admission (``worker.serving.fairness``): part of `WORKER_RUNTIME_OPTIONS`."""

WORKER_RUNTIME_OPTIONS = (
    click.Option(
        ["--slots", "n_seqs"],
        type=click.IntRange(min=1),
        default=WorkerConfig.n_seqs,
        show_default=True,
        help="Parallel sequences (llama-server --parallel).",
    ),
    click.Option(
        ["--batching"],
        type=click.Choice([b.value for b in Batching]),
        default=WorkerConfig.batching.value,
        show_default=True,
        help="mixed: different adapter sets share a batch; compat: llama.cpp's rule.",
    ),
    click.Option(
        ["--prefix-cache"],
        type=click.Choice([p.value for p in PrefixCachePolicy]),
        default=WorkerConfig.prefix_cache.value,
        show_default=True,
        help="keyed: per adapter-set prefixes; llama: llama.cpp's clear-on-switch.",
    ),
    click.Option(
        ["--dtype"],
        type=click.Choice(DTYPE_NAMES),
        default=WorkerConfig.dtype,
        show_default=True,
        help="Compute (activation) dtype; on CPU f32 is the exact kernels' path; f16 is refused for "
        "Gemma 2/3 (their activations overflow it: use bf16).",
    ),
    click.Option(
        ["--kv-cache-dtype"],
        type=click.Choice(KV_CACHE_DTYPE_NAMES),
        default=WorkerConfig.kv_cache_dtype,
        show_default=True,
        help="KV cache storage on CPU (llama-server's --cache-type-k/-v): auto = f16 with --dtype f32 "
        "and packed weights (llama.cpp's default), else the compute dtype; the GPU engine takes only auto.",
    ),
    click.Option(
        ["--weights", "weight_form"],
        type=click.Choice(["packed", "dequant"]),
        default=WorkerConfig.weight_form,
        show_default=True,
        help="packed: GGUF-quantized matrices multiplied in place by our kernels; "
        "dequant: the f32/bf16 dequantized reference (slower, 4x the memory).",
    ),
    click.Option(
        ["--device"],
        type=DEVICE,
        metavar=DEVICE_METAVAR,
        default=WorkerConfig.device,
        show_default=True,
        help="auto: the current CUDA device when present, else the CPU; cuda: the current "
        "CUDA device; cuda:N: GPU N (cpu:0 is the CPU too).",
    ),
    click.Option(
        ["--n-ctx", "n_ctx_seq"], type=click.IntRange(min=16), default=None, help="KV cache tokens per sequence (slot)."
    ),
    click.Option(
        ["--queue-limit"],
        type=click.IntRange(min=0),
        default=None,
        help="Waiting requests beyond the slots before RESOURCE_EXHAUSTED.",
    ),
    click.Option(
        ["--prefix-cache-tokens"],
        type=click.IntRange(min=0),
        default=None,
        help="Token budget of the keyed prefix cache.",
    ),
    click.Option(
        ["--max-loras"],
        type=click.IntRange(min=1),
        default=None,
        help="Adapter slots in the worker's device pool (default 16); a request may use at most this many adapters.",
    ),
    click.Option(
        ["--max-cpu-loras"],
        type=click.IntRange(min=1),
        default=None,
        help="Adapters kept validated on the host, ready to page in (default 128), LRU "
        "beyond it; their bytes stay in local files read at page-in, not in worker memory.",
    ),
    click.Option(
        ["--max-lora-rank"],
        type=click.IntRange(min=1),
        default=None,
        help="Largest adapter rank a worker accepts (default 64).",
    ),
    click.Option(
        ["--drain-timeout", "drain_timeout_s"],
        type=click.FloatRange(min=0),
        default=None,
        metavar="SECONDS",
        help="On SIGTERM the worker admits nothing new and lets in-flight generations finish "
        "for up to this long, then exits; a second signal stops at once. Whatever happens, the "
        "process is gone 5 s after this (default 45; keep it + 5 below the Kubernetes "
        "manifests' terminationGracePeriodSeconds of 60).",
    ),
    *FAIRNESS_OPTIONS,
    *GRAMMAR_LIMIT_OPTIONS,
    click.Option(
        ["--grammar-warmup/--no-grammar-warmup"],
        envvar=ENV_GRAMMAR_WARMUP,
        default=None,
        help="Build the grammar engine's view of the vocabulary at start-up, before "
        "registering (default), or at the first structured-output request (several seconds "
        f"of one core; for tests that start many workers; env {ENV_GRAMMAR_WARMUP}=0).",
    ),
)
"""Options ``loraplane serve`` takes as well and hands to its worker subprocess (`worker_argv`)."""

_ENUMS: dict[str, type] = {"batching": Batching, "prefix_cache": PrefixCachePolicy, "fairness": Fairness}


def worker_config(values: Mapping[str, Any]) -> WorkerConfig:
    """The `WorkerConfig` of a worker command's option values (by option name, e.g. the
    ``loraplane worker`` callback's keyword arguments): enum choices become their enums, the
    ``--grammar-max-*`` values one ``GrammarLimits``, ``--adapter-dir`` paths absolute; a value
    that is None keeps the field's default.

    Raises:
        TypeError: a name that is no `WorkerConfig` field (an option added without its field).
    """
    fields = dict(values)
    fields["grammar_limits"] = grammar_limits_of(fields)
    for name, enum in _ENUMS.items():
        if fields.get(name) is not None:
            fields[name] = enum(fields[name])
    if "adapter_dirs" in fields:
        fields["adapter_dirs"] = tuple(str(Path(d).resolve()) for d in fields["adapter_dirs"])
    if "worker_secret" in fields:
        fields["worker_secret"] = fields["worker_secret"] or None
    return WorkerConfig(**{k: v for k, v in fields.items() if v is not None})


def worker_argv(values: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``loraplane worker`` arguments that start a worker with ``values`` (by option name:
    ``--model`` and `WORKER_OPTIONS` / `WORKER_RUNTIME_OPTIONS`); a value that is None is left
    to the worker's default.

    Raises:
        TypeError: ``values`` names no worker option.
    """
    return tuple(option_argv((MODEL_OPTION, *WORKER_OPTIONS, *WORKER_RUNTIME_OPTIONS), values))


def n_ctx_of(runtime: Mapping[str, Any]) -> int:
    """The KV cache tokens per sequence a worker started with the `WORKER_RUNTIME_OPTIONS`
    values ``runtime`` gets (``--n-ctx``, else the config's default)."""
    return int(runtime.get("n_ctx_seq") or WorkerConfig.n_ctx_seq)


def drain_timeout_of(runtime: Mapping[str, Any]) -> float:
    """The drain timeout (seconds) of a worker started with the `WORKER_RUNTIME_OPTIONS` values
    ``runtime`` (``--drain-timeout``, else the config's default)."""
    value = runtime.get("drain_timeout_s")
    return float(WorkerConfig.drain_timeout_s if value is None else value)
