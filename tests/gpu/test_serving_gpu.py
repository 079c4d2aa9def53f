"""A serving round trip with ``--device cuda``: one real ``loraplane serve`` (control plane, HTTP
front, one worker on the GPU) over the tiny synthetic Qwen 2 model and two of its adapters,
asked over gRPC (``LoraplaneClient``) and over the OpenAI-compatible HTTP API (``httpx``).

- the worker reports its device as ``cuda`` (its own ``Stats``);
- greedy answers are the same tokens over gRPC and HTTP, for the base model and for an adapter;
- the adapter changes the answer's log-probs (the request reached the adapter's rows; a random
  tied-head model often repeats one token, so tokens alone would not show it);
- a mixed batch of concurrent requests on different adapters gives each request the tokens and
  log-probs (within 2e-3, f32) it gets alone;
- a chat completion goes through the model's chat template and finishes.
"""

from __future__ import annotations

import re
import threading

import grpc
import httpx
import pytest

from bench.synthetic import SHAPES
from bench.synthetic_vocab import FAMILIES
from clients.client import LoraplaneClient
from loraplane.v1 import common_pb2, worker_pb2_grpc
from loraplane.worker_secret import with_secret
from tests.helpers.http_serve import start_http_serve

pytestmark = pytest.mark.cuda

SECRET = "gpu-test-worker-secret"
PROMPT = "The quick brown fox jumps over the lazy dog. Then"
N_TOKENS = 12


@pytest.fixture(scope="module")
def serve(tmp_path_factory, synthetic_tiny):
    model, adapters = synthetic_tiny
    s = start_http_serve(
        tmp_path_factory.mktemp("gpu-serve"),
        "--model",
        str(model),
        "--served-model-name",
        "synthetic",
        "--device",
        "cuda",
        "--slots",
        "4",
        "--worker-secret",
        SECRET,
        "--lora",
        str(adapters[0]),
        "--lora",
        str(adapters[1]),
        "--lora-init-without-apply",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(serve):
    with LoraplaneClient(serve.grpc_addr, timeout=120) as c:
        yield c


def _adapter_ids(client: LoraplaneClient) -> dict[str, int]:
    return {a.name: a.id for a in client.list_adapters()}


def _http_tokens(serve, model: str, prompt: str) -> list[int]:
    r = httpx.post(
        serve.http + "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": N_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return list(choice["token_ids"])


def test_the_worker_runs_on_cuda(serve):
    m = re.search(r"\(worker (\S+) at (\S+?)\)", serve.banner)
    assert m, serve.banner
    with grpc.insecure_channel(m.group(2)) as ch:
        stats = worker_pb2_grpc.WorkerStub(with_secret(ch, SECRET)).Stats(common_pb2.Empty(), timeout=30)
    assert stats.device.startswith("cuda"), stats.device


def test_grpc_and_http_give_the_same_greedy_tokens(serve, client):
    ids = _adapter_ids(client)
    name = next(n for n in ids if n.endswith("-0"))
    base_grpc = client.generate(PROMPT, max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    lora_grpc = client.generate(PROMPT, adapters={ids[name]: 1.0}, max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    assert len(base_grpc.token_ids) == N_TOKENS and len(lora_grpc.token_ids) == N_TOKENS
    assert list(base_grpc.token_ids) == _http_tokens(serve, "synthetic", PROMPT)
    assert list(lora_grpc.token_ids) == _http_tokens(serve, name, PROMPT)
    moved = max(abs(x.logprob - y.logprob) for x, y in zip(base_grpc.logprobs, lora_grpc.logprobs, strict=True))
    assert moved > 0.05, f"the adapter did not change the answer: log-probs moved by at most {moved:.4f}"


def test_concurrent_requests_on_different_adapters_equal_each_alone(client):
    ids = sorted(_adapter_ids(client).values())
    specs = [{}, {ids[0]: 1.0}, {ids[1]: 1.0}, {ids[0]: 0.5, ids[1]: 0.5}]
    prompts = [f"{PROMPT} {i}" for i in range(len(specs))]
    alone = [
        client.generate(p, adapters=a, max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
        for p, a in zip(prompts, specs, strict=True)
    ]
    together: list = [None] * len(specs)

    def run(i: int) -> None:
        together[i] = client.generate(
            prompts[i], adapters=specs[i], max_tokens=N_TOKENS, temperature=0, ignore_eos=True
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    batch = max(int(st.get("batch_size", 0)) for r in together for st in r.telemetry.get("steps", []))
    print(f"largest batch the concurrent requests decoded in: {batch}")
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert t.token_ids == a.token_ids, f"request {i} ({specs[i]})"
        worst = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, t.logprobs, strict=True))
        assert worst <= 2e-3, f"request {i} ({specs[i]}): log-probs differ by {worst:.5f}"
    firsts = {round(r.logprobs[0].logprob, 3) for r in alone}
    assert len(firsts) == len(specs), f"the adapter sets should give distinct answers: {firsts}"


def test_chat_completion_through_the_template(serve):
    r = httpx.post(
        serve.http + "/v1/chat/completions",
        json={
            "model": "synthetic",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    im_start = SHAPES["qwen2.5-1.5b"].tiny.n_vocab - FAMILIES["qwen2"].n_special + 1
    assert body["prompt_token_ids"][0] == im_start  # the model's ChatML template ran
