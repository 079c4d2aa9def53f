"""Offline tool commands of the ``loraplane`` CLI: ``convert-peft``, ``export-lora``, ``bench``.

They run in this process, need no server and import their implementation lazily. Problems
with the inputs arrive as ``ValueError`` subclasses carrying every problem found; they end
with exit code 1 and the message on stderr.
"""

from __future__ import annotations

import importlib

import click

from clients.peft import adapter_source_problem
from loraplane.options import PATH_OPTIONAL_SCALE


def _tool_failed(what: str, err: BaseException) -> click.ClickException:
    return click.ClickException(f"{what}: {err}")


@click.command("convert-peft")
@click.argument("peft_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", "out_path", required=True, metavar="OUT.gguf", help="Adapter GGUF to write.")
@click.option(
    "--model",
    "base_gguf",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    metavar="BASE.gguf",
    help="Base model: gives the architecture and validates the result.",
)
@click.option(
    "--outtype",
    type=click.Choice(["f32", "f16"]),
    default="f32",
    show_default=True,
    help="Storage type of the A/B tensors.",
)
def convert_peft_cmd(peft_dir: str, out_path: str, base_gguf: str | None, outtype: str) -> None:
    """Convert a PEFT LoRA folder (adapter_config.json + safetensors) into an adapter GGUF."""
    try:
        from loraplane.formats.convert_peft import convert_peft
    except ImportError as err:
        raise click.ClickException(f"convert-peft is not available: {err}") from None
    from loraplane.progress import progress_bar, progress_enabled

    try:
        with progress_bar("converting modules", enabled=progress_enabled()) as advance:
            written = convert_peft(peft_dir, out_path, base_gguf=base_gguf, outtype=outtype, progress=advance)
    except (ValueError, OSError) as err:
        raise _tool_failed("convert-peft", err) from None
    click.echo(f"wrote {written or out_path}")


@click.command("export-lora")
@click.option(
    "--model",
    "base_gguf",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    metavar="BASE.gguf",
    help="Base model GGUF.",
)
@click.option(
    "--lora",
    "loras",
    required=True,
    multiple=True,
    type=PATH_OPTIONAL_SCALE,
    help="Adapter to merge, with its scale (default 1); repeatable.",
)
@click.option("-o", "--output", "out_path", required=True, metavar="OUT.gguf", help="Merged model GGUF to write.")
@click.option(
    "--outtype",
    type=click.Choice(["f32", "f16", "q8_0"]),
    default="f32",
    show_default=True,
    help="Storage type of the merged weights.",
)
def export_lora_cmd(base_gguf: str, loras: tuple[tuple[str, float], ...], out_path: str, outtype: str) -> None:
    """Merge adapters into the base model (dequantize, add scale·B·A, write back)."""
    for path, _ in loras:
        if (problem := adapter_source_problem(path, peft=False)) is not None:
            raise click.BadParameter(problem, param_hint="--lora")
    try:
        from worker.tools.export_lora import export_lora
    except ImportError as err:
        raise click.ClickException(f"export-lora is not available: {err}") from None
    from loraplane.progress import progress_bar, progress_enabled

    try:
        with progress_bar("writing tensors", enabled=progress_enabled()) as advance:
            written = export_lora(base_gguf, list(loras), out_path, outtype=outtype, progress=advance)
    except (ValueError, OSError) as err:
        raise _tool_failed("export-lora", err) from None
    click.echo(f"wrote {written or out_path}")


BENCH_MODULE = "bench.__main__"
"""The module ``loraplane bench`` runs (imported on use: product code never imports the bench at
module level)."""


@click.command("bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--quick", is_flag=True, help="A short run (minutes, not tens of minutes).")
@click.option("--json", "json_out", default=None, metavar="OUT", help="Also write the results as JSON to OUT.")
@click.pass_context
def bench_cmd(ctx: click.Context, quick: bool, json_out: str | None) -> None:
    """Run the benchmarks (further options are passed to bench as they are)."""
    try:
        bench_main = importlib.import_module(BENCH_MODULE).main
    except ModuleNotFoundError as err:
        if err.name and (BENCH_MODULE + ".").startswith(err.name + "."):
            raise click.ClickException("bench not installed") from None
        raise click.ClickException(f"bench is not available: {err}") from None
    except AttributeError:
        raise click.ClickException(f"bench not installed ({BENCH_MODULE} has no main)") from None
    argv = (["--quick"] if quick else []) + (["--json", json_out] if json_out else [])
    code = bench_main(argv + list(ctx.args))
    ctx.exit(int(code or 0))


TOOL_COMMANDS = (convert_peft_cmd, export_lora_cmd, bench_cmd)
