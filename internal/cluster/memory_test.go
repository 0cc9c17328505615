package cluster

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"
	"time"
	"weak"

	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// TestDroppedReplicaIsReleased: a replica the node no longer holds (moved
// to other nodes, dropGroup) does not stay in memory with its store, its
// raft and its log cache. Before, the goroutine that watches a group for
// failure held it until the node stopped: one group's data more for each
// replica moved away.
func TestDroppedReplicaIsReleased(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 1, 1)
	n := h.nodes[0]
	val := bytes.Repeat([]byte("v"), 64<<10)
	for i := 0; i < 50; i++ {
		done := make(chan error, 1)
		n.Submit(ctx(t), replica.Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint("k", i)), Value: val},
			Done: func(_ store.Result, err error) { done <- err }})
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	group := weak.Make(n.local(0))
	n.dropGroup(0)
	// The watcher ends on its own goroutine: collect until it has.
	for deadline := time.Now().Add(5 * time.Second); group.Value() != nil && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		runtime.GC()
	}
	if group.Value() != nil {
		t.Fatal("the dropped replica is still reachable")
	}
}

// TestAscendPagesAreBoundedByBytes: a page of a group's keys holds at most
// maxPageBytes of keys and values (they are copied, and sent over the
// node link), and the router goes on after a short page: a SCAN over big
// values neither copies them all at once nor misses any.
func TestAscendPagesAreBoundedByBytes(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	val := bytes.Repeat([]byte("v"), 1<<20)
	const n = 12
	for i := 0; i < n; i++ {
		setAgainIfUnknown(t, h.nodes[0], store.Command{Op: store.OpSet, Key: []byte(fmt.Sprintf("k%02d", i)), Value: val})
	}
	var seen []string
	var from []byte
	for pages := 0; ; pages++ {
		if pages > n {
			t.Fatalf("no end after %d pages: %q", pages, seen)
		}
		got := 0
		exhausted, err := h.nodes[1].Ascend(ctx(t), from, nil, 1000, func(e *store.Entry) bool {
			seen = append(seen, string(e.Key))
			from = append(append([]byte(nil), e.Key...), 0)
			got++
			return true
		})
		if err != nil {
			t.Fatal(err)
		}
		if got > 2*(maxPageBytes/len(val)+1) { // a page per group
			t.Fatalf("a page of %d values of 1 MiB", got)
		}
		if exhausted {
			break
		}
	}
	if len(seen) != n {
		t.Fatalf("keys seen: %q, want %d", seen, n)
	}
}
