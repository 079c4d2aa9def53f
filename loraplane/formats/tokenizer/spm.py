"""The SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``, llama.cpp
``LLAMA_VOCAB_TYPE_SPM``): encoding of raw-text fragments and the text of normal/byte tokens.

Defaults (`SPM_DEFAULTS`), the space prefix and escaping, the merge loop (sentencepiece's BPE
model run on a ``ModelProto`` built from the GGUF fields) and the byte fallback, following
``src/llama-vocab.cpp``; why two proto settings make it match llama.cpp exactly:
docs/formats.md, "SentencePiece".
"""

from __future__ import annotations

from collections.abc import Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as spm_pb2  # generated protobuf module

from loraplane.formats.tokenizer.vocab import TokenAttr, TokenizerError, Vocab, VocabDefaults

_SPACE = " "
_NORMAL, _BYTE = int(TokenAttr.NORMAL), int(TokenAttr.BYTE)
_ESCAPED_SPACE = "\u2581"  # "▁", what SentencePiece vocabularies use for a space

# load(), tokenizer_model == "llama": special ids and flags before the metadata overrides them.
SPM_DEFAULTS = VocabDefaults(bos=1, eos=2, add_bos=True, add_space_prefix=True)


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


class SpmModel:
    """llama.cpp's SPM session over one vocabulary (see the module docstring for the rules)."""

    def __init__(self, vocab: Vocab) -> None:
        """Build the sentencepiece model for ``vocab`` (well under a second for 262k tokens)."""
        self._vocab = vocab
        self._byte_ids = [self._lookup_byte(b) for b in range(256)]
        sentinel = " <loraplane-unknown>"
        while sentinel in vocab.piece_to_id:
            sentinel += "_"
        self._unk_sentinel_id = vocab.n_vocab
        self._spm = _build_spm(vocab.pieces, vocab.scores, sentinel)

    def encode(self, fragments: Sequence[str | int], out: list[int]) -> None:
        """``llama_vocab::impl::tokenize``, SPM case, between BOS and EOS: appends to ``out``."""
        add_space_prefix = self._vocab.add_space_prefix
        is_prev_special = True  # the first fragment counts as following a special token
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                is_prev_special = True
                continue
            if add_space_prefix and is_prev_special:
                frag = _SPACE + frag
            out.extend(self._encode_fragment(frag.replace(_SPACE, _ESCAPED_SPACE)))
            is_prev_special = False

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
                        f"{self._vocab.source}: no byte token <0x{b:02X}> for unknown character {piece.surface!r}"
                    )
                out.append(byte_id)
        return out

    def _lookup_byte(self, b: int) -> int | None:
        """``llama_vocab::byte_to_token`` for SPM: ``<0xXX>``, else the one-byte text."""
        found = self._vocab.piece_to_id.get(f"<0x{b:02X}>")
        if found is None and b < 0x80:
            found = self._vocab.piece_to_id.get(chr(b))
        return found

    def piece_bytes(self, token_id: int, attr: TokenAttr | int) -> bytes:
        """``token_to_piece`` (SPM branch) of a token that is not CONTROL/UNKNOWN/USER_DEFINED."""
        text = self._vocab.pieces[token_id]
        bits = int(attr)  # plain int bit tests: IntFlag's operators cost microseconds each
        if bits & _NORMAL:
            return text.replace(_ESCAPED_SPACE, _SPACE).encode("utf-8")
        if bits & _BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED / UNDEFINED render as nothing
