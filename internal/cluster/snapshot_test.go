package cluster

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// TestFollowerWithALogCatchesUpBySnapshot: a follower that has a log, is
// down while the leader compacts its log past it, and comes back, is
// caught up by a snapshot and then follows again. Before, raft kept the
// follower's old entries after installing the snapshot (the journal did
// not say its entries are monotonic), the leader's next entry could not
// follow them, and the follower never took an entry again: the group ran
// on two of three replicas.
func TestFollowerWithALogCatchesUpBySnapshot(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 1)
	for i := 0; i < 20; i++ {
		if _, err := set(t, h.nodes[0], fmt.Sprint("a", i), "v"); err != nil {
			t.Fatal(err)
		}
	}
	var leader *raft.Raft
	lead := -1
	for i := 0; i < 3; i++ {
		if r := h.nodes[i].local(0); r != nil && r.Raft().State() == raft.Leader {
			leader, lead = r.Raft(), i
		}
	}
	if leader == nil {
		t.Fatal("no leader")
	}
	f := (lead + 1) % 3 // a follower
	want := leader.LastIndex()
	for deadline := time.Now().Add(10 * time.Second); h.nodes[f].local(0).Stats().AppliedIndex < want; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the follower never applied the first writes")
		}
	}
	h.stop(f)
	start := leader.LastIndex()
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; leader.LastIndex() < start+1500; i++ {
				set(t, h.nodes[lead], fmt.Sprint("b", w, "-", i), "v")
			}
		}()
	}
	wg.Wait()
	if err := leader.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	h.start(f)
	for i := 0; i < 5; i++ {
		set(t, h.nodes[lead], fmt.Sprint("c", i), "v")
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		r := h.nodes[f].local(0)
		if r != nil && r.Stats().AppliedIndex >= leader.LastIndex() {
			return
		}
		if time.Now().After(deadline) {
			var applied uint64
			if r != nil {
				applied = r.Stats().AppliedIndex
			}
			first, _ := h.nodes[f].journal.Group(0).FirstIndex()
			last, _ := h.nodes[f].journal.Group(0).LastIndex()
			t.Fatalf("the follower never caught up: applied %d, leader at %d; its journal holds %d..%d", applied, leader.LastIndex(), first, last)
		}
	}
}
