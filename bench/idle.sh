#!/usr/bin/env bash
# What an idle three-node cluster costs: three mqkv processes on
# 127.0.0.1 (durable, default groups and replicas, no clients), left to
# settle for SETTLE seconds, then their CPU time over MEASURE seconds from
# /proc, in milliseconds of CPU a second (1000 = one core).
#   bench/idle.sh [SETTLE] [MEASURE]     (defaults 90 and 20: a new cluster
# moves leaders and replicas in its first minute)
set -euo pipefail
settle=${1:-90}
measure=${2:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/lib.sh"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
go build -o "$work/mqkv" "$root/cmd/mqkv"
first=""
pids=()
for i in 1 2 3; do
	link=127.0.0.1:$(freeport)
	args=(serve --node-id "i$i" --data-dir "$work/n$i" --listen "127.0.0.1:$(freeport)" --admin-listen "127.0.0.1:$(freeport)" --cluster-listen "$link")
	[ -n "$first" ] && args+=(--join "$first")
	[ -z "$first" ] && first=$link
	"$work/mqkv" "${args[@]}" >"$work/n$i.log" 2>&1 &
	pids+=($!)
	sleep 2
done
sleep "$settle"
all_ticks() { local t=0; for p in "${pids[@]}"; do t=$((t + $(ticks "$p"))); done; echo $t; }
hz=$(getconf CLK_TCK)
a=$(all_ticks)
sleep "$measure"
b=$(all_ticks)
echo "three idle nodes: $(( (b - a) * 1000 / hz / measure )) ms of CPU a second in all (over ${measure} s, after ${settle} s)"
