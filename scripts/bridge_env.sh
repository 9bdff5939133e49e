#!/usr/bin/env bash
# Build a Megatron-Bridge test environment (CPU, Python 3.11) from the package registries.
#
# Megatron-Bridge 0.6.2 declares Python >= 3.12 and CUDA-only dependencies; its data and batch
# code runs here once installed without its dependency list. Usage, from the repository root:
#
#     bash scripts/bridge_env.sh                       # builds .bridge-venv/
#     BRIDGE_VENV=/some/dir bash scripts/bridge_env.sh # builds elsewhere
#     BRIDGE_CONSTRAINTS= bash scripts/bridge_env.sh   # without the lock (scripts/lock.sh bridge)
#
# The packages are exactly those of constraints/bridge.txt (what scripts/lock.sh bridge wrote),
# installed without resolving again; Megatron-Core and Megatron-Bridge are pinned here.
# torch is pinned and installed first so that nothing can pull an unpinned (CUDA) build.
# When Bridge's GPTSFTPackedParquetDataset and vlm_step import, "$BRIDGE_VENV/.ready" is written
# with the hash of this script and the lock; an environment whose .ready matches is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="torch==2.13.0"
BRIDGE_PIN="megatron-bridge==0.6.2"
CORE_PIN="megatron-core==0.19.2"
TRANSFORMERS_PIN="transformers==5.12.1"
# transformers 5.12 reads the hub kernels of kernels < 0.13 (0.19's API fails its import).
KERNELS_PIN="kernels<0.13"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
BRIDGE_VENV="${BRIDGE_VENV:-.bridge-venv}"
PY="$BRIDGE_VENV/bin/python"
PIP=("$PY" -m pip install --quiet)
BRIDGE_CONSTRAINTS="${BRIDGE_CONSTRAINTS-constraints/bridge.txt}"
read -r -a EXTRA <<< "${EXTRA:-}"

if [ -n "$BRIDGE_CONSTRAINTS" ]; then
    WANT="$(cat scripts/bridge_env.sh "$BRIDGE_CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
    if [ -f "$BRIDGE_VENV/.ready" ] && [ "$(cat "$BRIDGE_VENV/.ready")" = "$WANT" ]; then
        exit 0
    fi
else
    WANT="unlocked"
fi
rm -f "$BRIDGE_VENV/.ready"
[ -x "$PY" ] || "$PYTHON" -m venv "$BRIDGE_VENV"
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "$TORCH_PIN"
if [ -n "$BRIDGE_CONSTRAINTS" ]; then
    # The lock's versions exactly, then energon_pack itself (editable).
    "${PIP[@]}" --no-deps -r "$BRIDGE_CONSTRAINTS"
    "${PIP[@]}" --no-deps -e .
else
    # energon_pack itself (editable) with its own and its test dependencies.
    "${PIP[@]}" -e ".[test]" "$TORCH_PIN" pyarrow
fi

# megatron-core: a wheel built from its sdist, installed without its dependency list.
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download --quiet --no-deps --ignore-requires-python --no-binary :all: -d "$WHEELS" \
    "$CORE_PIN"
"$PY" -m pip wheel --quiet --no-deps --ignore-requires-python -w "$WHEELS" "$WHEELS"/megatron_core-*.tar.gz
"${PIP[@]}" --no-deps --ignore-requires-python "$WHEELS"/megatron_core-*.whl
"${PIP[@]}" --no-deps --ignore-requires-python "$BRIDGE_PIN"
if [ -z "$BRIDGE_CONSTRAINTS" ]; then
    # What Bridge's data and batch code imports, with the CPU torch kept.
    "${PIP[@]}" "$TORCH_PIN" triton "$TRANSFORMERS_PIN" "$KERNELS_PIN" omegaconf hydra-core \
        einops tensorboard qwen-vl-utils "${EXTRA[@]}"
fi

# Bridge imports only with the shims of tests/bridge/shims.py installed first.
PYTHONPATH="$PWD" "$PY" -c '
import tests.bridge.shims as shims
shims.install()
from megatron.bridge.data.packing.parquet import GPTSFTPackedParquetDataset  # noqa: F401
from megatron.bridge.training import vlm_step  # noqa: F401
print("Megatron-Bridge imports:", shims.bridge_version())
'
echo "$WANT" > "$BRIDGE_VENV/.ready"
