// Package procs sizes the Go scheduler to a server's load: one P (one
// thread running Go code at a time) while the load fits in one core, as
// many as the process may use when it does not.
//
// Why: a request crosses several goroutines (the client's reader, the
// proposer, raft's loops, the reply). With two or more Ps each hand-off
// can wake a thread on another core, and the runtime's idle Ps spin
// looking for work between requests. Measured on the 2-core machine, a
// node on its own (docs/benchmarks.md): at one P a durable SET at 64
// clients costs 27-28 µs of server CPU against 33, a ping 13.6-14
// against 15.2, and one client's SET is 25 µs quicker. A load one core
// cannot carry needs the other Ps back, so the count follows the load,
// with hysteresis.
package procs

import (
	"context"
	"runtime"
	"syscall"
	"time"
)

// Policy decides, from the CPU the process used over each tick, how many
// Ps to run: 1 or Max.
type Policy struct {
	Max int // the most Ps: the runtime's default (cores, CPU affinity, cgroup limit)
	// At one P: this many ticks in a row at Up cores or more go to Max.
	// Up sits below 1 because a saturated P shows as about one core.
	Up      float64
	UpTicks int
	// At Max: this many ticks in a row under Down cores go back to one.
	// The same load costs about a fifth more CPU at Max than at one P, so
	// Down sits well under Up to keep the count from flapping.
	Down      float64
	DownTicks int
}

// DefaultPolicy is the server's: up within two seconds of a saturated
// core, down after ten quiet ones.
func DefaultPolicy(max int) Policy {
	return Policy{Max: max, Up: 0.8, UpTicks: 2, Down: 0.5, DownTicks: 10}
}

// State is where the policy stands: the Ps it runs, and how many ticks
// in a row pointed the other way.
type State struct {
	Procs  int
	streak int
}

// Next is the state after a tick in which the process used `used` cores
// of CPU (CPU seconds over wall seconds).
func (p Policy) Next(s State, used float64) State {
	if p.Max <= 1 {
		return State{Procs: 1}
	}
	switch s.Procs {
	case 1:
		if used < p.Up {
			return State{Procs: 1}
		}
		if s.streak+1 >= p.UpTicks {
			return State{Procs: p.Max}
		}
		return State{Procs: 1, streak: s.streak + 1}
	default:
		if used >= p.Down {
			return State{Procs: p.Max}
		}
		if s.streak+1 >= p.DownTicks {
			return State{Procs: 1}
		}
		return State{Procs: p.Max, streak: s.streak + 1}
	}
}

// Run starts the process at one P and sets runtime.GOMAXPROCS as p
// decides, every tick, until ctx ends; then it gives back p.Max. changed,
// if not nil, hears each change with the CPU use that caused it.
func Run(ctx context.Context, p Policy, tick time.Duration, changed func(procs int, used float64)) {
	s := State{Procs: 1}
	runtime.GOMAXPROCS(1)
	defer runtime.GOMAXPROCS(p.Max)
	t := time.NewTicker(tick)
	defer t.Stop()
	last, lastCPU := time.Now(), CPU()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			c := CPU()
			used := float64(c-lastCPU) / float64(now.Sub(last))
			last, lastCPU = now, c
			next := p.Next(s, used)
			if next.Procs != s.Procs {
				runtime.GOMAXPROCS(next.Procs)
				if changed != nil {
					changed(next.Procs, used)
				}
			}
			s = next
		}
	}
}

// CPU is the user and system CPU time this process has used.
func CPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
