#!/usr/bin/env bash
# Creates a virtual environment (the first argument, default .venv; an existing one is kept) and installs the
# project into it, editable, with its test extras. torch==2.13.0 comes first: on a CPU machine that is a local
# CPU wheel, where a torch left to the project's range would be a multi-GB CUDA build. The rest are the newest
# releases that pyproject.toml allows, at the time they are first installed into this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
install() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
install "torch==2.13.0"
install -e ".[test]"
