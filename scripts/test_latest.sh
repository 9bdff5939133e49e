#!/usr/bin/env bash
# Non-blocking check (not run by .ci/run): the tests against the newest releases the extras allow
# (transformers above all), in .venv-latest, built without constraints/test.txt and upgraded on
# every run. It prints what differs from the lock, then runs pytest with the given arguments.
#
#     bash scripts/test_latest.sh                    # the whole suite
#     bash scripts/test_latest.sh tests/media -x     # pytest arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=".venv-latest"
VENV="$VENV" CONSTRAINTS="" bash scripts/venv.sh
echo "Installed here, not in constraints/test.txt:"
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v "^torch==" \
    | grep -vxFf constraints/test.txt || true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m pytest "$@"
