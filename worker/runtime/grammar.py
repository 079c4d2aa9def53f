"""Structured output: per-request grammar constraints on sampling (llguidance).

A request may carry a ``ResponseFormat`` (JSON object, JSON Schema, regex or a Lark grammar).
It is compiled at submit into an ``llguidance.LLMatcher`` bound to the model's vocabulary
(`grammar_tokenizer`), once per distinct format (`compiled_matcher`: a request whose format was
compiled before gets a copy of that matcher, in microseconds); at each decode step the
scheduler fills the allowed-token bitmask of every constrained row that samples (`fill_masks`,
one ``LLExecutor`` call for the whole batch, started before the forward pass so it overlaps
it), sets the disallowed logits of those rows to ``-inf`` (`apply_masks`: the separate "grammar
mask" step, after penalties and before temperature / top-k / top-p / min-p) and advances each
matcher with the token it sampled (`Constraint.advance`). Unconstrained rows are never touched.

The rules follow vLLM's structured-output backend for llguidance
(``vllm/v1/structured_output/backend_guidance.py``): control tokens are spelled with a leading
``0xFF`` byte so no grammar text can produce them, the end-of-generation ids are the
tokenizer's EOS set (the mask allows them once the grammar accepts; a grammar that is complete
and allows nothing else leaves only them, which forces the end), and ``json_object`` is the
schema ``{"type": "object"}``. Engine choice and its measured cost: ``bench/grammar_engines.py``
and bench/RESULTS.md.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch

from loraplane.grammar_limits import GrammarError, GrammarLimits
from loraplane.response_format import (
    KINDS,
    ResponseFormat,
    compile_grammar,
    engine_limits,
    json_schema_grammar,
    one_line,
)

log = structlog.get_logger("loraplane.worker.runtime.grammar")

__all__ = ["compile_grammar", "json_schema_grammar"]

# ------------------------------------------------------------------------------ vocabulary


class _VocabView:
    """The duck-typed tokenizer ``llguidance.TokenizerWrapper`` wraps: token bytes with control
    tokens marked by a leading ``0xFF`` (llguidance's convention, its ``llamacpp.py``), the
    EOS id and an encode callable."""

    def __init__(self, tok: Any) -> None:
        from loraplane.formats.tokenizer import TokenAttr

        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else sorted(tok.eog_ids)[0]
        self.bos_token_id = tok.bos_id
        attrs = [int(a) for a in tok._attrs]  # plain int bit tests: IntFlag's operators are slow
        special = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
        user_defined = int(TokenAttr.USER_DEFINED)
        tokens: list[bytes] = []
        ids: list[int] = []
        for i in range(tok.n_vocab):
            a = attrs[i]
            if a & special or (a & user_defined and tok._pieces[i].startswith("<") and tok._pieces[i].endswith(">")):
                tokens.append(b"\xff" + tok.token_bytes(i, skip_special=False))
                ids.append(i)
            else:
                tokens.append(tok.token_bytes(i, skip_special=False))
        self.tokens = tokens
        self.special_token_ids = ids

    def __call__(self, text: str) -> list[int]:
        """Token ids of a piece of text in the middle of an output: no BOS and, for SPM, no
        leading-space prefix (llguidance re-tokenizes forced bytes with this)."""
        if self._tok.vocab_type == "llama":
            from loraplane.formats.tokenizer.spm import _ESCAPED_SPACE, _SPACE

            return self._tok._model._encode_fragment(text.replace(_SPACE, _ESCAPED_SPACE)) if text else []
        return self._tok.encode(text, add_special=False, parse_special=False)


class _Build:
    """One tokenizer's grammar view, built once: the first caller builds, the others wait."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok  # held so that its id is not reused while the entry lives
        self.done = threading.Event()
        self.llt: Any = None
        self.error: BaseException | None = None


_LLTOK: dict[int, _Build] = {}
_LLTOK_LOCK = threading.Lock()


def grammar_tokenizer(tok: Any, n_vocab: int | None = None) -> Any:
    """The ``llguidance.LLTokenizer`` of our `loraplane.formats.tokenizer.Tokenizer` ``tok``,
    built once per tokenizer (single-flight: callers that arrive while it is being built wait
    for that build instead of starting their own; a failed build is retried by the next caller).

    It walks the whole vocabulary (the Python part, about 2 s at 262k tokens, lets other
    threads run) and then the engine holds the interpreter lock twice (about 0.7 s for the
    token trie, 0.9 s for the mask slices on an idle core, twice that on a busy one): a worker
    builds it at start-up, before it registers (`start_grammar_warmup`), so that no heartbeat
    waits on those holds, and four concurrent first requests cost one build, not four.

    Args:
        tok: the model's tokenizer.
        n_vocab: the logits' width when it exceeds the vocabulary (padded rows are never allowed).

    Raises:
        whatever the engine raises building it (to every caller waiting on that build).
    """
    key = id(tok)
    with _LLTOK_LOCK:
        entry = _LLTOK.get(key)
        if entry is None or entry.tok is not tok or (entry.done.is_set() and entry.error is not None):
            entry = _LLTOK[key] = _Build(tok)
            builder = True
        else:
            builder = False
    if builder:
        try:
            entry.llt = _build_tokenizer(tok, n_vocab)
        except BaseException as exc:
            entry.error = exc
            raise
        finally:
            entry.done.set()
        return entry.llt
    entry.done.wait()
    if entry.error is not None:
        raise entry.error
    return entry.llt


def _build_tokenizer(tok: Any, n_vocab: int | None) -> Any:
    import llguidance

    view = _VocabView(tok)  # a Python loop: other threads keep running between its bytecodes
    # two holds of the interpreter lock instead of one: waiting threads run between them
    llt = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(view),
        n_vocab=max(n_vocab or 0, tok.n_vocab),
        eos_token=sorted(tok.eog_ids) or None,
        slices=[],
    )
    time.sleep(0)
    return llt.with_slices(llguidance.LLTokenizer.general_slices())


def start_grammar_warmup(tok: Any, n_vocab: int | None = None) -> threading.Thread:
    """Build ``tok``'s grammar view (`grammar_tokenizer`) on a background thread, started now;
    join the thread to wait for it. A failure is logged, and the first constrained request
    tries again."""

    def run() -> None:
        t0 = time.monotonic()
        try:
            grammar_tokenizer(tok, n_vocab)
        except Exception as exc:  # never fatal: structured output retries at its first request
            log.warning("grammar_warmup_failed", error=f"{type(exc).__name__}: {exc}")
            return
        log.info("grammar_vocabulary_ready", seconds=round(time.monotonic() - t0, 3), n_vocab=tok.n_vocab)

    thread = threading.Thread(target=run, name="loraplane-grammar-warmup", daemon=True)
    thread.start()
    return thread


COMPILE_STACK_BYTES = 256 * 1024 * 1024
"""Stack of the threads matchers are built on: 32 times the one the control plane checks every
format on (`control_plane.grammar_check.CHILD_STACK_BYTES`), so a format that passed
there cannot overflow here however deep the engine recurses. Only the pages used are committed."""

_COMPILER: Any = None
_COMPILER_LOCK = threading.Lock()


def _compiler() -> Any:
    """Two threads with `COMPILE_STACK_BYTES` stacks that build matchers (created at first use;
    the engine drops the interpreter lock while it builds)."""
    global _COMPILER
    with _COMPILER_LOCK:
        if _COMPILER is None:
            import concurrent.futures

            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="loraplane-grammar-compile")
                # threads take the stack size in force when they start: start both now
                for f in [pool.submit(time.sleep, 0.01) for _ in range(2)]:
                    f.result()
            finally:
                threading.stack_size(previous)
            _COMPILER = pool
        return _COMPILER


# ------------------------------------------------------------------------------ compiled formats

MATCHER_CACHE_SIZE = 64
"""Compiled formats a worker keeps (LRU), each a pristine matcher that requests copy."""
MATCHER_CACHE_BYTES = 2 * 1024 * 1024
"""Format text the kept matchers may stand for together (LRU beyond it): a matcher holds about
20 times its format's size (a 250 KB regex literal about 5 MiB), so this bounds the cache near
40 MiB however large the formats a client sends, while the usual few-KB schemas fill the count."""


class _Compiled:
    """One format's compilation against one vocabulary view, done once: the first caller
    compiles, the others wait; the outcome is a pristine matcher or the refusal."""

    def __init__(self, llt: Any, size: int) -> None:
        self.llt = llt  # held so that its id, in the key, is not reused while the entry lives
        self.size = size  # UTF-8 bytes of the format's text
        self.done = threading.Event()
        self.matcher: Any = None
        self.error: GrammarError | None = None


_COMPILED: OrderedDict[tuple[Any, ...], _Compiled] = OrderedDict()
_COMPILED_LOCK = threading.Lock()
_compiled_bytes = 0  # sizes of the entries in _COMPILED, under _COMPILED_LOCK


def _format_key(fmt: ResponseFormat, llt: Any, limits: GrammarLimits) -> tuple[tuple[Any, ...], int]:
    """The cache key of ``fmt`` on ``llt`` under ``limits``, and the format text's size."""
    h = hashlib.sha256()
    size = 0
    for part in (fmt.type, fmt.schema, "1" if fmt.strict else "0", fmt.pattern, fmt.grammar):
        data = part.encode("utf-8", "surrogatepass")
        size += len(data)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return (id(llt), limits, h.digest()), size


def _drop(key: tuple[Any, ...]) -> None:
    """Forget ``key``'s entry (caller holds `_COMPILED_LOCK`)."""
    global _compiled_bytes
    entry = _COMPILED.pop(key, None)
    if entry is not None:
        _compiled_bytes -= entry.size


def refuse_format(key: tuple[Any, ...], message: str) -> None:
    """Refuse the cached format ``key`` from now on with ``message``: its matcher failed while
    a request used it (a lexer or parser limit reached lazily, during a mask). The engine shares
    that lazily built state between a format's copies, so every later copy starts failed (its
    first mask allows only end-of-sequence: an empty answer that looked finished); refused
    here, the next request with the format is an error at submit, as a format that did not
    compile is."""
    with _COMPILED_LOCK:
        entry = _COMPILED.get(key)
        if entry is not None and entry.error is None and entry.done.is_set():
            entry.error = GrammarError(message)
            entry.matcher = None


def compiled_matcher(fmt: ResponseFormat, llt: Any, limits: GrammarLimits | None, compile_fn: Any) -> Any:
    """A fresh matcher of ``fmt`` on the vocabulary view ``llt``: a copy of the one compiled for
    the same format before (`MATCHER_CACHE_SIZE` formats and `MATCHER_CACHE_BYTES` of their
    text, LRU), else ``compile_fn(fmt, llt,
    limits)``'s, compiled once however many requests carry the format at once (single-flight:
    the others wait for that compilation). A format the engine refused is refused again from
    the cache. The control plane remembers its verdicts the same way
    (`control_plane.grammar_check`), so a costly format sent again costs neither
    process another compilation.

    Raises:
        GrammarError: ``fmt`` is over a limit or does not compile (the first caller's error).
    """
    global _compiled_bytes
    key, size = _format_key(fmt, llt, limits or GrammarLimits())
    with _COMPILED_LOCK:
        entry = _COMPILED.get(key)
        builder = entry is None
        if entry is None:
            entry = _COMPILED[key] = _Compiled(llt, size)
            _compiled_bytes += size
            while len(_COMPILED) > 1 and (len(_COMPILED) > MATCHER_CACHE_SIZE or _compiled_bytes > MATCHER_CACHE_BYTES):
                _drop(next(iter(_COMPILED)))
        else:
            _COMPILED.move_to_end(key)
    if builder:
        try:
            entry.matcher = compile_fn(fmt, llt, limits)
        except GrammarError as exc:
            entry.error = exc
        except BaseException:
            with _COMPILED_LOCK:  # not a verdict on the format: the next caller compiles again
                if _COMPILED.get(key) is entry:
                    _drop(key)
            raise
        finally:
            entry.done.set()
    else:
        entry.done.wait()
    if entry.error is not None:
        raise type(entry.error)(*entry.error.args)
    if entry.matcher is None:  # the builder failed otherwise: compile here
        return compile_fn(fmt, llt, limits)
    return entry.matcher.deep_copy()


# ------------------------------------------------------------------------------ matching


class Constraint:
    """One request's grammar state: an ``llguidance.LLMatcher`` advanced token by token.

    Build it at submit (`Constraint.build`); the scheduler thread alone then uses it.
    """

    def __init__(self, matcher: Any, fmt: ResponseFormat, key: tuple[Any, ...] | None = None) -> None:
        self.matcher = matcher
        self.format = fmt
        self.key = key  # the format's cache key (`compiled_matcher`), for `refuse_format`

    @classmethod
    def build(
        cls, fmt: ResponseFormat, tok: Any, n_vocab: int | None = None, limits: GrammarLimits | None = None
    ) -> Constraint:
        """``fmt``'s matcher on the vocabulary of ``tok``: compiled on a thread with a
        `COMPILE_STACK_BYTES` stack (the caller waits for it), once per format
        (`compiled_matcher`: later requests with the same format get a copy).

        Args:
            limits: bounds checked before the engine sees the format (the worker's
                ``--grammar-max-*``; default `GrammarLimits()`).

        Raises:
            GrammarError: over a limit, the format does not compile (`compile_grammar`) or the
                matcher refuses it (names the type and the engine's message).
        """
        llt = grammar_tokenizer(tok, n_vocab)  # on the caller's thread: single-flight, may wait
        key, _ = _format_key(fmt, llt, limits or GrammarLimits())
        return cls(compiled_matcher(fmt, llt, limits, cls._compile), fmt, key)

    @staticmethod
    def _compile(fmt: ResponseFormat, llt: Any, limits: GrammarLimits | None) -> Any:
        """A pristine matcher of ``fmt``, built on a `_compiler` thread (the caller waits)."""
        return _compiler().submit(Constraint._matcher, fmt, llt, limits).result()

    @staticmethod
    def _matcher(fmt: ResponseFormat, llt: Any, limits: GrammarLimits | None) -> Any:
        import llguidance

        g = compile_grammar(fmt, limits)
        try:
            m = llguidance.LLMatcher(llt, g, log_level=0, limits=engine_limits())
        except (ValueError, RuntimeError) as exc:  # API misuse only, per llguidance; never a crash here
            raise GrammarError(f"{fmt.type}: {one_line(str(exc))}") from exc
        if m.is_error():
            raise GrammarError(f"{fmt.type}: {one_line(m.get_error())}")
        return m

    def advance(self, token_id: int) -> bool:
        """Feed the sampled token; False when the grammar refuses it (the matcher is then in its
        error state, `error`)."""
        return bool(self.matcher.consume_token(int(token_id)))

    @property
    def error(self) -> str | None:
        """The matcher's error text, or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def failed(self) -> bool:
        """The matcher is in its error state (a refused token, or a limit reached while it
        computed a mask)."""
        return bool(self.matcher.is_error())

    @property
    def done(self) -> bool:
        """The grammar accepted the output and can take nothing more (stopped, not failed)."""
        return bool(self.matcher.is_stopped()) and not self.failed


_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def mask_words(n_vocab: int) -> int:
    """int32 words of one row's bitmask (32 tokens a word)."""
    return (n_vocab + 31) // 32


def fill_masks(constraints: Sequence[Constraint], out: torch.Tensor) -> None:
    """Compute the allowed-token bitmasks of ``constraints`` into rows ``0..len-1`` of ``out``
    (int32 ``(>= len, mask_words(n_vocab))``, contiguous CPU; bit ``t % 32`` of word ``t // 32``
    set = token ``t`` allowed). One ``LLExecutor`` call computes all rows on its thread pool
    with the GIL released, so it may run beside the forward pass.
    """
    if not constraints:
        return
    # the engine writes host memory through the pointer: a CPU buffer, whatever the model's device
    assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
    words = out.shape[1]
    _executor().unsafe_compute_mask_ptr(
        [(c.matcher, i) for i, c in enumerate(constraints)], out.data_ptr(), words * 4, out.shape[0]
    )


def apply_masks(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> None:
    """The grammar-mask step: set to ``-inf`` every logit of ``logits[rows[i]]`` whose token is
    not allowed by ``masks[i]`` (in place; ``logits`` f32 ``(m, n_vocab)``, ``masks`` int32
    ``(>= len(rows), mask_words(n_vocab))`` from `fill_masks`). Other rows are untouched.

    It runs after penalties and before temperature / top-k / top-p / min-p (vLLM applies the
    grammar bitmask to the logits before its sampler the same way). ``-inf`` survives every
    penalty (repetition divides or multiplies, presence/frequency subtract), so the order
    against penalties does not change the result.

    On CPU the work goes by 32-token word, so a row costs what its mask changes: a word with no
    allowed token is one 128-byte block fill, a word of all-allowed tokens is skipped, and only
    mixed words are expanded to bits. JSON masks are mostly one or the other (a few structural
    tokens, or nearly everything inside a string); a row-wide ``masked_fill`` with a bool row
    costs several times more on a 262k vocabulary (bench/grammar_engines.py).
    """
    if not rows:
        return
    with torch.inference_mode():  # the decode's logits are inference tensors
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            _apply_cpu(logits, rows, masks)
        else:
            _apply_torch(logits, rows, masks)


def _apply_cpu(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> None:
    n_vocab = logits.shape[-1]
    words = masks.numpy().view(np.uint32)
    n_full = n_vocab // 32
    for i, r in enumerate(rows):
        row = logits[r].numpy()
        w = words[i]
        blocks = row[: n_full * 32].reshape(n_full, 32)
        wf = w[:n_full]
        blocks[wf == 0] = -np.inf
        mixed = np.flatnonzero((wf != 0) & (wf != 0xFFFFFFFF))
        if mixed.size:
            bits = np.unpackbits(wf[mixed].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little").view(bool)
            sub = blocks[mixed]
            sub[~bits] = -np.inf
            blocks[mixed] = sub
        tail = n_vocab - n_full * 32
        if tail:
            tb = np.unpackbits(w[n_full : n_full + 1].view(np.uint8), bitorder="little")[:tail].view(bool)
            row[n_full * 32 :][~tb] = -np.inf


def _apply_torch(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> None:
    n_vocab = logits.shape[-1]
    allowed = np.unpackbits(masks[: len(rows)].numpy().view(np.uint8), axis=1, bitorder="little")[:, :n_vocab]
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    keep = torch.from_numpy(allowed).to(logits.device).bool()
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))


__all__ = [
    "KINDS",
    "Constraint",
    "GrammarError",
    "ResponseFormat",
    "apply_masks",
    "compile_grammar",
    "compiled_matcher",
    "fill_masks",
    "grammar_tokenizer",
    "json_schema_grammar",
    "mask_words",
    "start_grammar_warmup",
]
