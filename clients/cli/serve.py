"""``loraplane serve``: the control plane in this process plus one worker subprocess.

The main thread runs ``control_plane.server.run_control_plane``; a supervisor thread
(`_Supervisor`) starts the worker (``python -m clients.cli worker …``) once the control plane
accepts connections, waits for it to register, runs the optional ``on_ready`` hook (the demo),
restarts it after a crash (`RestartBackoff`) and drains it at shutdown (``before_stop``). The
worker secret travels in ``$LORAPLANE_WORKER_SECRET``, parent death through
``$LORAPLANE_PARENT_FD`` (`worker.rpc.parent`). Who stops what, signals, restarts and the
parent pipe: docs/operations.md, "``serve``".
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from clients.results import WorkerInfo
from loraplane.env import ENV_NO_PROGRESS, ENV_PARENT_FD, ENV_WORKER_RESTARTS, ENV_WORKER_SECRET
from loraplane.process import child_pythonpath, stop_process

WORKER_STOP_GRACE_S = 60.0
"""Default wait for the worker to drain and exit before SIGKILL (its drain timeout + a margin)."""
POLL_INTERVAL_S = 0.25

# Called with a connected client and the registered worker once serving; returns True to stop.
ReadyHook = Callable[[LoraplaneClient, WorkerInfo], bool]


@dataclass(frozen=True)
class RestartBackoff:
    """When `serve` restarts a dead worker.

    Attributes:
        initial_s: wait before the first restart, in seconds.
        max_s: the longest wait; each quick death doubles the previous one up to this.
        reset_after_s: a worker that lived this long resets the wait to ``initial_s``.
    """

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def next_delay(self, previous_s: float | None, uptime_s: float) -> float:
        """Seconds to wait before the next restart."""
        if previous_s is None or uptime_s >= self.reset_after_s:
            return self.initial_s
        return min(previous_s * 2, self.max_s)


@dataclass(frozen=True)
class ServeSpec:
    """What `run_serve` starts.

    Attributes:
        cp_addr: address the control plane binds and the worker dials (a real port, not 0).
        worker_args: ``loraplane worker`` options besides ``--control-plane``/``--addr``.
        ready_timeout_s: how long the worker may take to load the model and register.
        worker_log: file for the worker's stdout/stderr (None: share this process's).
        quiet: do not announce readiness on stderr.
        http_addr / metrics_addr / worker_metrics_addr: announced with readiness (None: off).
        worker_secret: passed to the worker in ``$LORAPLANE_WORKER_SECRET`` (None: not set).
        api_key: the control plane's inference API key, sent by serve's own client (None: the
            admin token from the environment, if any).
        backoff: restart timing of a worker that died after registering.
        worker_stop_grace_s: how long a stopping ``serve`` waits for its draining worker
            before SIGKILL (above the worker's ``--drain-timeout``).
    """

    cp_addr: str
    worker_args: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0
    worker_log: Path | None = None
    quiet: bool = False
    worker_secret: str | None = None
    api_key: str | None = None
    backoff: RestartBackoff = RestartBackoff()
    http_addr: str | None = None
    metrics_addr: str | None = None
    worker_metrics_addr: str | None = None
    worker_stop_grace_s: float = WORKER_STOP_GRACE_S

    def addresses(self) -> str:
        """``"; HTTP API http://…/v1; metrics http://…/metrics (control plane), …"`` for the
        endpoints that are on ("" when none is)."""
        parts = []
        if self.http_addr:
            parts.append(f"OpenAI-compatible HTTP API http://{dial_addr(self.http_addr)}/v1")
        if self.metrics_addr:
            parts.append(f"metrics http://{dial_addr(self.metrics_addr)}/metrics (control plane)")
        if self.worker_metrics_addr:
            parts.append(f"http://{dial_addr(self.worker_metrics_addr)}/metrics (worker)")
        return "".join(f"; {p}" for p in parts)


def resolve_port(addr: str) -> str:
    """``host:0`` → ``host:<a free port>`` (the worker must be told a real port)."""
    host, _, port = addr.rpartition(":")
    if port != "0":
        return addr
    bind_host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bind_host, 0))
        return f"{host}:{s.getsockname()[1]}"


def dial_addr(addr: str) -> str:
    """The address to dial for a bind address (a wildcard host becomes loopback)."""
    host, _, port = addr.rpartition(":")
    if host in ("0.0.0.0", "", "[::]", "::"):
        return f"127.0.0.1:{port}"
    return addr


def worker_command(cp_addr: str, worker_id: str, worker_args: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "clients.cli",
        "worker",
        "--control-plane",
        cp_addr,
        "--addr",
        "127.0.0.1:0",
        "--worker-id",
        worker_id,
        *worker_args,
    ]


def _worker_env(secret: str | None, parent_fd: int, restarts: int) -> dict[str, str]:
    env = dict(os.environ)
    if secret:
        env[ENV_WORKER_SECRET] = secret
    env[ENV_PARENT_FD] = str(parent_fd)
    env[ENV_WORKER_RESTARTS] = str(restarts)
    env["PYTHONPATH"] = child_pythonpath(env)
    # `python -m` would put the working directory first on sys.path (Python >= 3.11 honours this):
    # a worker.py or clients/ of the user's must not stand in for the package
    env["PYTHONSAFEPATH"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[ENV_NO_PROGRESS] = "1"  # serve draws the one "loading" spinner; two would garble the line
    return env


def _say(message: str) -> None:
    click.echo(f"loraplane: {message}", err=True)


class _Supervisor(threading.Thread):
    """Starts and watches the worker; see the module docstring."""

    def __init__(self, spec: ServeSpec, on_ready: ReadyHook | None, stopping: threading.Event) -> None:
        super().__init__(name="loraplane-serve-supervisor", daemon=True)
        self.spec = spec
        self.on_ready = on_ready
        self.exit_code = 0
        self.stopping = stopping
        # Our worker is recognised by this id (never mistake another server's worker for it).
        self.worker_id = f"serve-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._parent_pipe: int | None = None  # write end: the worker sees EOF when we die
        self._stop_requested = False
        self._started_at = 0.0
        self.restarts = 0

    # -- thread body ---------------------------------------------------------------------

    def run(self) -> None:
        try:
            # No per-call deadline: on_ready may generate on a slow CPU worker.
            with LoraplaneClient(
                dial_addr(self.spec.cp_addr),
                wait_for_server=True,
                connect_timeout=self.spec.ready_timeout_s,
                api_key=self.spec.api_key,
            ) as client:
                client.connect()
                if not self._spawn_worker():
                    return
                from loraplane.progress import progress_enabled, spinner

                with spinner("loading the model in the worker", enabled=progress_enabled()):
                    worker = self._wait_registered(client)
                if worker is None:
                    return
                if not self.spec.quiet:
                    _say(
                        f"serving on {self.spec.cp_addr} "
                        f"(worker {worker.worker_id} at {worker.addr}){self.spec.addresses()}; Ctrl-C stops"
                    )
                if self.on_ready is not None and self.on_ready(client, worker):
                    self.request_stop(0)
                    return
            self._watch_worker()
        except LoraplaneError as err:
            if not self.stopping.is_set():
                _say(f"serve failed: {err.message}")
                self.request_stop(1)
        except Exception as err:  # noqa: BLE001 - report, then stop the whole process
            if not self.stopping.is_set():
                _say(f"serve failed: {type(err).__name__}: {err}")
                self.request_stop(1)

    def _spawn_worker(self, restarts: int = 0) -> bool:
        """Start the worker (its ``restarts``-th restart); False when stopping already."""
        cmd = worker_command(dial_addr(self.spec.cp_addr), self.worker_id, self.spec.worker_args)
        with self._lock:
            if self.stopping.is_set():
                return False
            out: Any = None
            if self.spec.worker_log is not None:
                self._log_file = open(self.spec.worker_log, "ab")  # noqa: SIM115
                out = self._log_file
            # os.pipe() fds are close-on-exec: only the worker gets the read end (pass_fds),
            # and nothing we start ever inherits the write end.
            read_end, write_end = os.pipe()
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    env=_worker_env(self.spec.worker_secret, read_end, restarts),
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(read_end,),
                    start_new_session=True,  # group signals are serve's to pass on (docstring)
                )
            except BaseException:
                os.close(write_end)
                raise
            finally:
                os.close(read_end)
            if self._parent_pipe is not None:
                os.close(self._parent_pipe)  # the previous (dead) worker's
            self._parent_pipe = write_end
            self._started_at = time.monotonic()
        return True

    def _wait_registered(self, client: LoraplaneClient) -> WorkerInfo | None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while not self.stopping.is_set():
            code = self._proc.poll() if self._proc else None
            if code is not None:
                _say(
                    f"the worker exited with code {code} before registering"
                    + (f" (log: {self.spec.worker_log})" if self.spec.worker_log else "")
                )
                self.request_stop(1)
                return None
            ours = [w for w in client.list_workers() if w.alive and w.worker_id == self.worker_id]
            if ours:
                return ours[0]
            if time.monotonic() > deadline:
                _say(f"the worker did not register within {self.spec.ready_timeout_s:g}s")
                self.request_stop(1)
                return None
            self.stopping.wait(POLL_INTERVAL_S)
        return None

    def _watch_worker(self) -> None:
        """Restart the worker whenever it exits, after `RestartBackoff`'s wait, until stopped."""
        delay: float | None = None
        while not self.stopping.wait(POLL_INTERVAL_S):
            code = self._proc.poll() if self._proc else None
            if code is None or self.stopping.is_set():
                continue
            delay = self.spec.backoff.next_delay(delay, time.monotonic() - self._started_at)
            _say(
                f"the worker {self.worker_id} exited unexpectedly with code {code}; "
                f"restarting it in {delay:g}s (restart {self.restarts + 1})"
            )
            if self.stopping.wait(delay):
                return
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            if not self._spawn_worker(self.restarts + 1):
                return
            self.restarts += 1
            _say(f"worker {self.worker_id} restarted (pid {self._proc.pid if self._proc else '?'})")

    # -- stopping ------------------------------------------------------------------------

    def request_stop(self, exit_code: int) -> None:
        """Stop serving from this thread: record the code and end ``run_control_plane``."""
        with self._lock:
            if self._stop_requested or self.stopping.is_set():
                return
            self._stop_requested = True
            self.exit_code = exit_code
        self.stopping.set()

    def drain_worker(self) -> None:
        """Main thread, while the control plane still serves (``run_control_plane``'s
        ``before_stop``): SIGTERM the worker and wait up to ``worker_stop_grace_s`` for it to
        drain and exit. A SIGINT/SIGTERM meanwhile is passed on to the worker (its second
        signal: stop now)."""
        with self._lock:
            self.stopping.set()
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return

        def forward(signum: int, _frame: Any) -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # first: the message may block (a stalled stderr)
                _say("stopping the worker now (second signal)")

        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            proc.send_signal(signal.SIGTERM)
            if not self.spec.quiet:
                _say(f"draining the worker {self.worker_id} (a second Ctrl-C stops at once)")
            proc.wait(self.spec.worker_stop_grace_s)
        except subprocess.TimeoutExpired:
            pass  # shutdown() kills it
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def shutdown(self) -> None:
        """Main thread, after the control plane returned: stop the worker and this thread."""
        with self._lock:
            self.stopping.set()
            proc = self._proc
        stop_process(proc, self.spec.worker_stop_grace_s)
        with self._lock:
            if self._parent_pipe is not None:
                os.close(self._parent_pipe)
                self._parent_pipe = None
        if self._log_file is not None:
            self._log_file.close()
        self.join(timeout=5.0)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_serve(
    spec: ServeSpec, run_control_plane: Callable[..., Any], cp_config: Any, on_ready: ReadyHook | None = None
) -> int:
    """Serve until interrupted (or until ``on_ready`` returns True); returns the exit code.

    ``run_control_plane(cp_config, stop_event=event, before_stop=hook)`` blocks until ``event``
    is set (its own SIGINT/SIGTERM handlers set it), then runs ``hook`` (the worker's drain).
    Before it installs them, and after it restores them, both signals raise
    KeyboardInterrupt here (even where SIGINT was inherited as ignored, as for background jobs
    of a script), which ends serving the same way.
    """
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopping = threading.Event()
    supervisor = _Supervisor(spec, on_ready, stopping)
    supervisor.start()
    try:
        run_control_plane(cp_config, stop_event=stopping, before_stop=supervisor.drain_worker)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            supervisor.shutdown()
        except KeyboardInterrupt:
            pass
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return supervisor.exit_code
