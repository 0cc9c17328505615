package cluster

import (
	"strings"
	"testing"
	"time"
)

// TestClusterProtocol: the cluster runs at the highest protocol every
// member speaks, rises once the last member that spoke less is upgraded,
// never falls, and refuses a node that does not speak it (a joiner of an
// older release, a member rolled back below it) with both named.
func TestClusterProtocol(t *testing.T) {
	t.Parallel()
	h := &harness{t: t, groups: 2}
	t.Cleanup(func() {
		for i := range h.nodes {
			h.stop(i)
		}
	})
	speaks := func(lo, hi int) func(*Config) {
		return func(c *Config) { c.Protocols = [2]int{lo, hi}; c.Release = "test-" + string(rune('0'+hi)) }
	}
	// n1 creates the cluster with a release that speaks protocol 1 only
	// (a cluster starts at its creator's highest).
	for i, hi := range []int{1, 2, 2} {
		if err := h.tryStart(i, speaks(1, hi)); err != nil {
			t.Fatalf("n%d: %v", i+1, err)
		}
	}
	h.awaitReplicas(3)
	if p := h.nodes[0].Protocol(); p != 1 {
		t.Fatalf("protocol %d with a member that speaks 1 only", p)
	}
	// n1 upgraded: every member speaks 2, and the cluster moves to it.
	h.stop(0)
	if err := h.tryStart(0, speaks(1, 2)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; i < 3; i++ {
		for h.nodes[i].Protocol() != 2 {
			if time.Now().After(deadline) {
				for j := range 3 {
					for _, m := range h.nodes[j].state.Load().Nodes {
						t.Logf("view of n%d: %s %q %d %d", j+1, m.ID, m.Release, m.ProtoMin, m.ProtoMax)
					}
				}
				t.Fatalf("n%d still at protocol %d after every member speaks 2", i+1, h.nodes[i].Protocol())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	st := h.nodes[1].Status()
	if st.Protocol != 2 {
		t.Fatalf("status says protocol %d", st.Protocol)
	}
	for _, ns := range st.Nodes {
		if ns.Release != "test-2" || ns.ProtoMin != 1 || ns.ProtoMax != 2 {
			t.Fatalf("status of %s: release %q, protocols %d-%d", ns.ID, ns.Release, ns.ProtoMin, ns.ProtoMax)
		}
	}
	// A new node of a release that speaks 1 only is refused.
	err := h.tryStart(3, speaks(1, 1))
	if err == nil || !strings.Contains(err.Error(), "speaks cluster protocol 1 to 1, and the cluster runs at protocol 2") {
		t.Fatalf("a joiner that speaks protocol 1 only: %v", err)
	}
	// A member rolled back to such a release is refused too, and keeps
	// its data for the newer release.
	h.stop(2)
	err = h.tryStart(2, speaks(1, 1))
	if err == nil {
		// Its reopening took longer than Start waits (reopenQuick, under
		// load): the refusal then stops the node (Failed) instead.
		select {
		case <-h.nodes[2].Failed():
			err = h.nodes[2].Err()
		case <-time.After(30 * time.Second):
		}
		h.stop(2)
	}
	if err == nil || !strings.Contains(err.Error(), "runs at protocol 2") {
		t.Fatalf("a member rolled back below the cluster's protocol: %v", err)
	}
	if err := h.tryStart(2, speaks(1, 2)); err != nil {
		t.Fatalf("the member on its release again: %v", err)
	}
	if p := h.nodes[2].Protocol(); p != 2 {
		t.Fatalf("protocol %d after the refused rollback: it never falls", p)
	}
}
