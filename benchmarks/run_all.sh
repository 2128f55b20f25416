#!/usr/bin/env bash
# Run the repository's benchmark set and write one Markdown report (see run_all.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=".venv/bin/python"
[ -x "$PY" ] || PY="python3"
exec "$PY" benchmarks/run_all.py "$@"
