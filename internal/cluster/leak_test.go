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
