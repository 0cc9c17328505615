#!/bin/bash
# Measures what a cluster backup costs the node serving it: starts three
# nodes of BINARY (default: mqkv on PATH) on loopback ports from PORT
# (default 42100), stores 4,000 values of 64 KiB (250 MiB) through the
# first, takes `mqkv backup` through the first, and prints the first
# node's resident memory before the backup and its peak during it
# (sampled every 50 ms from /proc), and how long the backup took.
set -euo pipefail
BIN=${1:-mqkv}
PORT=${PORT:-42100}
dir=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait; rm -rf "$dir"' EXIT
for i in 1 2 3; do
  join=()
  [ "$i" -gt 1 ] && join=(--join "127.0.0.1:$((PORT + 11))")
  "$BIN" serve --listen "127.0.0.1:$((PORT + i))" --data-dir "$dir/n$i" --node-id "n$i" \
    --cluster-listen "127.0.0.1:$((PORT + 10 + i))" "${join[@]}" \
    --admin-listen "127.0.0.1:$((PORT + 20 + i))" > "$dir/n$i.log" 2>&1 &
  pids+=($!)
  sleep 2
done
sleep 3
"$BIN" bench --server "127.0.0.1:$((PORT + 1))" --op get --value-size 65536 --keys 4000 \
  --clients 8 --duration 1s --warmup 0s > "$dir/load.log" 2>&1
sleep 2
rss() { awk '/VmRSS/{print $2}' "/proc/${pids[0]}/status"; }
before=$(rss)
peak=$before
start=$(date +%s%N)
"$BIN" backup --admin "http://127.0.0.1:$((PORT + 21))" --out "$dir/out.snap" > "$dir/backup.log" 2>&1 &
backup=$!
while kill -0 "$backup" 2>/dev/null; do
  r=$(rss)
  [ "$r" -gt "$peak" ] && peak=$r
  sleep 0.05
done
wait "$backup"
end=$(date +%s%N)
echo "node 1 RSS before the backup $((before / 1024)) MiB, peak during it $((peak / 1024)) MiB (+$(((peak - before) / 1024)) MiB); backup took $(((end - start) / 1000000)) ms"
tail -1 "$dir/backup.log"
