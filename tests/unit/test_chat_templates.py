"""Chat templates of real model families rendered by ``ChatTemplate`` (jinja2 sandbox with
transformers' globals): ChatML as Qwen 2.5 ships it, and Llama 3.1 / 3.2 (``tojson`` with
keyword arguments, ``strftime_now``, tools). The templates are llama.cpp's test copies, read
from the llama-cpp-python sdist (``tests/helpers/registry_models.py``); the expected texts are each
family's documented prompt format."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from control_plane.http.chat_template import ChatTemplate, ChatTemplateError

LLAMA3_BOS, LLAMA3_EOT = "<|begin_of_text|>", "<|eot_id|>"


def template(vocab_dir: Path, name: str, bos: str, eos: str) -> ChatTemplate:
    return ChatTemplate(f"file:{name}", (vocab_dir / "templates" / name).read_text(encoding="utf-8"), bos, eos)


def test_qwen25_chatml(llama_cpp_vocab_dir: Path) -> None:
    t = template(llama_cpp_vocab_dir, "Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>")
    assert t.render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
    ]
    assert t.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
    )


def test_llama31_default_date_and_header_format(llama_cpp_vocab_dir: Path) -> None:
    t = template(llama_cpp_vocab_dir, "meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3_BOS, LLAMA3_EOT)
    assert t.render([{"role": "user", "content": "hi"}]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama32_strftime_now(llama_cpp_vocab_dir: Path) -> None:
    t = template(llama_cpp_vocab_dir, "meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3_BOS, LLAMA3_EOT)
    before = datetime.now().strftime("%d %b %Y")
    text = t.render([{"role": "user", "content": "hi"}])
    after = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n" in text or f"Today Date: {after}\n" in text


def test_llama31_tools_rendered_with_tojson(llama_cpp_vocab_dir: Path) -> None:
    t = template(llama_cpp_vocab_dir, "meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3_BOS, LLAMA3_EOT)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in <city> — ünïcode kept",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    text = t.render([{"role": "user", "content": "Weather in Paris?"}], tools=[tool])
    # the tool definition is printed with tojson(indent=4): non-ASCII and '<' kept as they are
    assert json.dumps(tool, indent=4, ensure_ascii=False) in text
    assert text.endswith("Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_refusal_is_a_chat_template_error(llama_cpp_vocab_dir: Path) -> None:
    t = template(llama_cpp_vocab_dir, "meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3_BOS, LLAMA3_EOT)
    call = {"function": {"name": "f", "arguments": {}}}
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call, call]}]
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        t.render(msgs)
