# Helpers the benchmark scripts share (sourced, not run).

# freeport prints a TCP port free on 127.0.0.1 now. Another process may
# take it before the caller binds it: see answers.
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# ticks PID prints the CPU time PID has used, user and system, in clock
# ticks (getconf CLK_TCK a second).
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }

# answers PORT [PID] waits, 10 s at most, until the RESP server on
# 127.0.0.1:PORT answers PING, and fails if it does not; at once if PID,
# its process, has exited (its port taken, for one). Why check: sent to a
# closed port, redis-benchmark spins rather than fails.
answers() {
	for _ in $(seq 100); do
		redis-cli -p "$1" ping >/dev/null 2>&1 && return 0
		if [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null; then
			return 1
		fi
		sleep 0.1
	done
	return 1
}

# fresh DATA LAUNCH [ARG...] starts a server afresh and waits until it
# answers: DATA emptied, port set to a free port, then LAUNCH ARG... run,
# which starts the server in the background on them (its $! is the pid).
# Sets pid and port. A server may not come up (the port taken between
# freeport and its bind, for one: the server exits); one that does not
# answer is started again on other ports, three times at most, after
# which fresh returns 1. Why: a scratch script of this shape once went on
# with a server that was gone before its load, and redis-benchmark spun
# for ten minutes.
fresh() {
	local data=$1 try
	shift
	for try in 1 2 3; do
		port=$(freeport)
		rm -rf "$data" && mkdir -p "$data"
		"$@"
		pid=$!
		answers "$port" "$pid" && return 0
		kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
		pid=
	done
	return 1
}

# keyspace sets keys to redis-benchmark's flags for the keys a load goes
# to: -r KEYSPACE from the environment (10000 by default), or none for
# KEYSPACE=one (redis-benchmark's own single key, as the command
# line is written).
keyspace() {
	keys=(-r "${KEYSPACE:-10000}")
	if [ "${KEYSPACE:-}" = one ]; then keys=(); fi
}

# buildrev REV OUT builds mqkv into OUT: the working tree for REV ".",
# else git revision REV from a clean export of it (in OUT.src, removed).
buildrev() {
	if [ "$1" = . ]; then
		go build -o "$2" ./cmd/mqkv
		return
	fi
	mkdir "$2.src"
	git archive "$1" | tar -x -C "$2.src"
	(cd "$2.src" && go build -o "$2" ./cmd/mqkv)
	rm -rf "$2.src"
}

# scratch sets work to a new scratch directory and, on exit, stops the
# server whose pid is in pid (fresh sets it) and removes the directory.
scratch() {
	work=$(mktemp -d)
	pid=
	trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"' EXIT
}
