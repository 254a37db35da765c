#!/usr/bin/env bash
# Crash and recover: kill -9 a generation mid-stream, `kvstore continue` it, and show with --trace
# files that the result equals an uninterrupted run, token for token and logits bit for bit.
#
#   bash examples/crash_recover.sh                 # SmolLM2 (pulled on first use)
#   KVSTORE_MODEL=path/to/model N=96 bash examples/crash_recover.sh
#
# Each trace line is {"position", "token", "logits_sha256"}. The killed run wrote lines for tokens
# past its last checkpoint (every 8 tokens here); `continue` generates those tokens again and
# appends their lines once more. With the repeated lines removed, the file must equal the
# uninterrupted run's trace: a regenerated token that differed would leave an extra line.
set -euo pipefail

MODEL="${KVSTORE_MODEL:-smollm2}"
N="${N:-64}"
PROMPT="${PROMPT:-Write a short story about a lighthouse keeper who collects lost letters.}"
KVSTORE="${KVSTORE:-kvstore}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# The demo's sessions live in a throwaway home; the model is resolved in your usual one first.
case "$MODEL" in */*|*.gguf) ;; *) MODEL="$("$KVSTORE" pull "$MODEL")" ;; esac
export KVSTORE_HOME="$WORK/home"
RUN=demo

gen=(--model "$MODEL" --prompt "$PROMPT" --max-new-tokens "$N" --temperature 0.8 --seed 42 --checkpoint-every 8)

echo "== 1. the uninterrupted run (the reference)"
"$KVSTORE" new "$RUN-ref" "${gen[@]}" --trace "$WORK/ref.jsonl" </dev/null >"$WORK/ref.txt"
echo "   $(wc -l <"$WORK/ref.jsonl") tokens generated"

echo "== 2. the same run, killed with SIGKILL after about $((N / 3)) tokens"
"$KVSTORE" new "$RUN" "${gen[@]}" --trace "$WORK/crash.jsonl" </dev/null >"$WORK/crash.txt" &
pid=$!
lines() { if [ -f "$1" ]; then wc -l <"$1"; else echo 0; fi; }
while kill -0 "$pid" 2>/dev/null && [ "$(lines "$WORK/crash.jsonl")" -lt $((N / 3)) ]; do sleep 0.02; done
if kill -9 "$pid" 2>/dev/null; then
    wait "$pid" 2>/dev/null || true
    echo "   killed after $(lines "$WORK/crash.jsonl") tokens"
else
    echo "   (the run finished before it could be killed; the comparison below still holds)"
fi
shown="$("$KVSTORE" show "$RUN")"
grep -E '^(tokens|checkpoints|interrupted):' <<<"$shown" | sed 's/^/   /'

if grep -q '^interrupted:' <<<"$shown"; then
    echo "== 3. kvstore continue: finish the killed generation from its last checkpoint"
    "$KVSTORE" continue "$RUN" --trace "$WORK/crash.jsonl" </dev/null >/dev/null
    echo "   trace lines: $(lines "$WORK/crash.jsonl") (tokens after the last checkpoint appear twice)"
else  # the kill landed after the last token (a fast model): there is nothing to finish
    echo "== 3. nothing to finish: the generation ended before the kill (try a larger N)"
fi

echo "== 4. compare"
awk '!seen[$0]++' "$WORK/crash.jsonl" >"$WORK/crash.dedup.jsonl"
if cmp -s "$WORK/crash.dedup.jsonl" "$WORK/ref.jsonl"; then
    echo "   identical: every token and every logits hash equals the uninterrupted run's"
else
    echo "   DIFFERENT:" >&2
    diff "$WORK/ref.jsonl" "$WORK/crash.dedup.jsonl" | head -5 >&2
    exit 1
fi
