"""Human-readable output of the CLI (``rich`` tables); ``--json`` output never comes here.

Generated text is always printed as plain text (``markup=False``, no highlighting) so that
brackets or emoji in a model's output are shown verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from clients.results import Adapter, DefaultSet, GenerateResult, Tenant, WorkerInfo, f32


class _StdoutConsole(Console):
    """A console that, off a terminal (piped, redirected), widens itself to the natural width
    of each table it prints, so no cell is cut with "…" or folded at 80 columns: ``workers
    list | cat`` or ``> file`` keeps full ids, addresses and paths. Tables that fill the
    width on purpose (``expand=True``, the demo's side-by-side) keep the console's width."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if not self.is_terminal:
            wide = self.options.update_width(_UNBOUNDED)
            need = max(
                (Measurement.get(self, wide, o).maximum for o in objects if isinstance(o, Table) and not o.expand),
                default=0,
            )
            if need > self.width:
                self.width = need
        super().print(*objects, **kwargs)


_UNBOUNDED = 1 << 20  # columns offered when measuring a table's natural width


def stdout_console() -> Console:
    """Rich console on stdout: a terminal's width on a TTY, each table's full width off one."""
    return _StdoutConsole(highlight=False, soft_wrap=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    """One JSON object on one line of stdout (ASCII-escaped: safe on any terminal encoding)."""
    import click

    click.echo(json.dumps(obj))


def _scales_text(entries: Sequence[dict[str, Any]] | dict[int, float]) -> str:
    if isinstance(entries, dict):
        items = sorted(entries.items())
    else:
        items = [(e["id"], e["scale"]) for e in entries]
    return ", ".join(f"{i}={f32(s):g}" for i, s in items) or "(none)"


def adapters_table(adapters: Sequence[Adapter]) -> Table:
    table = Table(title="Registered adapters", title_justify="left")
    for col in ("id", "name", "aliases", "rank", "alpha", "default", "task", "aLoRA", "pinned"):
        table.add_column(col, justify="right" if col in {"id", "alpha", "default"} else "left")
    table.add_column("sha256", min_width=12, no_wrap=True)
    table.add_column("file", overflow="fold")  # full path: `adapters show ID`
    for a in adapters:
        table.add_row(
            str(a.id),
            a.name,
            ",".join(a.aliases),
            ",".join(map(str, a.ranks)),
            f"{a.alpha:g}",
            f"{a.default_scale:g}",
            a.task_name,
            a.alora_invocation_text or ("yes" if a.is_alora else ""),
            "yes" if a.pinned else "",
            a.sha256[:12],
            a.path.replace("\\", "/").rsplit("/", 1)[-1],
        )
    if not adapters:
        table.caption = "no adapters are registered"
    return table


def adapter_detail(a: Adapter) -> Table:
    table = Table(show_header=False, title=f"Adapter {a.id}", title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in a.to_json().items():
        if isinstance(value, list):
            value = ", ".join(map(str, value))
        table.add_row(key, Text(str(value)))
    return table


def named_id(adapter_id: int, names: Mapping[int, str]) -> str:
    """``"3 (sea)"``: an adapter id with its name (`adapter_names`), the id alone when unnamed."""
    name = names.get(adapter_id, "")
    return f"{adapter_id} ({name})" if name else str(adapter_id)


def default_table(default: DefaultSet, names: Mapping[int, str]) -> Table:
    table = Table(title="Default adapter set", title_justify="left")
    table.add_column("id", justify="right")
    table.add_column("name")
    table.add_column("scale", justify="right")
    for e in default.entries:
        table.add_row(str(e.id), names.get(e.id, ""), f"{e.scale:g}")
    if not default.entries:
        table.caption = "empty: requests without an adapter map use no adapters"
    return table


def workers_table(workers: Sequence[WorkerInfo], names: Mapping[int, str]) -> Table:
    table = Table(title="Workers", title_justify="left")
    for col in (
        "worker",
        "addr",
        "state",
        "heartbeat",
        "restarts",
        "slots",
        "in flight",
        "adapters",
        "resident",
        "host",
        "page-ins",
        "evictions",
        "fetches",
        "fetched",
        "model",
    ):
        table.add_column(col)
    for w in workers:
        table.add_row(
            w.worker_id,
            w.addr,
            Text(w.state, style="green" if w.alive else "yellow" if w.state == "draining" else "red"),
            f"{w.last_heartbeat_age_s:.1f}s ago",
            str(w.restarts),
            str(w.n_slots),
            str(w.in_flight),
            ", ".join(named_id(i, names) for i in w.adapter_ids)
            + "".join(f" {i}(draining)" for i in w.draining_adapter_ids),
            f"{w.resident}/{w.max_loras}",
            f"{w.host}/{w.max_cpu_loras}",
            str(w.page_ins),
            str(w.evictions),
            str(w.fetches),
            f"{w.fetch_bytes / 2**20:.1f} MiB",
            w.model,
        )
    if not workers:
        table.caption = "no workers registered"
    return table


def telemetry_lines(result: GenerateResult) -> list[str]:
    """A few ``key value`` lines summarising a request's telemetry."""
    t = result.telemetry
    steps = t.get("steps") or []
    lines = [
        f"finish {result.finish_reason}; {len(result.token_ids)} tokens generated, "
        f"prompt {len(result.prompt_token_ids)} tokens "
        f"({t.get('cached_prompt_tokens', 0)} from the prefix cache, "
        f"policy {t.get('prefix_cache') or '?'})",
        f"adapters {_scales_text(t.get('adapters') or [])}"
        + (f"; aLoRA from token {t['alora_activation_pos']}" if t.get("alora_activation_pos", -1) >= 0 else ""),
        f"graph reused {t.get('graph_reuses', 0)} / rebuilt {t.get('graph_rebuilds', 0)} "
        f"steps; batch up to {t.get('max_batch_size', 0)} sequences, "
        f"{t.get('max_adapter_sets_in_batch', 0)} adapter sets"
        + (
            f" ({steps[-1].get('batching')} batching, {steps[-1].get('n_nodes')}/{steps[-1].get('node_budget')} nodes)"
            if steps
            else ""
        ),
        f"ttft {t.get('ttft_ms', 0.0):.1f} ms, total {t.get('total_ms', 0.0):.1f} ms; "
        f"worker {t.get('worker_id') or '?'} slot {t.get('slot_id', 0)}",
    ]
    if t.get("cache_cleared"):
        lines.append(f"slot cache cleared: {t.get('cache_clear_reason') or 'no reason given'}")
    return lines


def print_telemetry(result: GenerateResult, console: Console) -> None:
    for line in telemetry_lines(result):
        console.print(Text(line, style="dim"))


def logprobs_table(result: GenerateResult) -> Table:
    table = Table(title="Log-probs of generated tokens", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("token", justify="right")
    table.add_column("logprob", justify="right")
    table.add_column("top")
    for i, lp in enumerate(result.logprobs):
        top = "  ".join(f"{t.token_id}:{t.logprob:.3f}" for t in lp.top)
        table.add_row(str(i), str(lp.token_id), f"{lp.logprob:.4f}", top)
    return table


def prompt_logprobs_table(result: GenerateResult) -> Table:
    table = Table(title="Prompt log-probs", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("token", justify="right")
    table.add_column("logprob", justify="right")
    entries = result.prompt_logprobs or ()
    for j, token in enumerate(result.prompt_token_ids):
        entry = entries[j] if j < len(entries) else None
        table.add_row(str(j), str(token), "-" if entry is None else f"{entry.logprob:.4f}")
    return table


def side_by_side(prompt: str, columns: Sequence[tuple[str, GenerateResult]]) -> Table:
    """The demo's table: one column per adapter setting, text then telemetry."""
    table = Table(title=f"Prompt: {prompt}", title_justify="left", show_lines=True, expand=True)
    for name, _ in columns:
        table.add_column(name, ratio=1, overflow="fold")
    table.add_row(*(Text(r.text.strip() or "(empty)") for _, r in columns))
    table.add_row(*(Text("\n".join(telemetry_lines(r)), style="dim") for _, r in columns))
    return table


def _limit(value: int) -> str:
    return str(value) if value else "∞"


def tenants_table(tenants: Sequence[Tenant]) -> Table:
    """Tenants: settings (∞: unlimited) and usage over all replicas (buckets: available / limit)."""
    table = Table(title="Tenants", title_justify="left")
    for col in (
        "tenant",
        "weight",
        "priority",
        "keys",
        "in flight",
        "tokens/min",
        "requests/min",
        "requests",
        "tokens",
        "rejected",
    ):
        table.add_column(col)
    for t in tenants:
        u = t.usage
        tpm = f"{u.tokens_available:.0f}/{t.tokens_per_minute}" if t.tokens_per_minute else "∞"
        rpm = f"{u.requests_available:.0f}/{t.requests_per_minute}" if t.requests_per_minute else "∞"
        table.add_row(
            t.name,
            f"{t.weight:g}",
            str(t.priority),
            str(t.key_count),
            f"{u.in_flight}/{_limit(t.max_concurrent)}",
            tpm,
            rpm,
            str(u.requests_total),
            str(u.tokens_total),
            str(u.rejected_total),
        )
    if not tenants:
        table.caption = "no tenants configured: every request is unlimited"
    return table
