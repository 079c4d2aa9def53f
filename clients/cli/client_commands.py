"""Client commands of the ``loraplane`` CLI: generate, adapters, default, workers.

Exit codes: 0 success; 1 the server refused (with ``--json`` the error object
goes to stdout, else the message to stderr); 2 usage error (click); 3 the server cannot be
reached.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import click

from clients.channel import parse_addresses
from clients.cli.params import (
    ADAPTER_REF,
    ADAPTER_SCALE,
    TOKEN_IDS,
    UINT32_MAX,
    UINT64_MAX,
    AdapterKey,
    client_options,
    scales_to_map,
)
from clients.client import LoraplaneClient
from clients.errors import LoraplaneError, ServerUnreachable
from clients.results import DefaultSet, ResultBuilder, TokenEvent, adapter_names
from loraplane.env import ENV_ADMIN_TOKEN, ENV_API_KEY

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class ClientOptions:
    addr: str
    as_json: bool
    admin_token: str | None
    api_key: str | None
    timeout: float | None
    connect_timeout: float

    def client(self) -> LoraplaneClient:
        return LoraplaneClient(
            self.addr,
            admin_token=self.admin_token,
            api_key=self.api_key,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
        )


def _opts(kwargs: dict) -> ClientOptions:
    try:
        parse_addresses(kwargs["addr"])
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--addr") from None
    return ClientOptions(
        addr=kwargs.pop("addr"),
        as_json=kwargs.pop("as_json"),
        admin_token=kwargs.pop("admin_token"),
        api_key=kwargs.pop("api_key"),
        timeout=kwargs.pop("timeout"),
        connect_timeout=kwargs.pop("connect_timeout"),
    )


AUTH_HINTS = (
    ("admin token", f"the admin token comes from --admin-token or ${ENV_ADMIN_TOKEN}"),
    ("API key", f"the API key comes from --api-key or ${ENV_API_KEY} (--admin-token passes too)"),
)
"""For an UNAUTHENTICATED answer: what the server's message names (``loraplane.interceptors``:
"needs the admin token", "API key (...) rejected") → where the CLI takes that credential."""


def with_auth_hint(err: LoraplaneError) -> LoraplaneError:
    """``err`` with the flag and environment variable of the credential it names appended, when
    it is an UNAUTHENTICATED answer about the admin token or the API key; else ``err``."""
    if err.code != "UNAUTHENTICATED" or isinstance(err, ServerUnreachable):
        return err
    for named, hint in AUTH_HINTS:
        if named in err.message:
            return LoraplaneError(err.code, f"{err.message}; {hint}")
    return err


def report_error(err: LoraplaneError, as_json: bool) -> None:
    """Print ``err`` (stderr, or the ``--json`` error object on stdout), auth errors with the
    flag to fix them (`with_auth_hint`)."""
    from clients.cli.render import print_json

    err = with_auth_hint(err)
    if as_json:
        print_json(err.to_json())
    elif isinstance(err, ServerUnreachable):
        click.echo(f"loraplane: {err.message}", err=True)
    else:
        click.echo(f"loraplane: {err.code}: {err.message}", err=True)


@contextmanager
def server_call(opts: ClientOptions) -> Iterator[LoraplaneClient]:
    """A connected client; server errors become exit codes 1 and 3, Ctrl-C exit 130."""
    ctx = click.get_current_context()
    client = opts.client()
    try:
        yield client
    except ServerUnreachable as err:
        report_error(err, opts.as_json)
        ctx.exit(EXIT_UNREACHABLE)
    except LoraplaneError as err:
        report_error(err, opts.as_json)
        ctx.exit(EXIT_REFUSED)
    except KeyboardInterrupt:
        click.echo("\nloraplane: interrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    finally:
        client.close()


# ---- generate ----------------------------------------------------------------------------


@click.command()
@click.argument("prompt", required=False)
@click.option(
    "--prompt-tokens",
    type=TOKEN_IDS,
    default=None,
    help="Prompt as token ids, taken verbatim (nothing added). Instead of PROMPT.",
)
@click.option(
    "--lora",
    "loras",
    type=ADAPTER_SCALE,
    multiple=True,
    help="Use adapter ID (or NAME: its name or an alias) at SCALE (repeatable); every other adapter at 0.",
)
@click.option("--no-lora", is_flag=True, help="Use no adapters at all (not the default set).")
@click.option("--max-tokens", type=click.IntRange(min=1, max=UINT32_MAX), default=16, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy.")
@click.option(
    "--top-k", type=click.IntRange(min=0, max=UINT32_MAX), default=0, show_default=True, help="0: no top-k cut."
)
@click.option("--top-p", type=click.FloatRange(min=0, max=1), default=1.0, show_default=True)
@click.option(
    "--min-p",
    type=click.FloatRange(min=0, max=1),
    default=0.0,
    show_default=True,
    help="Drop tokens less likely than MIN_P × the most likely one (after temperature); 0: off.",
)
@click.option(
    "--presence-penalty",
    type=click.FloatRange(min=-2, max=2),
    default=0.0,
    show_default=True,
    help="Subtracted from the logit of every token already generated (OpenAI / vLLM).",
)
@click.option(
    "--frequency-penalty",
    type=click.FloatRange(min=-2, max=2),
    default=0.0,
    show_default=True,
    help="Subtracted once per occurrence of a token in the generated text (OpenAI / vLLM).",
)
@click.option(
    "--repetition-penalty",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Tokens of the prompt or the output: positive logits divided by it, others multiplied (vLLM); 1: off.",
)
@click.option("--seed", type=click.IntRange(min=0, max=UINT64_MAX), default=None)
@click.option(
    "--logprobs",
    type=click.IntRange(min=0, max=UINT32_MAX),
    default=None,
    metavar="N",
    help="Return each generated token's log-prob and the top N alternatives.",
)
@click.option("--prompt-logprobs", is_flag=True, help="Return the log-prob of every prompt token given its prefix.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-generation.")
@click.option(
    "--stop",
    "stop",
    multiple=True,
    metavar="TEXT",
    help="Stop when the generated text contains TEXT (cut before it; repeatable).",
)
@click.option(
    "--json-schema",
    "json_schema",
    type=click.File("r"),
    default=None,
    metavar="FILE",
    help="Structured output: the text is JSON valid against the JSON Schema in FILE ('-': stdin).",
)
@click.option("--strict", is_flag=True, help="With --json-schema: objects admit no properties beyond the listed ones.")
@click.option("--json-object", is_flag=True, help="Structured output: the text is a JSON object.")
@click.option("--regex", default=None, metavar="REGEX", help="Structured output: the whole text matches REGEX.")
@click.option(
    "--grammar",
    type=click.File("r"),
    default=None,
    metavar="FILE",
    help="Structured output: the text follows the Lark (or llama.cpp GBNF) grammar in FILE.",
)
@click.option("--request-id", default="", help="Request id (assigned by the server if empty).")
@click.option("--no-telemetry", is_flag=True, help="Text mode: print only the generated text.")
@client_options
def generate(
    prompt: str | None,
    prompt_tokens: tuple[int, ...] | None,
    loras: tuple[tuple[AdapterKey, float], ...],
    no_lora: bool,
    logprobs: int | None,
    prompt_logprobs: bool,
    no_telemetry: bool,
    stop: tuple[str, ...],
    **kwargs,
) -> None:
    """Generate a continuation of PROMPT (or of --prompt-tokens), streaming tokens.

    Adapters: no --lora and no --no-lora → the control plane's default set; --no-lora →
    none; --lora ID=SCALE… or NAME=SCALE… → exactly those (ASCII digits are always an id).
    """
    opts = _opts(kwargs)
    if (prompt is None) == (prompt_tokens is None):
        raise click.UsageError("give exactly one of PROMPT or --prompt-tokens")
    if loras and no_lora:
        raise click.UsageError("--lora and --no-lora exclude each other")
    if any(not s for s in stop):
        raise click.BadParameter("stop strings must not be empty", param_hint="--stop")
    structured = {
        "json_schema": kwargs["json_schema"].read() if kwargs["json_schema"] else None,
        "json_object": kwargs["json_object"],
        "regex": kwargs["regex"],
        "grammar": kwargs["grammar"].read() if kwargs["grammar"] else None,
    }
    if sum(v is not None and v is not False for v in structured.values()) > 1:
        raise click.UsageError("give at most one of --json-schema, --json-object, --regex, --grammar")
    adapters: dict[AdapterKey, float] | None = None
    if no_lora:
        adapters = {}
    elif loras:
        adapters = scales_to_map(loras, "--lora")
    sampling = dict(
        max_tokens=kwargs["max_tokens"],
        temperature=kwargs["temperature"],
        top_k=kwargs["top_k"],
        top_p=kwargs["top_p"],
        min_p=kwargs["min_p"],
        presence_penalty=kwargs["presence_penalty"],
        frequency_penalty=kwargs["frequency_penalty"],
        repetition_penalty=kwargs["repetition_penalty"],
        seed=kwargs["seed"],
        logprobs=logprobs or 0,
        prompt_logprobs=prompt_logprobs,
        ignore_eos=kwargs["ignore_eos"],
        request_id=kwargs["request_id"],
        stop=stop,
        strict=kwargs["strict"],
        **structured,
    )
    builder = ResultBuilder()
    streamed = False
    with server_call(opts) as client:
        try:
            for ev in client.generate_stream(prompt, prompt_tokens=prompt_tokens, adapters=adapters, **sampling):
                builder.add(ev)
                if not opts.as_json and isinstance(ev, TokenEvent) and ev.text:
                    click.echo(ev.text, nl=False)
                    streamed = True
        finally:
            if streamed:
                click.echo()
        if builder.finished is None:
            raise LoraplaneError("UNKNOWN", "the generation stream ended before finishing")
    result = builder.build()
    if opts.as_json:
        from clients.cli.render import print_json

        print_json(result.to_json(include_logprobs=logprobs is not None, include_prompt_logprobs=prompt_logprobs))
        return
    if not streamed and result.text:
        click.echo(result.text)
    if no_telemetry:
        return
    from clients.cli.render import (
        logprobs_table,
        print_telemetry,
        prompt_logprobs_table,
        stderr_console,
    )

    console = stderr_console()
    print_telemetry(result, console)
    if logprobs is not None:
        console.print(logprobs_table(result))
    if prompt_logprobs:
        console.print(prompt_logprobs_table(result))


# ---- adapters ----------------------------------------------------------------------------


@click.group()
def adapters() -> None:
    """List, inspect, register and unregister LoRA adapters."""


@adapters.command("list")
@client_options
def adapters_list(**kwargs) -> None:
    """List registered adapters."""
    opts = _opts(kwargs)
    with server_call(opts) as client:
        found = client.list_adapters()
    from clients.cli.render import adapters_table, print_json, stdout_console

    if opts.as_json:
        print_json({"adapters": [a.to_json() for a in found]})
    else:
        stdout_console().print(adapters_table(found))


@adapters.command("show")
@click.argument("adapter_id", metavar="ID|NAME", type=ADAPTER_REF)
@client_options
def adapters_show(adapter_id: AdapterKey, **kwargs) -> None:
    """Show everything known about adapter ID (or NAME: its name or an alias)."""
    opts = _opts(kwargs)
    with server_call(opts) as client:
        adapter = client.get_adapter(adapter_id)
    from clients.cli.render import adapter_detail, print_json, stdout_console

    if opts.as_json:
        print_json(adapter.to_json())
    else:
        stdout_console().print(adapter_detail(adapter))


@adapters.command("add")
@click.argument("file", metavar="FILE")
@click.option("--name", default=None, help="Display name (default: the file's general.name).")
@click.option("--server-path", is_flag=True, help="FILE is a path on the server: register it without uploading.")
@click.option("--pin", is_flag=True, help="Pin it: workers never evict it from their slots or host cache.")
@client_options
def adapters_add(file: str, name: str | None, server_path: bool, pin: bool, **kwargs) -> None:
    """Register the adapter GGUF FILE or PEFT folder (uploaded in chunks unless --server-path).

    A PEFT folder (adapter_config.json + adapter_model.safetensors) is converted like
    ``convert-peft`` does: here before an upload, by the control plane for --server-path.
    """
    from clients.peft import adapter_source_problem, is_peft_folder
    from loraplane.progress import UPLOAD_BAR_BYTES, progress_bar, progress_enabled

    opts = _opts(kwargs)
    if server_path:
        # Relative paths mean "relative to where I am", as for an upload.
        file = os.path.abspath(file) if not os.path.isabs(file) else file
    elif (problem := adapter_source_problem(file)) is not None:
        raise click.BadParameter(problem, param_hint="FILE")
    big = server_path or is_peft_folder(file) or os.path.getsize(file) > UPLOAD_BAR_BYTES
    with (
        server_call(opts) as client,
        progress_bar(
            f"uploading {os.path.basename(file.rstrip(os.sep))}",
            unit="bytes",
            enabled=big and not server_path and progress_enabled(as_json=opts.as_json),
        ) as advance,
    ):
        try:
            adapter = client.add_adapter(file, name=name, server_path=server_path, progress=advance)
        except ValueError as err:  # a PEFT folder that cannot be converted (every problem listed)
            raise LoraplaneError("INVALID_ARGUMENT", str(err)) from None
        if pin:
            adapter = client.pin_adapter(adapter.id, True)
    from clients.cli.render import print_json

    if opts.as_json:
        print_json(adapter.to_json())
    else:
        click.echo(f"registered adapter {adapter.id} ({adapter.name or 'unnamed'}, sha256 {adapter.sha256[:12]})")


@adapters.command("remove")
@click.argument("adapter_ref", metavar="ID|NAME", type=ADAPTER_REF)
@client_options
def adapters_remove(adapter_ref: AdapterKey, **kwargs) -> None:
    """Unregister adapter ID (or NAME: its name or an alias), with every name it has; its id
    is never reused."""
    opts = _opts(kwargs)
    with server_call(opts) as client:
        adapter_id = adapter_ref if isinstance(adapter_ref, int) else client.get_adapter(adapter_ref).id
        client.remove_adapter(adapter_id)
    from clients.cli.render import print_json

    if opts.as_json:
        print_json({"id": adapter_id, "removed": True})
    else:
        click.echo(f"removed adapter {adapter_id}")


def _pin_command(adapter_ref: AdapterKey, pinned: bool, kwargs: dict) -> None:
    opts = _opts(kwargs)
    with server_call(opts) as client:
        adapter = client.pin_adapter(adapter_ref, pinned)
    from clients.cli.render import print_json

    if opts.as_json:
        print_json(adapter.to_json())
    else:
        click.echo(f"{'pinned' if pinned else 'unpinned'} adapter {adapter.id}")


@adapters.command("pin")
@click.argument("adapter_id", metavar="ID|NAME", type=ADAPTER_REF)
@client_options
def adapters_pin(adapter_id: AdapterKey, **kwargs) -> None:
    """Pin adapter ID (or NAME): workers never evict it from their slot pool or host cache."""
    _pin_command(adapter_id, True, kwargs)


@adapters.command("unpin")
@click.argument("adapter_id", metavar="ID|NAME", type=ADAPTER_REF)
@client_options
def adapters_unpin(adapter_id: AdapterKey, **kwargs) -> None:
    """Unpin adapter ID (or NAME; it is evicted by LRU like any other)."""
    _pin_command(adapter_id, False, kwargs)


# ---- default set -------------------------------------------------------------------------


@click.group()
def default() -> None:
    """Show or replace the global default adapter set."""


def known_names(client: LoraplaneClient) -> dict[int, str]:
    """``{id: name}`` of the registered adapters, for output beside ids; empty when the list
    cannot be had (the names are a help to read the answer, never a reason to fail it)."""
    try:
        return adapter_names(client.list_adapters())
    except LoraplaneError:
        return {}


def _print_default(opts: ClientOptions, default_set: DefaultSet, names: Mapping[int, str]) -> None:
    from clients.cli.render import default_table, print_json, stdout_console

    if opts.as_json:
        print_json(default_set.to_json(names))
    else:
        stdout_console().print(default_table(default_set, names))


@default.command("get")
@client_options
def default_get(**kwargs) -> None:
    """Show the default set (used by requests that carry no adapter map)."""
    opts = _opts(kwargs)
    with server_call(opts) as client:
        current = client.get_default()
        names = known_names(client)
    _print_default(opts, current, names)


@default.command("set")
@click.argument("entries", metavar="ID|NAME=SCALE...", type=ADAPTER_SCALE, nargs=-1)
@click.option("--clear", is_flag=True, help="Set the default to no adapters.")
@client_options
def default_set(entries: tuple[tuple[AdapterKey, float], ...], clear: bool, **kwargs) -> None:
    """Replace the default set with ID=SCALE… or NAME=SCALE… (others at 0), or --clear it."""
    opts = _opts(kwargs)
    if bool(entries) == clear:
        raise click.UsageError("give ID=SCALE… or --clear (not both)")
    scales = {} if clear else scales_to_map(entries, "ID=SCALE")
    with server_call(opts) as client:
        current = client.set_default(scales)
        names = known_names(client)
    _print_default(opts, current, names)


# ---- workers -----------------------------------------------------------------------------


@click.group()
def workers() -> None:
    """Inspect the workers registered with the control plane."""


@workers.command("list")
@client_options
def workers_list(**kwargs) -> None:
    """List workers with their state, slots and loaded adapters."""
    opts = _opts(kwargs)
    with server_call(opts) as client:
        found = client.list_workers()
        names = known_names(client)
    from clients.cli.render import print_json, stdout_console, workers_table

    if opts.as_json:
        print_json({"workers": [w.to_json(names) for w in found]})
    else:
        stdout_console().print(workers_table(found, names))


CLIENT_COMMANDS = (generate, adapters, default, workers)
