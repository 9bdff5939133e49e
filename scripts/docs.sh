#!/usr/bin/env bash
# Set up .venv (if needed), then build the documentation site; any Sphinx warning fails the build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html "$@"
