#!/usr/bin/env bash
# Where a pipelined SET's time goes on the server's side, for mqkv, Redis
# with appendfsync always and the raft floor (bench/respfloor -raft, the
# loop's shape), taking turns on fresh servers:
#
#   bench/where.sh [ROUNDS] [REQUESTS]
#
# Each round runs each server once, in a shuffled order, under
# redis-benchmark -t set -c 50 -d 256 -P 16 -n REQUESTS (1,000,000 by
# default) to one key (no -r: the issue's command line), and prints for
# each: SETs a second; the server's CPU and redis-benchmark's a request
# (/proc); the share of the machine idle meanwhile (/proc/stat); and, where
# perf is installed and allowed, the system calls a request the server
# made (perf stat of the syscall tracepoints). Why: a server that makes
# the same calls as another and leaves the machine as idle, yet answers
# fewer SETs a second, is slower for its own CPU on the round's path, not
# for its kernel work or for want of a core (docs/benchmarks.md, "Above the
# raft floor").
#
# perf, attached, adds its own cost to each system call the server makes:
# compare the servers within a run, not with figures taken without it.
#
# Needs redis-server, redis-tools, python3 and /usr/bin/time (Debian's
# time); perf is optional.
set -euo pipefail
rounds=${1:-3}
n=${2:-1000000}
cd "$(dirname "$0")/.."
. bench/lib.sh
hz=$(getconf CLK_TCK)

work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
go build -o "$work/mqkv" ./cmd/mqkv
go build -o "$work/respfloor" ./bench/respfloor

calls="futex read write pwrite64 fdatasync epoll_wait epoll_pwait"
events=
if command -v perf >/dev/null 2>&1 && perf stat -e syscalls:sys_enter_read true >/dev/null 2>&1; then
	for c in $calls; do events="$events${events:+,}syscalls:sys_enter_$c"; done
	events="$events,context-switches"
fi

# launch NAME starts that server in the background on $port, its data in
# $work/data (see fresh).
launch() {
	case $1 in
	mqkv) "$work/mqkv" serve --data-dir "$work/data" --listen "127.0.0.1:$(freeport)" --resp-listen "127.0.0.1:$port" --log-level error >/dev/null 2>&1 & ;;
	redis) redis-server --port "$port" --bind 127.0.0.1 --dir "$work/data" --appendonly yes --appendfsync always --save '' --daemonize no --loglevel warning >/dev/null & ;;
	floor) "$work/respfloor" -raft "$work/data/raft" -handoff loop "127.0.0.1:$port" >/dev/null 2>&1 & ;;
	esac
}

# start NAME: starts that server afresh and waits until it answers; sets
# pid and port.
start() {
	fresh "$work/data" launch "$1" || {
		echo "where.sh: $1 did not start (three tries)" >&2
		exit 1
	}
}

# idle prints the machine's idle and all clock ticks so far (/proc/stat).
idle() { awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i; print $5 + $6, t }' /proc/stat; }

one() {
	local sp= out before after i0 t0 i1 t1 client
	start "$1"
	if [ -n "$events" ]; then
		perf stat -x, -e "$events" -p "$pid" -o "$work/stat" &
		sp=$!
		sleep 0.3 # perf attached before the load
	fi
	before=$(ticks "$pid")
	read -r i0 t0 < <(idle)
	out=$( { /usr/bin/time -f 'client %U %S' timeout 600 redis-benchmark -h 127.0.0.1 -p "$port" -t set -c 50 -d 256 -P 16 -n "$n" --csv; } 2>&1 || true)
	read -r i1 t1 < <(idle)
	after=$(ticks "$pid" 2>/dev/null || echo -)
	[ -n "$sp" ] && kill -INT "$sp" && wait "$sp" 2>/dev/null || true
	kill "$pid" && wait "$pid" 2>/dev/null || true
	pid=
	if [ "$after" = - ] || ! echo "$out" | grep -q '^"SET"'; then
		echo "where.sh: $1's run failed (its server gone, or redis-benchmark timed out)" >&2
		exit 1
	fi
	client=$(echo "$out" | awk '/^client/ { print ($2 + $3) * 1000000 }')
	printf 'round %d %-6s %8.0f SETs/s  server %5.2f µs/op  client %5.2f µs/op  idle %4.1f %%' "$2" "$1" \
		"$(echo "$out" | awk -F'","' '/^"SET"/ { print $2 }')" \
		"$(echo "$(((after - before) * 1000000 / hz)) $n" | awk '{ print $1 / $2 }')" \
		"$(echo "$client $n" | awk '{ print $1 / $2 }')" \
		"$(echo "$i0 $t0 $i1 $t1" | awk '{ print 100 * ($3 - $1) / ($4 - $2) }')"
	if [ -n "$sp" ]; then
		# perf stat -x, lines: count,,event,...
		awk -F, -v n="$n" '$3 ~ /sys_enter_|context-switches/ { e = $3; sub(/.*sys_enter_/, "", e); printf "  %s %.4f", e, $1 / n }' "$work/stat"
	fi
	echo
}

for ((r = 1; r <= rounds; r++)); do
	for s in $(printf '%s\n' mqkv redis floor | shuf); do
		one "$s" "$r"
	done
done
