#!/usr/bin/env bash
# Set up a virtual environment (CPU torch first) and run the whole test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSTORE_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
# The CPU build of torch first: letting pip choose could pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
exec "$VENV/bin/python" -m pytest "$@"
