#!/usr/bin/env bash
# Make PostgreSQL's server binaries available for the tests (tests/postgres_server.py starts
# a private server from them, as an unprivileged user). Installs the Debian package
# `postgresql` when neither pg_ctl is on PATH nor /usr/lib/postgresql/*/bin/pg_ctl exists;
# that needs root (CI runs as root); otherwise it says what to install and fails.
set -euo pipefail
if command -v pg_ctl >/dev/null || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_postgres: PostgreSQL server binaries missing; install the Debian package 'postgresql' (as root)" >&2
  exit 1
fi
echo "== installing PostgreSQL (Debian package postgresql)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends postgresql
compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null
