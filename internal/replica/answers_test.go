package replica

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// bigEntry is an entry of n SETs as the proposer builds it, with a done
// for each that records the result it was given.
func bigEntry(n int) (data []byte, cmds []store.Command, dones []func(store.Result, error), got []store.Result, calls []atomic.Int32) {
	got, calls = make([]store.Result, n), make([]atomic.Int32, n)
	for i := range n {
		cmds = append(cmds, store.Command{Op: store.OpSet, Key: fmt.Appendf(nil, "k%d", i%(n/2)), Value: []byte("v"),
			Version: hlc.Timestamp{Wall: int64(i + 1), Node: "n1"}})
		dones = append(dones, func(r store.Result, err error) {
			if err == nil {
				got[i] = r
			}
			calls[i].Add(1)
		})
	}
	return store.AppendBatch(nil, store.Limits{}, cmds), cmds, dones, got, calls
}

// TestApplyHandsResultsAsItGoes: the apply hands a big entry's results
// to be answered a chunk at a time, in order, all of them before the
// entry is over (the batch's events are reported after its last
// command); a chunk that finds the queue full stops the handing, and
// forget says how many were handed: the rest are the completer's.
func TestApplyHandsResultsAsItGoes(t *testing.T) {
	clock, err := hlc.New("n1", nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 3*answerEvery + 4
	queued := -1
	out := make(chan answer, 8)
	f := &fsm{st: store.New(store.Limits{}), clock: clock, wakeExpiry: func() {},
		onEvents: func(Batch) { queued = len(out) }}
	data, cmds, dones, got, calls := bigEntry(n)
	ans := &answers{dones: dones, results: make([]store.Result, n), out: out}
	f.propose(data, store.Limits{}, cmds, ans)
	res := f.ApplyBatch([]*raft.Log{{Type: raft.LogCommand, Index: 1, Data: data}})
	if queued != 4 {
		t.Fatalf("%d chunks handed when the entry's events were reported, want 4", queued)
	}
	close(out)
	var sizes []int
	for a := range out {
		sizes = append(sizes, len(a.dones))
		for i, d := range a.dones {
			d(a.results[i], nil)
		}
	}
	if fmt.Sprint(sizes) != fmt.Sprint([]int{answerEvery, answerEvery, answerEvery, 4}) {
		t.Fatalf("chunks of %v commands", sizes)
	}
	for i := range n {
		if calls[i].Load() != 1 || got[i].Outcome != store.Applied || got[i].Version != cmds[i].Version {
			t.Fatalf("command %d: answered %d times with %+v, want once with its version %v", i, calls[i].Load(), got[i], cmds[i].Version)
		}
	}
	if r := res[0].([]store.Result); len(r) != n || r[n-1].Version != got[n-1].Version {
		t.Fatalf("the entry's results: %d, the last %+v", len(r), r[n-1])
	}
	if h := f.forget(data, ans); h != n {
		t.Fatalf("forget: %d handed, want %d", h, n)
	}

	// A queue with room for one chunk: the rest wait for the entry.
	out = make(chan answer, 1)
	data, cmds, dones, _, _ = bigEntry(n)
	ans = &answers{dones: dones, results: make([]store.Result, n), out: out}
	f.propose(data, store.Limits{}, cmds, ans)
	f.ApplyBatch([]*raft.Log{{Type: raft.LogCommand, Index: 2, Data: data}})
	if a := <-out; len(a.dones) != answerEvery || len(out) != 0 {
		t.Fatalf("first chunk %d commands, %d more queued", len(a.dones), len(out))
	}
	if h := f.forget(data, ans); h != answerEvery {
		t.Fatalf("forget: %d handed, want %d", h, answerEvery)
	}
}

// TestPipelinedWritesAnsweredOnce: writes that queue while an entry is
// synced share the next one, answered as it is applied; each is answered
// exactly once, with its own result, and the store holds them all.
func TestPipelinedWritesAnsweredOnce(t *testing.T) {
	var biggest atomic.Int64
	g, err := Open(Config{NodeID: "n1", Dir: t.TempDir(), Timings: Timings{Entry: func(n int) {
		for m := biggest.Load(); int64(n) > m && !biggest.CompareAndSwap(m, int64(n)); m = biggest.Load() {
		}
	}}})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	const n = 600
	for round := 0; biggest.Load() < answerFrom; round++ {
		if round == 20 {
			t.Fatalf("no entry of %d writes or more in %d rounds (the largest %d)", answerFrom, round, biggest.Load())
		}
		calls := make([]atomic.Int32, n)
		results := make([]store.Result, n)
		var wg sync.WaitGroup
		wg.Add(n)
		for i := range n {
			g.Submit(Proposal{Cmd: store.Command{Op: store.OpSet, Key: fmt.Appendf(nil, "r%d-%d", round, i), Value: fmt.Appendf(nil, "%d", i)},
				Done: func(r store.Result, err error) {
					if err != nil {
						t.Errorf("write %d: %v", i, err)
					}
					results[i] = r
					if calls[i].Add(1) == 1 {
						wg.Done()
					}
				}})
		}
		wg.Wait()
		time.Sleep(10 * time.Millisecond) // a second answer would come now
		for i := range n {
			if c := calls[i].Load(); c != 1 || results[i].Outcome != store.Applied {
				t.Fatalf("write %d answered %d times, %+v", i, c, results[i])
			}
			e, ok := g.Get(fmt.Appendf(nil, "r%d-%d", round, i))
			if !ok || string(e.Value) != fmt.Sprint(i) || e.Version != results[i].Version {
				t.Fatalf("write %d: stored %+v, answered version %v", i, e, results[i].Version)
			}
		}
	}
}
