"""The byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``, llama.cpp
``LLAMA_VOCAB_TYPE_BPE``): pre-tokenizer, merges, and the text of normal tokens.

The pre-tokenizer types and their split regexes (`PRE_TOKENIZERS`), the byte map
(`BYTE_TO_CHAR`), the merge loop (HF ``tokenizers``' BPE model built from the GGUF's tokens and
merges) and ``token_to_piece``, each following ``src/llama-vocab.cpp`` / ``src/unicode.cpp``;
the rules, how the regexes run on collapsed text, and the known differences from llama.cpp:
docs/formats.md, "Byte-level BPE".
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from loraplane.formats.tokenizer.vocab import TokenAttr, TokenizerError, Vocab, VocabDefaults

_NORMAL, _BYTE = int(TokenAttr.NORMAL), int(TokenAttr.BYTE)

# load(), tokenizer_model == "gpt2": special ids and flags before the metadata overrides them.
BPE_DEFAULTS = VocabDefaults(bos=11, eos=11, add_bos=False, add_space_prefix=False)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map (``unicode_byte_to_utf8_map``): printable Latin-1
    bytes stand for themselves, the other 68 take U+0100 onwards in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


BYTE_TO_CHAR = _byte_to_char()
_ENCODE_TABLE = str.maketrans({chr(b): c for b, c in BYTE_TO_CHAR.items()})  # latin-1 view -> GPT-2
_DECODE_TABLE = str.maketrans({c: chr(b) for b, c in BYTE_TO_CHAR.items()})  # GPT-2 -> latin-1 view
_NOT_A_BYTE_CHAR = re.compile("[^" + "".join(re.escape(c) for c in BYTE_TO_CHAR.values()) + "]")

# ----------------------------------------------------------------------------- the split regexes

# The regexes of llm_tokenizer_bpe, by family (several pre types share one list).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER_THEN_LOWER = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_UPPER_RUN = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_TEKKEN = _UPPER_THEN_LOWER + "|" + _UPPER_RUN + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _UPPER_THEN_LOWER
    + _CONTRACTIONS
    + "?|"
    + _UPPER_RUN
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Written as escapes: several of these code points have canonical equivalents an editor may swap in.
_DEEPSEEK_LATIN = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_PUNCT = "!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_FAMILIES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "starcoder": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "deepseek-llm": (
        "[\r\n]",
        r"\s?[" + _DEEPSEEK_LATIN + "]+",
        r"\s?[" + _DEEPSEEK_PUNCT + "]+",
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "tekken": (_TEKKEN,),
    "gpt4o": (_GPT4O,),
}


@dataclass(frozen=True)
class PreTokenizer:
    """What one ``tokenizer.ggml.pre`` value selects in llama.cpp: its regex family and flags."""

    family: str
    ignore_merges: bool = False
    add_bos: bool = False  # load() sets add_bos for some types; metadata still overrides it


_LLAMA3_TYPE = PreTokenizer("llama3", ignore_merges=True, add_bos=True)
# load()'s pre name -> type mapping, for the types whose regexes we run (names that llama.cpp
# gives extra per-model rules we do not implement, e.g. add_sep or <mask> LSTRIP, are left out).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer("default"),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3_TYPE
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer("llama3")),
    "deepseek-llm": PreTokenizer("deepseek-llm"),
    "deepseek-coder": PreTokenizer("deepseek-coder"),
    "falcon": PreTokenizer("falcon"),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat", "mellum"),
        PreTokenizer("gpt2"),
    ),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        PreTokenizer("starcoder"),
    ),
    **dict.fromkeys(
        (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        PreTokenizer("qwen2"),
    ),
    "qwen35": PreTokenizer("qwen35"),
    "tekken": PreTokenizer("tekken", ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer("gpt4o")),
}

# unicode_regex_split's collapsed text: one placeholder per category for non-ASCII code points,
# and the ASCII members each class keeps in the collapsed regex.
_WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)
_PLACEHOLDER = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER_PLACEHOLDER = "\xd0"  # separators that are no whitespace, controls, unassigned
_ASCII_MEMBERS = {
    "N": "0-9",
    "L": "A-Za-z",
    "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "",
    "S": r"\$\+<=>\^`\|~",
}
_CLASS_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}
_CLASS = re.compile(r"\\p\{(\w+)\}")


class _CollapseTable(dict[int, str]):
    """``str.translate`` table for the collapsed text, filled on first sight of a code point."""

    def __missing__(self, cp: int) -> str:
        if cp < 0x80:
            value = chr(cp)
        elif cp in _WHITESPACE:
            value = "\v"
        else:
            value = _PLACEHOLDER.get(unicodedata.category(chr(cp))[0], _OTHER_PLACEHOLDER)
        self[cp] = value
        return value


class _RawTable(dict[int, str]):
    """``str.translate`` table for class-free regexes: only non-ASCII whitespace changes."""

    def __missing__(self, cp: int) -> str:
        value = "\v" if cp >= 0x80 and cp in _WHITESPACE else chr(cp)
        self[cp] = value
        return value


_COLLAPSE = _CollapseTable()
_RAW = _RawTable()


def _translate_regex(expr: str) -> tuple[re.Pattern[str], bool]:
    """``expr`` as a Python regex and whether it runs on the collapsed text.

    Unicode classes become their placeholder plus ASCII members (bracketed when outside a
    bracket expression, as unicode_regex_split does); ``$`` is end of piece (ECMAScript).
    """
    collapsed = bool(_CLASS.search(expr))
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        escaped = i > 0 and expr[i - 1] == "\\"
        m = _CLASS.match(expr, i)
        if m:
            if m.group(1) not in _CLASS_NAMES:
                raise ValueError(f"unsupported class {m.group(0)} in {expr!r}")
            name = _CLASS_NAMES[m.group(1)]
            body = _PLACEHOLDER[name] + _ASCII_MEMBERS[name]
            out.append(body if inside else f"[{body}]")
            i = m.end()
            continue
        if c == "[" and not escaped:
            inside = True
        elif c == "]" and inside and not escaped:
            inside = False
        elif c == "$" and not escaped and not inside:
            c = r"\Z"
        out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII), collapsed


@functools.cache
def _compiled(family: str) -> tuple[tuple[re.Pattern[str], bool], ...]:
    return tuple(_translate_regex(expr) for expr in _FAMILIES[family])


def split_words(text: str, family: str) -> list[str]:
    """``unicode_regex_split`` of ``text`` with the regex list of ``family`` (not byte-encoded)."""
    spans = [(0, len(text))]
    views: dict[bool, str] = {}
    for pattern, collapsed in _compiled(family):
        if collapsed not in views:
            views[collapsed] = text.translate(_COLLAPSE if collapsed else _RAW)
        subject = views[collapsed]
        new: list[tuple[int, int]] = []
        for start, end in spans:
            pos = start
            for m in pattern.finditer(subject[start:end]):
                a, b = start + m.start(), start + m.end()
                if a == b:
                    continue  # an empty match adds an empty piece, which encodes to nothing
                if a > pos:
                    new.append((pos, a))
                new.append((a, b))
                pos = b
            if pos < end:
                new.append((pos, end))
        spans = new
    return [text[a:b] for a, b in spans]


def byte_encode(word: str) -> str:
    """``unicode_byte_encoding_process``: the UTF-8 bytes of ``word`` as GPT-2 characters."""
    return word.encode("utf-8").decode("latin-1").translate(_ENCODE_TABLE)


def supported_pre() -> list[str]:
    """The ``tokenizer.ggml.pre`` values we build, sorted (for error messages and docs)."""
    return sorted(PRE_TOKENIZERS)


def _merge_pairs(merges: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """load()'s merge list: split at the first space after the first character, first rank wins;
    pairs whose parts or result are no tokens are dropped (the HF model refuses them)."""
    seen: set[tuple[str, str]] = set()
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            continue
        pair = (merge[:cut], merge[cut + 1 :])
        if pair in seen or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            continue
        seen.add(pair)
        pairs.append(pair)
    return pairs


class BpeModel:
    """llama.cpp's BPE session over one vocabulary (see the module docstring for the rules)."""

    def __init__(self, vocab: Vocab, md: dict[str, Any], pre_name: str) -> None:
        """Build the HF BPE model from ``tokenizer.ggml.merges`` (pre type already validated)."""
        merges = md.get("tokenizer.ggml.merges")
        if not merges:
            raise TokenizerError(f"{vocab.source}: no tokenizer.ggml.merges in metadata (a gpt2 vocab needs them)")
        self._vocab = vocab
        self.pre = PRE_TOKENIZERS[pre_name]
        self.pre_name = pre_name
        model = BPE(
            vocab=vocab.piece_to_id,
            merges=_merge_pairs(merges, vocab.piece_to_id),
            ignore_merges=self.pre.ignore_merges,
        )
        self._hf = HFTokenizer(model)

    def encode(self, fragments: Sequence[str | int], out: list[int]) -> None:
        """``llama_vocab::impl::tokenize``, BPE case, between BOS and EOS: appends to ``out``."""
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            words = [byte_encode(w) for w in split_words(frag, self.pre.family)]
            if words:
                out.extend(self._hf.encode(words, is_pretokenized=True, add_special_tokens=False).ids)

    def piece_bytes(self, token_id: int, attr: TokenAttr | int) -> bytes:
        """``token_to_piece`` (BPE branch) of a token that is not CONTROL/UNKNOWN/USER_DEFINED."""
        text = self._vocab.pieces[token_id]
        bits = int(attr)  # plain int bit tests: IntFlag's operators cost microseconds each
        if bits & _NORMAL:
            return decode_text(text)
        if bits & _BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b"\x00"  # strtol of a non-hex text is 0
        return b""  # UNUSED / UNDEFINED render as nothing


def decode_text(text: str) -> bytes:
    """``llama_decode_text``: GPT-2 characters back to bytes."""
    if not _NOT_A_BYTE_CHAR.search(text):
        return text.translate(_DECODE_TABLE).encode("latin-1")
    out = bytearray()
    for c in text:
        if _NOT_A_BYTE_CHAR.match(c):
            out += b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        else:
            out += c.translate(_DECODE_TABLE).encode("latin-1")
    return bytes(out)
