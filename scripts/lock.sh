#!/usr/bin/env bash
# Refresh a lock file on purpose: build its environment in a scratch folder without the lock
# (the newest versions the requirements allow), then write what was installed.
#
#     bash scripts/lock.sh                          # constraints/test.txt (.venv: test + docs)
#     bash scripts/lock.sh bridge                   # constraints/bridge.txt (.bridge-venv)
#     bash scripts/lock.sh test transformers==5.24.0   # hold a package at a version
#
# Then build against the new lock (bash scripts/test.sh, bash scripts/test_bridge.sh) and commit
# the lock with the changes its new versions need. torch (pinned in the scripts) and the
# packages the Bridge script installs without dependencies are left out of the lock.
set -euo pipefail
cd "$(dirname "$0")/.."

WHAT="${1:-test}"
HOLD="${*:2}"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
case "$WHAT" in
    test) VENV="$SCRATCH/venv" CONSTRAINTS="" EXTRA="$HOLD" bash scripts/venv.sh ;;
    bridge) BRIDGE_VENV="$SCRATCH/venv" BRIDGE_CONSTRAINTS="" EXTRA="$HOLD" bash scripts/bridge_env.sh ;;
    *)
        echo "usage: bash scripts/lock.sh [test|bridge] [REQUIREMENT ...]" >&2
        exit 2
        ;;
esac
PY="$SCRATCH/venv/bin/python"
{
    echo "# Written by: bash scripts/lock.sh $*"
    echo "# $("$PY" --version), $(date -u +%Y-%m-%d). Refresh on purpose, never by hand."
    "$PY" -m pip freeze --exclude-editable | grep -viE '^(torch|megatron[-_](core|bridge))( @ |==)'
} > "constraints/$WHAT.txt"
echo "wrote constraints/$WHAT.txt ($(grep -vc '^#' "constraints/$WHAT.txt") packages)"
