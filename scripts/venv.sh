#!/usr/bin/env bash
# Create or reuse .venv and install energon_pack with its test and docs extras, at the versions
# of constraints/test.txt (what CI tests; refreshed on purpose by scripts/lock.sh).
# torch is pinned and installed first so that no dependency can pull an unpinned (CUDA) build.
#
#     VENV=DIR bash scripts/venv.sh                 # another folder than .venv
#     VENV=DIR CONSTRAINTS= bash scripts/venv.sh    # no lock: the newest versions the extras allow
#     ... EXTRA="pkg==1.2" bash scripts/venv.sh     # and these requirements too (scripts/lock.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="torch==2.13.0"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV="${VENV:-.venv}"
CONSTRAINTS="${CONSTRAINTS-constraints/test.txt}"
read -r -a EXTRA <<< "${EXTRA:-}"
STAMP="$VENV/.energon_pack-installed"

if [ -n "$CONSTRAINTS" ]; then
    LOCK=(-c "$CONSTRAINTS")
    WANT="$(cat pyproject.toml scripts/venv.sh "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
        exit 0
    fi
else  # unlocked: resolve anew on every run, upgrading what a newer release exists of
    LOCK=(--upgrade --upgrade-strategy eager)
    WANT="unlocked"
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$TORCH_PIN"
"$VENV/bin/python" -m pip install --quiet "${LOCK[@]}" -e ".[test,docs]" "$TORCH_PIN" \
    "${EXTRA[@]}"
# Test reference only: torchvision for transformers' Qwen3-VL processors, and timm (which
# imports torchvision) for Gemma 3n's vision tower, installed without their dependencies
# (torchvision would replace the CPU torch) into a folder outside sys.path; only the child
# processes of tests/support/qwen3_reference.py and tests/support/torchvision_child.py import
# them, so the rest of the suite never sees them.
"$VENV/bin/python" -m pip install --quiet --upgrade --no-deps --target "$VENV/reference" \
    "torchvision==0.28.0" "timm==1.0.29"
# Test reference only: mistral-common (Voxtral's tokenizer backend) with the audio readers its
# processor path needs, without dependencies (its numpy cap would replace the locked numpy) into
# a folder of its own; only the Voxtral child processes of tests/support/torchvision_child.py
# put it on their path.
"$VENV/bin/python" -m pip install --quiet --upgrade --no-deps --target "$VENV/mistral" \
    "mistral-common==1.13.1" "pydantic-extra-types==2.11.1" "pycountry==26.2.16" \
    "soundfile==0.14.0" "soxr==1.1.0"
echo "$WANT" > "$STAMP"
