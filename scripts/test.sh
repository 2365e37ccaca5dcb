#!/usr/bin/env bash
# The whole CPU test suite, set up from nothing (the README's test command; CI runs it through .ci/run).
#   .venv      torch 2.13 (CPU build), transformers, triton (interpreter), this package: every CPU test
#   .venv-xla  torch 2.9 + torch_xla 2.9: the same suite on torch 2.9, XLA tests included (PJRT_DEVICE=CPU)
# Extra arguments go to both pytest runs (e.g. -k options).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
say() { printf '\n== %s (%s)\n' "$*" "$(date +%H:%M:%S)"; }
# pytest-xdist workers: one a core, at most 4 (each holds a torch and, in some tests, a transformers model);
# KPT_TEST_WORKERS sets it (1: one process, no xdist). The torch 2.13 run on a 2-core machine: 8.4 minutes with 2
# workers (s47), about 16 in one process (s46).
WORKERS=${KPT_TEST_WORKERS:-$(n=$(nproc); echo $(( n < 4 ? n : 4 )))}
XDIST=(); [ "$WORKERS" -gt 1 ] && XDIST=(-n "$WORKERS")

say "environment .venv: torch 2.13.0 (CPU), transformers, kernelpytorch"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first and pinned: a bare 'torch' requirement would fetch a CUDA build of several GB.
.venv/bin/pip install -q torch==2.13.0
# triton: the kernels run in its interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 there).
.venv/bin/pip install -q -e ".[test,bench]" triton==3.9.0

say "tests on torch 2.13"
.venv/bin/python -m pytest -q -m "not gpu" "${XDIST[@]}" "$@"

say "environment .venv-xla: torch 2.9.0 + torch_xla 2.9.0 (torch_xla 2.9 works only with torch 2.9)"
# torch 2.9.0 from PyPI is a CUDA build: the environment takes about 7.1 GB (4.3 GB of it nvidia-* libraries that
# `import torch` loads even on the CPU), and pip needs room for the wheels while it installs. A machine with less
# free disk skips this stage and says so, rather than failing half-way with "No space left on device"; every test
# but the three XLA ones has already run above, on torch 2.13.
NEED_MB=${KPT_XLA_NEED_MB:-12000}
if [ ! -d .venv-xla ]; then  # an existing environment is used as it is
  FREE_MB=$(df -Pm . | awk 'NR==2 {print $4}')
  if [ "$FREE_MB" -lt "$NEED_MB" ]; then
    say "SKIPPED the torch 2.9 + torch_xla stage: it needs about $NEED_MB MB of free disk, this machine has $FREE_MB MB"
    echo "tests/test_xla.py and the torch 2.9 run did not run here; free disk (or set KPT_XLA_NEED_MB) to run them."
    exit 0
  fi
fi
[ -x .venv-xla/bin/python ] || "$PY" -m venv .venv-xla
.venv-xla/bin/pip install -q --no-cache-dir torch==2.9.0
.venv-xla/bin/pip install -q --no-cache-dir torch_xla==2.9.0
.venv-xla/bin/pip install -q -e ".[test]"

say "tests on torch 2.9 with torch_xla (PJRT_DEVICE=CPU)"
PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -q -m "not gpu" "${XDIST[@]}" "$@"
say "all CPU tests passed"
