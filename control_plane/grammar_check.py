"""Structured-output formats checked in child processes, so that the grammar library's native
code can never take the control plane down.

Every format a request carries (``response_format``, ``guided_*``, a forced tool call's schema)
is compiled by `loraplane.response_format.compile_grammar` before any worker sees it: first
the Python bounds of `loraplane.grammar_limits` (size, ``$ref`` / rule chains, counts), then the
engine's own validation. Both run here in a pool of child processes (pebble's ``ProcessPool``,
``spawn`` start: the control plane's gRPC threads are never forked): a format that crashes the
engine (SIGSEGV on a stack overflow, an abort) kills one child, that request alone gets a clear
INVALID_ARGUMENT / HTTP 400, the pool starts a new child and every other request goes on. A
check that runs longer than ``timeout_s`` is killed the same way. In the child the compile runs
on a thread with a fixed stack (`CHILD_STACK_BYTES`, whatever ``ulimit -s`` says), smaller
than the stack the worker compiles on (`worker.runtime.grammar.COMPILE_STACK_BYTES`),
so what passes here cannot overflow there.

Results are cached by the format's content (`GrammarChecker.cache_size` entries, LRU): the same
schema sent by many requests costs one child round trip, and the HTTP front and the router may
both check a request for the price of one. Requests that bring a format while it is being
checked wait for that check (single-flight) instead of each taking a child for it, so they all
get the same verdict.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import threading
from collections import OrderedDict
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import structlog

from loraplane.grammar_limits import GrammarError, GrammarLimits
from loraplane.response_format import ResponseFormat

log = structlog.get_logger("loraplane.control_plane.grammar_check")

CHILD_STACK_BYTES = 8 * 1024 * 1024
"""Stack of the thread that compiles a format in a child (the common ``ulimit -s``)."""


def _compile_in_child(fmt: ResponseFormat, limits: GrammarLimits) -> str | None:
    """Runs in a child: compile ``fmt`` on a thread with a `CHILD_STACK_BYTES` stack; the
    refusal's message, or None when it compiles."""
    from loraplane.response_format import compile_grammar, one_line

    result: list[str | None] = ["the check did not finish"]

    def run() -> None:
        try:
            compile_grammar(fmt, limits)
            result[0] = None
        except GrammarError as exc:
            result[0] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - any other failure refuses the format, named
            # (the engine's panics are BaseException; `one_line` keeps their text from the client)
            why = f"{type(exc).__name__}: {one_line(str(exc))}"
            result[0] = f"{fmt.type}: the grammar check failed on this format ({why})"

    previous = threading.stack_size(CHILD_STACK_BYTES)
    try:
        t = threading.Thread(target=run, name="grammar-check")
        t.start()
    finally:
        threading.stack_size(previous)
    t.join()
    return result[0]


class _Pending:
    """A check in progress: the requests that bring the same format wait on ``done``."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.verdict: str | None = None
        self.failed = False  # the check raised (not a verdict): a waiter checks again


class GrammarChecker:
    """Compiles formats in a pool of child processes (module docstring).

    Checks are fair between tenants: one tenant's checks in children at once are at most
    ``processes - 1`` (at least 1), so a tenant sending distinct formats that each run to the
    timeout holds back its own later checks, never every child (`for_tenant`; requests without
    a tenant key share the lane of ``None``). Cached verdicts and checks of a format already
    running cost no child.

    Args:
        limits: the bounds every format is held to (the control plane's flags).
        processes: child processes (``--grammar-check-processes``, default 2); each checks one
            format at a time.
        timeout_s: seconds one check may run before its child is killed and the format refused
            (``--grammar-check-timeout``, default 10).
        cache_size: verdicts remembered by content.
    """

    def __init__(
        self,
        limits: GrammarLimits | None = None,
        *,
        processes: int = 2,
        timeout_s: float = 10.0,
        cache_size: int = 1024,
    ) -> None:
        self.limits = limits or GrammarLimits()
        self.timeout_s = float(timeout_s)
        self.cache_size = int(cache_size)
        self.processes = int(processes)
        if self.processes < 1:
            raise ValueError(f"grammar check processes must be at least 1, got {processes}")
        self._cache: OrderedDict[bytes, str | None] = OrderedDict()
        self._pending: dict[bytes, _Pending] = {}
        self._lock = threading.Lock()
        self._pool: Any = None  # started at the first check: most deployments never need it
        self._lanes: dict[str | None, threading.Semaphore] = {}  # children a tenant may hold at once
        self.crashes = 0
        self.timeouts = 0

    def _key(self, fmt: ResponseFormat) -> bytes:
        h = hashlib.sha256()
        for part in (fmt.type, fmt.schema, "1" if fmt.strict else "0", fmt.pattern, fmt.grammar):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.digest()

    def for_tenant(self, tenant: str | None) -> TenantChecker:
        """This checker as ``tenant``'s requests use it (its lane of children)."""
        return TenantChecker(self, tenant)

    def _lane(self, tenant: str | None) -> threading.Semaphore:
        with self._lock:
            lane = self._lanes.get(tenant)
            if lane is None:
                if len(self._lanes) >= 4096:  # idle lanes of departed tenants
                    self._lanes = {t: sem for t, sem in self._lanes.items() if sem._value < self._per_tenant}
                lane = self._lanes[tenant] = threading.Semaphore(self._per_tenant)
            return lane

    @property
    def _per_tenant(self) -> int:
        return max(1, self.processes - 1)

    def check(self, fmt: ResponseFormat, tenant: str | None = None) -> None:
        """Compile ``fmt`` in a child (or take the cached verdict, or wait for the check of the
        same format already running), in ``tenant``'s lane (class docstring).

        Raises:
            GrammarError: the format is over a limit, does not compile, crashed the engine
                (the child died: named as such, with its exit code) or took longer than
                ``timeout_s`` (the child was killed).
        """
        key = self._key(fmt)
        while True:
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    verdict = self._cache[key]
                    if verdict is not None:
                        raise GrammarError(verdict)
                    return
                pending = self._pending.get(key)
                owner = pending is None
                if pending is None:
                    pending = self._pending[key] = _Pending()
            if owner:
                break
            pending.done.wait()
            if not pending.failed:
                if pending.verdict is not None:
                    raise GrammarError(pending.verdict)
                return
        try:
            with self._lane(tenant):
                verdict = self._run(fmt)
        except BaseException:
            pending.failed = True
            raise
        else:
            pending.verdict = verdict
            with self._lock:
                self._cache[key] = verdict
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        finally:
            with self._lock:
                del self._pending[key]
            pending.done.set()
        if verdict is not None:
            raise GrammarError(verdict)

    def _started(self) -> Any:
        """The process pool, started on first use."""
        with self._lock:
            if self._pool is None:
                from pebble import ProcessPool

                self._pool = ProcessPool(max_workers=self.processes, context=multiprocessing.get_context("spawn"))
            return self._pool

    def _run(self, fmt: ResponseFormat) -> str | None:
        from pebble import ProcessExpired

        future = self._started().schedule(_compile_in_child, args=(fmt, self.limits), timeout=self.timeout_s)
        try:
            return future.result()
        except FutureTimeout:
            self.timeouts += 1
            log.warning("grammar_check_timeout", type=fmt.type, timeout_s=self.timeout_s)
            return (
                f"{fmt.type}: compiling it took longer than {self.timeout_s:g} s and was stopped "
                "(--grammar-check-timeout); simplify the format"
            )
        except ProcessExpired as exc:
            self.crashes += 1
            log.warning("grammar_check_crashed", type=fmt.type, exitcode=exc.exitcode)
            return (
                f"{fmt.type}: the grammar engine crashed on this format (exit code {exc.exitcode}); it "
                "is too deeply nested or too large to compile safely"
            )

    def close(self) -> None:
        """Stop the children (pending checks are cancelled); a later check starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=5)

    def __enter__(self) -> GrammarChecker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TenantChecker:
    """A `GrammarChecker` bound to one tenant's lane: what request paths hold (``limits``,
    ``check``)."""

    def __init__(self, checker: GrammarChecker, tenant: str | None) -> None:
        self.checker = checker
        self.tenant = tenant
        self.limits = checker.limits

    def check(self, fmt: ResponseFormat) -> None:
        """`GrammarChecker.check` in this tenant's lane.

        Raises:
            GrammarError: as `GrammarChecker.check`.
        """
        self.checker.check(fmt, self.tenant)


class InlineChecker:
    """`GrammarChecker`'s interface, compiling in this process: for tools and tests that have
    no serving process to protect (a crashing format crashes the caller)."""

    def __init__(self, limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()

    def for_tenant(self, tenant: str | None) -> InlineChecker:
        """Itself: no lanes in one process."""
        return self

    def check(self, fmt: ResponseFormat) -> None:
        """Compile ``fmt`` here.

        Raises:
            GrammarError: over a limit, or it does not compile.
        """
        from loraplane.response_format import compile_grammar

        compile_grammar(fmt, self.limits)

    def close(self) -> None:
        """Nothing to stop."""


__all__ = ["CHILD_STACK_BYTES", "GrammarChecker", "InlineChecker", "TenantChecker"]
