#!/usr/bin/env bash
# Run the tests against Megatron-Bridge's own code (tests/bridge/) in its test environment.
# Builds the environment first when it is missing or older than constraints/bridge.txt
# (bash scripts/bridge_env.sh).
#
#     bash scripts/test_bridge.sh                   # all Bridge tests
#     bash scripts/test_bridge.sh -k offline -x     # pytest arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."
BRIDGE_VENV="${BRIDGE_VENV:-.bridge-venv}"
BRIDGE_VENV="$BRIDGE_VENV" bash scripts/bridge_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$BRIDGE_VENV/bin/python" -m pytest tests/bridge -q -p no:cacheprovider "$@"
