#!/usr/bin/env bash
# The README's test command: set up (if needed), lint, then run every test tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check flying sglang_patches scheduler workloads tests
exec .venv/bin/python -m pytest "$@"
