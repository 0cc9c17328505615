package replica

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// TestRoundRestTakesTheExtraSlot: with an entry in flight, the rest of a
// round of gathered writes goes into an entry of its own once its sender
// has sent all of it (RoundSent), not while it still reads the round, and
// writes that are not a round's wait for the entry in flight as before.
// Every write is answered, in order.
func TestRoundRestTakesTheExtraSlot(t *testing.T) {
	entries := make(chan int, 16)
	// gate, when set, holds the next apply of a batch with events until
	// it is closed: its entry stays in flight, its slot taken.
	var gate atomic.Pointer[chan struct{}]
	var held []chan struct{}
	hold := func() chan struct{} {
		c := make(chan struct{})
		gate.Store(&c)
		held = append(held, c)
		return c
	}
	free := func(c chan struct{}) {
		select {
		case <-c:
		default:
			close(c)
		}
	}
	g, err := Open(Config{NodeID: "n1", Dir: t.TempDir(),
		Timings: Timings{Entry: func(n int) { entries <- n }},
		OnEvents: func(b Batch) {
			if len(b.Events) == 0 {
				return
			}
			if c := gate.Swap(nil); c != nil {
				<-*c
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	defer func() { // before Close, which waits for the apply, on failure too
		for _, c := range held {
			free(c)
		}
	}()
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		key string
		res store.Result
		err error
	}
	answers := make(chan answer, 16)
	submit := func(key string, gathered bool) {
		g.Submit(Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte(key), Value: []byte("v")}, Gathered: gathered,
			Done: func(r store.Result, err error) { answers <- answer{key, r, err} }})
	}
	entry := func(want int) {
		t.Helper()
		select {
		case n := <-entries:
			if n != want {
				t.Fatalf("an entry of %d writes, want %d", n, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no entry of %d writes", want)
		}
	}
	// noEntry: none is proposed meanwhile (what is waited for would come
	// within microseconds).
	noEntry := func(why string) {
		t.Helper()
		select {
		case n := <-entries:
			t.Fatalf("%s: an entry of %d writes proposed", why, n)
		case <-time.After(100 * time.Millisecond):
		}
	}
	answered := func(keys ...string) {
		t.Helper()
		var last store.Result
		for _, k := range keys {
			select {
			case a := <-answers:
				if a.key != k || a.err != nil || a.res.Outcome != store.Applied || a.res.Version.Compare(last.Version) <= 0 {
					t.Fatalf("answered %s: %+v, %v; want %s applied after %v", a.key, a.res, a.err, k, last.Version)
				}
				last = a.res
			case <-time.After(10 * time.Second):
				t.Fatalf("%s not answered", k)
			}
		}
	}

	release := hold()
	submit("a", true)
	entry(1) // in flight, held
	// A round sent before (its signal not taken yet) does not let this
	// one's writes go while it is read.
	g.RoundSent()
	g.RoundBegun()
	submit("b", true)
	submit("c", true)
	noEntry("a round being read")
	g.RoundSent()
	entry(2) // b and c, with a still in flight
	free(release)
	answered("a", "b", "c")
	// Both entries' command slices came back for reuse (complete gives
	// an entry's back before it answers it): none is made for the next.
	if n := len(g.spare); n != 2 {
		t.Fatalf("%d command slices kept for reuse, want 2", n)
	}

	release = hold()
	submit("d", false)
	entry(1)
	submit("e", false)
	g.RoundBegun()
	g.RoundSent()
	noEntry("writes that are no round's")
	free(release)
	entry(1)
	answered("d", "e")

	// Both slots are free again: a round's writes go at once.
	for i := range 3 {
		submit(fmt.Sprint("f", i), true)
	}
	for n := 0; n < 3; {
		select {
		case m := <-entries:
			n += m
		case <-time.After(10 * time.Second):
			t.Fatal("the last writes were not proposed")
		}
	}
	answered("f0", "f1", "f2")
}

// TestFSMSaysWhenKeysMayHaveExpired: as of the last apply, a write
// proposed before the earliest deadline meets no key expired (the
// proposer then neither looks nor locks); at or past it, one may; once
// the key is gone, none does again.
func TestFSMSaysWhenKeysMayHaveExpired(t *testing.T) {
	clock, err := hlc.New("n1", nil)
	if err != nil {
		t.Fatal(err)
	}
	f := &fsm{st: store.New(store.Limits{}), clock: clock, wakeExpiry: func() {}, fail: func(error) {}}
	f.noteExpiry()
	if f.mayHaveExpired(1 << 60) {
		t.Fatal("an empty store may have expired keys")
	}
	apply := func(index uint64, c store.Command) {
		t.Helper()
		c.Version = hlc.Timestamp{Wall: int64(index), Node: "n1"}
		out := f.ApplyBatch([]*raft.Log{{Type: raft.LogCommand, Index: index, Data: store.AppendBatch(nil, store.Limits{}, []store.Command{c})}})
		if r, ok := out[0].([]store.Result); !ok || r[0].Outcome != store.Applied {
			t.Fatalf("apply %+v: %v", c, out[0])
		}
	}
	apply(1, store.Command{Op: store.OpSet, Key: []byte("plain"), Value: []byte("v"), Now: 1000})
	if f.mayHaveExpired(1 << 60) {
		t.Fatal("a key without a deadline may have expired")
	}
	apply(2, store.Command{Op: store.OpSet, Key: []byte("ttl"), Value: []byte("v"), Now: 1000, TTL: 500})
	if f.mayHaveExpired(1499) || !f.mayHaveExpired(1500) || !f.mayHaveExpired(9999) {
		t.Fatal("a key due at 1500 is not told right")
	}
	apply(3, store.Command{Op: store.OpDel, Key: []byte("ttl"), Now: 1200})
	if f.mayHaveExpired(1 << 60) {
		t.Fatal("the key with the deadline is gone, yet keys may have expired")
	}
}

// TestProposerGathersBesideTheApply: while no key has a deadline, the
// proposer cuts an entry without the apply's lock (see Group.propose):
// a round's rest goes to the log while the entry before is applied.
func TestProposerGathersBesideTheApply(t *testing.T) {
	entries := make(chan int, 16)
	g, err := Open(Config{NodeID: "n1", Dir: t.TempDir(), Timings: Timings{Entry: func(n int) { entries <- n }}})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	answered := make(chan error, 1)
	g.fsm.mu.Lock() // as an apply holds it
	g.Submit(Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte("a"), Value: []byte("v")}, Done: func(_ store.Result, err error) { answered <- err }})
	select {
	case <-entries:
	case <-time.After(10 * time.Second):
		g.fsm.mu.Unlock()
		t.Fatal("the entry waited for the apply's lock")
	}
	g.fsm.mu.Unlock()
	if err := <-answered; err != nil {
		t.Fatal(err)
	}
}
