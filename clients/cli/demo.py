"""``loraplane demo``: serve with the two demo adapters and show what they do.

Starts what ``serve`` starts (control plane here, one worker subprocess) on a fresh temporary
data dir (or ``--data-dir``), with ``loraplane/demo/adapters/shout.gguf`` and ``sea.gguf`` (package data,
:data:`DEMO_DIR`) registered as with ``--lora-init-without-apply`` (loaded, default set empty).
Once the worker is up it
sends one prompt three times at once — no adapters, shout@1, sea@1 — so the three requests
can share a batch (mixed batching), prints the greedy continuations side by side with their
telemetry, and keeps serving until interrupted (``--once``: exits after printing).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

import loraplane
from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from clients.results import GenerateResult, WorkerInfo
from loraplane.compute_spec import DEVICE_METAVAR, DTYPE_NAMES
from loraplane.options import DEVICE

DEMO_DIR = Path(loraplane.__file__).resolve().parent / "demo" / "adapters"
"""``loraplane/demo/adapters/``: package data, the same folder in a checkout and in the wheel."""
DEMO_ADAPTERS = (("shout", DEMO_DIR / "shout.gguf"), ("sea", DEMO_DIR / "sea.gguf"))
DEFAULT_PROMPT = "Tell me about the weather today."


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def demo_adapter_ids(client: LoraplaneClient) -> dict[str, int]:
    """The ids the control plane gave the demo adapters, matched by content hash."""
    by_sha = {a.sha256: a.id for a in client.list_adapters()}
    ids = {}
    for name, path in DEMO_ADAPTERS:
        sha = _sha256(path)
        if sha not in by_sha:
            raise LoraplaneError("NOT_FOUND", f"demo adapter {path} is not registered")
        ids[name] = by_sha[sha]
    return ids


def run_demo_requests(
    client: LoraplaneClient, prompt: str, max_tokens: int, ids: dict[str, int]
) -> list[tuple[str, GenerateResult]]:
    """Base, shout and sea continuations of ``prompt`` (greedy), sent concurrently."""
    settings: list[tuple[str, dict[int, float]]] = [
        ("base (no adapters)", {}),
        (f"shout (id {ids['shout']} @ 1.0)", {ids["shout"]: 1.0}),
        (f"sea (id {ids['sea']} @ 1.0)", {ids["sea"]: 1.0}),
    ]
    with ThreadPoolExecutor(max_workers=len(settings)) as pool:
        futures = [
            pool.submit(client.generate, prompt, adapters=adapters, max_tokens=max_tokens, temperature=0.0)
            for _, adapters in settings
        ]
        return [(name, fut.result()) for (name, _), fut in zip(settings, futures, strict=True)]


def _ready_hook(prompt: str, max_tokens: int, once: bool, as_json: bool, addresses: str = ""):
    def on_ready(client: LoraplaneClient, worker: WorkerInfo) -> bool:
        from clients.cli.render import side_by_side, stdout_console

        console = stdout_console()
        ids = demo_adapter_ids(client)
        columns = run_demo_requests(client, prompt, max_tokens, ids)
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "prompt": prompt,
                        "results": [
                            {"name": name, "text": r.text, "token_ids": list(r.token_ids), "telemetry": r.telemetry}
                            for name, r in columns
                        ],
                    },
                    ensure_ascii=False,
                )
            )
        else:
            console.print(side_by_side(prompt, columns))
        if not once:
            console.print(
                f"Serving on {client.addr}{addresses}. Try:  loraplane generate --addr "
                f'{client.addr} --lora {ids["shout"]}=1 "{prompt}"   '
                "(Ctrl-C stops)",
                markup=False,
            )
        return once

    return on_ready


@click.command("demo")
@click.option("--once", is_flag=True, help="Exit after printing the comparison.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as one JSON object.")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Data dir to use (default: a fresh temporary one, removed on exit).",
)
@click.option(
    "--addr", default="127.0.0.1:50051", show_default=True, help="Control plane address (port 0 picks a free port)."
)
@click.option(
    "--model", "model_path", default=None, metavar="PATH", help="Base model GGUF (default: the embedded Gemma 3 270M)."
)
@click.option("--device", type=DEVICE, metavar=DEVICE_METAVAR, default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="f32", show_default=True)
@click.option("--ready-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True, metavar="SECONDS")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="warning",
    show_default=True,
    help="Control-plane log level.",
)
@click.option(
    "--http-addr",
    default="127.0.0.1:0",
    show_default=True,
    help="OpenAI-compatible HTTP API (port 0 picks a free port; printed).",
)
@click.option(
    "--metrics-addr",
    default="127.0.0.1:0",
    show_default=True,
    help="Control-plane Prometheus endpoint (the worker gets a free port; both printed).",
)
@click.pass_context
def demo_cmd(
    ctx: click.Context,
    once: bool,
    as_json: bool,
    prompt: str,
    max_tokens: int,
    data_dir: str | None,
    addr: str,
    model_path: str | None,
    device: str,
    dtype: str,
    ready_timeout: float,
    log_level: str,
    http_addr: str,
    metrics_addr: str,
) -> None:
    """Serve with the shout and sea demo adapters and compare them on one prompt."""
    from clients.cli.serve import ServeSpec, resolve_port, run_serve
    from clients.cli.server_commands import load_control_plane
    from control_plane.options import control_plane_config
    from loraplane.worker_secret import new_worker_secret
    from worker.options import worker_argv

    missing = [str(p) for _, p in DEMO_ADAPTERS if not p.is_file()]
    if missing:
        raise click.ClickException(f"demo adapters missing: {', '.join(missing)}")
    run_control_plane = load_control_plane()
    temporary = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="loraplane-demo-")) if data_dir is None else Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    addr = resolve_port(addr)
    http_addr, metrics_addr = resolve_port(http_addr), resolve_port(metrics_addr)
    worker_metrics_addr = resolve_port("127.0.0.1:0")
    worker_secret = new_worker_secret()  # as ``serve``: its own worker only, given in the environment
    config = control_plane_config(
        {
            "addr": addr,
            "data_dir": str(root),
            "adapter_dirs": [str(DEMO_DIR)],
            "model_path": model_path,
            "lora_init_without_apply": True,
            "worker_secret": worker_secret,
            "log_level": log_level,
            "http_addr": http_addr,
            "metrics_addr": metrics_addr,
        },
        adapters=[(str(p), 1.0) for _, p in DEMO_ADAPTERS],
    )
    spec = ServeSpec(
        cp_addr=addr,
        worker_args=worker_argv(
            {"model_path": model_path, "dtype": dtype, "device": device, "metrics_addr": worker_metrics_addr}
        ),
        ready_timeout_s=ready_timeout,
        worker_secret=worker_secret,
        worker_log=root / "worker.log",
        quiet=once,
        http_addr=http_addr,
        metrics_addr=metrics_addr,
        worker_metrics_addr=worker_metrics_addr,
    )
    click.echo(
        f"loraplane demo: data dir {root}, worker log {spec.worker_log}; loading the model...{spec.addresses()}",
        err=True,
    )
    try:
        code = run_serve(
            spec, run_control_plane, config, on_ready=_ready_hook(prompt, max_tokens, once, as_json, spec.addresses())
        )
    except (OSError, RuntimeError, ValueError) as err:
        raise click.ClickException(f"demo failed: {err}") from None
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
    ctx.exit(code)
