#!/usr/bin/env bash
# Set up .venv (if needed), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy energon_pack
exec .venv/bin/python -m pytest "$@"
