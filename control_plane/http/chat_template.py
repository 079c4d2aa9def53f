"""Chat templates: messages → prompt text, rendered with jinja2 as the model defines it.

Where the template comes from, first found wins:
  1. ``--chat-template FILE``;
  2. the base GGUF's ``tokenizer.chat_template`` key;
  3. a built-in template for a known architecture: ``gemma3`` gets Gemma's turn format
     (``<start_of_turn>user\\n…<end_of_turn>\\n`` … ``<start_of_turn>model\\n``; a system message
     is prepended to the first user turn), because the embedded Gemma 3 270M file has no key.
Otherwise chat requests get a 400.

Rendering follows Hugging Face transformers (``apply_chat_template``): a sandboxed jinja2
environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``), the
variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, the
callables ``raise_exception`` (its error becomes a 400) and ``strftime_now`` (today's date, which
Llama 3.x templates print), and transformers' ``tojson`` filter (``ensure_ascii=False``,
``indent``, ``separators``, ``sort_keys``). The rendered text is then tokenized
with special tokens parsed and **nothing added**, so BOS appears once: where the template puts
``bos_token``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

GEMMA_TURN_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
BUILTIN_TEMPLATES = {"gemma3": GEMMA_TURN_TEMPLATE}


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter: JSON without HTML escaping (jinja2's own escapes ``<``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """The current local time formatted with ``fmt`` (transformers' ``strftime_now`` global)."""
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token texts it is rendered with."""

    source: str  # "file:<path>", "gguf" or "builtin:<arch>"
    text: str
    bos_token: str
    eos_token: str

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, OpenAI function definitions, for
        templates that render them; None: the variable is left undefined, as transformers does).

        Raises:
            ChatTemplateError: ``raise_exception`` in the template, or a template error.
        """
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.text).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **({"tools": tools} if tools is not None else {}),
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template ({self.source}): {exc}") from exc


def load_chat_template(
    *, override_file: str | None, metadata: dict[str, Any], arch: str, bos_token: str, eos_token: str
) -> ChatTemplate | None:
    """The template to use (see the module docstring); None when there is none.

    Raises:
        OSError: ``override_file`` cannot be read.
    """
    if override_file:
        text, source = Path(override_file).read_text(encoding="utf-8"), f"file:{override_file}"
    elif isinstance(metadata.get(CHAT_TEMPLATE_KEY), str):
        text, source = metadata[CHAT_TEMPLATE_KEY], "gguf"
    elif arch in BUILTIN_TEMPLATES:
        text, source = BUILTIN_TEMPLATES[arch], f"builtin:{arch}"
    else:
        return None
    return ChatTemplate(source=source, text=text, bos_token=bos_token, eos_token=eos_token)
