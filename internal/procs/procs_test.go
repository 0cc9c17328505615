package procs

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

func TestPolicy(t *testing.T) {
	us := time.Microsecond
	p := Policy{Max: 4, Up: 0.8, UpWait: 200 * us, UpTicks: 2, Down: 0.5, DownWait: 60 * us, DownFit: 1.1, DownTicks: 3}
	steps := []struct {
		used  float64
		wait  time.Duration
		procs int
	}{
		{0.9, 500 * us, 1}, // one busy tick is not enough
		{0.3, 500 * us, 1}, // and a quiet one starts over
		{0.9, 500 * us, 1},
		{0.9, 60 * us, 1}, // a busy core, nothing waiting for it: starts over
		{0.9, 500 * us, 1},
		{0.95, 300 * us, 4}, // two in a row
		{0.6, 250 * us, 4},  // the same load costs more at 4: no flapping
		{1.2, 100 * us, 4},  // and its goroutines wait less
		{0.2, 300 * us, 4},
		{0.2, 300 * us, 4},
		{0.7, 300 * us, 4}, // a busy tick starts the count down over
		{0.2, 300 * us, 4},
		{0.1, 300 * us, 4},
		{0.0, 0, 1}, // three quiet in a row
		{0.5, 0, 1},
		{0.9, 600 * us, 1},
		{0.9, 600 * us, 4},
		{1.0, 40 * us, 4}, // busy, but nothing waits: one P does as well
		{1.0, 30 * us, 4},
		{1.0, 50 * us, 1},
		{0.9, 600 * us, 1},
		{1.6, 600 * us, 4},
		{1.5, 30 * us, 4}, // little waiting, but more than one P carries
		{1.5, 30 * us, 4},
		{1.5, 30 * us, 4},
		{1.5, 30 * us, 4},
	}
	s := State{Procs: 1}
	for i, st := range steps {
		s = p.Next(s, st.used, st.wait)
		if s.Procs != st.procs {
			t.Fatalf("step %d (%.2f cores used, %v waits): %d Ps, want %d", i, st.used, st.wait, s.Procs, st.procs)
		}
	}
	if s := (Policy{Max: 1, Up: 0.8, UpTicks: 1}).Next(State{Procs: 1}, 5, time.Second); s.Procs != 1 {
		t.Fatalf("Max 1 went to %d Ps", s.Procs)
	}
}

// TestPolicyBacksOff: a load that comes back to Max soon after going
// down makes the next way down take twice the quiet ticks, up to
// DownTicksMax; one that stays down resets it.
func TestPolicyBacksOff(t *testing.T) {
	us := time.Microsecond
	p := Policy{Max: 2, Up: 0.8, UpWait: 200 * us, UpTicks: 1, Down: 0.5, DownWait: 60 * us, DownFit: 1.1,
		DownTicks: 2, Retry: 3, DownTicksMax: 8}
	busy := func(s State) State { return p.Next(s, 1.0, 500*us) } // needs two Ps at one
	quiet := func(s State) State { return p.Next(s, 1.0, 20*us) } // fits in one at two
	s := busy(State{Procs: 1})
	// downs counts the quiet ticks at two Ps before each way down; after
	// each, the load comes back at once (a failed try), except where
	// stay says it stays down for longer than Retry.
	for i, c := range []struct {
		downs int
		stay  bool
	}{{2, false}, {4, false}, {8, false}, {8, true}, {2, false}, {4, true}, {2, false}} {
		if s.Procs != 2 {
			t.Fatalf("try %d: %d Ps before the quiet ticks", i, s.Procs)
		}
		for k := 1; k < c.downs; k++ {
			if s = quiet(s); s.Procs != 2 {
				t.Fatalf("try %d: down after %d quiet ticks, want %d", i, k, c.downs)
			}
		}
		if s = quiet(s); s.Procs != 1 {
			t.Fatalf("try %d: still at two after %d quiet ticks", i, c.downs)
		}
		if c.stay {
			for range p.Retry + 1 {
				s = p.Next(s, 0.5, 20*us)
			}
		}
		if s = busy(s); s.Procs != 2 {
			t.Fatalf("try %d: the load came back and the policy stayed at one", i)
		}
	}
}

// TestRunFollowsLoad runs the controller on this process: goroutines
// spinning on one P, each ready and waiting while another runs, take it
// to two (so the wait is read from the runtime: at none it would stay),
// and stopping them brings it back.
func TestRunFollowsLoad(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("one CPU: nothing to choose")
	}
	prev := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
	// Thresholds low enough for a machine busy with other tests: the
	// spinning goroutines still get a good part of a core, and wait for
	// each other's preemption (every 10 ms) to run.
	p := Policy{Max: 2, Up: 0.3, UpWait: time.Millisecond, UpTicks: 2, Down: 0.1, DownFit: 2, DownTicks: 3}
	changes := make(chan int, 8)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() {
		Run(ctx, p, 50*time.Millisecond, func(procs int, _ float64, _ time.Duration) { changes <- procs })
		close(stopped)
	}()
	want := func(procs int) {
		t.Helper()
		select {
		case got := <-changes:
			if got != procs || runtime.GOMAXPROCS(0) != procs {
				t.Fatalf("changed to %d (GOMAXPROCS %d), want %d", got, runtime.GOMAXPROCS(0), procs)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("still %d Ps, want %d", runtime.GOMAXPROCS(0), procs)
		}
	}
	var spin atomic.Bool
	spin.Store(true)
	for range 3 {
		go func() {
			for spin.Load() {
			}
		}()
	}
	want(2)
	spin.Store(false)
	want(1)
	cancel()
	<-stopped
	if got := runtime.GOMAXPROCS(0); got != 2 {
		t.Fatalf("GOMAXPROCS %d after Run ended, want Max (2)", got)
	}
}

// TestAsked: asked, the policy goes to Max at once from one P, and stays
// at Max; asked again soon after coming down, it stays up longer the next
// time, as a load the ticks bring back does.
func TestAsked(t *testing.T) {
	us := time.Microsecond
	p := Policy{Max: 2, Up: 0.8, UpWait: 200 * us, UpTicks: 2, Down: 0.5, DownWait: 60 * us, DownFit: 1.1,
		DownTicks: 2, Retry: 3, DownTicksMax: 8}
	quiet := func(s State) State { return p.Next(s, 1.0, 20*us) }
	s := p.Asked(State{Procs: 1})
	if s.Procs != 2 {
		t.Fatalf("asked at one P: %d Ps", s.Procs)
	}
	if s2 := p.Asked(s); s2 != s {
		t.Fatalf("asked at Max: %+v, was %+v", s2, s)
	}
	for want := 2; want <= 8; want *= 2 {
		for k := 1; k < want; k++ {
			if s = quiet(s); s.Procs != 2 {
				t.Fatalf("down after %d quiet ticks, want %d", k, want)
			}
		}
		if s = quiet(s); s.Procs != 1 {
			t.Fatalf("still at two after %d quiet ticks", want)
		}
		if s = p.Asked(quiet(s)); s.Procs != 2 {
			t.Fatal("asked again: stayed at one")
		}
	}
	if s := (Policy{Max: 1}).Asked(State{Procs: 1}); s.Procs != 1 {
		t.Fatalf("Max 1 went to %d Ps", s.Procs)
	}
}

// TestAskMovesRunAtOnce: Ask takes a running controller to Max without
// waiting for a tick, and does nothing when none runs.
func TestAskMovesRunAtOnce(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("one CPU: nothing to choose")
	}
	prev := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
	Ask() // no controller: nothing happens, nothing blocks
	p := DefaultPolicy(2)
	changes := make(chan float64, 8)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() {
		// A tick no test waits for: the move can only be Ask's.
		Run(ctx, p, time.Hour, func(procs int, used float64, _ time.Duration) {
			if procs == 2 {
				changes <- used
			}
		})
		close(stopped)
	}()
	deadline := time.After(20 * time.Second)
	for done := false; !done; {
		Ask() // until Run is up and hears it
		select {
		case used := <-changes:
			if used >= 0 || runtime.GOMAXPROCS(0) != 2 {
				t.Fatalf("changed with used %v, GOMAXPROCS %d", used, runtime.GOMAXPROCS(0))
			}
			done = true
		case <-time.After(10 * time.Millisecond):
		case <-deadline:
			t.Fatal("Ask did not move the controller to two Ps")
		}
	}
	Ask() // at Max: nothing more
	cancel()
	<-stopped
	if len(changes) != 0 {
		t.Fatalf("%d more moves up", len(changes))
	}
}
