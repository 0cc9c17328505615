package cluster

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// leaderOfGroup returns the index of the node whose replica leads g.
func (h *harness) leaderOfGroup(g int) int {
	h.t.Helper()
	for i, n := range h.nodes {
		if n == nil {
			continue
		}
		if r := n.local(g); r != nil {
			if _, me := r.Leader(); me {
				return i
			}
		}
	}
	return -1
}

// ledKey starts three nodes (two groups) and returns them, the index of
// the node that leads group g, and a key of g set to value.
func ledKey(t *testing.T, g int, value string) (*harness, int, string) {
	t.Helper()
	h := newHarness(t, 3, 2)
	var l int
	eventuallyT(t, 10*time.Second, "a leader", func() bool { l = h.leaderOfGroup(g); return l >= 0 })
	key := keyOfGroup(h.nodes[l], g)
	if _, err := set(t, h.nodes[l], key, value); err != nil {
		t.Fatal(err)
	}
	return h, l, key
}

// TestReadsUnderTheLease: a leader that its followers keep accepting
// serves reads without a round of heartbeats each.
func TestReadsUnderTheLease(t *testing.T) {
	t.Parallel()
	h, l, key := ledKey(t, 0, "v")
	r := h.nodes[l].local(0)
	lease0, verified0 := r.Reads()
	for range 200 {
		if e, ok, err := h.nodes[l].Get(ctx(t), []byte(key)); err != nil || !ok || string(e.Value) != "v" {
			t.Fatalf("GET %s on its leader = %q %v %v", key, e.Value, ok, err)
		}
	}
	lease, verified := r.Reads()
	t.Logf("200 reads: %d under the lease, %d after a round of heartbeats", lease-lease0, verified-verified0)
	if lease-lease0 < 150 {
		t.Fatalf("%d of 200 reads on a leader its followers follow were served under the lease", lease-lease0)
	}
}

// TestLeaseEndsBeforeANewLeaderWrites: a leader cut off from its
// followers serves no read that begins after a new leader has committed a
// write: its lease ends before the followers may elect another. And a
// leader that hands its leadership over stops serving reads under the
// lease at once.
func TestLeaseEndsBeforeANewLeaderWrites(t *testing.T) {
	t.Parallel()
	h, l, key := ledKey(t, 1, "old")
	old := h.nodes[l].local(1)

	// Reads on the old leader, as Node.Get makes them, until the end.
	type read struct {
		start time.Time
		value string
	}
	var mu sync.Mutex
	var served []read
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			start := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			ready := old.ReadReady(ctx) == nil
			cancel()
			if ready {
				e, _ := old.Get([]byte(key))
				mu.Lock()
				served = append(served, read{start, string(e.Value)})
				mu.Unlock()
			}
			time.Sleep(time.Millisecond)
		}
	}()
	for i := range h.nodes {
		if i != l {
			h.links[l].Cut(h.links[i].Addr(), true)
			h.links[i].Cut(h.links[l].Addr(), true)
		}
	}
	cut := time.Now()
	// The others elect a leader and write through it.
	other := h.nodes[(l+1)%3]
	var written time.Time
	eventuallyT(t, 20*time.Second, "a write through the other members", func() bool {
		c, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		ch := make(chan error, 1)
		other.Submit(c, replica.Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte(key), Value: []byte("new")}, Done: func(_ store.Result, err error) { ch <- err }})
		if err := <-ch; err != nil {
			return false
		}
		written = time.Now()
		return true
	})
	time.Sleep(300 * time.Millisecond) // reads the old leader might still serve
	close(stop)
	wg.Wait()
	var afterCut, stale int
	for _, r := range served {
		if r.start.After(cut) {
			afterCut++
		}
		if r.start.After(written) {
			stale++
			t.Errorf("a read that began %v after the new leader's write was acknowledged was served by the old leader: %q", r.start.Sub(written), r.value)
		}
	}
	t.Logf("the cut old leader served %d reads after the cut (the write came %v after it)", afterCut, written.Sub(cut).Round(time.Millisecond))
	if written.Sub(cut) < replica.ReadLease {
		t.Fatalf("a new leader wrote %v after the cut, within the old leader's lease (%v)", written.Sub(cut), replica.ReadLease)
	}

	// A handover: the leader serves no more reads under the lease.
	for i := range h.nodes {
		for j := range h.nodes {
			h.links[i].Cut(h.links[j].Addr(), false)
		}
	}
	var nl int
	eventuallyT(t, 20*time.Second, "one leader of group 1 again", func() bool {
		nl = h.leaderOfGroup(1)
		if nl < 0 {
			return false
		}
		lease0, _ := h.nodes[nl].local(1).Reads()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if h.nodes[nl].local(1).ReadReady(ctx) != nil {
			return false
		}
		lease1, _ := h.nodes[nl].local(1).Reads()
		return lease1 > lease0
	})
	r := h.nodes[nl].local(1)
	r.TransferLeadership("", "")
	lease0, _ := r.Reads()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	r.ReadReady(ctx)
	if lease1, _ := r.Reads(); lease1 != lease0 {
		t.Fatal("a leader that began handing over its leadership served a read under the lease")
	}
}

// TestQuorumReadsTrustNoLease: with QuorumReads every read on a leader
// confirms the leadership with a round of heartbeats.
func TestQuorumReadsTrustNoLease(t *testing.T) {
	t.Parallel()
	h := &harness{t: t, groups: 1}
	for i := range 3 {
		if err := h.tryStart(i, func(c *Config) { c.QuorumReads = true }); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for i := range h.nodes {
			h.stop(i)
		}
	})
	h.awaitReplicas(3)
	var l int
	eventuallyT(t, 10*time.Second, "a leader of group 0", func() bool { l = h.leaderOfGroup(0); return l >= 0 })
	r := h.nodes[l].local(0)
	lease0, verified0 := r.Reads()
	for range 50 {
		if _, _, err := h.nodes[l].Get(ctx(t), []byte("k")); err != nil {
			t.Fatal(err)
		}
	}
	if lease, verified := r.Reads(); lease != lease0 || verified-verified0 < 50 {
		t.Fatalf("with QuorumReads, 50 reads: %d under the lease, %d confirmed", lease-lease0, verified-verified0)
	}
}
