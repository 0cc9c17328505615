#!/usr/bin/env bash
# mqkv's RESP endpoint against Redis, with Redis's own load generator:
# redis-benchmark -t set,get -c 50 -d 256 against
#   - mqkv serve --resp-listen (durable: every SET fsynced through the log),
#   - redis-server with appendonly yes, appendfsync always (durable too),
#   - redis-server as Debian ships it (snapshots only: an acknowledged SET
#     can be lost),
#   - bench/respfloor: a Go server shaped as mqkv's RESP endpoint that
#     answers +OK to every command and does nothing else (no store, no
#     disk): the floor of the network and Go's scheduler on this machine,
#   - bench/respfloor -log: the durable floor, the same server appending
#     every command to a file that one goroutine fdatasyncs for all the
#     connections before their +OK (group commit, as Redis's appendfsync
#     always), with the replies written by that goroutine ("committer")
#     and, in a second server, by a writer goroutine per connection
#     ("writer"): the least a Go server does for a durable SET; and in a
#     third, Redis's own shape in Go ("epoll loop": one goroutine waits in
#     epoll for every socket, reads, logs, syncs and answers, with no
#     goroutine per connection): what the shape of a server costs,
#   - bench/respfloor -raft: the raft floor, the committer's and the
#     epoll loop's rounds going through a hashicorp/raft group of one on
#     mqkv's raft-wal log, answered once applied (to an FSM that does
#     nothing): what mqkv's consensus library and log cost, without its
#     store, service and gateway,
# without and with pipelining (-P 16), the servers taking turns each
# round; and mqkv's MQTT path for the same SET and GET (mqkv bench --server,
# 50 clients, 256-byte values) against the same mqkv server. Server CPU
# per request comes from /proc/PID/stat around each run.
#
#   bench/resp.sh [ROUNDS] [REQUESTS]
#
# The keys are drawn at random among 10,000 (-r 10000); KEYSPACE=one runs
# the command line as the issue writes it, without -r: every request to
# redis-benchmark's one key (a pipeline's 16 SETs all to it).
#
# Needs redis-server and redis-tools (apt-get install redis-server
# redis-tools).
set -euo pipefail
rounds=${1:-2}
n=${2:-200000}
cd "$(dirname "$0")/.."
. bench/lib.sh
keyspace
work=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
go build -o "$work/mqkv" ./cmd/mqkv
go build -o "$work/respfloor" ./bench/respfloor
mport=$(freeport) rport=$(freeport) aport=$(freeport) dport=$(freeport) fport=$(freeport)
cport=$(freeport) wport=$(freeport) lport=$(freeport)
rcport=$(freeport) rlport=$(freeport)
"$work/mqkv" serve --data-dir "$work/mqkv-data" --listen "127.0.0.1:$mport" --resp-listen "127.0.0.1:$rport" --log-level warn &
pids+=($!); mqkv_pid=$!
mkdir -p "$work/aof" "$work/default"
redis-server --port "$aport" --bind 127.0.0.1 --dir "$work/aof" --appendonly yes --appendfsync always --save '' --daemonize no --loglevel warning &
pids+=($!); aof_pid=$!
redis-server --port "$dport" --bind 127.0.0.1 --dir "$work/default" --daemonize no --loglevel warning &
pids+=($!); def_pid=$!
"$work/respfloor" "127.0.0.1:$fport" &
pids+=($!); floor_pid=$!
"$work/respfloor" -log "$work/floor-committer.log" "127.0.0.1:$cport" &
pids+=($!); committer_pid=$!
"$work/respfloor" -log "$work/floor-writer.log" -handoff writer "127.0.0.1:$wport" &
pids+=($!); writer_pid=$!
"$work/respfloor" -log "$work/floor-loop.log" -handoff loop "127.0.0.1:$lport" &
pids+=($!); loop_pid=$!
"$work/respfloor" -raft "$work/floor-raft-committer" "127.0.0.1:$rcport" &
pids+=($!); raft_committer_pid=$!
"$work/respfloor" -raft "$work/floor-raft-loop" -handoff loop "127.0.0.1:$rlport" &
pids+=($!); raft_loop_pid=$!
# A server that does not answer ends the run here (see answers).
for p in "$rport" "$aport" "$dport" "$fport" "$cport" "$wport" "$lport" "$rcport" "$rlport"; do
	if ! answers "$p"; then
		echo "resp.sh: the server on port $p did not start" >&2
		exit 1
	fi
done

hz=$(getconf CLK_TCK)

# run LABEL PID PORT PIPELINE [OPS]: redis-benchmark's SET, then its GET
# (on the keys the SETs wrote), or only OPS; prints ops/s, p50 and server
# CPU per request.
run() {
	local op before after out
	for op in ${5:-set get}; do
		before=$(ticks "$2")
		out=$(timeout 600 redis-benchmark -h 127.0.0.1 -p "$3" -t "$op" -c 50 -d 256 "${keys[@]}" -n "$n" -P "$4" --csv 2>/dev/null || true)
		after=$(ticks "$2")
		# CSV: "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",...
		echo "$out" | awk -F'","' -v label="$1" -v pl="$4" -v cpu="$(((after - before) * 1000000 / hz))" -v n="$n" '
			/^"SET"|^"GET"/ { gsub(/"/, "", $1); printf "%-26s P%-2s %-3s %9.0f ops/s  p50 %7s ms  server CPU %6.1f µs/op\n", label, pl, $1, $2, $5, cpu / n }'
	done
}

mqtt() { # op: mqkv's MQTT path on the same server
	local before after out
	before=$(ticks "$mqkv_pid")
	out=$("$work/mqkv" bench --server "127.0.0.1:$mport" --op "$1" --clients 50 --value-size 256 --duration 10s --warmup 2s 2>&1)
	after=$(ticks "$mqkv_pid")
	echo "$out" | awk -v op="$1" -v cpu="$(( (after - before) * 1000000 / hz ))" '
		$1 == op { ops = $2; printf "%-26s     %-3s %9.0f ops/s  p50 %9s  server CPU %6.1f µs/op (warmup included: an upper bound)\n", "mqkv MQTT (AIO framing)", toupper(op), $4, $5, cpu / ops }'
}

for ((i = 1; i <= rounds; i++)); do
	echo "# round $i"
	for pl in 1 16; do
		run "mqkv RESP (durable)" "$mqkv_pid" "$rport" "$pl"
		run "redis appendfsync=always" "$aof_pid" "$aport" "$pl"
		run "redis default" "$def_pid" "$dport" "$pl"
		run "floor (Go, answers +OK)" "$floor_pid" "$fport" "$pl"
		run "durable floor, committer" "$committer_pid" "$cport" "$pl" set
		run "durable floor, writer" "$writer_pid" "$wport" "$pl" set
		run "durable floor, epoll loop" "$loop_pid" "$lport" "$pl" set
		run "raft floor, committer" "$raft_committer_pid" "$rcport" "$pl" set
		run "raft floor, epoll loop" "$raft_loop_pid" "$rlport" "$pl" set
	done
	mqtt set
	mqtt get
done
