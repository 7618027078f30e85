#!/usr/bin/env bash
# What CI runs: a new virtual environment every time (.venv-test, cleared first), so that the tests see the newest
# releases that pyproject.toml allows and nothing that the machine had installed; then the linter and the whole
# suite (GPU tests skip without CUDA) with that venv's python. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-test
python3 -m venv --clear "$venv"
bash scripts/setup.sh "$venv"
"$venv/bin/python" -m ruff check .
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
