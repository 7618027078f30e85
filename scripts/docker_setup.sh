#!/usr/bin/env bash
# What the docker deployment needs on a Debian host without a container registry; idempotent (each step
# is skipped when its result is there), so tests and users can run it every time:
#   1. docker.io, docker-compose (v1) and debootstrap from apt;
#   2. a running dockerd (started here, in the background, when `docker info` fails);
#   3. the base image ddtree-base:bookworm: debootstrap (python3, python3-venv) + `docker import`;
#   4. docker/wheels: torch==2.13.0 (the CPU wheel) and the project's dependencies, for the CPU image.
# PYTHON (default python3) is the interpreter that reads pyproject.toml and downloads the wheels. With
# DDTREE_DOCKER_RECORD=FILE, what this run started or built is appended to FILE, one `dockerd PID` or
# `image NAME` a line, so that a caller (tests/test_compose.py) can undo exactly that.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE=${DDTREE_BASE_IMAGE:-ddtree-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELS=docker/wheels
LOG_DIR=${DDTREE_DOCKER_LOGS:-/tmp/ddtree-docker-setup}
PYTHON=${PYTHON:-python3}
mkdir -p "$LOG_DIR" "$WHEELS"

say() { echo "docker_setup: $*" >&2; }
record() { [ -z "${DDTREE_DOCKER_RECORD:-}" ] || echo "$*" >>"$DDTREE_DOCKER_RECORD"; }
need_root() { [ "$(id -u)" = 0 ] || { say "$1 needs root"; exit 1; }; }

install_packages() {
  local missing=()
  for tool in docker:docker.io dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return
  need_root "installing ${missing[*]}"
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >"$LOG_DIR/apt.log"
}

start_dockerd() {
  docker info >/dev/null 2>&1 && return
  need_root "starting dockerd"
  say "starting dockerd (log: $LOG_DIR/dockerd.log)"
  setsid nohup dockerd >"$LOG_DIR/dockerd.log" 2>&1 </dev/null &
  record dockerd $!  # setsid and nohup exec: $! is dockerd itself
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return
    sleep 1
  done
  say "dockerd did not come up; see $LOG_DIR/dockerd.log"
  exit 1
}

build_base_image() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  need_root "debootstrap"
  say "building $BASE_IMAGE with debootstrap (log: $LOG_DIR/debootstrap.log)"
  local rootfs
  rootfs=$(mktemp -d /tmp/ddtree-rootfs.XXXXXX)
  if ! debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$MIRROR" \
      >"$LOG_DIR/debootstrap.log" 2>&1; then
    tail -20 "$LOG_DIR/debootstrap.log" >&2
    rm -rf "$rootfs"
    exit 1
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import -c "ENV LANG=C.UTF-8" - "$BASE_IMAGE" >/dev/null
  record image "$BASE_IMAGE"
  rm -rf "$rootfs"
}

download_wheels() {
  # The project's dependencies (from pyproject.toml) and setuptools (builds the project's wheel in the
  # image), as wheels for bookworm's Python 3.11; fetched again only when that list changes.
  local wanted="$WHEELS/requirements.txt"
  "$PYTHON" -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
    >"$wanted.new"
  printf 'torch==2.13.0\nsetuptools>=68\n' >>"$wanted.new"
  if cmp -s "$wanted.new" "$wanted"; then
    rm "$wanted.new"
    return
  fi
  say "downloading wheels into $WHEELS"
  "$PYTHON" -m pip download -q --disable-pip-version-check -d "$WHEELS" --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -r "$wanted.new"
  mv "$wanted.new" "$wanted"
}

install_packages
start_dockerd
build_base_image
download_wheels
say "ready: $(docker info --format '{{.ServerVersion}}'), $BASE_IMAGE, $(ls "$WHEELS"/*.whl | wc -l) wheels"
