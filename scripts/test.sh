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
# A PostgreSQL server for the tests of the index on PostgreSQL (tests/pg_server.py starts a throwaway
# one); where none can be installed those tests skip and say why.
if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing PostgreSQL (Debian's postgresql package) for the index tests"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q postgresql || { apt-get update -q && apt-get install -y -q postgresql; }; } >/dev/null 2>&1 \
        || echo "PostgreSQL could not be installed: its tests will be skipped"
fi
# The real model is pulled into the user's own models folder, once per machine, not once per run
# (tests/conftest.py); everything else a test writes stays in temporary folders.
export KVSTORE_TEST_MODELS="${KVSTORE_TEST_MODELS:-${KVSTORE_MODELS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/models}}"
exec "$VENV/bin/python" -m pytest "$@"
