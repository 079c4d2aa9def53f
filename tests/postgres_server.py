"""A real PostgreSQL server for the tests: started once per test session on loopback.

PostgreSQL refuses to run as root, so when the tests run as root (CI) the server runs as an
unprivileged user (`PG_USER`, the Debian package's ``postgres`` user, created with
``useradd --system`` if missing) through ``runuser``; otherwise as the current user. The
cluster lives in a fresh temporary directory (``initdb``, trust authentication: it listens
on 127.0.0.1 and a private socket directory only, and dies with the session).

Binaries: ``pg_ctl`` on PATH, else the newest ``/usr/lib/postgresql/*/bin`` (the Debian
layout; ``scripts/install_postgres.sh`` installs the package when neither exists).
A server that cannot start is a test failure naming the reason, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

PG_USER = "postgres"
PG_ROLE = "loraplane"
START_TIMEOUT_S = 60


class PostgresUnavailable(RuntimeError):
    """The test PostgreSQL server could not be started (the message says why)."""


def pg_bin_dir() -> Path:
    """Where ``initdb``/``pg_ctl`` live.

    Raises:
        PostgresUnavailable: no PostgreSQL installation found.
    """
    on_path = shutil.which("pg_ctl")
    candidates = ([Path(on_path).resolve().parent] if on_path else []) + sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    for d in candidates:
        if (d / "initdb").is_file() and (d / "pg_ctl").is_file():
            return d
    raise PostgresUnavailable(
        "no PostgreSQL binaries (initdb, pg_ctl) on PATH or under /usr/lib/postgresql/*/bin;"
        " run scripts/install_postgres.sh (apt-get install -y postgresql)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PostgresServer:
    """A running test server: ``url(dbname)`` to connect, ``create_database()`` per test group."""

    bin_dir: Path
    root: Path
    port: int
    run_as: list[str]

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

    def stop(self) -> None:
        _run(
            self.run_as + [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"],
            check=False,
        )
        shutil.rmtree(self.root, ignore_errors=True)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=START_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise PostgresUnavailable(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}")
    return proc


def _unprivileged_user() -> list[str]:
    """``runuser -u postgres --`` when root (creating the user if needed), else nothing."""
    if os.geteuid() != 0:
        return []
    if _run(["id", "-u", PG_USER], check=False).returncode != 0:
        _run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER])
    return ["runuser", "-u", PG_USER, "--"]


def start_postgres() -> PostgresServer:
    """initdb + pg_ctl start on a free 127.0.0.1 port; the server, once it accepts connections.

    Raises:
        PostgresUnavailable: with the step that failed and the server log's tail.
    """
    bin_dir = pg_bin_dir()
    run_as = _unprivileged_user()
    root = Path(tempfile.mkdtemp(prefix="loraplane-pg-"))
    os.chmod(root, 0o755)
    if run_as:
        shutil.chown(root, user=PG_USER)
    server = PostgresServer(bin_dir, root, free_port(), run_as)
    try:
        _run(
            run_as
            + [
                str(bin_dir / "initdb"),
                "-D",
                str(server.data_dir),
                "-U",
                PG_ROLE,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ]
        )
        opts = (
            f"-p {server.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        proc = _run(
            run_as
            + [
                str(bin_dir / "pg_ctl"),
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
            check=False,
        )
        if proc.returncode != 0:
            log = (root / "server.log").read_text(errors="replace")[-2000:] if (root / "server.log").exists() else ""
            raise PostgresUnavailable(f"pg_ctl start exited {proc.returncode}: {proc.stderr.strip()}\n{log}")
    except BaseException:
        server.stop()
        raise
    return server
