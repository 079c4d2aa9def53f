"""Tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata, giving llama.cpp's token ids.

Only ``tokenizer.ggml.model == "llama"`` (SentencePiece vocab, llama.cpp ``LLAMA_VOCAB_TYPE_SPM``)
is supported; any other model raises `TokenizerError`.

Rule sources, all llama.cpp ``src/llama-vocab.cpp``:

- ``llama_vocab::impl::load``: defaults for an SPM vocab (bos 1, eos 2, add_bos true,
  add_eos false, add_space_prefix true), the metadata keys that override them, token type ->
  attribute mapping, empty tokens renamed ``[EMPTY_<id>]``, duplicate texts rejected, special
  tokens auto-detected by text (forced to CONTROL), the end-of-generation set, the special-token
  cache (CONTROL | USER_DEFINED | UNKNOWN, longest text first) and phi-3's RSTRIP attributes.
- ``tokenizer_st_partition``: special tokens found literally in the text are cut out first, one
  token at a time over all raw fragments; CONTROL and UNKNOWN only when ``parse_special``,
  USER_DEFINED always.
- ``llama_vocab::impl::tokenize`` (SPM case): BOS per ``add_bos``; a raw fragment gets a leading
  space when ``add_space_prefix`` and it is the first fragment or follows a special token; spaces
  become U+2581 (``llama_escape_whitespace``); each fragment is encoded on its own.
- ``llm_tokenizer_spm_session``: split into UTF-8 characters, repeatedly merge the adjacent pair
  whose concatenation is a vocab token with the highest score (ties: leftmost), then map pieces
  to ids; a character that is no token becomes its UTF-8 bytes as ``<0xXX>`` tokens
  (``llama_vocab::byte_to_token``).
- ``token_to_piece`` / ``detokenize``: the inverse, see `Tokenizer.decode`.

The merge loop itself is not ours: it is sentencepiece's BPE model (``bpe_model.cc``, which
llama.cpp's SPM session mirrors: same priority queue, same tie rule, same stale-pair test) run on
a ``ModelProto`` built from the GGUF fields. Two settings make it match llama.cpp exactly:
every GGUF token is declared NORMAL (llama.cpp merges into any vocab text, control and byte
tokens included, where sentencepiece would skip non-NORMAL pieces), and the proto's required
UNKNOWN piece is an extra sentinel whose text holds a plain space, which escaped input never
contains. Characters that come back as the sentinel get llama.cpp's byte fallback here. The proto
is built in well under a second for a 262k vocab, so nothing is cached on disk.

Known differences from llama.cpp, none reachable with the vocabularies we serve: "</s>" is not an
end-of-generation text here (see `_EOG_TEXTS`); equal-length special tokens that overlap in the
text are tried in id order (llama.cpp's std::sort leaves that order unspecified); a vocab with
several auto-detectable EOT/FIM texts takes the lowest id (llama.cpp: hash-map order).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as spm_pb2  # generated protobuf module

from worker.gguf.reader import GGUFFile

_SPACE = " "
_ESCAPED_SPACE = "\u2581"  # "▁", what SentencePiece vocabularies use for a space
_C_ISSPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, used by LSTRIP/RSTRIP


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
_SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
_HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # empty in detokenize unless unparsed

# llama.cpp load(), "auto-detect special tokens by text": when the metadata has no id for one of
# these, a token with one of the texts becomes it and is forced to CONTROL (so parse_special cuts
# it out). llama.cpp walks an unordered_map; we take the lowest id when several texts exist.
_AUTODETECT_TEXTS: dict[str, tuple[str, ...]] = {
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
_EOG_TEXTS = frozenset(
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
# Left out on purpose: "</s>" (added upstream for PaddleOCR, whose EOS it is). Gemma 3 has "</s>"
# as an ordinary HTML tag (id 212, USER_DEFINED); as EOG it would end generation inside HTML and
# stop being cut out with parse_special=false. Upstream later patched it out for Gemma 4 only
# (llama.cpp PR #21492). Where "</s>" is a vocab's real end token it is its eos_token_id anyway.
# The gpt-oss "<|end|>" exception in load() concerns BPE vocabularies, which we do not build.


@dataclass(frozen=True)
class _Special:
    """One entry of llama.cpp's ``cache_special_tokens``."""

    text: str
    token_id: int
    attr: TokenAttr


def _meta_id(md: dict[str, Any], key: str, n_vocab: int, default: int | None) -> int | None:
    """A special-token id from metadata; out-of-range values keep the default, as llama.cpp does."""
    if default is not None and default >= n_vocab:
        default = None
    value = md.get(key)
    if value is None or not 0 <= int(value) < n_vocab:
        return default
    return int(value)


def _build_spm(pieces: Sequence[str], scores: Sequence[float], sentinel: str) -> spm.SentencePieceProcessor:
    """A sentencepiece BPE model over ``pieces`` (all NORMAL) plus the UNKNOWN ``sentinel``."""
    proto = spm_pb2.ModelProto()  # type: ignore[attr-defined]
    normal = spm_pb2.ModelProto.SentencePiece.NORMAL  # type: ignore[attr-defined]
    add = proto.pieces.add
    for text, score in zip(pieces, scores, strict=False):
        p = add()
        p.piece = text
        p.score = score
        p.type = normal
    p = add()
    p.piece = sentinel
    p.score = 0.0
    p.type = spm_pb2.ModelProto.SentencePiece.UNKNOWN  # type: ignore[attr-defined]
    trainer = proto.trainer_spec
    trainer.model_type = spm_pb2.TrainerSpec.BPE  # type: ignore[attr-defined]
    trainer.unk_id = len(pieces)
    trainer.unk_piece = sentinel
    trainer.byte_fallback = False  # done by us, with llama.cpp's byte_to_token rule
    # Identity normalizer: escaping, dummy prefix and whitespace handling are llama.cpp's, done
    # before the text reaches sentencepiece.
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = False
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _read_vocab(md: dict[str, Any], src: str) -> tuple[list[str], list[float], list[TokenAttr]]:
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
    # float32 in the file (int32 in some, which llama.cpp casts); the proto stores float32 too.
    score_list = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
    if types is None:
        attrs = [TokenAttr.NORMAL] * n
    else:
        attrs = [_ATTR_OF_TYPE.get(int(t), TokenAttr.UNDEFINED) for t in types[:n]]
    return pieces, score_list, attrs


def _apply_text_rules(
    md: dict[str, Any], pieces: list[str], attrs: list[TokenAttr]
) -> tuple[dict[str, int | None], set[int]]:
    """load()'s by-text rules: auto-detected special ids, EOG texts, per-model attributes.

    Updates ``attrs`` in place (forced CONTROL, gpt-oss USER_DEFINED, phi-3 RSTRIP) and returns
    the special ids by kind (``eot``, ``eom``, ``fim_*``) and the EOG ids found so far.
    """
    n = len(pieces)
    index = {text: i for i, text in enumerate(pieces)}
    special_ids = {kind: _meta_id(md, f"tokenizer.ggml.{kind}_token_id", n, None) for kind in _AUTODETECT_TEXTS}
    for kind, old_key in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
        special_ids[kind] = _meta_id(md, f"tokenizer.ggml.{old_key}_token_id", n, special_ids[kind])
    for kind, texts in _AUTODETECT_TEXTS.items():
        found = [index[t] for t in texts if t in index]
        if special_ids[kind] is None and found:
            special_ids[kind] = min(found)
            attrs[min(found)] |= TokenAttr.CONTROL
    eog: set[int] = {i for i in (special_ids[k] for k in ("fim_pad", "fim_rep", "fim_sep")) if i is not None}
    for text in _EOG_TEXTS:
        if text in index:
            eog.add(index[text])
            attrs[index[text]] |= TokenAttr.CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss quick hack
        if text in index:
            attrs[index[text]] = TokenAttr.USER_DEFINED
    name = str(md.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:  # the SPM case of load()'s per-model attributes
        for i, a in enumerate(attrs):
            if a & _SPECIAL_ATTRS:
                attrs[i] = a | TokenAttr.RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if text in index:
                i = index[text]
                attrs[i] = attrs[i] | TokenAttr.RSTRIP if on else attrs[i] & ~TokenAttr.RSTRIP
    return special_ids, eog


class Tokenizer:
    """llama.cpp-exact SPM tokenizer of one GGUF vocabulary.

    Attributes:
        bos_id / eos_id: special ids (None when the vocab has none).
        add_bos / add_eos: whether ``encode(add_special=True)`` adds them.
        add_space_prefix: SPM leading-space rule (``tokenizer.ggml.add_space_prefix``).
        n_vocab: number of tokens.
        eog_ids: ids that end generation (eos, eot, eom and llama.cpp's end-of-generation texts).
    """

    def __init__(
        self,
        *,
        source: str,
        pieces: list[str],
        scores: list[float],
        attrs: list[TokenAttr],
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None,
        eom_id: int | None,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        eog_ids: frozenset[int],
    ) -> None:
        """Use `from_gguf`; this takes already-resolved llama.cpp vocab state."""
        self.source = source
        self.n_vocab = len(pieces)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_id = eot_id
        self.eom_id = eom_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.eog_ids = eog_ids
        self._pieces = pieces
        self._attrs = attrs
        self._piece_to_id = {text: i for i, text in enumerate(pieces)}
        self._byte_ids = [self._lookup_byte(b) for b in range(256)]
        # cache_special_tokens: sorted by byte length, longest first. llama.cpp's std::sort is not
        # stable; equal-length special tokens only compete when they overlap in the text, which
        # no vocabulary we serve has. We break ties by id.
        specials = [_Special(pieces[i], i, attrs[i]) for i in range(self.n_vocab) if attrs[i] & _SPECIAL_ATTRS]
        specials.sort(key=lambda s: (-len(s.text.encode("utf-8")), s.token_id))
        self._specials = specials
        sentinel = " <loraplane-unknown>"
        while sentinel in self._piece_to_id:
            sentinel += "_"
        self._unk_sentinel_id = self.n_vocab
        self._spm = _build_spm(pieces, scores, sentinel)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        """Build the tokenizer from ``gguf.metadata['tokenizer.ggml.*']`` (llama.cpp vocab load).

        Raises:
            TokenizerError: no or an unsupported ``tokenizer.ggml.model``, no token list,
                duplicate token texts, or ``add_bos``/``add_eos`` without the id (names the file).
        """
        md = gguf.metadata
        src = str(gguf.path)
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{src}: no tokenizer.ggml.model in metadata")
        if model != "llama":
            raise TokenizerError(
                f"{src}: tokenizer model '{model}' is not supported "
                "(supported: 'llama', the SentencePiece/SPM vocabulary)"
            )
        pieces, scores, attrs = _read_vocab(md, src)
        n = len(pieces)
        # SPM defaults (load(): tokenizer_model == "llama"), then the metadata.
        bos_id = _meta_id(md, "tokenizer.ggml.bos_token_id", n, 1)
        eos_id = _meta_id(md, "tokenizer.ggml.eos_token_id", n, 2)
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", True))
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        if add_bos and bos_id is None:
            raise TokenizerError(f"{src}: tokenizer.ggml.add_bos_token is true, but bos_token_id is not set")
        if add_eos and eos_id is None:
            raise TokenizerError(f"{src}: tokenizer.ggml.add_eos_token is true, but eos_token_id is not set")
        special_ids, eog = _apply_text_rules(md, pieces, attrs)
        eog.update(i for i in (eos_id, special_ids["eot"], special_ids["eom"]) if i is not None)
        return cls(
            source=src,
            pieces=pieces,
            scores=scores,
            attrs=attrs,
            bos_id=bos_id,
            eos_id=eos_id,
            eot_id=special_ids["eot"],
            eom_id=special_ids["eom"],
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            eog_ids=frozenset(eog),
        )

    # ----------------------------------------------------------------------------------- encode

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` exactly as llama.cpp's ``llama_tokenize`` gives them.

        Args:
            add_special: add BOS (and EOS) as the vocab's ``add_bos``/``add_eos`` say.
            parse_special: turn literal CONTROL/UNKNOWN token texts (e.g. ``<start_of_turn>``)
                into their ids; USER_DEFINED texts are always turned into ids.
        """
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]  # checked in from_gguf
        is_prev_special = True  # the first fragment counts as following a special token
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                is_prev_special = True
                continue
            if self.add_space_prefix and is_prev_special:
                frag = _SPACE + frag
            out.extend(self._encode_fragment(frag.replace(_SPACE, _ESCAPED_SPACE)))
            is_prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """``tokenizer_st_partition``: raw-text fragments (str) and special-token ids (int)."""
        if not text:
            return []
        fragments: list[str | int] = [text]
        for sp in self._specials:
            if not parse_special and sp.attr & _HIDDEN_ATTRS:
                continue
            if sp.text not in text:  # cheap pre-check on the whole text
                continue
            new: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or sp.text not in frag:
                    new.append(frag)
                    continue
                start = 0
                while True:
                    match = frag.find(sp.text, start)
                    if match < 0:
                        if start < len(frag):
                            new.append(frag[start:])
                        break
                    left = frag[start:match]
                    if sp.attr & TokenAttr.LSTRIP:
                        left = left.rstrip(_C_ISSPACE)
                    if left:
                        new.append(left)
                    new.append(sp.token_id)
                    start = match + len(sp.text)
                    if sp.attr & TokenAttr.RSTRIP:
                        while start < len(frag) and frag[start] in _C_ISSPACE:
                            start += 1
            fragments = new
        return fragments

    def _encode_fragment(self, escaped: str) -> list[int]:
        """``llm_tokenizer_spm_session::tokenize`` of one escaped fragment (sentencepiece BPE)."""
        ids = self._spm.encode(escaped)
        if self._unk_sentinel_id not in ids:
            return ids
        # Characters that are no vocab token: llama.cpp's resegment() emits their UTF-8 bytes.
        out: list[int] = []
        for piece in self._spm.encode(escaped, return_type="proto").pieces:
            if piece.id != self._unk_sentinel_id:
                out.append(piece.id)
                continue
            for b in piece.surface.encode("utf-8"):
                byte_id = self._byte_ids[b]
                if byte_id is None:
                    raise TokenizerError(
                        f"{self.source}: no byte token <0x{b:02X}> for unknown character {piece.surface!r}"
                    )
                out.append(byte_id)
        return out

    def _lookup_byte(self, b: int) -> int | None:
        """``llama_vocab::byte_to_token`` for SPM: ``<0xXX>``, else the one-byte text."""
        found = self._piece_to_id.get(f"<0x{b:02X}>")
        if found is None and b < 0x80:
            found = self._piece_to_id.get(chr(b))
        return found

    # ----------------------------------------------------------------------------------- decode

    def _piece_bytes(self, token_id: int, special: bool) -> bytes:
        """llama.cpp ``token_to_piece`` (SPM branch) as bytes."""
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(f"{self.source}: token id {token_id} out of range [0, {self.n_vocab})")
        attr = self._attrs[token_id]
        text = self._pieces[token_id]
        if attr & _HIDDEN_ATTRS and not special:
            return b""
        if attr & (_HIDDEN_ATTRS | TokenAttr.USER_DEFINED):
            return text.encode("utf-8")
        if attr & TokenAttr.NORMAL:
            return text.replace(_ESCAPED_SPACE, _SPACE).encode("utf-8")
        if attr & TokenAttr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED / UNDEFINED render as nothing

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids`` as llama.cpp's ``llama_detokenize`` gives it.

        ``skip_special=True`` is ``remove_special=true, unparse_special=false``: a leading BOS and
        (when ``add_eos``) a trailing EOS are dropped and CONTROL/UNKNOWN tokens render empty;
        ``False`` keeps every token and spells special tokens out. U+2581 becomes a space and byte
        tokens are joined into UTF-8 (invalid sequences become U+FFFD). With ``add_space_prefix``
        the first token loses one leading space, except after a removed BOS (llama.cpp's rule).
        """
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        buf = bytearray()
        for k, token_id in enumerate(ids):
            piece = self._piece_bytes(int(token_id), special=not skip_special)
            if k == 0 and remove_space and piece.startswith(b" "):
                piece = piece[1:]
            buf += piece
        return buf.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        """Bytes ``decode`` emits for one token (no first-token space rule applied)."""
        return self._piece_bytes(int(token_id), special=not skip_special)

    def token_to_piece(self, token_id: int) -> str:
        """Text of one token for display: llama.cpp ``token_to_piece(special=true)``.

        Special tokens are spelled out, U+2581 is a space, and a lone byte token that is not valid
        UTF-8 on its own shows as U+FFFD.
        """
        return self._piece_bytes(int(token_id), special=True).decode("utf-8", errors="replace")
