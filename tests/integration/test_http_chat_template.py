"""Chat completions use the GGUF's own ``tokenizer.chat_template``: a synthetic model (the
tiny llama-MoE fixture's tensors and metadata plus a template key) served by a real
``loraplane serve``; the prompt tokens must equal the template rendered by jinja2 and then
tokenized with nothing added (BOS once, the template's)."""

from __future__ import annotations

from pathlib import Path

import gguf
import jinja2
import openai
import pytest

from tests.helpers.http_serve import start_http_serve

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_model_with_template(src: Path, out: Path, template: str) -> Path:
    """``src`` copied field by field and tensor by tensor, plus ``tokenizer.chat_template``."""
    from worker.tools.export_lora import _copy_metadata, _records

    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    _copy_metadata(reader, writer)
    writer.add_string("tokenizer.chat_template", template)
    for name, rec in _records(reader).items():
        writer.add_tensor(name, rec.raw, raw_dtype=rec.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, fixtures_dir: Path):
    root = tmp_path_factory.mktemp("chat-template")
    model = write_model_with_template(
        fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", root / "tiny-chat.gguf", TEMPLATE
    )
    s = start_http_serve(root, "--model", str(model), "--served-model-name", "tiny")
    yield s, model
    s.stop()


def test_chat_prompt_is_the_gguf_template_rendered_then_tokenized(tiny):
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

    serve, model = tiny
    tok = Tokenizer.from_gguf(read_gguf(model))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    client = openai.OpenAI(base_url=serve.http + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=3,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    text = (
        jinja2.Environment()
        .from_string(TEMPLATE)
        .render(messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    )
    assert text == "<s><|system|>\nYou are terse.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    want = tok.encode(text, add_special=False, parse_special=True)
    assert r.model_extra["prompt_token_ids"] == want
    assert want[0] == tok.bos_id and want.count(tok.bos_id) == 1
    assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == ["tiny"]
