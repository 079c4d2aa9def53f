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

import ctypes
import functools
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
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


RENDER_TIMEOUT_S = 1.0
"""Wall-clock bound of one chat-template rendering, in seconds."""
RENDER_MAX_CHARS = 8 * 1024 * 1024
"""Default bound on a rendering's output and on any string or list it builds, in characters
(the HTTP front passes its prompt byte limit instead: a longer prompt cannot fit anyway)."""
MAX_POWER_BITS = 4096
"""Largest integer ``**`` may produce in a template, in bits."""


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``), failed to render, or passed
    its time or size bound; ``code`` says which (the HTTP error's ``code``)."""

    def __init__(self, message: str, code: str = "chat_template_error") -> None:
        super().__init__(message)
        self.code = code


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message), "chat_template_refused")


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


class _RenderTimeout(BaseException):
    """Raised inside a rendering that passed its deadline: from the sandbox's hooks, or injected
    into the rendering thread by its watchdog (`_bounded`). A BaseException, so no
    ``except Exception`` on the way (jinja's or a template's filters) swallows it."""


class _RenderTooLarge(Exception):
    """A rendering's output, or a value it built, passed its size bound."""


class _Budget(threading.local):
    """The current thread's rendering bounds (one rendering per thread at a time)."""

    deadline: float = math.inf
    max_chars: int = RENDER_MAX_CHARS


_budget = _Budget()


def _tick() -> None:
    if time.monotonic() > _budget.deadline:
        raise _RenderTimeout()


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > _budget.max_chars:
        raise _RenderTooLarge(f"a value of {len(value)} items")
    return value


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox (immutable: templates cannot mutate ``messages``) plus bounds.

    Every attribute or item lookup and every call (filters, methods, macros: the sandbox routes
    them all here) checks the current rendering's deadline and the size of what it returns;
    ``*``, ``**`` and ``+`` are checked before they run (jinja's documented way to stop
    ``'a' * 10**9``: ``intercepted_binops``). Loops that call nothing are stopped by the
    watchdog (`_bounded`); ``range`` is the sandbox's (at most 100 000 items).
    """

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """``left <operator> right`` once its result is known to fit the bounds.

        Raises:
            _RenderTooLarge: a repeated or concatenated sequence over the size bound, or a
                power over `MAX_POWER_BITS` bits.
        """
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                size = _sized(seq)
                if size is not None and isinstance(n, int) and size * max(n, 0) > _budget.max_chars:
                    raise _RenderTooLarge(f"a repetition of {size} × {n} items")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if left.bit_length() * right > MAX_POWER_BITS:
                    raise _RenderTooLarge(f"a power of about {left.bit_length() * right} bits")
        elif operator == "+":
            a, b = _sized(left), _sized(right)
            if a is not None and b is not None and a + b > _budget.max_chars:
                raise _RenderTooLarge(f"a concatenation of {a} + {b} items")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        """The sandbox's attribute lookup, deadline and size checked."""
        _tick()
        return _check_size(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        """The sandbox's item lookup, deadline and size checked."""
        _tick()
        return _check_size(super().getitem(obj, argument))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """The sandbox's call, deadline and size checked."""
        _tick()
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: clear a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def _bounded(render: Callable[[], str], *, timeout_s: float, max_chars: int) -> str:
    """Run ``render`` on this thread within ``timeout_s`` seconds and ``max_chars`` characters.

    The sandbox's hooks check the deadline at every lookup and call; for a loop that makes
    none, a timer thread raises `_RenderTimeout` in this thread at the deadline (CPython's
    ``PyThreadState_SetAsyncExc``, delivered at the next bytecode). A lock orders the timer
    against the end of the rendering, so the exception is either delivered inside this call or
    cleared before it returns: it never escapes into the caller's code.

    Raises:
        _RenderTimeout, _RenderTooLarge: the bound that was passed.
    """
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(thread_id, _RenderTimeout)

    saved = (_budget.deadline, _budget.max_chars)
    _budget.deadline, _budget.max_chars = time.monotonic() + timeout_s, max_chars
    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return render()
        finally:
            with lock:
                state["done"] = True
                if state["fired"]:
                    _set_async_exc(thread_id, None)
    finally:
        timer.cancel()
        _budget.deadline, _budget.max_chars = saved


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token texts it is rendered with."""

    source: str  # "file:<path>", "gguf" or "builtin:<arch>"
    text: str
    bos_token: str
    eos_token: str

    @functools.cached_property
    def _compiled(self) -> jinja2.Template:
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.text)

    def references(self, name: str) -> bool:
        """Whether the template reads the variable ``name`` (jinja2's
        ``meta.find_undeclared_variables``; transformers tells a tool-aware template by its
        reading ``tools``). False for a template that does not parse."""
        try:
            ast = self._compiled.environment.parse(self.text)
        except jinja2.TemplateError:
            return False
        return name in jinja2.meta.find_undeclared_variables(ast)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        timeout_s: float = RENDER_TIMEOUT_S,
        max_chars: int = RENDER_MAX_CHARS,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, OpenAI function definitions, for
        templates that render them; None: the variable is left undefined, as transformers does).

        Bounded (`BoundedSandbox`, `_bounded`): at most ``timeout_s`` seconds of wall-clock
        time, at most ``max_chars`` characters of output, and no string or list it builds
        longer than that. Measured overhead on Gemma's built-in template, 4 messages: see
        docs/http-api.md.

        Raises:
            ChatTemplateError: ``raise_exception`` in the template (code ``chat_template_refused``),
                a template error or any exception the template raises (``chat_template_error``),
                recursion too deep (``chat_template_recursion``), the time bound
                (``chat_template_timeout``) or the size bound (``chat_template_too_large``).
        """
        where = f"chat template ({self.source})"
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **({"tools": tools} if tools is not None else {}),
        }

        def render() -> str:
            out: list[str] = []
            n = 0
            for chunk in self._compiled.generate(**variables):
                n += len(chunk)
                if n > max_chars:
                    raise _RenderTooLarge(f"output of more than {max_chars} characters")
                out.append(chunk)
            return "".join(out)

        try:
            return _bounded(render, timeout_s=timeout_s, max_chars=max_chars)
        except _RenderTimeout:
            raise ChatTemplateError(
                f"{where}: rendering exceeded its time limit of {timeout_s:g} s", "chat_template_timeout"
            ) from None
        except _RenderTooLarge as exc:
            raise ChatTemplateError(
                f"{where}: rendering exceeded its size limit of {max_chars} characters ({exc})",
                "chat_template_too_large",
            ) from None
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError(f"{where}: recursion too deep", "chat_template_recursion") from None
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{where}: {exc}") from exc
        except Exception as exc:  # a template's own fault (bad operand, filter error): the request's 400
            raise ChatTemplateError(f"{where}: {type(exc).__name__}: {exc}") from exc


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
