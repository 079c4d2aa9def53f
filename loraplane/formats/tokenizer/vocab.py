"""What every vocabulary type shares: token texts and attributes, special ids, the
end-of-generation set and the special-token partition of a prompt.

Follows llama.cpp ``llama_vocab::impl::load`` and ``tokenizer_st_partition``
(``src/llama-vocab.cpp``); the rules (attributes, auto-detected specials, the EOG set, LSTRIP /
RSTRIP) and the known differences from llama.cpp (`EOG_TEXT_UNLESS_USER_DEFINED`):
docs/formats.md, "What every vocabulary shares".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

C_ISSPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, used by LSTRIP/RSTRIP


class TokenizerError(ValueError):
    """The GGUF's tokenizer cannot be built or used; messages name the file where one is known."""


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """Per-token attribute bits (llama.cpp ``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


_TYPE_TO_ATTR = {
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.BYTE: TokenAttr.BYTE,
}
_ATTR_OF_TYPE: dict[int, TokenAttr] = {int(k): v for k, v in _TYPE_TO_ATTR.items()}
SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # empty in detokenize unless unparsed

# llama.cpp load(), "auto-detect special tokens by text": when the metadata has no id for one of
# these, a token with one of the texts becomes it and is forced to CONTROL (so parse_special cuts
# it out). llama.cpp walks an unordered_map; we take the lowest id when several texts exist.
AUTODETECT_TEXTS: dict[str, tuple[str, ...]] = {
    "eot": (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# llama.cpp load(): every token with one of these texts ends generation (and is forced CONTROL).
EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    )
)
# "</s>" is in llama.cpp's list too (added for PaddleOCR, whose EOS it is), and so it is here —
# Qwen 2's vocabulary has it as an ordinary token (id 128247) that llama.cpp turns into a CONTROL
# end-of-generation token, which changes how "…</s>" tokenizes. The one exception: a vocab that
# declares it USER_DEFINED, as Gemma 3 does for the HTML tag (id 212): as EOG it would end
# generation inside HTML and stop being cut out with parse_special=false (llama.cpp later made
# the same exception for Gemma 4).
EOG_TEXT_UNLESS_USER_DEFINED = "</s>"

# load(), gpt-oss: these are always rendered, so they become USER_DEFINED.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True)
class Special:
    """One entry of llama.cpp's ``cache_special_tokens``."""

    text: str
    token_id: int
    attr: TokenAttr


@dataclass
class Vocab:
    """A GGUF vocabulary after llama.cpp's load(): texts, scores, attributes and special ids.

    Built by `read_vocab` then `resolve_specials`; the tokenizers only read it.
    """

    source: str
    pieces: list[str]
    scores: list[float]
    attrs: list[TokenAttr]
    piece_to_id: dict[str, int]
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    eog_ids: frozenset[int] = frozenset()
    specials: tuple[Special, ...] = ()

    @property
    def n_vocab(self) -> int:
        """Number of tokens."""
        return len(self.pieces)


@dataclass(frozen=True)
class VocabDefaults:
    """What load() sets for a vocab type before the metadata overrides it."""

    bos: int | None
    eos: int | None
    add_bos: bool
    add_space_prefix: bool


def meta_id(md: dict[str, Any], key: str, n_vocab: int, default: int | None) -> int | None:
    """A special-token id from metadata; out-of-range values keep the default, as llama.cpp does
    (load(), "special tokens"), and an out-of-range default is disabled."""
    if default is not None and default >= n_vocab:
        default = None
    value = md.get(key)
    if value is None or not 0 <= int(value) < n_vocab:
        return default
    return int(value)


def read_vocab(md: dict[str, Any], src: str) -> Vocab:
    """Token texts, scores and attributes as llama.cpp's load() sets them up."""
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{src}: no tokenizer.ggml.tokens in metadata")
    n = len(tokens)
    scores = md.get("tokenizer.ggml.scores")
    types = md.get("tokenizer.ggml.token_type")
    if scores is not None and len(scores) < n:
        raise TokenizerError(f"{src}: {len(scores)} tokenizer.ggml.scores for {n} tokens")
    if types is not None and len(types) < n:
        raise TokenizerError(f"{src}: {len(types)} tokenizer.ggml.token_type for {n} tokens")
    pieces: list[str] = []
    seen: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if text == "":
            text = f"[EMPTY_{i}]"  # llama.cpp's name for an empty token
        if text in seen:
            raise TokenizerError(
                f"{src}: duplicate token in vocabulary: {text!r} has ids {seen[text]} and {i} "
                "(llama.cpp refuses this vocabulary too)"
            )
        seen[text] = i
        pieces.append(text)
    # float32 in the file (int32 in some, which llama.cpp casts).
    score_list = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
    if types is None:
        attrs = [TokenAttr.NORMAL] * n
    else:
        attrs = [_ATTR_OF_TYPE.get(int(t), TokenAttr.UNDEFINED) for t in types[:n]]
    return Vocab(source=src, pieces=pieces, scores=score_list, attrs=attrs, piece_to_id=seen)


def resolve_specials(
    vocab: Vocab,
    md: dict[str, Any],
    defaults: VocabDefaults,
) -> None:
    """load()'s special-token rules on ``vocab`` (in place), given the vocab type's defaults.

    Metadata ids and ``add_bos_token`` / ``add_eos_token`` / ``add_space_prefix`` override the
    defaults; then the by-text rules (`_apply_text_rules`), the EOG set and the special-token cache.

    Raises:
        TokenizerError: ``add_bos``/``add_eos`` without the id (llama.cpp asserts at tokenize).
    """
    n, src = vocab.n_vocab, vocab.source
    vocab.bos_id = meta_id(md, "tokenizer.ggml.bos_token_id", n, defaults.bos)
    vocab.eos_id = meta_id(md, "tokenizer.ggml.eos_token_id", n, defaults.eos)
    vocab.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", defaults.add_bos))
    vocab.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    vocab.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", defaults.add_space_prefix))
    if vocab.add_bos and vocab.bos_id is None:
        raise TokenizerError(f"{src}: tokenizer.ggml.add_bos_token is true, but bos_token_id is not set")
    if vocab.add_eos and vocab.eos_id is None:
        raise TokenizerError(f"{src}: tokenizer.ggml.add_eos_token is true, but eos_token_id is not set")
    special_ids, eog = _apply_text_rules(md, vocab.pieces, vocab.attrs, vocab.piece_to_id)
    vocab.eot_id, vocab.eom_id = special_ids["eot"], special_ids["eom"]
    eog.update(i for i in (vocab.eos_id, vocab.eot_id, vocab.eom_id) if i is not None)
    _drop_harmony_end(eog, vocab.pieces, vocab.attrs)
    _apply_model_attrs(md, vocab.attrs, vocab.piece_to_id)
    vocab.eog_ids = frozenset(eog)
    vocab.specials = _special_cache(vocab.pieces, vocab.attrs)


def _apply_text_rules(
    md: dict[str, Any], pieces: list[str], attrs: list[TokenAttr], index: dict[str, int]
) -> tuple[dict[str, int | None], set[int]]:
    """load()'s by-text rules: auto-detected special ids, EOG texts, gpt-oss USER_DEFINED.

    Updates ``attrs`` in place and returns the special ids by kind (``eot``, ``eom``, ``fim_*``)
    and the EOG ids found so far.
    """
    n = len(pieces)
    special_ids = {kind: meta_id(md, f"tokenizer.ggml.{kind}_token_id", n, None) for kind in AUTODETECT_TEXTS}
    for kind, old_key in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
        special_ids[kind] = meta_id(md, f"tokenizer.ggml.{old_key}_token_id", n, special_ids[kind])
    for kind, texts in AUTODETECT_TEXTS.items():
        found = [index[t] for t in texts if t in index]
        if special_ids[kind] is None and found:
            special_ids[kind] = min(found)
            attrs[min(found)] |= TokenAttr.CONTROL
    eog: set[int] = {i for i in (special_ids[k] for k in ("fim_pad", "fim_rep", "fim_sep")) if i is not None}
    for text in EOG_TEXTS:
        if text in index:
            eog.add(index[text])
            attrs[index[text]] |= TokenAttr.CONTROL
    tid = index.get(EOG_TEXT_UNLESS_USER_DEFINED)
    if tid is not None and not attrs[tid] & TokenAttr.USER_DEFINED:
        eog.add(tid)
        attrs[tid] |= TokenAttr.CONTROL
    for text in _ALWAYS_RENDERED:
        if text in index:
            attrs[index[text]] = TokenAttr.USER_DEFINED
    return special_ids, eog


def _drop_harmony_end(eog: set[int], pieces: list[str], attrs: list[TokenAttr]) -> None:
    """load()'s o200k_harmony / solar-open exception: with ``<|return|>`` and ``<|call|>`` (or
    ``<|calls|>`` and ``<|flush|>``) in the EOG set, ``<|end|>`` leaves it and is USER_DEFINED."""
    texts = {pieces[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        end_id = texts["<|end|>"]
        eog.discard(end_id)
        attrs[end_id] = TokenAttr.USER_DEFINED


def _apply_model_attrs(md: dict[str, Any], attrs: list[TokenAttr], index: dict[str, int]) -> None:
    """load()'s per-model attributes, the phi-3 case: every special token gets RSTRIP, then
    ``</s>`` gets it and ``<unk>``, ``<s>``, ``<|endoftext|>`` lose it."""
    name = str(md.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return
    for i, a in enumerate(attrs):
        if a & SPECIAL_ATTRS:
            attrs[i] = a | TokenAttr.RSTRIP
    for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
        if text in index:
            i = index[text]
            attrs[i] = attrs[i] | TokenAttr.RSTRIP if on else attrs[i] & ~TokenAttr.RSTRIP


def _special_cache(pieces: Sequence[str], attrs: Sequence[TokenAttr]) -> tuple[Special, ...]:
    """load()'s ``cache_special_tokens``: CONTROL | USER_DEFINED | UNKNOWN tokens, longest text
    (in bytes) first. llama.cpp's std::sort is not stable; equal-length special tokens only
    compete when they overlap in the text, which no vocabulary we serve has. We break ties by id."""
    specials = [Special(pieces[i], i, a) for i, a in enumerate(attrs) if a & SPECIAL_ATTRS]
    specials.sort(key=lambda s: (-len(s.text.encode("utf-8")), s.token_id))
    return tuple(specials)


def partition(text: str, specials: Sequence[Special], parse_special: bool) -> list[str | int]:
    """``tokenizer_st_partition``: raw-text fragments (str) and special-token ids (int)."""
    if not text:
        return []
    fragments: list[str | int] = [text]
    for sp in specials:
        if not parse_special and sp.attr & HIDDEN_ATTRS:
            continue
        if sp.text not in text:  # cheap pre-check on the whole text
            continue
        new: list[str | int] = []
        for frag in fragments:
            if isinstance(frag, int) or sp.text not in frag:
                new.append(frag)
                continue
            _cut(frag, sp, new)
        fragments = new
    return fragments


def _cut(frag: str, sp: Special, out: list[str | int]) -> None:
    """Every occurrence of ``sp`` in one raw fragment, with its LSTRIP/RSTRIP rule."""
    start = 0
    while True:
        match = frag.find(sp.text, start)
        if match < 0:
            if start < len(frag):
                out.append(frag[start:])
            return
        left = frag[start:match]
        if sp.attr & TokenAttr.LSTRIP:
            left = left.rstrip(C_ISSPACE)
        if left:
            out.append(left)
        out.append(sp.token_id)
        start = match + len(sp.text)
        if sp.attr & TokenAttr.RSTRIP:
            while start < len(frag) and frag[start] in C_ISSPACE:
                start += 1
