#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job on the shipped data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/energon-pack tune --lazy --eager "$@"
