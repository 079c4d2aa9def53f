#!/usr/bin/env bash
# README command 2: install everything the tests need, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --with-node
exec .venv/bin/python -m pytest -q "$@"
