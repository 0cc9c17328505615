package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// A cluster backup reads each group's copy a page at a time, from the
// node that holds it, and merges them in key order: it holds every key as
// it was when its group was copied, none written after, and the holders
// let their copies go at the end.
func TestBackupPagesThroughEveryGroup(t *testing.T) {
	defer func(b int) { copyPageBytes = b }(copyPageBytes)
	copyPageBytes = 8 << 10 // about eight entries a page
	h := newHarness(t, 3, 4)
	value := func(i int) string { return fmt.Sprintf("v%d-", i) + strings.Repeat("x", 1000) }
	const keys = 300
	for i := range keys {
		if _, err := set(t, h.nodes[i%3], fmt.Sprint("k-", i), value(i)); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	var announced, remote int
	held := func(n *Node) int {
		n.copies.mu.Lock()
		defer n.copies.mu.Unlock()
		return len(n.copies.held)
	}
	err := h.nodes[0].Backup(context.Background(), func(_ hlc.Timestamp, n int) {
		announced = n
		remote = held(h.nodes[1]) + held(h.nodes[2])
		// Every group is copied by now: what follows is not in it.
		set(t, h.nodes[1], "k-0", "overwritten")
		set(t, h.nodes[2], "late", "v")
	}, &buf)
	if err != nil {
		t.Fatal(err)
	}
	st := store.New(store.Limits{})
	if err := st.ReadSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	if st.Len() != keys || announced != keys {
		t.Fatalf("the backup holds %d keys, announced %d; want %d", st.Len(), announced, keys)
	}
	for i := range keys {
		e, ok := st.Get([]byte(fmt.Sprint("k-", i)), 0)
		if !ok || string(e.Value) != value(i) {
			t.Fatalf("k-%d in the backup: %v %+v", i, ok, e)
		}
	}
	for i, n := range h.nodes {
		if c := held(n); c != 0 {
			t.Errorf("n%d still holds %d copies", i+1, c)
		}
	}
	if remote == 0 {
		t.Error("every group was copied on the node serving the backup: no page crossed the link")
	}
}

// A copy nobody reads goes after copyIdle, read or not before; a copy
// being read stays; an id is held once.
func TestBackupCopiesExpire(t *testing.T) {
	defer copyIdle.Store(copyIdle.Load())
	// Three times the writer's pause (so pages come further apart than
	// it), with room for a keep-alive call held up on a loaded machine
	// (at 100 ms one was, under CI's -race load).
	copyIdle.Store(int64(300 * time.Millisecond))
	var c copies
	st := store.New(store.Limits{})
	st.Apply(&store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("v"), Version: hlc.Timestamp{Wall: 1, Node: "n1"}}, nil)
	const idle, read = 1, 2
	if err := c.hold(idle, st); err != nil {
		t.Fatal(err)
	}
	if err := c.hold(read, st); err != nil {
		t.Fatal(err)
	}
	if err := c.hold(read, st); err == nil {
		t.Fatal("an id held twice")
	}
	defer c.close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, _, err := c.page(read, nil); err != nil {
			t.Fatalf("a copy being read was dropped: %v", err)
		}
		c.mu.Lock()
		_, held := c.held[idle]
		c.mu.Unlock()
		if !held {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("an idle copy is still held")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A backup whose copying is cancelled (its client went away) leaves no
// copy held: the holders took some without the backup hearing their ids.
func TestCancelledBackupLeavesNoCopies(t *testing.T) {
	h := newHarness(t, 3, 8)
	for i := range 50 {
		set(t, h.nodes[i%3], fmt.Sprint("k-", i), "v")
	}
	held := func() (n int) {
		for _, node := range h.nodes {
			node.copies.mu.Lock()
			n += len(node.copies.held)
			node.copies.mu.Unlock()
		}
		return n
	}
	for i := range 40 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(1+i)*250*time.Microsecond)
		err := h.nodes[0].Backup(ctx, func(hlc.Timestamp, int) {}, new(bytes.Buffer))
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("a cancelled backup says %v, not that it was cancelled", err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for held() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d copies still held after every backup returned", held())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A backup of a cluster that has lost a group's quorum fails after
// copyTimeout instead of waiting for a leader as long as its client does.
func TestBackupWithoutQuorumFails(t *testing.T) {
	defer func(d time.Duration) { copyTimeout = d }(copyTimeout)
	copyTimeout = 2 * time.Second
	h := newHarness(t, 3, 2)
	h.stop(1)
	h.stop(2)
	done := make(chan error, 1)
	go func() {
		done <- h.nodes[0].Backup(context.Background(), func(hlc.Timestamp, int) {}, new(bytes.Buffer))
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a backup without a quorum succeeded")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the backup still waits for a leader after 30 s")
	}
	h.nodes[0].copies.mu.Lock()
	n := len(h.nodes[0].copies.held)
	h.nodes[0].copies.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d copies held after the failed backup", n)
	}
}

// A backup written to a slow client keeps its copies: a group's next page
// may be asked for long after the last, and the copies must not expire
// meanwhile.
func TestSlowBackupKeepsItsCopies(t *testing.T) {
	defer func(b int) { copyPageBytes = b }(copyPageBytes)
	defer copyIdle.Store(copyIdle.Load())
	copyPageBytes = 8 << 10
	h := newHarness(t, 3, 4)
	for i := range 300 {
		if _, err := set(t, h.nodes[i%3], fmt.Sprint("k-", i), strings.Repeat("x", 1000)); err != nil {
			t.Fatal(err)
		}
	}
	// Three times the writer's pause (so pages come further apart than
	// it), with room for a keep-alive call held up on a loaded machine
	// (at 100 ms one was, under CI's -race load).
	copyIdle.Store(int64(300 * time.Millisecond))
	var buf bytes.Buffer
	err := h.nodes[0].Backup(context.Background(), func(hlc.Timestamp, int) {}, slowWriter{&buf})
	if err != nil {
		t.Fatalf("a slow backup failed: %v", err)
	}
	st := store.New(store.Limits{})
	if err := st.ReadSnapshot(&buf); err != nil || st.Len() != 300 {
		t.Fatalf("the slow backup: %d keys, %v", st.Len(), err)
	}
}

// slowWriter takes 900 ms for each write (the snapshot writer's buffer
// flushes every 64 KiB): a client on a slow link.
type slowWriter struct{ w *bytes.Buffer }

func (s slowWriter) Write(p []byte) (int, error) {
	time.Sleep(900 * time.Millisecond)
	return s.w.Write(p)
}
