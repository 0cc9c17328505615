package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/store"
)

// TestFollowerGoesOnAfterFallingBehindTheRings: a node that follows a
// group from other members' event rings, and falls further behind than
// they keep (cut off while 10 MiB of values are written, rings keep 8),
// goes on delivering the group's changes once it is back, and reports
// the loss (OnEventsGap: first the zero version, then that of the first
// change delivered after it). Before, it asked for the lost position
// for ever: the group's notifications stopped on that node until it
// restarted.
func TestFollowerGoesOnAfterFallingBehindTheRings(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 4, 1)
	f := withoutReplica(t, h)
	via := h.nodes[(f+1)%4]
	if err := h.nodes[f].Follow(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if res, err := set(t, via, "before", "v"); err != nil || res.Outcome != store.Applied {
		t.Fatal(res, err)
	}
	awaitEvent(t, h.events[f], "before")
	h.links[f].Isolate(true)
	big := bytes.Repeat([]byte("x"), 1<<20)
	for i := 0; i < 10; i++ {
		setAgainIfUnknown(t, via, store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint("big", i)), Value: big})
	}
	h.links[f].Isolate(false)
	if res, err := set(t, via, "after", "v"); err != nil || res.Outcome != store.Applied {
		t.Fatal(res, err)
	}
	awaitEvent(t, h.events[f], "after")
	for i, want := range []string{"the loss", "the first version after it"} {
		select {
		case v := <-h.gaps[f]:
			if v.IsZero() != (i == 0) {
				t.Fatalf("OnEventsGap heard %v for %s", v, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("OnEventsGap never heard of %s", want)
		}
	}
	select {
	case v := <-h.gaps[f]:
		t.Fatalf("OnEventsGap heard %v more", v)
	default:
	}
}

// withoutReplica returns the index of a node of h that holds no replica
// of group 0.
func withoutReplica(t *testing.T, h *harness) int {
	t.Helper()
	for i, n := range h.nodes {
		if !slices.Contains(n.state.Load().Placement()[0], n.cfg.NodeID) {
			return i
		}
	}
	t.Fatal("every node holds a replica of group 0")
	return -1
}

// setAgainIfUnknown submits cmd (a SET, which may be applied twice)
// through n, again when an election made its outcome unknown: a loaded
// machine may hold a leader up past its followers' patience.
func setAgainIfUnknown(t *testing.T, n *Node, cmd store.Command) {
	t.Helper()
	if _, err := submitAgainIfUnknown(t, n, cmd); err != nil {
		t.Fatal(err)
	}
}

// awaitEvent waits until an event about key arrives on ch.
func awaitEvent(t *testing.T, ch chan []store.Event, key string) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case evs := <-ch:
			for _, e := range evs {
				if string(e.Key) == key {
					return
				}
			}
		case <-deadline:
			t.Fatalf("no event for %q within 20 s", key)
		}
	}
}

// TestStreamParts: a ring's events go out in messages of at most
// streamPart bytes each (one entry alone may be larger), every entry
// once, in order.
func TestStreamParts(t *testing.T) {
	var entries []entryEvents
	for i := 1; i <= 100; i++ {
		entries = append(entries, entryEvents{Index: uint64(i), Events: []store.Event{{Key: []byte("k"), Value: make([]byte, (i%7)*20<<10)}}})
	}
	entries = append(entries, entryEvents{Index: 101, Events: []store.Event{{Key: []byte("big"), Value: make([]byte, 2*streamPart)}}})
	var next uint64 = 1
	for rest := entries; len(rest) > 0; {
		n := partEnd(rest)
		if n < 1 {
			t.Fatalf("an empty part at index %d", next)
		}
		size := 0
		for _, e := range rest[:n] {
			if e.Index != next {
				t.Fatalf("entry %d where %d was next", e.Index, next)
			}
			next++
			size += len(e.Events[0].Key) + len(e.Events[0].Value)
		}
		if size > streamPart && n > 1 {
			t.Fatalf("a part of %d entries and %d bytes", n, size)
		}
		rest = rest[n:]
	}
	if next != 102 {
		t.Fatalf("%d entries sent of 101", next-1)
	}
}

// TestFollowStartsWithTheRingsBacklog: a node that starts following a
// group it holds no replica of gets the changes another member's ring
// holds, from its beginning (the node's change history then reaches back
// before it followed), and all of them before Follow returns, though
// they come in several parts: its callers register for notifications
// then, and must not be sent the older changes as new ones.
func TestFollowStartsWithTheRingsBacklog(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 4, 1)
	f := withoutReplica(t, h)
	via := h.nodes[(f+1)%4]
	value := bytes.Repeat([]byte("v"), 16<<10)
	const backlog = 100 // 1.6 MiB: several parts of streamPart
	for i := range backlog {
		setAgainIfUnknown(t, via, store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint("old", i)), Value: value})
	}
	if err := h.nodes[f].Follow(ctx(t)); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for drained := false; !drained; {
		select {
		case evs := <-h.events[f]:
			for _, e := range evs {
				seen[string(e.Key)] = true
			}
		default:
			drained = true
		}
	}
	if len(seen) != backlog {
		t.Fatalf("%d of the %d changes before Follow delivered when it returned", len(seen), backlog)
	}
	select {
	case evs := <-h.events[f]:
		t.Fatalf("a change from before Follow delivered after it returned: %s", evs[0].Key)
	case <-time.After(500 * time.Millisecond):
	}
}

// TestAStartingStreamIsSentToTheLeader: a member that does not lead a
// group sends a follower starting out to the leader (only its ring is sure
// to hold every acknowledged change: a CI run caught another member's two
// writes behind, and its follower then heard of them as new), and serves
// it all the same when the follower could not reach the leader.
func TestAStartingStreamIsSentToTheLeader(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 1)
	var l int
	eventuallyT(t, 10*time.Second, "a leader", func() bool { l = h.leaderOfGroup(0); return l >= 0 })
	other := h.nodes[(l+1)%3]
	eventuallyT(t, 10*time.Second, "the other member hears the leader", func() bool {
		id, _ := other.local(0).Leader()
		return id == h.nodes[l].cfg.NodeID
	})
	from := h.nodes[(l+2)%3]
	first := func(any bool) callResp {
		t.Helper()
		s, err := from.link.Open(ctx(t), from.addrOf(other.cfg.NodeID), peer.KindCall, nil)
		if err != nil {
			t.Fatal(err)
		}
		c := peer.NewConn(s)
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if err := c.Send(callReq{Op: opEvents, FromStart: true, AnyReplica: any}); err != nil {
			t.Fatal(err)
		}
		var resp callResp
		if err := c.Receive(&resp); err != nil {
			t.Fatal(err)
		}
		return resp
	}
	if resp := first(false); resp.Kind != errNotLeader || resp.Leader != h.nodes[l].cfg.NodeID {
		t.Fatalf("a follower's start at a non-leader: %+v, want errNotLeader naming %s", resp, h.nodes[l].cfg.NodeID)
	}
	if resp := first(true); resp.Kind != errNone || !resp.HasFloor {
		t.Fatalf("with AnyReplica: %+v, want the stream's first frame", resp)
	}
}

// TestEventQueueKeepsOrderAndBound: a node on its own's event queue
// delivers every batch once, in order, with the events as they were
// pushed (the apply goroutine reuses its slice); a push that finds the
// queue at its bound waits until a delivery makes room; close delivers
// what is still held before it returns.
func TestEventQueueKeepsOrderAndBound(t *testing.T) {
	t.Parallel()
	ev := func(i int) store.Event {
		return store.Event{Key: []byte(fmt.Sprintf("k%03d", i)), Value: bytes.Repeat([]byte{'v'}, 100)}
	}
	one := eventsSize([]store.Event{ev(0)})
	q := newEventQueue(3 * one) // three batches of one event
	gate := make(chan struct{})
	var got []string
	delivered := make(chan struct{}, 100)
	go q.run(func(evs []store.Event) {
		<-gate // the first delivery is held until the queue is full
		for _, e := range evs {
			got = append(got, string(e.Key))
		}
		delivered <- struct{}{}
	})
	reused := make([]store.Event, 1)
	pushed := make(chan int, 10)
	go func() {
		for i := 0; i < 10; i++ {
			reused[0] = ev(i)
			q.push(reused)
			pushed <- i
		}
	}()
	// Batch 0 is taken by the held delivery (its bytes still count), 1
	// and 2 fill the queue: the push of 3 must wait.
	for i := 0; i < 3; i++ {
		<-pushed
	}
	select {
	case i := <-pushed:
		t.Fatalf("push %d went through a full queue", i)
	case <-time.After(50 * time.Millisecond):
	}
	close(gate)
	for i := 3; i < 10; i++ {
		<-pushed
	}
	q.close()
	want := make([]string, 10)
	for i := range want {
		want[i] = fmt.Sprintf("k%03d", i)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("delivered %v, want %v", got, want)
	}
	q.push([]store.Event{ev(10)}) // after close: dropped, not blocked
}

// TestEventQueueReusesDeliveredSlices: a batch delivered gives its slice
// back, cleared (it holds no key or value past the delivery), and the
// next push copies into it rather than into a new one: a pipelined
// load's batches are hundreds of events each.
func TestEventQueueReusesDeliveredSlices(t *testing.T) {
	// Not parallel: AllocsPerRun.
	q := newEventQueue(1 << 20)
	delivered := make(chan []store.Event, 1)
	go q.run(func(evs []store.Event) {
		if len(evs) != 64 || string(evs[63].Key) != "k63" || string(evs[0].Value) != "v" {
			t.Errorf("delivered %d events, not the 64 pushed", len(evs))
		}
		delivered <- evs
	})
	t.Cleanup(q.close)
	batch := make([]store.Event, 64)
	for i := range batch {
		batch[i] = store.Event{Key: []byte(fmt.Sprint("k", i)), Value: []byte("v")}
	}
	q.push(batch)
	first := <-delivered
	if err := q.flush(context.Background()); err != nil { // first is back in free
		t.Fatal(err)
	}
	if first[0].Key != nil || first[63].Value != nil {
		t.Fatalf("a delivered batch still holds %q", first[0].Key)
	}
	q.push(batch)
	if again := <-delivered; &again[0] != &first[0] {
		t.Fatal("the second batch was copied into a new slice, not the first's")
	}
	if raceDetector {
		return // its instrumentation allocates
	}
	if n := testing.AllocsPerRun(100, func() {
		q.push(batch)
		<-delivered
	}); n != 0 {
		t.Fatalf("%v allocations a batch pushed and delivered, want 0", n)
	}
}

// TestEventQueueKeepsRoomForLargeBatches: with the slices kept for reuse
// all small (single writes' batches), a large batch's slice, once
// delivered, takes the place of one of them; a small batch pushed next
// takes a small one, so that a large batch pushed beside it is copied
// into the large one.
func TestEventQueueKeepsRoomForLargeBatches(t *testing.T) {
	t.Parallel()
	q := newEventQueue(1 << 20)
	step := make(chan struct{}) // one delivery each
	delivered := make(chan []store.Event, 8)
	go q.run(func(evs []store.Event) {
		<-step
		delivered <- evs
	})
	t.Cleanup(func() {
		go func() {
			for range step {
			}
		}()
		q.close()
		close(step)
	})
	deliver := func(n int) []store.Event {
		t.Helper()
		var last []store.Event
		for range n {
			step <- struct{}{}
			last = <-delivered
		}
		if err := q.flush(context.Background()); err != nil { // their slices are back
			t.Fatal(err)
		}
		return last
	}
	one := []store.Event{{Key: []byte("k")}}
	for range maxFree + 1 { // each copied into a new slice: none is back yet
		q.push(one)
	}
	deliver(maxFree + 1)
	large := make([]store.Event, 64)
	for i := range large {
		large[i] = store.Event{Key: []byte(fmt.Sprint("k", i))}
	}
	q.push(large)
	first := deliver(1)
	q.push(one) // held in its delivery
	q.push(large)
	step <- struct{}{}
	<-delivered
	step <- struct{}{}
	if again := <-delivered; &again[0] != &first[0] {
		t.Fatal("a large batch was copied into a new slice, the last large one's taken by a small batch or not kept")
	}
}

// TestEventQueueFlush: flush returns once every batch pushed before it
// was delivered (not before: the delivery is held until flush waits),
// at once when nothing is queued, and with the context's error when it
// ends first.
func TestEventQueueFlush(t *testing.T) {
	t.Parallel()
	q := newEventQueue(1 << 20)
	gate := make(chan struct{})
	var delivered atomic.Int64
	go q.run(func(evs []store.Event) {
		<-gate
		delivered.Add(int64(len(evs)))
	})
	var open sync.Once
	release := func() { open.Do(func() { close(gate) }) }
	t.Cleanup(func() { release(); q.close() })
	if err := q.flush(context.Background()); err != nil {
		t.Fatalf("flush of an empty queue: %v", err)
	}
	for i := range 3 {
		q.push([]store.Event{{Key: []byte(fmt.Sprint(i))}})
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := q.flush(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("flush with its context ended: %v, want context.Canceled", err)
	}
	flushed := make(chan int64)
	go func() {
		q.flush(context.Background())
		flushed <- delivered.Load()
	}()
	release()
	if n := <-flushed; n != 3 {
		t.Fatalf("flush returned with %d of 3 changes delivered", n)
	}
}

// On a node on its own, Delivered returns only once the changes applied
// before it was called have been delivered: a KEYNOTIFY registered after
// it (the statestore waits for it) must not be told, as new, of a write
// answered before it was asked for (it was, when the node's event queue
// ran late).
func TestDeliveredAloneWaitsForWhatWasApplied(t *testing.T) {
	t.Parallel()
	gate := make(chan struct{})
	var delivered atomic.Int64
	n, err := Start(Config{NodeID: "n1", Dir: t.TempDir(), Logger: quiet(), OnEvents: func(e []store.Event) {
		<-gate
		delivered.Add(int64(len(e)))
	}})
	if err != nil {
		t.Fatal(err)
	}
	var open sync.Once
	release := func() { open.Do(func() { close(gate) }) }
	t.Cleanup(func() { release(); n.Close() })
	if err := n.Delivered(ctx(t)); err != nil {
		t.Fatalf("Delivered with nothing applied: %v", err)
	}
	if res, err := set(t, n, "k", "v"); err != nil || res.Outcome != store.Applied {
		t.Fatalf("SET: %+v %v", res, err)
	}
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := n.Delivered(short); err == nil {
		t.Fatal("Delivered returned while the SET's change was still undelivered")
	}
	flushed := make(chan error, 1)
	go func() { flushed <- n.Delivered(ctx(t)) }()
	release()
	if err := <-flushed; err != nil || delivered.Load() != 1 {
		t.Fatalf("Delivered: %v, with %d changes delivered, want 1", err, delivered.Load())
	}
}
