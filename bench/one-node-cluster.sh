#!/usr/bin/env bash
# What being a cluster costs on one node: durable SET and GET throughput of
# a node on its own against a one-node cluster (default groups) of the
# same build, and optionally of another build (a git revision) too, all
# running side by side and measured in alternating rounds.
#
#   bench/one-node-cluster.sh [ROUNDS] [BASE-REVISION]
#
# ROUNDS defaults to 3 (5 s each, 64 clients, 256-byte values). With
# BASE-REVISION, that revision is built and run as a third server, a
# one-node cluster too. Prints each round and the mean ops/s with its ratio
# to the node on its own.
set -euo pipefail
rounds=${1:-3}
base=${2:-}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
pids=()
trap '{ kill -9 "${pids[@]}"; wait; } 2>/dev/null; rm -rf "$work"' EXIT
go build -o "$work/mqkv" ./cmd/mqkv
if [ -n "$base" ]; then
	git worktree add --detach "$work/base-src" "$base" >/dev/null 2>&1
	(cd "$work/base-src" && go build -o "$work/mqkv-base" ./cmd/mqkv)
	git worktree remove --force "$work/base-src"
fi

port=$((20000 + RANDOM % 20000))
start() { # name binary [serve flags...]: starts a server on the next port
	local name=$1 bin=$2
	shift 2
	port=$((port + 2))
	"$bin" serve --listen 127.0.0.1:$port --data-dir "$work/$name" "$@" >/dev/null 2>"$work/$name.log" &
	pids+=($!)
	until grep -q "mqkv serving" "$work/$name.log" 2>/dev/null; do sleep 0.05; done
	eval "addr_$name=127.0.0.1:$port"
}
start alone "$work/mqkv"
start cluster "$work/mqkv" --node-id n1 --cluster-listen 127.0.0.1:$((port + 3))
servers="alone cluster"
if [ -n "$base" ]; then
	start base "$work/mqkv-base" --node-id n1 --cluster-listen 127.0.0.1:$((port + 3))
	servers="$servers base"
fi

declare -A sum
for op in set get; do
	for r in $(seq "$rounds"); do
		for s in $servers; do
			addr=addr_$s
			ops=$("$work/mqkv" bench --server "${!addr}" --op $op --clients 64 --duration 5s --warmup 1s 2>&1 |
				awk -v op=$op '$1 == op {print $4}')
			echo "round $r $op $s: $ops ops/s"
			sum[$op.$s]=$(( ${sum[$op.$s]:-0} + ops ))
		done
	done
done
echo
printf '%-4s' op
for s in $servers; do printf '%16s' "$s"; done
echo
for op in set get; do
	printf '%-4s' $op
	for s in $servers; do
		mean=$(( sum[$op.$s] / rounds ))
		ratio=$(awk -v a="${sum[$op.$s]}" -v b="${sum[$op.alone]}" 'BEGIN {printf "%.2f", a / b}')
		printf '%16s' "$mean (${ratio}x)"
	done
	echo
done
