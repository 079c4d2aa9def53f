#!/usr/bin/env bash
# README command 1: install, assemble the base model, start the control plane and one
# worker on localhost with the demo adapters, print base / shout / sea continuations side
# by side with telemetry, then keep serving (pass --once to exit after printing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/loraplane demo "$@"
