"""A made-up byte-level BPE vocabulary of a real model's size, for the synthetic models
(`bench.synthetic`): what ``tokenizer.ggml.*`` needs for the worker's
`loraplane.formats.tokenizer.Tokenizer` to load, encode and decode, without any
download.

Layout (the ids of the real vocabularies, so special ids, the EOS and the "ordinary ids" the
bench draws prompts from match the real model's):

- ids ``0..255``: the 256 byte tokens, GPT-2's printable characters in GPT-2's order
  (``loraplane.formats.tokenizer.bpe.BYTE_TO_CHAR``), type NORMAL;
- ids ``256..n_text-1``: merged tokens, each the concatenation of two earlier tokens, with one
  merge rule ``"left right"`` per token in id order (merge rank = id - 256): first every pair
  of byte characters, then pairs followed by one more character. The characters of ordinary
  English (space ``Ġ``, letters, digits, newline ``Ċ``, punctuation) come first, so a text
  encodes into tokens of 2–3 characters;
- ids ``n_text..n_vocab-1``: the family's special tokens (`FAMILIES`): Qwen 2's three control
  tokens then ``[PAD<id>]`` user-defined ones, or Llama 3's 256 control tokens.

The texts and merges are deterministic (no RNG): two runs write the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import gguf

from loraplane.formats.tokenizer import TokenType
from loraplane.formats.tokenizer.bpe import BYTE_TO_CHAR

QWEN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _qwen2_specials(n: int, first_id: int) -> list[tuple[str, TokenType]]:
    named = [
        ("<|endoftext|>", TokenType.CONTROL),
        ("<|im_start|>", TokenType.CONTROL),
        ("<|im_end|>", TokenType.CONTROL),
    ]
    return named + [(f"[PAD{first_id + i}]", TokenType.USER_DEFINED) for i in range(len(named), n)]


_LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "<|eot_id|>",
}


def _llama3_specials(n: int, first_id: int) -> list[tuple[str, TokenType]]:
    out, reserved = [], 0
    for i in range(n):
        if i in _LLAMA3_NAMED:
            out.append((_LLAMA3_NAMED[i], TokenType.CONTROL))
        else:
            out.append((f"<|reserved_special_token_{reserved}|>", TokenType.CONTROL))
            reserved += 1
    return out


@dataclass(frozen=True)
class VocabFamily:
    """One real vocabulary's special-token layout and tokenizer settings.

    Attributes:
        pre: ``tokenizer.ggml.pre`` (the pre-tokenizer regexes the worker runs).
        n_special: special tokens at the end of the vocabulary (Qwen 2: 293 = 151 936 - 151 643;
            Llama 3: 256 = 128 256 - 128 000).
        bos / eos: their offsets among the special tokens.
        add_bos: ``tokenizer.ggml.add_bos_token``.
        chat_template: ``tokenizer.chat_template`` (Jinja, the family's chat format).
    """

    pre: str
    n_special: int
    bos: int
    eos: int
    add_bos: bool
    chat_template: str

    def specials(self, n_vocab: int) -> list[tuple[str, TokenType]]:
        """``(text, type)`` of the ids ``n_vocab - n_special .. n_vocab - 1``."""
        first = n_vocab - self.n_special
        return (_qwen2_specials if self.pre == "qwen2" else _llama3_specials)(self.n_special, first)


FAMILIES = {
    "qwen2": VocabFamily("qwen2", n_special=293, bos=0, eos=0, add_bos=False, chat_template=QWEN_CHATML),
    "llama3": VocabFamily("llama-bpe", n_special=256, bos=0, eos=1, add_bos=True, chat_template=LLAMA3_TEMPLATE),
}
"""Vocabulary families by name: Qwen 2 (``<|endoftext|>`` is BOS and EOS, as in Qwen2.5's base
GGUFs; no BOS added) and Llama 3 (``<|begin_of_text|>`` added, ``<|end_of_text|>`` ends)."""


def _alphabet() -> list[str]:
    """The 256 byte characters, those of ordinary English text first (space, letters, digits,
    newline, ASCII punctuation), then the rest in GPT-2's order."""
    first = [BYTE_TO_CHAR[b] for b in b" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\n"]
    first += [BYTE_TO_CHAR[b] for b in range(0x21, 0x7F) if BYTE_TO_CHAR[b] not in first]
    return first + [c for c in BYTE_TO_CHAR.values() if c not in first]


def _merged_tokens() -> Iterator[tuple[str, str]]:
    """``(left, right)`` of every merged token in id order: all pairs of characters, then each
    pair followed by each character (16.8 M: more than any vocabulary needs)."""
    alphabet = _alphabet()
    for a in alphabet:
        for b in alphabet:
            yield a, b
    for a in alphabet:
        for b in alphabet:
            for c in alphabet:
                yield a + b, c


def build_vocab(family: VocabFamily, n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token types, merges)`` of a vocabulary of ``n_vocab`` ids (see the module
    docstring for the layout).

    Raises:
        ValueError: ``n_vocab`` leaves no room for the 256 byte tokens and the specials.
    """
    n_text = n_vocab - family.n_special
    if n_text < 256:
        raise ValueError(f"n_vocab {n_vocab}: needs at least {256 + family.n_special} ids (256 bytes + specials)")
    tokens = list(BYTE_TO_CHAR.values())
    merges: list[str] = []
    for left, right in _merged_tokens():
        if len(tokens) == n_text:
            break
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    types = [int(TokenType.NORMAL)] * n_text
    for text, kind in family.specials(n_vocab):
        tokens.append(text)
        types.append(int(kind))
    return tokens, types, merges


def add_tokenizer(writer: gguf.GGUFWriter, family: VocabFamily, n_vocab: int) -> None:
    """Write the ``tokenizer.*`` keys of a ``family`` vocabulary of ``n_vocab`` ids to ``writer``."""
    tokens, types, merges = build_vocab(family, n_vocab)
    first_special = n_vocab - family.n_special
    arr, u32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    writer.add_key_value("tokenizer.ggml.model", "gpt2", gguf.GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.pre", family.pre, gguf.GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.tokens", tokens, arr, sub_type=gguf.GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.token_type", types, arr, sub_type=gguf.GGUFValueType.INT32)
    writer.add_key_value("tokenizer.ggml.merges", merges, arr, sub_type=gguf.GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.bos_token_id", first_special + family.bos, u32)
    writer.add_key_value("tokenizer.ggml.eos_token_id", first_special + family.eos, u32)
    writer.add_key_value("tokenizer.ggml.padding_token_id", first_special + family.eos, u32)
    writer.add_key_value("tokenizer.ggml.add_bos_token", family.add_bos, gguf.GGUFValueType.BOOL)
    writer.add_key_value("tokenizer.chat_template", family.chat_template, gguf.GGUFValueType.STRING)
