#!/usr/bin/env bash
# The README's first command: set up (if needed), then serve (demo model by default).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m flying.launch "$@"
