"""Frameworks no one here wrote, against a real ``loraplane serve`` (control plane + worker,
embedded Gemma 3 270M, whose built-in template renders no tools): instructor in its default
modes with models that leave extra keys allowed, LangChain's completions ``batch`` and
``ChatOpenAI.bind_tools(tool_choice="required")``. Each failed on the server before "Interfaces,
round 2": open JSON objects ran to ``max_tokens``, a list of prompts was a 400, ``"auto"`` tools
on such a template were a 400."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.http_serve import start_http_serve

pytestmark = pytest.mark.slow

BASE = "gemma-3-270m-q4_k_m"


class Person(BaseModel):
    """A person (pydantic's default: extra keys allowed, so the schema leaves objects open)."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = start_http_serve(tmp_path_factory.mktemp("frameworks"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.http + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_model_with_extra_keys_allowed(client, mode):
    """instructor's default mode (forced tool call) and its JSON-schema mode, no retries: the
    answer is a valid ``Person`` at once, the call ended by itself (closed objects)."""
    import instructor

    assert "additionalProperties" not in Person.model_json_schema()
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    person, completion = patched.chat.completions.create_with_completion(
        model=BASE,
        response_model=Person,
        messages=[{"role": "user", "content": "Extract: Ada is 36 years old."}],
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(person, Person) and 0 <= person.age <= 120
    assert completion.choices[0].finish_reason in ("stop", "tool_calls")


def test_langchain_completions_batch_is_one_answer_per_prompt(serve, client):
    """``OpenAI.batch`` sends the prompts as one list: each answer equals the prompt's own."""
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=serve.http + "/v1", api_key="unused", model=BASE, max_tokens=6, temperature=0)
    prompts = ["The weather today is", "Once upon a time", "1, 2, 3,"]
    answers = llm.batch(prompts)
    alone = [
        client.completions.create(model=BASE, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts
    ]
    assert answers == alone
    result = llm.generate(prompts)
    assert [g[0].text for g in result.generations] == alone
    assert result.llm_output["token_usage"]["completion_tokens"] == 18


def test_langchain_bind_tools_required_gives_a_tool_call(serve):
    """``ChatOpenAI.bind_tools(tool_choice="required")`` on a model whose template renders no
    tools: a tool call whose arguments are the tool's (closed) parameters."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add_person(name: str, age: int) -> str:
        """Add a person with a name and an age in years."""
        return f"{name} ({age})"

    chat = ChatOpenAI(base_url=serve.http + "/v1", api_key="unused", model=BASE, max_tokens=60, temperature=0)
    message = chat.bind_tools([add_person], tool_choice="required").invoke("Add Ada, 36 years old.")
    assert message.tool_calls and {c["name"] for c in message.tool_calls} == {"add_person"}
    args = message.tool_calls[0]["args"]
    assert set(args) == {"name", "age"} and isinstance(args["name"], str) and isinstance(args["age"], int)
    auto = chat.bind_tools([add_person]).invoke("Add Ada, 36 years old.")  # "auto": accepted on any template
    assert auto.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
