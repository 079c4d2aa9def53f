"""The scheduler's grammar-mask step: per-row structured-output constraints in a mixed batch.

Per decode step (``StepRunner.run``, ``worker.serving.step``):

1. `GrammarStage.start` — before the forward pass, for the constrained sequences that sample
   this step, start computing their allowed-token bitmasks (`worker.runtime.grammar.fill_masks`:
   one llguidance ``LLExecutor`` call for all rows, GIL released) on a helper thread, so the
   mask work overlaps the decode instead of adding to it;
2. `GrammarStage.apply` — after the forward pass, wait for the masks and set the disallowed
   logits of those rows to ``-inf`` (`worker.runtime.grammar.apply_masks`); rows without a
   constraint are never touched. Sampling (greedy or drawn) then sees only allowed tokens;
3. `GrammarStage.advance` — after a constrained row sampled, feed the token to its matcher;
   a grammar that is complete and allows nothing more ends the request ("stop"), as a forced
   end-of-generation token would (vLLM ends a request whose grammar terminated the same way).
   A matcher that cannot take the token — the engine's own bounds met while it follows the
   format (``Current row has 2002 items; max is 2000``, ``too many expressions constructed``)
   — ends it with an error after the tokens so far (`GRAMMAR_FAILED`, `failure`): the text
   could no longer be held to the format, so it is never passed off as a complete one.

``max_tokens`` and stop strings keep their meaning ("length" / "stop").
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence

import structlog
import torch

from loraplane.response_format import one_line
from worker.errors import InvalidRequestError
from worker.runtime.grammar import Constraint, apply_masks, fill_masks, mask_words, refuse_format
from worker.serving.request import GenRequest

log = structlog.get_logger("loraplane.worker.serving.constraints")

GRAMMAR_FAILED = "grammar_failed"
"""`GrammarStage.advance`'s reason for a request whose matcher refused its sampled token: the
scheduler ends it with `GrammarStage.failure`, not as finished."""


class PendingMasks:
    """Masks being computed for one step: the requests in mask-row order and the future."""

    def __init__(self, reqs: list[GenRequest], buf: torch.Tensor, fut: concurrent.futures.Future[None]) -> None:
        self.reqs = reqs
        self.buf = buf
        self.fut = fut


class GrammarStage:
    """Mask computation and application for a scheduler (loop thread only, plus its helper).

    Args:
        n_vocab: the logits' width (a bitmask row covers it).
        n_rows: the most rows a step samples (the sequence count): the mask buffer's height.
    """

    def __init__(self, n_vocab: int, n_rows: int) -> None:
        self.n_vocab = n_vocab
        self._buf = torch.zeros((max(1, n_rows), mask_words(n_vocab)), dtype=torch.int32)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # loop-thread seconds spent on constrained steps (bench/grammar_engines.py): waiting for
        # masks the forward pass did not hide, and applying them; steps that had any
        self.wait_s = 0.0
        self.apply_s = 0.0
        self.steps = 0

    def start(self, reqs: Sequence[GenRequest]) -> PendingMasks | None:
        """Start the bitmasks of the constrained requests among ``reqs`` (those sampling this
        step); None when none is constrained (the step pays nothing)."""
        cons = [r for r in reqs if r.constraint is not None]
        if not cons:
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="loraplane-grammar")
        if len(cons) > self._buf.shape[0]:
            self._buf = torch.zeros((len(cons), self._buf.shape[1]), dtype=torch.int32)
        constraints: list[Constraint] = [r.constraint for r in cons]  # type: ignore[misc]
        fut = self._pool.submit(fill_masks, constraints, self._buf)
        return PendingMasks(cons, self._buf, fut)

    def apply(self, pending: PendingMasks | None, logits: torch.Tensor, row_of: dict[int, int]) -> None:
        """Wait for ``pending`` and mask the logits rows of its requests in place
        (``row_of``: ``id(request)`` → its sampling row of ``logits``, f32 ``(m, n_vocab)``)."""
        if pending is None:
            return
        t0 = time.perf_counter()
        pending.fut.result()
        t1 = time.perf_counter()
        reqs = [r for r in pending.reqs if id(r) in row_of]
        if len(reqs) != len(pending.reqs):  # a row that did not sample: keep the mask rows aligned
            keep = [i for i, r in enumerate(pending.reqs) if id(r) in row_of]
            masks = pending.buf[keep]
        else:
            masks = pending.buf
        for r in reqs:  # a limit reached while computing the mask
            if r.constraint is not None and r.constraint.failed:
                _refuse(r.constraint)
        apply_masks(logits, [row_of[id(r)] for r in reqs], masks)
        self.wait_s += t1 - t0
        self.apply_s += time.perf_counter() - t1
        self.steps += 1

    def advance(self, req: GenRequest, token_id: int, reason: str | None) -> str | None:
        """Feed the sampled ``token_id`` to ``req``'s matcher; returns the finish reason: the one
        the ids decided, else "stop" once the grammar is complete, or `GRAMMAR_FAILED` when the
        matcher refused the token (logged, never raised — the worker keeps serving)."""
        c = req.constraint
        if c is None:
            return reason
        if c.failed:  # failed computing this step's mask: whatever was sampled, the request fails
            log.warning("grammar_failed_in_mask", request_id=req.request_id, error=c.error)
            return GRAMMAR_FAILED
        if not c.advance(token_id):  # the mask allowed it: the engine failed (a limit), not the model
            log.warning("grammar_rejected_token", request_id=req.request_id, token_id=token_id, error=c.error)
            _refuse(c)
            return reason or GRAMMAR_FAILED
        if reason is None and c.done:
            return "stop"
        return reason

    @staticmethod
    def failure(req: GenRequest) -> InvalidRequestError:
        """The error that ends a request whose matcher refused a token (`GRAMMAR_FAILED`):
        names the format, how far it got and the engine's reason (one line, no state dump)."""
        c = req.constraint
        kind = c.format.type if c is not None else "response_format"
        why = one_line(c.error or "") if c is not None else ""
        return InvalidRequestError(
            f"response_format: the grammar engine could not follow this {kind} format at generated token "
            f"{len(req.generated)} ({why or 'the token was refused'}); simplify the format"
        )

    def close(self) -> None:
        """Stop the helper thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


REFUSED_TOKEN = "doesn't satisfy the grammar"
"""How the engine words a plain refusal of a token (llguidance's parser): the token's fault, not
the format's (a token the mask did not cover, as when ``ignore_eos`` bans the only one allowed)."""


def _refuse(c: Constraint) -> None:
    """The format of a matcher that failed on its own (a lexer or parser limit, not a refused
    token: `REFUSED_TOKEN`) is refused from now on (`grammar.refuse_format`: later copies would
    start failed)."""
    error = c.error or ""
    if c.key is not None and REFUSED_TOKEN not in error:
        refuse_format(c.key, f"{c.format.type}: {one_line(error or 'the engine failed')}")


__all__ = ["GrammarStage", "PendingMasks"]
