#!/usr/bin/env bash
# Sets up, lints and runs the whole test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m pytest -q -p no:cacheprovider "$@"
