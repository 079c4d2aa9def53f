"""Fast checks of the pieces behind the HTTP front and the metrics: chat templates, stop
strings, bounded labels, model names, progress switches, the store migration, the connection
guard's sweep pacing."""

from __future__ import annotations

import sqlite3

import pytest

from control_plane.http.chat_template import GEMMA_TURN_TEMPLATE, ChatTemplateError, load_chat_template
from control_plane.http.connections import SWEEP_INTERVAL_S, ConnectionGuard
from loraplane.metrics import OTHER_LABEL, BoundedLabels
from worker.serving.output import StopMatcher


def test_template_precedence_file_then_gguf_then_builtin(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ bos_token }}F{{ messages[0]['content'] }}")
    meta = {"tokenizer.chat_template": "{{ bos_token }}G{{ messages[0]['content'] }}"}
    msgs = [{"role": "user", "content": "x"}]
    kw = dict(arch="gemma3", bos_token="<s>", eos_token="</s>")
    assert load_chat_template(override_file=str(f), metadata=meta, **kw).render(msgs) == "<s>Fx"
    assert load_chat_template(override_file=None, metadata=meta, **kw).render(msgs) == "<s>Gx"
    builtin = load_chat_template(override_file=None, metadata={}, **kw)
    assert builtin.source == "builtin:gemma3" and builtin.text == GEMMA_TURN_TEMPLATE
    assert (
        builtin.render(
            [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}], add_generation_prompt=False
        )
        == "<s><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
    )
    assert load_chat_template(override_file=None, metadata={}, arch="llama", bos_token="", eos_token="") is None


def test_template_raise_exception_and_sandbox():
    t = load_chat_template(override_file=None, metadata={}, arch="gemma3", bos_token="<bos>", eos_token="<eos>")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        t.render([{"role": "assistant", "content": "first"}])
    evil = load_chat_template(
        override_file=None,
        metadata={"tokenizer.chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"},
        arch="x",
        bos_token="",
        eos_token="",
    )
    with pytest.raises(ChatTemplateError):
        evil.render([])


def _template(text: str):
    from control_plane.http.chat_template import ChatTemplate

    return ChatTemplate(source="file:test", text=text, bos_token="", eos_token="")


@pytest.mark.parametrize(
    "text",
    [
        # calls range() between inner loops: the sandbox's hooks see the deadline
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        # loops over a string, no call or lookup inside: only the watchdog can stop it
        "{% set s = messages[0].content %}{% for a in s %}{% for b in s %}{% for c in s %}"
        "{% for d in s %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}",
    ],
)
def test_template_endless_loop_is_stopped_by_its_time_bound(text):
    import time

    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="time limit of 0.2 s") as err:
        _template(text).render([{"role": "user", "content": "x" * 300}], timeout_s=0.2)
    assert err.value.code == "chat_template_timeout" and time.monotonic() - t0 < 5
    # the watchdog's exception never outlives the call: this thread keeps running code
    t1 = time.monotonic()
    while time.monotonic() - t1 < 0.4:
        sum(range(1000))


@pytest.mark.parametrize(
    "text, code",
    [
        ("{% macro f(x) %}{{ f(x ~ 'a') }}{% endmacro %}{{ f('') }}", "chat_template_recursion"),
        ("{{ 'ab' * 10**9 }}", "chat_template_too_large"),
        ("{{ 7 ** 100000 }}", "chat_template_too_large"),
        ("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}", "chat_template_too_large"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "chat_template_too_large",
        ),
    ],
)
def test_template_recursion_and_size_bounds(text, code):
    with pytest.raises(ChatTemplateError) as err:
        _template(text).render([{"role": "user", "content": "y" * 1000}], max_chars=100_000)
    assert err.value.code == code


def test_bounded_render_keeps_normal_output_and_reuses_the_compiled_template():
    t = load_chat_template(override_file=None, metadata={}, arch="gemma3", bos_token="<bos>", eos_token="<eos>")
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render(msgs) == t.render(msgs) == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert t._compiled is t._compiled


def test_cli_ids_are_ascii_digits():
    import click

    from clients.cli.params import AdapterIdType, TokenIdsType
    from loraplane.options import HostPortType

    assert AdapterIdType().convert("7", None, None) == 7
    for bad in ("\u0663", "1_0", "+3", "4294967296", "-1", "12345678901234567890"):
        with pytest.raises(click.BadParameter):
            AdapterIdType().convert(bad, None, None)
    with pytest.raises(click.BadParameter):
        TokenIdsType().convert("1,\u0663", None, None)
    with pytest.raises(click.BadParameter):
        HostPortType().convert("localhost:\u0668\u0660", None, None)


def test_not_found_messages_name_at_most_16_adapters():
    from control_plane.errors import NotFoundError
    from control_plane.resolution import find_adapter
    from tests.helpers.http_fakes import FakeRecord

    records = [FakeRecord(i, f"adapter-{i:05d}-" + "n" * 240) for i in range(2000)]
    for token, start in (("nope", "no adapter is named 'nope' (names: ['adapter-00000-"), ("99999", "adapter 99999")):
        with pytest.raises(NotFoundError) as err:
            find_adapter(token, records)  # type: ignore[arg-type]
        message = str(err.value)
        assert message.startswith(start) and len(message) < 6000, len(message)  # was 500 KB
        assert "registered ids: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, … and 1984 more]" in message
    with pytest.raises(NotFoundError, match=r"registered ids: \[0, 1\]$"):
        find_adapter("7", records[:2])  # type: ignore[arg-type]


def test_parse_adapter_id_is_ascii_and_uint32():
    from control_plane.resolution import parse_adapter_id

    assert parse_adapter_id("0") == 0 and parse_adapter_id("4294967295") == 2**32 - 1
    for bad in ("\u0663", "", "3 ", "+3", "1_0", "4294967296", "12345678901234567890"):
        assert parse_adapter_id(bad) is None


@pytest.mark.parametrize(
    "pieces, stops, emitted, hit",
    [
        (["Hello", " wor", "ld. Next"], ["."], ["Hello", " wor", "ld"], True),
        (["ab", "c", "d"], ["cd"], ["ab", "", ""], True),  # "c" held back until "d" completes the stop
        (["ab", "c", "e"], ["cd"], ["ab", "", "ce"], False),  # released once it cannot be a stop any more
        (["x<en", "d>y"], ["<end>", "zz"], ["x", ""], True),
    ],
)
def test_stop_matcher(pieces, stops, emitted, hit):
    m = StopMatcher(stops)
    out, found = [], False
    for p in pieces:
        text, found = m.push(p)
        out.append(text)
        if found:
            break
    assert out == emitted and found is hit


def test_stop_matcher_flush_returns_held_tail():
    m = StopMatcher(["END"])
    assert m.push("the EN") == ("the ", False)
    assert m.flush() == "EN"


def test_bounded_labels_fold_the_rest_into_other():
    labels = BoundedLabels(2)
    assert [labels(v) for v in ("3", "5", "3", "9", "none", "5")] == ["3", "5", "3", OTHER_LABEL, "none", "5"]


def test_progress_is_off_under_json_and_without_a_tty(monkeypatch):
    from loraplane.progress import progress_bar, progress_enabled

    assert progress_enabled(as_json=True) is False
    assert progress_enabled() is False  # pytest captures stderr: not a TTY
    with progress_bar("x", enabled=False) as advance:
        advance(1, 2)  # a no-op


def test_store_migration_adds_source_format(tmp_path):
    """A database written before the column existed (schema version 2) is migrated: its rows
    read as "gguf", new rows keep what they are given."""
    from control_plane.store import MIGRATIONS, open_store

    db = tmp_path / "loraplane.sqlite3"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO schema_version (version) VALUES (2)")
    for migration in MIGRATIONS[:2]:
        for sql in migration.sqlite:
            conn.execute(sql)
    conn.execute(
        "INSERT INTO adapters (id, sha256, name, path, metadata, default_scale, created_at) "
        "VALUES (0, 'ab', 'old', '/x.gguf', '{}', 0, 0)"
    )
    conn.execute("UPDATE id_counter SET next_id = 1")
    conn.commit()
    conn.close()
    store = open_store(None, tmp_path)
    try:
        assert store.schema_version == len(MIGRATIONS) == 7
        assert store.get(0).source_format == "gguf"
        content = tmp_path / "new.part"
        content.write_bytes(b"gguf bytes")
        rec, created = store.insert(
            sha256="cd", name="new", metadata={}, content=content, source=None, source_format="peft"
        )
        assert created and (rec.id, rec.source_format) == (1, "peft")
        assert store.get(1).source_format == "peft"
    finally:
        store.close()


def test_openai_error_shape_for_domain_errors():
    import grpc

    from control_plane.errors import NotFoundError, UnavailableError
    from control_plane.http.errors import from_control_plane
    from control_plane.router import WorkerRequestError

    assert from_control_plane(NotFoundError("adapter 9")).body() == {
        "error": {"message": "adapter 9", "type": "not_found_error", "param": None, "code": None}
    }
    assert from_control_plane(UnavailableError("no worker")).status == 503
    busy = from_control_plane(WorkerRequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    assert (busy.status, busy.code, busy.headers) == (429, "resource_exhausted", {"Retry-After": "1"})


def test_grafana_dashboard_uses_only_exported_metric_names():
    import json
    import re
    from pathlib import Path

    from control_plane.metrics import ControlPlaneMetrics
    from worker.serving.engine import WorkerStatsRecord
    from worker.serving.metrics import WorkerMetrics
    from worker.serving.stats import SchedulerStats

    sched = SchedulerStats(
        n_slots=2,
        slots_busy=0,
        queue_depth=0,
        queue_limit=4,
        graph_reuses=0,
        graph_rebuilds=0,
        prefix_cache_entries=0,
        prefix_cache_hit_tokens=0,
        prompt_tokens_computed=0,
        tokens_generated=0,
    )
    stats = WorkerStatsRecord(
        scheduler=sched,
        worker_id="w",
        batching="mixed",
        prefix_cache="keyed",
        model="m",
        device="cpu",
        dtype="f32",
        adapter_ids=[],
        node_budget=0,
        adapter_bytes=0,
    )
    cp = ControlPlaneMetrics(model_name="base", adapters=dict, pool_state=lambda: (1, 2, 16), adapter_label_cap=4)
    wm = WorkerMetrics(lambda: stats, adapter_label_cap=4)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    exported = {
        fam.name + sfx for reg in (cp.registry, wm.registry) for fam in reg.collect() for sfx in suffixes[fam.type]
    }
    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/loraplane-dashboard.json").read_text())
    used = {
        m
        for p in dash["panels"]
        for t in p["targets"]
        for m in re.findall(r"\b(?:loraplane_[a-z0-9_]+|vllm:[a-z_]+)", t["expr"])
    }
    assert used and used <= exported, sorted(used - exported)
    # no family under one name on both sides, where a sum over every scraped target would add
    # the control plane's pool-wide value to the workers' own (vLLM's KV gauge aside: the
    # dashboard reads the control plane's by its model_name)
    both = {f.name for f in cp.registry.collect()} & {f.name for f in wm.registry.collect()}
    assert both == {"vllm:kv_cache_usage_perc"}


def test_control_plane_kv_residency_and_paging_metrics_keep_the_label_cap():
    """The heartbeat-fed metrics on their own: KV usage summed over workers, residency per
    worker and state, page-in / eviction counters from cumulative per-process counts (a new
    incarnation starts again from 0), all under the adapter label cap (here 1: the rest is
    "other"), parsed back with prometheus_client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from control_plane.adapter_labels import AdapterNaming, adapter_label
    from control_plane.metrics import ControlPlaneMetrics
    from control_plane.workers import WorkerHoldingsView
    from loraplane.v1.membership_pb2 import AdapterPagingCount as Count

    views = [
        WorkerHoldingsView("w1", frozenset({1, 2, 3}), frozenset({1, 2, 3, 4}), frozenset({1}), (30, 100)),
        WorkerHoldingsView("w2", frozenset(), frozenset(), frozenset(), (0, 100)),
    ]
    named = {1: "sea", 2: "dup", 3: "dup", 4: "other"}
    m = ControlPlaneMetrics(
        model_name="base",
        adapters=lambda: {i: AdapterNaming(n, adapter_label(i, n, n)) for i, n in named.items()},
        pool_state=lambda: (2, 2, 4),
        adapter_label_cap=1,
        holdings=lambda: views,
    )
    m.on_paging("w1", "inc-a", [Count(adapter_id=1, page_ins=2, evictions=1), Count(adapter_id=3, page_ins=5)])
    m.on_paging(
        "w1",
        "inc-a",
        [
            Count(adapter_id=1, page_ins=3, evictions=1),
            Count(adapter_id=3, page_ins=5),
            Count(adapter_id=4, page_ins=1),
        ],
    )
    m.on_paging("w1", "inc-b", [Count(adapter_id=1, page_ins=1)])  # restarted: its counts begin again
    body, _ = m.exposition()
    s = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for fam in text_string_to_metric_families(body.decode())
        for x in fam.samples
    }
    assert s[("loraplane_adapter_slot_page_ins_total", (("adapter", "sea"),))] == 3 + 1
    assert s[("loraplane_adapter_slot_evictions_total", (("adapter", "sea"),))] == 1
    assert s[("loraplane_adapter_slot_page_ins_total", (("adapter", "other"),))] == 5 + 1
    residency = {
        tuple(v for _, v in labels): value
        for (name, labels), value in s.items()
        if name == "loraplane_adapter_residency"
    }
    # labels sort as (adapter, state, worker)
    assert residency == {
        ("sea", "device", "w1"): 1,
        ("other", "device", "w1"): 2,
        ("other", "host", "w1"): 1,
        ("sea", "pinned", "w1"): 1,
    }
    assert s[("vllm:kv_cache_usage_perc", (("model_name", "base"),))] == 30 / 200
    assert s[("loraplane_kv_cache_usage_perc", (("worker", "w1"),))] == 0.3
    assert s[("loraplane_kv_cache_usage_perc", (("worker", "w2"),))] == 0.0


def test_a_sweep_asked_for_within_the_interval_is_deferred_not_dropped():
    guard = ConnectionGuard(max_connections=4)  # busy from 3 open
    guard.open = 2
    assert guard.sweep_delay(10.0) is None  # not busy
    guard.open = 3
    assert guard.sweep_delay(10.0) == 0.0  # due now, counted as done
    assert guard.sweep_delay(10.1) == pytest.approx(SWEEP_INTERVAL_S - 0.1)  # defer, by the rest of the interval
    guard._sweep_pending = object()  # type: ignore[assignment]  # one deferred sweep scheduled
    assert guard.sweep_delay(10.2) is None and guard.sweep_delay(11.0) is None
    guard._sweep_pending = None
    assert guard.sweep_delay(10.0 + SWEEP_INTERVAL_S) == 0.0
