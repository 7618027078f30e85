#!/usr/bin/env bash
# Installs the project and its test tools. On a CPU machine torch==2.13.0 comes first (a local CPU
# wheel); GPU images bring their own torch, which the project's range accepts.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
