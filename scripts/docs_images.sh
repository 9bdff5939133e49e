#!/usr/bin/env bash
# Regenerate the plots the docs show: the fill-vs-buffer curve (benchmarks/bin_fill.py) and the
# plots of the README's demo command (energon-pack tune on the shipped fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
.venv/bin/python benchmarks/plot_fill.py --out docs/_static/fill_vs_buffer.png
out="$(mktemp -d)"
.venv/bin/energon-pack tune --lazy --eager --out "$out" > /dev/null
cp "$out/rss.png" docs/_static/tune_rss.png
cp "$out/bin_fill.png" docs/_static/tune_bin_fill.png
rm -r "$out"
