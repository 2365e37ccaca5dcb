#!/usr/bin/env bash
# The main job (README): compile a real model with kernelpytorch, check it against eager, time eager,
# Inductor and kernelpytorch side by side, print which passes fired, write the report to kpt_demo/.
# Where torch is already installed (the GPU machine, which has no network) nothing is downloaded.
# Arguments go to `python -m kpt_compiler.demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
elif ! "$PY" -c "import torch" 2>/dev/null; then
  # A fresh CPU machine: torch 2.13's CPU build (pinned: a bare 'torch' would fetch a CUDA build), transformers.
  "$PY" -m venv .venv
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q transformers
  PY=.venv/bin/python
fi
if ! "$PY" -c "import kpt_compiler.passes" 2>/dev/null; then
  # Offline-safe: no dependencies fetched, no build environment created.
  "$PY" -c "import networkx" 2>/dev/null || "$PY" -m pip install -q networkx
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
exec "$PY" -m kpt_compiler.demo "$@"
