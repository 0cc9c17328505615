package procs

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

func TestPolicy(t *testing.T) {
	p := Policy{Max: 4, Up: 0.8, UpTicks: 2, Down: 0.5, DownTicks: 3}
	steps := []struct {
		used  float64
		procs int
	}{
		{0.9, 1}, // one busy tick is not enough
		{0.3, 1}, // and a quiet one starts over
		{0.9, 1},
		{0.95, 4}, // two in a row
		{0.6, 4},  // the same load costs more at 4: no flapping
		{0.2, 4},
		{0.2, 4},
		{0.7, 4}, // a busy tick starts the count down over
		{0.2, 4},
		{0.1, 4},
		{0.0, 1}, // three quiet in a row
		{0.5, 1},
	}
	s := State{Procs: 1}
	for i, st := range steps {
		s = p.Next(s, st.used)
		if s.Procs != st.procs {
			t.Fatalf("step %d (%.2f cores used): %d Ps, want %d", i, st.used, s.Procs, st.procs)
		}
	}
	if s := (Policy{Max: 1, Up: 0.8, UpTicks: 1}).Next(State{Procs: 1}, 5); s.Procs != 1 {
		t.Fatalf("Max 1 went to %d Ps", s.Procs)
	}
}

// TestRunFollowsLoad runs the controller on this process: a goroutine
// spinning on one P takes it to two, and stopping it brings it back.
func TestRunFollowsLoad(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("one CPU: nothing to choose")
	}
	prev := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
	// Thresholds low enough for a machine busy with other tests: a
	// spinning goroutine still gets a good part of a core.
	p := Policy{Max: 2, Up: 0.3, UpTicks: 2, Down: 0.1, DownTicks: 3}
	changes := make(chan int, 8)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() {
		Run(ctx, p, 50*time.Millisecond, func(procs int, _ float64) { changes <- procs })
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
	go func() {
		for spin.Load() {
		}
	}()
	want(2)
	spin.Store(false)
	want(1)
	cancel()
	<-stopped
	if got := runtime.GOMAXPROCS(0); got != 2 {
		t.Fatalf("GOMAXPROCS %d after Run ended, want Max (2)", got)
	}
}
