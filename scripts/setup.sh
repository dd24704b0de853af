#!/usr/bin/env bash
# Create .venv (if missing) and install Flying with its test, benchmark and router extras
# (the router extra: sglang-router and smg, for tests/integration/test_router.py).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import flying, sglang, pytest, matplotlib, sglang_router, smg" 2>/dev/null; then
  # The install takes ~11 GB; with less free, pip dies half-way with "No space left on device".
  free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt 13 ]; then
    echo "[setup] only ${free_gb} GB free on $(df -P . | awk 'NR==2 {print $6}'); installing needs ~13 GB" >&2
    exit 1
  fi
  echo "[setup] installing sglang==0.5.23 and Flying (first time: ~5-7 min)"
  .venv/bin/pip install --upgrade pip 2>&1 | tail -1
  .venv/bin/pip install --no-cache-dir --progress-bar off -e ".[test,bench,router]" 2>&1 \
    | grep -v "^WARNING: Location" | grep -E "^(Successfully|ERROR|error)" || true
fi
.venv/bin/python -c "import flying, sglang_patches, sglang, pytest" \
  || { echo "[setup] installation failed" >&2; exit 1; }
echo "[setup] ready: $(.venv/bin/python -c 'import sglang; print("sglang", sglang.__version__)')"
