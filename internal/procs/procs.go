// Package procs sizes the Go scheduler to a server's load: one P (one
// thread running Go code at a time) while the load fits in one core, or
// runs no faster on more, as many as the process may use when it does
// not.
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
//
// A busy core alone does not show that more Ps would help: 50 clients
// with one durable SET each in flight keep one P busy (0.86 cores), and
// run no faster on two (-5 to -10 %, at a fifth more CPU per SET), as
// each request is a chain of hand-offs one core runs in turn. What does
// is work queueing for the P: goroutines that are ready and wait for it.
// With 16 SETs pipelined per client, the ready goroutines waited 520-580
// µs on average at one P, against 50-77 µs for the one-at-a-time load,
// and two Ps did 16-21 % more SETs (docs/benchmarks.md, 2026-11-30).
//
// The ticks see a load after half a second or more; a part of the server
// that sees a load needing more Ps directly asks for them at once (Ask).
package procs

import (
	"context"
	"math"
	"runtime"
	"runtime/metrics"
	"sync/atomic"
	"syscall"
	"time"
)

// Policy decides, from the CPU the process used over each tick and how
// long its ready goroutines waited to run, how many Ps to run: 1 or Max.
type Policy struct {
	Max int // the most Ps: the runtime's default (cores, CPU affinity, cgroup limit)
	// At one P: this many ticks in a row at Up cores or more, with ready
	// goroutines waiting UpWait or more on average, go to Max. Up sits
	// below 1 because a saturated P shows as about one core.
	Up      float64
	UpWait  time.Duration
	UpTicks int
	// At Max: DownTicks ticks in a row under Down cores, or under DownFit
	// cores with ready goroutines waiting under DownWait, go back to one.
	// The same load costs about a fifth more CPU at Max than at one P,
	// and its goroutines wait about half as long, so Down and DownWait sit
	// well under Up and UpWait to keep the count from flapping. DownFit
	// is about what one P carries: a load above it would queue at one P
	// and come straight back, however little it waits at Max.
	Down      float64
	DownWait  time.Duration
	DownFit   float64
	DownTicks int
	// A load that goes back to Max within Retry ticks of going down
	// needed it: the next time down takes twice the ticks, up to
	// DownTicksMax, so that such a load spends little of its time at one
	// P; one that stays down longer resets it to DownTicks. Why not a long
	// DownTicks alone: after a burst, a load that one P carries better ran
	// at Max that long, at a fifth more CPU for each request and fewer of
	// them (50 clients of one durable SET each after a pipelined burst:
	// 41,400 SETs a second at 23.5 µs of CPU, against 45,600 at 18.7 at
	// one P; docs/benchmarks.md, 2026-11-30).
	Retry        int
	DownTicksMax int
}

// DefaultTick is how often the server's policy looks at the load.
const DefaultTick = 250 * time.Millisecond

// DefaultPolicy is the server's, at DefaultTick: up within half a second
// of a core saturated with work waiting, down after two quiet seconds,
// or up to sixteen for a load that came back.
func DefaultPolicy(max int) Policy {
	return Policy{Max: max, Up: 0.8, UpWait: 200 * time.Microsecond, UpTicks: 2,
		Down: 0.5, DownWait: 60 * time.Microsecond, DownFit: 1.1, DownTicks: 8,
		Retry: 20, DownTicksMax: 64}
}

// State is where the policy stands: the Ps it runs, how many ticks in a
// row pointed the other way, how many quiet ticks going down takes now
// (0: DownTicks), and, counting from 1, the ticks at one P since it came
// down (0: not counting).
type State struct {
	Procs  int
	streak int
	need   int
	atOne  int
}

// Next is the state after a tick in which the process used `used` cores
// of CPU (CPU seconds over wall seconds) and its ready goroutines waited
// `wait` on average for a P.
func (p Policy) Next(s State, used float64, wait time.Duration) State {
	if p.Max <= 1 {
		return State{Procs: 1}
	}
	need := max(s.need, p.DownTicks)
	switch s.Procs {
	case 1:
		atOne := s.atOne
		if atOne > 0 {
			atOne++
		}
		if atOne > p.Retry+1 {
			need, atOne = p.DownTicks, 0 // it stayed down: down was right
		}
		if used < p.Up || wait < p.UpWait {
			return State{Procs: 1, need: need, atOne: atOne}
		}
		if s.streak+1 < p.UpTicks {
			return State{Procs: 1, streak: s.streak + 1, need: need, atOne: atOne}
		}
		return p.up(need, atOne)
	default:
		if used >= p.Down && (wait >= p.DownWait || used >= p.DownFit) {
			return State{Procs: p.Max, need: need}
		}
		if s.streak+1 >= need {
			return State{Procs: 1, need: need, atOne: 1}
		}
		return State{Procs: p.Max, streak: s.streak + 1, need: need}
	}
}

// Asked is the state after a part of the server that sees its load
// directly said more Ps would run it sooner (Ask): Max at once, as if the
// ticks had shown it, and a move up soon after a move down counts as one
// (see Retry).
func (p Policy) Asked(s State) State {
	if p.Max <= 1 || s.Procs != 1 {
		return s
	}
	return p.up(max(s.need, p.DownTicks), s.atOne)
}

// up is the move to Max from one P, where need quiet ticks took it down
// and atOne counts the ticks since (0: more than Retry, see Next): back
// within Retry ticks, it stays up longer next time.
func (p Policy) up(need, atOne int) State {
	if atOne > 0 {
		need = min(2*need, max(p.DownTicksMax, p.DownTicks))
	}
	return State{Procs: p.Max, need: need}
}

// asked carries Ask to Run; running and atMax let Ask cost an atomic
// load when there is nothing to ask.
var (
	asked   = make(chan struct{}, 1)
	running atomic.Bool
	atMax   atomic.Bool
)

// Ask tells the policy, if it runs, that work is waiting which more Ps
// would do sooner, before its ticks could show it: the RESP endpoint's
// loop asks when a round carries a deep pipeline's writes. Why: the
// ticks need half a second or more to see such a load (its ready
// goroutines' waits, read over 250 ms, overlap a lighter load's at
// shorter ticks), and a burst of pipelined durable SETs shorter than
// that ran at one P throughout, 15-20 % slower than at two
// (docs/benchmarks.md, issue 32, tenth). Redis decides the same way
// whether its I/O threads run: from the writes pending in each turn of
// its event loop. The way down is the ticks' as before.
func Ask() {
	if !running.Load() || atMax.Load() {
		return
	}
	select {
	case asked <- struct{}{}:
	default:
	}
}

// Run starts the process at one P and sets runtime.GOMAXPROCS as p
// decides, every tick, until ctx ends; then it gives back p.Max. changed,
// if not nil, hears each change with the load that caused it (used -1:
// Ask).
func Run(ctx context.Context, p Policy, tick time.Duration, changed func(procs int, used float64, wait time.Duration)) {
	s := State{Procs: 1}
	runtime.GOMAXPROCS(1)
	defer runtime.GOMAXPROCS(p.Max)
	select {
	case <-asked: // an earlier Run's, not this one's
	default:
	}
	running.Store(true)
	defer running.Store(false)
	defer atMax.Store(false)
	t := time.NewTicker(tick)
	defer t.Stop()
	last, lastCPU := time.Now(), CPU()
	var waits schedWaits
	waits.mean()
	set := func(next State, used float64, wait time.Duration) {
		if next.Procs != s.Procs {
			runtime.GOMAXPROCS(next.Procs)
			atMax.Store(next.Procs > 1)
			if changed != nil {
				changed(next.Procs, used, wait)
			}
		}
		s = next
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-asked:
			set(p.Asked(s), -1, 0)
		case now := <-t.C:
			c := CPU()
			used := float64(c-lastCPU) / float64(now.Sub(last))
			last, lastCPU = now, c
			wait := waits.mean()
			set(p.Next(s, used, wait), used, wait)
		}
	}
}

// schedWaits reads how long ready goroutines waited for a P, from the
// runtime's histogram of it (which samples some of the waits).
type schedWaits struct {
	sample [1]metrics.Sample
	last   []uint64 // the counts at the previous reading
}

// mean is the mean wait since the previous call (0 if none was
// sampled), each wait taken at its bucket's middle.
func (w *schedWaits) mean() time.Duration {
	w.sample[0].Name = "/sched/latencies:seconds"
	metrics.Read(w.sample[:])
	if w.sample[0].Value.Kind() != metrics.KindFloat64Histogram {
		return 0
	}
	h := w.sample[0].Value.Float64Histogram()
	var sum, n float64
	if len(w.last) == len(h.Counts) {
		for i, c := range h.Counts {
			d := float64(c - w.last[i])
			if d == 0 {
				continue
			}
			lo, hi := h.Buckets[i], h.Buckets[i+1]
			mid := (lo + hi) / 2
			switch {
			case math.IsInf(lo, -1):
				mid = max(hi, 0)
			case math.IsInf(hi, 1):
				mid = lo
			}
			sum += d * mid
			n += d
		}
	}
	w.last = append(w.last[:0], h.Counts...)
	if n == 0 {
		return 0
	}
	return time.Duration(sum / n * float64(time.Second))
}

// CPU is the user and system CPU time this process has used.
func CPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
