package replica

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

func open(t *testing.T, dir string, onEvents func([]store.Event)) *Group {
	t.Helper()
	cfg := Config{NodeID: "n1", Dir: dir}
	if onEvents != nil {
		cfg.OnEvents = func(b Batch) { onEvents(b.Events) }
	}
	g, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	return g
}

// write submits a command and waits for its result.
func write(t *testing.T, g *Group, c store.Command, after hlc.Timestamp) store.Result {
	t.Helper()
	ch := make(chan store.Result, 1)
	var err error
	g.Submit(Proposal{Cmd: c, After: after, Done: func(r store.Result, e error) { err = e; ch <- r }})
	r := <-ch
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestWritesSurviveRestart(t *testing.T) {
	dir := t.TempDir()
	g := open(t, dir, nil)
	versions := map[string]hlc.Timestamp{}
	for i := 0; i < 100; i++ {
		k := fmt.Sprintf("k%d", i%10)
		r := write(t, g, store.Command{Op: store.OpSet, Key: []byte(k), Value: []byte(fmt.Sprint(i))}, hlc.Timestamp{})
		if r.Outcome != store.Applied {
			t.Fatal(r.Outcome)
		}
		if prev := versions[k]; r.Version.Compare(prev) <= 0 {
			t.Fatalf("version %v not above %v", r.Version, prev)
		}
		versions[k] = r.Version
	}
	last := versions["k9"]
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	g = open(t, dir, nil)
	defer g.Close()
	for i := 0; i < 10; i++ {
		k := fmt.Sprintf("k%d", i)
		e, ok := g.Get([]byte(k))
		if !ok || string(e.Value) != fmt.Sprint(90+i) || e.Version != versions[k] {
			t.Fatalf("%s after restart: %+v %v", k, e, ok)
		}
	}
	if v := g.Clock().Now(); v.Compare(last) <= 0 {
		t.Fatalf("clock after restart %v not above %v", v, last)
	}
}

func TestSnapshotAndRestart(t *testing.T) {
	dir := t.TempDir()
	g := open(t, dir, nil)
	for i := 0; i < 50; i++ {
		write(t, g, store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint(i)), Value: []byte("v")}, hlc.Timestamp{})
	}
	if err := g.Snapshot(); err != nil {
		t.Fatal(err)
	}
	for i := 50; i < 60; i++ { // after the snapshot: replayed from the log
		write(t, g, store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint(i)), Value: []byte("v")}, hlc.Timestamp{})
	}
	write(t, g, store.Command{Op: store.OpDel, Key: []byte("0")}, hlc.Timestamp{})
	g.Close()
	g = open(t, dir, nil)
	defer g.Close()
	if s := g.Stats(); s.Keys != 59 {
		t.Fatalf("keys after restart = %d, want 59", s.Keys)
	}
	if _, ok := g.Get([]byte("0")); ok {
		t.Fatal("deleted key came back")
	}
}

func TestVersionAboveRequestTimestamp(t *testing.T) {
	g := open(t, "", nil)
	defer g.Close()
	ahead := hlc.Timestamp{Wall: time.Now().Add(30 * time.Second).UnixMilli(), Counter: 7, Node: "client"}
	r := write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("v")}, ahead)
	if r.Version.Compare(ahead) <= 0 {
		t.Fatalf("version %v not above request %v", r.Version, ahead)
	}
}

func TestExpiryProducesDeleteEvent(t *testing.T) {
	deleted := make(chan time.Time, 10)
	g := open(t, t.TempDir(), func(evs []store.Event) {
		for _, e := range evs {
			if e.Kind == store.EventDelete && string(e.Key) == "ttl" {
				deleted <- time.Now()
			}
		}
	})
	defer g.Close()
	start := time.UnixMilli(time.Now().UnixMilli()) // deadlines are in whole milliseconds
	write(t, g, store.Command{Op: store.OpSet, Key: []byte("ttl"), Value: []byte("v"), TTL: 200}, hlc.Timestamp{})
	e, _ := g.Get([]byte("ttl"))
	select {
	case at := <-deleted:
		if at.Sub(start) < 200*time.Millisecond {
			t.Fatalf("deleted after %v, before its TTL", at.Sub(start))
		}
		if late := at.Sub(time.UnixMilli(e.ExpiresAt)); late > 100*time.Millisecond {
			t.Fatalf("DELETE came %v after the deadline", late)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no DELETE event for the expired key")
	}
	if _, ok := g.Get([]byte("ttl")); ok {
		t.Fatal("expired key still readable")
	}
}

// A touch (store.OpTouch: memcached's touch, PEXPIRE) that gives a key
// without expiry a deadline wakes the expiry loop, as a SET with a TTL
// does: asleep until the next deadline it knew (an hour when no key
// expires), it removed the key only then, and observers got no DELETE.
func TestTouchWakesExpiry(t *testing.T) {
	deleted := make(chan struct{}, 10)
	g := open(t, t.TempDir(), func(evs []store.Event) {
		for _, e := range evs {
			if e.Kind == store.EventDelete && string(e.Key) == "k" {
				deleted <- struct{}{}
			}
		}
	})
	defer g.Close()
	write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("v")}, hlc.Timestamp{})
	if r := write(t, g, store.Command{Op: store.OpTouch, Key: []byte("k"), TTL: 200}, hlc.Timestamp{}); r.Outcome != store.Applied {
		t.Fatalf("touch: %+v", r)
	}
	select {
	case <-deleted:
	case <-time.After(5 * time.Second):
		t.Fatal("no DELETE event for the touched key once expired")
	}
}

func TestManyConcurrentWritersAreBatched(t *testing.T) {
	g := open(t, t.TempDir(), nil)
	defer g.Close()
	var wg sync.WaitGroup
	for w := 0; w < 32; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				ch := make(chan error, 1)
				g.Submit(Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte(fmt.Sprintf("%d-%d", w, i)), Value: []byte("x")},
					Done: func(_ store.Result, err error) { ch <- err }})
				if err := <-ch; err != nil {
					t.Error(err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	s := g.Stats()
	if s.Keys != 32*50 {
		t.Fatalf("keys = %d", s.Keys)
	}
	if s.LastIndex >= 32*50 {
		t.Fatalf("%d log entries for %d writes: no batching", s.LastIndex, 32*50)
	}
}

// TestSubmitKeepsEachCallersOrder: writes one goroutine submits without
// waiting (as a client's pipelined requests arrive) enter the log in that
// order, whether Submit proposes them itself (the group idle) or queues
// them behind others; other writers make both happen.
func TestSubmitKeepsEachCallersOrder(t *testing.T) {
	g := open(t, t.TempDir(), nil)
	defer g.Close()
	const writers, each = 4, 400
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			versions := make([]hlc.Timestamp, each)
			var done sync.WaitGroup
			for i := range each {
				done.Add(1)
				g.Submit(Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint("k", w)), Value: []byte(fmt.Sprint(i))},
					Done: func(r store.Result, err error) {
						if err != nil {
							t.Error(err)
						}
						versions[i] = r.Version
						done.Done()
					}})
				if i%50 == 0 {
					done.Wait() // let the group go idle now and then
				}
			}
			done.Wait()
			for i := 1; i < each; i++ {
				if versions[i].Compare(versions[i-1]) <= 0 {
					t.Errorf("writer %d: write %d got %v, not above write %d's %v", w, i, versions[i], i-1, versions[i-1])
					return
				}
			}
			e, _ := g.Get([]byte(fmt.Sprint("k", w)))
			if string(e.Value) != fmt.Sprint(each-1) {
				t.Errorf("writer %d: the key holds %q, not the last write", w, e.Value)
			}
		}()
	}
	wg.Wait()
}

func TestSubmitAfterCloseFails(t *testing.T) {
	g := open(t, "", nil)
	g.Close()
	ch := make(chan error, 1)
	g.Submit(Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte("k")}, Done: func(_ store.Result, err error) { ch <- err }})
	if err := <-ch; err != ErrClosed {
		t.Fatalf("err = %v", err)
	}
}

// Quotas are decided with the limits in force when a write was logged:
// restarting with lower limits keeps what was acknowledged.
func TestQuotaDecisionsReplayIdentically(t *testing.T) {
	dir := t.TempDir()
	g, err := Open(Config{NodeID: "n1", Dir: dir, Limits: store.Limits{MaxKeys: 10}})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		if r := write(t, g, store.Command{Op: store.OpSet, Key: []byte(k), Value: []byte("v")}, hlc.Timestamp{}); r.Outcome != store.Applied {
			t.Fatalf("%s: %v", k, r.Outcome)
		}
	}
	g.Close()
	g, err = Open(Config{NodeID: "n1", Dir: dir, Limits: store.Limits{MaxKeys: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		if _, ok := g.Get([]byte(k)); !ok {
			t.Fatalf("acknowledged key %s lost after restarting with lower limits", k)
		}
	}
	if r := write(t, g, store.Command{Op: store.OpSet, Key: []byte("f"), Value: []byte("v")}, hlc.Timestamp{}); r.Outcome != store.QuotaExceeded {
		t.Fatalf("new key under the new limit: %v", r.Outcome)
	}
}

// A write to a key past its deadline whose Expire has not been applied yet
// still produces the DELETE first, with a version of its own.
func TestWriteToExpiredKeyEmitsDeleteFirst(t *testing.T) {
	var mu sync.Mutex
	var events []store.Event
	g := open(t, "", func(evs []store.Event) {
		mu.Lock()
		events = append(events, evs...)
		mu.Unlock()
	})
	defer g.Close()
	write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("old"), TTL: 1}, hlc.Timestamp{})
	// Hold the expiry loop off: propose the write as soon as the key is
	// past its deadline; with or without the loop's Expire first, the
	// events must be SET, DELETE, SET in increasing versions.
	time.Sleep(2 * time.Millisecond)
	write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("new")}, hlc.Timestamp{})
	mu.Lock()
	defer mu.Unlock()
	if len(events) != 3 || events[0].Kind != store.EventSet || events[1].Kind != store.EventDelete || events[2].Kind != store.EventSet {
		t.Fatalf("events %+v", events)
	}
	if events[1].Version.Compare(events[0].Version) <= 0 || events[2].Version.Compare(events[1].Version) <= 0 {
		t.Fatalf("versions not increasing: %v %v %v", events[0].Version, events[1].Version, events[2].Version)
	}
}

// TestMissingSnapshotsIsAnError: a group whose log was compacted behind a
// snapshot, with the snapshot gone, refuses to start with an error naming
// what is missing (raft would panic: "log not found").
func TestMissingSnapshotsIsAnError(t *testing.T) {
	dir := t.TempDir()
	g := open(t, dir, nil)
	for i := 0; i < 3000; i++ {
		write(t, g, store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint(i % 50)), Value: []byte("v")}, hlc.Timestamp{})
	}
	if err := g.Snapshot(); err != nil {
		t.Fatal(err)
	}
	g.Close()
	if err := os.RemoveAll(filepath.Join(dir, "snapshots")); err != nil {
		t.Fatal(err)
	}
	_, err := Open(Config{NodeID: "n1", Dir: dir})
	var damaged *DamagedError
	if !errors.As(err, &damaged) || !strings.Contains(err.Error(), "snapshot") {
		t.Fatalf("open without its snapshot: %v", err)
	}
}

// TestDiskPollKeepsAheadOfAWriter: the guard looks again before a writer
// at fillRate could use up the space above the reserve, never less often
// than diskPollIdle, never more often than diskPoll.
func TestDiskPollKeepsAheadOfAWriter(t *testing.T) {
	const reserve = 128 << 20
	for _, free := range []uint64{0, reserve, reserve + 1, reserve + 10<<20, reserve + 1<<30, reserve + 3<<30, 1 << 50} {
		wait := nextPoll(free, reserve)
		if wait < diskPoll || wait > diskPollIdle {
			t.Fatalf("free %d: next poll in %v, outside [%v, %v]", free, wait, diskPoll, diskPollIdle)
		}
		if free > reserve && wait > diskPoll && float64(free-reserve) < wait.Seconds()*fillRate {
			t.Fatalf("free %d: a writer at %d B/s passes the reserve before the poll in %v", free, fillRate, wait)
		}
	}
	if nextPoll(1<<50, reserve) != diskPollIdle || nextPoll(reserve/2, reserve) != diskPoll {
		t.Fatal("far from full: once a second; below the reserve: every diskPoll")
	}
}

// TestFollowersApplyTheLastWriteAtOnce: a follower applies, and reports
// the events of, the last write of a burst without waiting for raft's
// CommitTimeout, here raised to a minute: the leader tells it the commit
// index itself (nudgeFollowers).
func TestFollowersApplyTheLastWriteAtOnce(t *testing.T) {
	defer func(d time.Duration) { commitTimeout = d }(commitTimeout)
	commitTimeout = time.Minute
	ids := []string{"n1", "n2", "n3"}
	trans := make([]*raft.InmemTransport, len(ids))
	var conf raft.Configuration
	for i, id := range ids {
		_, trans[i] = raft.NewInmemTransport(raft.ServerAddress(id))
		conf.Servers = append(conf.Servers, raft.Server{ID: raft.ServerID(id), Address: raft.ServerAddress(id)})
	}
	for i := range trans {
		for j := range trans {
			if i != j {
				trans[i].Connect(raft.ServerAddress(ids[j]), trans[j])
			}
		}
	}
	events := make([]chan store.Event, len(ids))
	groups := make([]*Group, len(ids))
	for i, id := range ids {
		ch := make(chan store.Event, 100)
		events[i] = ch
		g, err := Open(Config{NodeID: id, Transport: trans[i], Bootstrap: &conf, OnEvents: func(b Batch) {
			for _, e := range b.Events {
				ch <- e
			}
		}})
		if err != nil {
			t.Fatal(err)
		}
		groups[i] = g
		defer g.Close()
	}
	var leader *Group
	for deadline := time.Now().Add(20 * time.Second); leader == nil; {
		for _, g := range groups {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			if _, ok := g.Leader(); ok && g.LeaderReady(ctx) == nil {
				leader = g
			}
			cancel()
		}
		if time.Now().After(deadline) {
			t.Fatal("no leader")
		}
		time.Sleep(10 * time.Millisecond)
	}
	for round := range 3 {
		key := fmt.Sprint("last-", round)
		write(t, leader, store.Command{Op: store.OpSet, Key: []byte(key), Value: []byte("v")}, hlc.Timestamp{})
		for i, g := range groups {
			timeout := time.After(10 * time.Second) // far below the minute raft would take
			for done := false; !done; {
				select {
				case e := <-events[i]:
					done = string(e.Key) == key
				case <-timeout:
					leaderHere := g == leader
					t.Fatalf("round %d: node %s (leader: %v) never applied %s", round, ids[i], leaderHere, key)
				}
			}
		}
	}
}

// TestHoldFor: the proposer waits only after an entry of many writers
// when few have come back, and never longer than half a commit or
// maxHold.
func TestHoldFor(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		prev, queued int
		commit, want time.Duration
	}{
		{prev: 0, queued: 1, commit: ms, want: 0},      // the first entry
		{prev: 1, queued: 1, commit: ms, want: 0},      // one writer
		{prev: 7, queued: 1, commit: ms, want: 0},      // a few
		{prev: 8, queued: 1, commit: ms, want: ms / 2}, // many, one back
		{prev: 8, queued: 3, commit: ms, want: ms / 2}, // three of eight
		{prev: 8, queued: 4, commit: ms, want: 0},      // half are back
		{prev: 40, queued: 19, commit: 300 * time.Microsecond, want: 150 * time.Microsecond},
		{prev: 40, queued: 25, commit: ms, want: 0},           // more than half
		{prev: 40, queued: 1, commit: 0, want: 0},             // no commit timed yet
		{prev: 64, queued: 1, commit: 20 * ms, want: maxHold}, // a slow disk
		{prev: 579, queued: 63, commit: 2 * ms, want: ms},     // pipelining clients, a few back
		{prev: 579, queued: 226, commit: 2 * ms, want: 0},     // enough for an entry
	} {
		if got := holdFor(c.prev, c.queued, c.commit); got != c.want {
			t.Errorf("holdFor(%d, %d, %v) = %v, want %v", c.prev, c.queued, c.commit, got, c.want)
		}
	}
}

// TestLongLogIsSnapshottedSoonAfterStart: a group whose log holds more
// than the snapshot threshold past its last snapshot when it opens takes
// one within seconds, instead of at raft's first periodic check minutes
// later: a node restarted more often than that never compacted its log
// (found by review: 1.2 GB after 12 kills 3 s apart).
func TestLongLogIsSnapshottedSoonAfterStart(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{NodeID: "n1", Dir: dir, SnapshotThreshold: 100}
	g, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 300; i++ {
		write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte(fmt.Sprint(i))}, hlc.Timestamp{})
	}
	g.Close()
	if g, err = Open(cfg); err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for deadline := time.Now().Add(10 * time.Second); g.raft.Stats()["last_snapshot_index"] == "0"; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot 10 s after opening a log of %d entries", g.raft.LastIndex())
		}
	}
}
