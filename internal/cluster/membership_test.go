package cluster

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/store"
)

// writable waits until a write to a key of every group succeeds through
// n, and fails the test if one group stays unwritable for d.
func writable(t *testing.T, n *Node, groups int, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for g := 0; g < groups; g++ {
		key := keyOfGroup(n, g)
		for {
			res, err := set(t, n, key, "v")
			if err == nil && res.Outcome == store.Applied {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("group %d not writable for %s: %v (status %+v)", g, d, err, n.Status())
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

func keyOfGroup(n *Node, g int) string {
	for i := 0; ; i++ {
		if k := fmt.Sprint("key-", i); n.groupOf([]byte(k)) == g {
			return k
		}
	}
}

// The sequence of the issue, on four nodes: `mqkv cluster remove` of a
// live node that leads groups is refused; forced, the node stops serving
// and gives its groups up; then a node is killed and removed. No group
// is left without a leader: before, the removed node kept handing a
// group over to the dead one, 705 times over 75 s, and every write to
// the group failed meanwhile.
func TestRemoveOfALiveNodeThenOfADeadOne(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 4, 4)
	writable(t, h.nodes[0], 4, 10*time.Second)
	err := h.nodes[0].Remove(ctx(t), "n2", false)
	if !errors.Is(err, ErrMemberRunning) || !strings.Contains(err.Error(), "leave") {
		t.Fatalf("remove of a live node: %v, want it refused, saying to use leave", err)
	}
	if _, ok := h.nodes[0].state.Load().Node("n2"); !ok {
		t.Fatal("n2 removed though refused")
	}
	if err := h.nodes[0].Remove(ctx(t), "n2", true); err != nil {
		t.Fatalf("forced remove: %v", err)
	}
	// The removed node says so to its clients, and its groups go on
	// without it.
	eventuallyT(t, 10*time.Second, "n2 to know it was removed", func() bool { return h.nodes[1].Removed() })
	if _, err := set(t, h.nodes[1], "k", "v"); !errors.As(err, new(*NotMemberError)) {
		t.Fatalf("a write through the removed node: %v, want NotMemberError", err)
	}
	eventuallyT(t, 30*time.Second, "n2 to hold no replica", func() bool { return len(h.nodes[1].Groups()) == 0 })
	writable(t, h.nodes[0], 4, 10*time.Second)

	h.stop(3)
	if err := h.nodes[0].Remove(ctx(t), "n4", false); err != nil {
		t.Fatalf("remove of the stopped n4: %v", err)
	}
	writable(t, h.nodes[0], 4, 15*time.Second)
	h.awaitReplicas(2)
}

// A member removed while it was stopped is refused when it comes back
// with its data (a process supervisor restarts it with its command line,
// --join included): before, it was let in at once and took replicas
// again. --rejoin drops its data and makes it a member again.
func TestRemovedNodeIsRefusedUntilItRejoins(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	h.stop(2)
	if err := h.nodes[0].Remove(ctx(t), "n3", false); err != nil {
		t.Fatal(err)
	}
	err := h.tryStart(2, nil)
	if err == nil || !strings.Contains(err.Error(), "was removed from the cluster") {
		t.Fatalf("the removed node back with its data: %v, want refused as removed", err)
	}
	if !strings.Contains(err.Error(), "--rejoin") {
		t.Fatalf("the refusal does not say how to come back: %v", err)
	}
	if st := h.nodes[0].state.Load(); len(st.Nodes) != 2 {
		t.Fatalf("members after the refusal: %+v", st.Nodes)
	}
	if err := h.tryStart(2, func(c *Config) { c.Rejoin = true }); err != nil {
		t.Fatalf("--rejoin: %v", err)
	}
	h.awaitReplicas(3)
	if st := h.nodes[0].state.Load(); st.IsGone("n3") {
		t.Fatal("n3 still listed as removed")
	}
	// --rejoin of a node that is a member keeps its data and is refused.
	h.stop(1)
	if err := h.tryStart(1, func(c *Config) { c.Rejoin = true }); err == nil || !strings.Contains(err.Error(), "still a member") {
		t.Fatalf("--rejoin of a member: %v", err)
	}
	h.start(1)
	writable(t, h.nodes[1], 2, 15*time.Second)
}

// `mqkv cluster leave` of a node killed while it drains, restarted with
// its command line: the leave completes, and the node, which then knows
// it is no longer a member, says so; restarted once more, it is refused.
func TestLeaveCompletesAcrossARestart(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 4, 4)
	// Killed as it drains: stopped, then the leave is asked; the drain
	// cannot end without it (the node is asked whether it still holds
	// replicas).
	h.stop(3)
	if err := h.nodes[0].Leave(ctx(t), "n4"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // the replicas move meanwhile
	h.start(3)              // with its command line, --join included
	eventuallyT(t, 60*time.Second, "the leave to complete", func() bool {
		_, member := h.nodes[0].state.Load().Node("n4")
		return !member
	})
	eventuallyT(t, 15*time.Second, "n4 to know it left", func() bool { return h.nodes[3].Removed() })
	if st := h.nodes[3].Status(); !st.NotMember {
		t.Fatalf("n4's status does not say it is not a member: %+v", st)
	}
	if _, err := set(t, h.nodes[3], "k", "v"); !errors.As(err, new(*NotMemberError)) {
		t.Fatalf("a write through the node that left: %v, want NotMemberError", err)
	}
	h.stop(3)
	if err := h.tryStart(3, nil); err == nil || !strings.Contains(err.Error(), "was removed from the cluster") {
		t.Fatalf("the drained node restarted: %v, want refused", err)
	}
	h.awaitReplicas(3)
}

func eventuallyT(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
	}
}

// A leader leaving its group hands it only to a node that answers: with
// n4 down, n1 leaves; the groups n1 leads whose placement puts n4 first
// go to another placed replica, and every group stays writable (a
// transfer to the dead node was tried every round, and stalled the group's
// writes each time).
func TestHandoverSkipsADeadNode(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 4, 8)
	h.stop(3)
	eventuallyT(t, 10*time.Second, "n1 to see n4 down", func() bool { return !h.nodes[0].alive("n4") })
	if err := h.nodes[1].Leave(ctx(t), "n1"); err != nil {
		t.Fatal(err)
	}
	eventuallyT(t, 20*time.Second, "n1 to lead no group", func() bool {
		for _, r := range h.nodes[0].Groups() {
			if id, _ := r.Leader(); id == "n1" {
				return false
			}
		}
		return true
	})
	for range 3 { // for several rounds of the reconciler
		writable(t, h.nodes[1], 8, 5*time.Second)
		time.Sleep(300 * time.Millisecond)
	}
}
