#!/usr/bin/env bash
# Builds of mqkv against Redis with appendfsync always, taking turns on
# fresh servers: the comparison docs/benchmarks.md calls "alternating".
#
#   bench/alternate.sh [ROUNDS] [PIPELINE] [REQUESTS] [REV...]
#
# Each REV is a git revision of this repository (built from a clean export
# of it) or "." for the working tree (the default). Every round runs each
# build and Redis once, in a shuffled order, each on a server started
# afresh (an empty data directory) and stopped after its run:
# redis-benchmark -t TEST -c CLIENTS -d 256 -r KEYSPACE -n REQUESTS -P PIPELINE
# (TEST from the environment, set by default, or incr for the counters;
# CLIENTS from the environment, 50 by default: the issue's; KEYSPACE too,
# 10000 by default, or "one" for redis-benchmark's own single key, as the
# issue's command is written, with no -r: as bench/resp.sh). It prints
# each run, then for each server the median of its throughput, of its CPU
# per request (/proc/PID/stat around the run) and of its ratio to Redis in
# the same round. Why this shape: the machine is shared and noisy (Redis's
# pipelined SET ran 262,467-420,000 a second on one day); only runs close
# in time compare, and the ratio to Redis in the same round cancels most
# of the drift. Why fresh servers: a cold server pays for its heap and the
# change history growing (page faults), as bench/resp.sh's do.
#
# Needs redis-server and redis-tools (apt-get install redis-server
# redis-tools) and python3 (free ports).
set -euo pipefail
rounds=${1:-8}
pipeline=${2:-16}
n=${3:-1000000}
shift $(($# < 3 ? $# : 3))
revs=("$@")
[ ${#revs[@]} -gt 0 ] || revs=(.)
clients=${CLIENTS:-50}
test=${TEST:-set}
name=$(echo "$test" | tr a-z A-Z) # its row in redis-benchmark's CSV
cd "$(dirname "$0")/.."
. bench/lib.sh
keyspace
scratch

labels=()
for i in "${!revs[@]}"; do
	rev=${revs[$i]}
	buildrev "$rev" "$work/mqkv-$i"
	if [ "$rev" = . ]; then
		labels+=("working-tree")
	else
		labels+=("$(git rev-parse --short "$rev")")
	fi
done
labels+=(redis)
hz=$(getconf CLK_TCK)

# launch CONFIG starts its server in the background on $port, its data
# in $work/data (see fresh).
launch() {
	if [ "$1" -eq "${#revs[@]}" ]; then
		redis-server --port "$port" --bind 127.0.0.1 --dir "$work/data" --appendonly yes --appendfsync always --save '' --daemonize no --loglevel warning >/dev/null &
	else
		"$work/mqkv-$1" serve --data-dir "$work/data" --listen "127.0.0.1:$(freeport)" --resp-listen "127.0.0.1:$port" --log-level error >/dev/null 2>&1 &
	fi
}

# start CONFIG: starts its server afresh and waits until it answers; sets
# pid and port.
start() {
	fresh "$work/data" launch "$1" || {
		echo "alternate.sh: ${labels[$1]} did not start (three tries)" >&2
		exit 1
	}
}

# one CONFIG: starts its server afresh, runs the load, stops it; prints
# "ops/s cpu-µs/op".
one() {
	local port before after out
	start "$1"
	before=$(ticks "$pid")
	out=$(timeout 600 redis-benchmark -h 127.0.0.1 -p "$port" -t "$test" -c "$clients" -d 256 "${keys[@]}" -n "$n" -P "$pipeline" --csv 2>/dev/null || true)
	after=$(ticks "$pid" 2>/dev/null || echo -)
	kill "$pid" && wait "$pid" 2>/dev/null || true
	pid=
	if [ "$after" = - ] || ! echo "$out" | grep -q "^\"$name\""; then
		echo "alternate.sh: ${labels[$1]}'s run failed (its server gone, or redis-benchmark timed out)" >&2
		exit 1
	fi
	echo "$out" | awk -F'","' -v cpu="$(((after - before) * 1000000 / hz))" -v n="$n" -v row="\"$name\"" 'index($0, row) == 1 { printf "%.0f %.2f\n", $2, cpu / n }'
}

results="$work/results"
: >"$results"
for ((r = 1; r <= rounds; r++)); do
	for c in $(seq 0 "${#revs[@]}" | shuf); do
		one "$c" >"$work/run"
		read -r ops cpu <"$work/run"
		printf 'round %d %-14s %9s %ss/s %6s µs/op\n' "$r" "${labels[$c]}" "$ops" "$name" "$cpu"
		echo "$r $c $ops $cpu" >>"$results"
	done
done

echo "# $test: medians over $rounds rounds (-c $clients -P $pipeline -n $n ${keys[*]:-one key}); ratio: to Redis in the same round"
awk -v redis="${#revs[@]}" -v labels="${labels[*]}" -v what="$name" '
	function median(a, k,   i, j, t) {
		for (i = 2; i <= k; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
		return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
	}
	{ ops[$1, $2] = $3; cpu[$1, $2] = $4; if ($1 > rounds) rounds = $1 }
	END {
		split(labels, name, " ")
		for (c = 0; c <= redis; c++) {
			k = 0
			for (r = 1; r <= rounds; r++) { k++; o[k] = ops[r, c]; p[k] = cpu[r, c]; q[k] = ops[r, c] / ops[r, redis] }
			printf "%-14s %9.0f %ss/s %6.2f µs/op  %.3fx Redis\n", name[c + 1], median(o, k), what, median(p, k), median(q, k)
		}
	}' "$results"
