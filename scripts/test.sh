#!/usr/bin/env bash
# Set up .venv (if needed), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy energon_pack tests/package/typed_user_code.py
# The benchmarks import the test helpers; their own errors are the tests' concern, not these.
MYPYPATH=tests/support:tests/encoding:fixtures .venv/bin/mypy --follow-imports=silent benchmarks
exec .venv/bin/python -m pytest "$@"
