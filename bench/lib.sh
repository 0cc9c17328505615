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
