package main

import (
	"os"
	"strings"
	"syscall"
)

// schedtraceSetting keeps the Go runtime's monitor thread (sysmon) from
// its deep sleep. The runtime puts sysmon into a deep sleep whenever it
// finds every P idle, and the next system call of any goroutine wakes it
// with a futex; woken so, it polls every 20 µs for a millisecond before
// backing off again. A server busy part of the time, as the broker is
// between clients' round trips, goes through that cycle over and over
// (golang/go#18236 has others who found it). Measured on
// the 2-core machine at 64 clients: sysmon used 12 % of the server's CPU
// under GETs and 9 % under durable SETs; with it kept out of deep sleep,
// server CPU per pub/sub message fell by 16 %, per SET by 15 % (see
// docs/benchmarks.md). A GODEBUG schedtrace period is the runtime's only
// switch for this: with one, sysmon stays on its ordinary backoff (at
// most one wakeup per 10 ms when idle). The longest period, 2^31-1 ms,
// prints one scheduler status line on stderr every 24.8 days of the
// host's uptime (so once at start on a host up longer than that): a
// line a log pipeline reading JSON cannot parse, and a GODEBUG in the
// process's environment its operator did not set. So it is opt-in
// (serve --sysmon-awake), not the default; and since socket reads and
// writes are raw system calls that do not wake sysmon (package sockio),
// it saves only what the remaining ordinary calls (fsync above all)
// cost.
const schedtraceSetting = "schedtrace=2147483647"

// keepSysmonAwake runs the server again, in the same process (exec, so
// the pid and open files stay), with schedtraceSetting added to GODEBUG,
// unless GODEBUG sets schedtrace already: GODEBUG=schedtrace=0 keeps the
// runtime's default. It returns only if it did not exec.
func keepSysmonAwake() {
	godebug := os.Getenv("GODEBUG")
	if strings.Contains(godebug, "schedtrace=") {
		return
	}
	if godebug != "" {
		godebug += ","
	}
	exe, err := os.Executable()
	if err != nil {
		return // the runtime's default then: slower, not wrong
	}
	env := []string{"GODEBUG=" + godebug + schedtraceSetting}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GODEBUG=") {
			env = append(env, kv)
		}
	}
	_ = syscall.Exec(exe, os.Args, env)
}
