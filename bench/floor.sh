#!/usr/bin/env bash
# The protocol's floor under `mqkv bench --baseline ping`: how close to
# PING a SET or a GET can come when the server does no work for it beyond
# what PING does. Builds the last commit twice, as is and with bench/floor.patch
# (SET answered "applied" and GET answered with a constant 256-byte value,
# neither touching the store or the log), and runs the same comparison
# against PING on each, alternating.
#
#   bench/floor.sh [RUNS]
#
# RUNS defaults to 1 (each run: SET and GET, 64 clients, 3 rounds of 4 s,
# on both builds). The floor build's ratios are the most any server could
# measure on this machine with this load generator: it shares the cores
# with the server and spends more per SET or GET than per PING (a larger
# request, a larger reply with a version to parse).
set -euo pipefail
runs=${1:-1}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'git worktree remove --force "$work/src" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add --detach "$work/src" HEAD >/dev/null 2>&1
(cd "$work/src" && go build -o "$work/mqkv" ./cmd/mqkv &&
	git apply bench/floor.patch && go build -o "$work/mqkv-floor" ./cmd/mqkv)

measure() { # label env-assignment binary op
	local out
	out=$(env "$2" "$3" bench --op "$4" --clients 64 --baseline ping --rounds 3 --duration 4s 2>&1)
	printf '%-6s %-4s %s | %s\n' "$1" "$4" \
		"$(grep -o 'ratio: [0-9.]*' <<<"$out")" \
		"$(grep '^server CPU' <<<"$out" | sed 's/, summed.*//')"
}
for ((i = 1; i <= runs; i++)); do
	for op in set get; do
		measure mqkv MQKV_FLOOR= "$work/mqkv" "$op"
		measure floor MQKV_FLOOR=1 "$work/mqkv-floor" "$op"
	done
done
