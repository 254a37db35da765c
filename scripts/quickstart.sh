#!/usr/bin/env bash
# Quick start, from a fresh clone:
#   1. a virtual environment with torch 2.13.0 first (the README says how to get its CPU build),
#      then kvstore itself;
#   2. the default model (SmolLM2-135M-Instruct, ~100 MB, checksums verified), into the per-user
#      models folder (once per machine);
#   3. a session over a real text (the standard library's docstrings, ~2,300 tokens): read it once,
#      generate a little, and stop (the process exits; the session is on disk);
#   4. resume it in a new process: the KV cache is loaded, not recomputed, and generation goes on;
#   5. the time that saved.
# Usage: bash scripts/quickstart.sh   (KVSTORE_HOME chooses the store; the session is `quickstart`)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSTORE_VENV:-.venv}"
CHARS="${QUICKSTART_CHARS:-8000}"   # ~2,300 tokens of text
NEW_TOKENS="${QUICKSTART_TOKENS:-24}"

step() { printf '\n== %s\n' "$*"; }
shown() { printf '$ %s\n' "$*"; }

step "1. virtual environment ($VENV): torch first, then kvstore"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip --upgrade pip
pip torch==2.13.0   # before kvstore, so kvstore's own install keeps it; the README says how to get the CPU build
pip -e .
export PATH="$PWD/$VENV/bin:$PATH"

step "2. the default model"
shown kvstore pull
kvstore pull

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python examples/stdlib_text.py "$CHARS" >"$WORK/stdlib.txt"
kvstore rm quickstart >/dev/null 2>&1 || true

# Run a kvstore command with its stderr shown and also kept in $WORK/log (for the timings).
logged() { { "$@" 2>&1 1>&3 3>&- | tee -a "$WORK/log" >&2; } 3>&1; }

step "3. read $(wc -c <"$WORK/stdlib.txt") characters of standard-library docs into a session, generate, stop"
shown kvstore new quickstart --raw --file stdlib.txt --max-new-tokens "$NEW_TOKENS" --verbose
logged kvstore new quickstart --raw --file "$WORK/stdlib.txt" --max-new-tokens "$NEW_TOKENS" --verbose

step "4. a new process resumes the session from disk and keeps generating"
shown kvstore continue quickstart --max-new-tokens "$NEW_TOKENS" --verbose
logged kvstore continue quickstart --max-new-tokens "$NEW_TOKENS" --verbose

step "5. time saved"
prefill_line="$(grep -m1 'prefill:' "$WORK/log")"
restore_line="$(grep -m1 'restore:' "$WORK/log")"
prefill_s="$(sed -E 's/.* in ([0-9.]+) s.*/\1/' <<<"$prefill_line")"
restore_s="$(sed -E 's/.* in ([0-9.]+) s.*/\1/' <<<"$restore_line")"
tokens="$(sed -E 's/.*prefill: ([0-9,]+) tokens.*/\1/' <<<"$prefill_line")"
awk -v p="$prefill_s" -v r="$restore_s" -v n="$tokens" 'BEGIN {
    printf "   %-44s %8.3f s\n", sprintf("reading the %s tokens again (prefill):", n), p
    printf "   %-44s %8.3f s (checksums verified)\n", "restoring the session from disk:", r
    printf "   saved %.2f s on every resume (%.0fx faster), more for longer texts\n", p - r, (r > 0 ? p / r : 0)
}'
printf '\nThe session stays in your store: try `kvstore show quickstart`, `kvstore history quickstart`,\n'
printf '`kvstore continue quickstart -n 50`, or `kvstore rm quickstart`. (Activate it: source %s/bin/activate)\n' "$VENV"
