package cluster

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// A graceful stop hands the leadership of the node's groups (and of the
// metadata group) to the others before it closes: writes through the
// other nodes go on with no error, and the groups have leaders the moment
// the node is gone.
func TestHandOverBeforeStopping(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 6)
	h.awaitReplicas(3)
	n1 := h.nodes[0]
	led := 0
	for _, r := range n1.Groups() {
		if r.Raft().State() == raft.Leader {
			led++
		}
	}
	if led == 0 {
		t.Skip("n1 leads no group")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if left, err := n1.HandOver(ctx); err != nil {
		t.Fatalf("handover: %v (still led: %v)", err, left)
	}
	for g, r := range n1.Groups() {
		if r.Raft().State() == raft.Leader {
			t.Fatalf("n1 still leads group %d", g)
		}
	}
	if n1.meta.State() == raft.Leader {
		t.Fatal("n1 still leads the metadata group")
	}
	h.stop(0)
	// Every group has a leader at once: writes through n2 to every group
	// succeed without waiting for an election.
	for g := 0; g < 6; g++ {
		key := keyOfGroup(h.nodes[1], g)
		start := time.Now()
		if _, err := set(t, h.nodes[1], key, fmt.Sprint("after-", g)); err != nil {
			t.Fatalf("group %d after the stop: %v", g, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("group %d took %v to take a write", g, d)
		}
	}
}

// With no other voter up, a handover cannot happen: it says so at once,
// with what is still led, rather than wait (the last member of a cluster
// being stopped).
func TestHandOverAloneEndsAtOnce(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 1, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	left, err := h.nodes[0].HandOver(ctx)
	if err == nil || len(left) == 0 {
		t.Fatalf("a lone node handed over: %v %v", left, err)
	}
	if ctx.Err() != nil {
		t.Fatalf("waited %v for nobody", time.Since(start))
	}
}
