#!/usr/bin/env bash
# What keys cost: resident memory per key, and the time a restart takes.
# Writes a million 64-byte values (one per key) through `mqkv bench`, then
# SIGKILLs and restarts the server.
#
#   bench/memory.sh [KEYS]        (default 1000000; takes a few minutes)
set -euo pipefail
keys=${1:-1000000}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'kill -9 $pid 2>/dev/null || true; rm -rf "$work"' EXIT
go build -o "$work/mqkv" ./cmd/mqkv
mqkv="$work/mqkv"
port=$((20000 + RANDOM % 20000)); admin=$((port + 1))

start() { # waits for "mqkv serving"; sets pid and took (seconds)
	local t0=$(date +%s%N)
	"$mqkv" serve --listen 127.0.0.1:$port --admin-listen 127.0.0.1:$admin --data-dir "$work/data" >/dev/null 2>"$work/log" &
	pid=$!
	until grep -q "mqkv serving" "$work/log" 2>/dev/null; do sleep 0.02; done
	took=$(( ($(date +%s%N) - t0) / 1000000 ))ms
}
rss() { awk '/VmRSS/ {print $2 * 1024}' /proc/$pid/status; }
status() { "$mqkv" status --admin http://127.0.0.1:$admin --json; }

start
base=$(rss)
# `mqkv bench --op get` first writes every key of its keyspace (so that
# GETs hit), then reads for a second.
t0=$(date +%s)
"$mqkv" bench --server 127.0.0.1:$port --op get --keys "$keys" --value-size 64 --clients 64 --warmup 0s --duration 1s >/dev/null
echo "wrote $keys keys in $(( $(date +%s) - t0 )) s" >&2
sleep 2; full=$(rss)
n=$(status | python3 -c 'import json,sys; print(json.load(sys.stdin)["keys"])')
log=$(du -sb "$work/data/raft/wal" | cut -f1)
echo "keys: $n  RSS before: $((base >> 20)) MiB  after: $((full >> 20)) MiB  per key: $(( (full - base) / n )) B  log on disk: $((log >> 20)) MiB"

snap=$(du -sb "$work/data/raft/snapshots" | cut -f1)
kill -9 $pid; wait $pid 2>/dev/null || true
start
echo "SIGKILL, then restart (loads the newest snapshot, $((snap >> 20)) MiB on disk, and replays the log after it): $took, RSS $(( $(rss) >> 20 )) MiB"
