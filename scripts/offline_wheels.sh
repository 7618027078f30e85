#!/usr/bin/env bash
# Wheels for a GPU host with no network that brings its own torch, grpcio, protobuf and transformers (an image
# or a lent machine): what the services need besides those, pure Python or built for its CPython, into .whl/.
# The health-checking and reflection wheels must match the host's grpcio: generated code refuses an older one.
#
#   bash scripts/offline_wheels.sh [GRPCIO_VERSION] [PYTHON_VERSION]     # defaults: 1.84.0 3.12
#   # on the host:  pip install --no-index --no-deps --target /tmp/site .whl/*.whl .whl/http/*.whl
#   #               export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
grpcio=${1:-1.84.0}
python=${2:-3.12}
rm -rf .whl && mkdir -p .whl/http
python3 -m pip download -q --no-deps -d .whl "grpcio-health-checking==$grpcio" "grpcio-reflection==$grpcio"
python3 -m pip download -q -d .whl/http --only-binary=:all: --python-version "$python" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    aiohttp prometheus-client
# NOTE: what the host already has stays its own (a newer copy first on PYTHONPATH would shadow it)
rm -f .whl/http/idna-* .whl/http/typing_extensions-*
ls .whl .whl/http
