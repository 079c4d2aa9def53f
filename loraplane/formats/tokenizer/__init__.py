"""Tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata, giving llama.cpp's token ids.

Two vocabulary types (llama.cpp ``llama_vocab::impl::load``, ``tokenizer.ggml.model``):

- ``"llama"``: SentencePiece (``LLAMA_VOCAB_TYPE_SPM``), `loraplane.formats.tokenizer.spm`;
- ``"gpt2"``: byte-level BPE (``LLAMA_VOCAB_TYPE_BPE``) with the pre-tokenizer named by
  ``tokenizer.ggml.pre``, `loraplane.formats.tokenizer.bpe`.

What both share (token attributes, special ids, end-of-generation set, special-token
partition) is in `loraplane.formats.tokenizer.vocab`. Any other model, or an unknown ``pre``, raises
`TokenizerError` at load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from loraplane.formats.gguf.reader import GGUFFile
from loraplane.formats.tokenizer.bpe import BPE_DEFAULTS, PRE_TOKENIZERS, BpeModel, supported_pre
from loraplane.formats.tokenizer.spm import SPM_DEFAULTS, SpmModel
from loraplane.formats.tokenizer.vocab import (
    HIDDEN_ATTRS,
    TokenAttr,
    TokenizerError,
    TokenType,
    Vocab,
    partition,
    read_vocab,
    resolve_specials,
)

SUPPORTED_MODELS = ("gpt2", "llama")


class Tokenizer:
    """llama.cpp-exact tokenizer of one GGUF vocabulary (SPM or BPE).

    Attributes:
        vocab_type: ``"llama"`` (SPM) or ``"gpt2"`` (BPE), the GGUF ``tokenizer.ggml.model``.
        pre: the BPE pre-tokenizer name (``tokenizer.ggml.pre``, "default" when absent); None for SPM.
        bos_id / eos_id: special ids (None when the vocab has none).
        eot_id / eom_id: end-of-turn / end-of-message ids (metadata or auto-detected by text).
        add_bos / add_eos: whether ``encode(add_special=True)`` adds them.
        add_space_prefix: SPM leading-space rule (``tokenizer.ggml.add_space_prefix``).
        n_vocab: number of tokens.
        eog_ids: ids that end generation (eos, eot, eom and llama.cpp's end-of-generation texts).
    """

    def __init__(self, vocab: Vocab, model: SpmModel | BpeModel, vocab_type: str, pre: str | None) -> None:
        """Use `from_gguf`; this takes an already-resolved llama.cpp vocab and its model."""
        self.source = vocab.source
        self.vocab_type = vocab_type
        self.pre = pre
        self.n_vocab = vocab.n_vocab
        self.bos_id = vocab.bos_id
        self.eos_id = vocab.eos_id
        self.eot_id = vocab.eot_id
        self.eom_id = vocab.eom_id
        self.add_bos = vocab.add_bos
        self.add_eos = vocab.add_eos
        self.add_space_prefix = vocab.add_space_prefix
        self.eog_ids = vocab.eog_ids
        self._vocab = vocab
        self._pieces = vocab.pieces
        self._attrs = vocab.attrs
        self._model = model

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        """Build the tokenizer from ``gguf.metadata['tokenizer.ggml.*']`` (llama.cpp vocab load).

        Raises:
            TokenizerError: no or an unsupported ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``
                (the message lists the supported values), no token list or merges, duplicate
                token texts, or ``add_bos``/``add_eos`` without the id (names the file).
        """
        md = gguf.metadata
        src = str(gguf.path)
        model_name = md.get("tokenizer.ggml.model")
        if model_name is None:
            raise TokenizerError(f"{src}: no tokenizer.ggml.model in metadata")
        if model_name not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"{src}: tokenizer model '{model_name}' is not supported (supported: 'llama', the "
                "SentencePiece/SPM vocabulary, and 'gpt2', the byte-level BPE vocabulary)"
            )
        if model_name == "llama":
            vocab = read_vocab(md, src)
            resolve_specials(vocab, md, SPM_DEFAULTS)
            return cls(vocab, SpmModel(vocab), "llama", None)
        pre = str(md.get("tokenizer.ggml.pre") or "default")  # load(): absent -> "default"
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"{src}: BPE pre-tokenizer tokenizer.ggml.pre='{pre}' is not supported "
                f"(supported: {', '.join(supported_pre())})"
            )
        vocab = read_vocab(md, src)
        resolve_specials(vocab, md, dataclasses.replace(BPE_DEFAULTS, add_bos=PRE_TOKENIZERS[pre].add_bos))
        return cls(vocab, BpeModel(vocab, md, pre), "gpt2", pre)

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
        self._model.encode(partition(text, self._vocab.specials, parse_special), out)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    # ----------------------------------------------------------------------------------- decode

    def _piece_bytes(self, token_id: int, special: bool) -> bytes:
        """llama.cpp ``token_to_piece`` as bytes (the branch of the vocab type)."""
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(f"{self.source}: token id {token_id} out of range [0, {self.n_vocab})")
        attr = int(self._attrs[token_id])  # plain int bit tests: IntFlag's operators are slow
        if attr & _HIDDEN and not special:
            return b""
        if attr & _HIDDEN_OR_USER_DEFINED:
            return self._pieces[token_id].encode("utf-8")
        return self._model.piece_bytes(token_id, attr)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``: llama.cpp's ``llama_detokenize`` without its ``clean_spaces`` pass.

        ``skip_special=True`` is ``remove_special=true, unparse_special=false``: a leading BOS and
        (when ``add_eos``) a trailing EOS are dropped and CONTROL/UNKNOWN tokens render empty;
        ``False`` keeps every token and spells special tokens out. SPM: U+2581 becomes a space and
        byte tokens are joined; BPE: GPT-2 characters become their bytes. Invalid UTF-8 becomes
        U+FFFD. With ``add_space_prefix`` the first token loses one leading space, except after a
        removed BOS (llama.cpp's rule). The ``clean_spaces`` pass some BPE types get in
        ``llama_detokenize`` (" ," -> ",") is not applied: llama-server's text is the
        concatenation of ``token_to_piece``, which never applies it, and so is ours
        (`worker.serving.output.IncrementalDetokenizer` equals this).
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
        """Bytes ``decode`` emits for one token (no first-token space rule applied); for BPE the
        raw bytes of the byte-level token, which may be part of a multi-byte character."""
        return self._piece_bytes(int(token_id), special=not skip_special)

    def token_to_piece(self, token_id: int) -> str:
        """Text of one token for display: llama.cpp ``token_to_piece(special=true)``.

        Special tokens are spelled out, U+2581 is a space (SPM), and a token whose bytes are not
        valid UTF-8 on their own shows U+FFFD.
        """
        return self._piece_bytes(int(token_id), special=True).decode("utf-8", errors="replace")


_HIDDEN = int(HIDDEN_ATTRS)
_HIDDEN_OR_USER_DEFINED = int(HIDDEN_ATTRS | TokenAttr.USER_DEFINED)

__all__ = ["SUPPORTED_MODELS", "TokenAttr", "TokenType", "Tokenizer", "TokenizerError"]
