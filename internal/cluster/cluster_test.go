package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
	"github.com/mqkv/mqkv/internal/testaddr"
)

// harness runs nodes in this process, on real links over loopback.
type harness struct {
	deadTimeout time.Duration
	t           *testing.T
	nodes       []*Node
	links       []*peer.Link
	dirs        []string
	events      []chan []store.Event
	gaps        []chan hlc.Timestamp // what each node's OnEventsGap heard
	groups      int
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newHarness(t *testing.T, n, groups int) *harness {
	h := emptyHarness(t, groups)
	for i := 0; i < n; i++ {
		h.start(i)
	}
	h.awaitReplicas(min(n, 3))
	return h
}

// emptyHarness is a harness of no node yet, whose nodes stop when the
// test ends.
func emptyHarness(t *testing.T, groups int) *harness {
	h := &harness{t: t, groups: groups}
	t.Cleanup(func() {
		for i := range h.nodes {
			h.stop(i)
		}
	})
	return h
}

// start starts node i (again, on its directory, if it ran before).
func (h *harness) start(i int) {
	h.t.Helper()
	if err := h.tryStart(i, nil); err != nil {
		h.t.Fatalf("start n%d: %v", i+1, err)
	}
}

// tryStart starts node i, its configuration changed by edit (if not nil),
// and returns why it could not.
func (h *harness) tryStart(i int, edit func(*Config)) error {
	h.t.Helper()
	for len(h.nodes) <= i {
		h.nodes = append(h.nodes, nil)
		h.links = append(h.links, nil)
		h.dirs = append(h.dirs, h.t.TempDir())
		h.events = append(h.events, make(chan []store.Event, 10000))
		h.gaps = append(h.gaps, make(chan hlc.Timestamp, 100))
	}
	id := fmt.Sprintf("n%d", i+1)
	var listen string
	if h.links[i] != nil {
		listen = h.links[i].Addr() // a restart keeps its address
	} else {
		// Not the kernel's choice: a port from its ephemeral range may
		// be some connection's while the node is stopped (testaddr).
		addr, err := testaddr.Free()
		if err != nil {
			h.t.Fatal(err)
		}
		listen = addr
	}
	link, err := peer.Listen(peer.Config{NodeID: id, Listen: listen, Secret: []byte("test-secret-0123456789"), Logger: quiet()})
	if err != nil {
		h.t.Fatal(err)
	}
	var join []string
	if i > 0 {
		join = []string{h.links[0].Addr()}
		if i == 0 || h.nodes[0] == nil {
			join = []string{h.links[1].Addr()}
		}
	}
	ev, gaps := h.events[i], h.gaps[i]
	cfg := Config{NodeID: id, Dir: h.dirs[i], Link: link, Join: join, Groups: h.groups, RF: 3, Logger: quiet(), DeadNodeTimeout: h.deadTimeout,
		OnEvents:    func(e []store.Event) { ev <- append([]store.Event(nil), e...) },
		OnEventsGap: func(v hlc.Timestamp) { gaps <- v }}
	if edit != nil {
		edit(&cfg)
	}
	node, err := Start(cfg)
	if err != nil {
		link.Close()
		h.links[i] = link // its address, for the next start
		return err
	}
	h.nodes[i], h.links[i] = node, link
	return nil
}

func (h *harness) stop(i int) {
	if h.nodes[i] == nil {
		return
	}
	h.nodes[i].Close()
	h.links[i].Close()
	h.nodes[i] = nil
}

// awaitReplicas waits until every group has rf voters, led by the
// placement's preferred leader.
func (h *harness) awaitReplicas(rf int) {
	h.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if h.settled(rf) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	h.t.Fatalf("groups did not reach %d replicas: %+v", rf, h.any().Status())
}

func (h *harness) any() *Node {
	for _, n := range h.nodes {
		if n != nil {
			return n
		}
	}
	return nil
}

func (h *harness) settled(rf int) bool {
	st := h.any().Status()
	return len(st.Groups) == h.groups && st.Settled(rf, true)
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func set(t *testing.T, n *Node, key, value string) (store.Result, error) {
	return submitAgainIfUnknown(t, n, store.Command{Op: store.OpSet, Key: []byte(key), Value: []byte(value)})
}

// submitAgainIfUnknown submits cmd, and submits it again when an election
// made its outcome unknown (on a loaded machine a group may change leaders
// while a write is in flight). Only for commands that may apply twice, such
// as a plain SET.
func submitAgainIfUnknown(t *testing.T, n *Node, cmd store.Command) (store.Result, error) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		ch := make(chan struct{})
		var res store.Result
		var err error
		n.Submit(ctx(t), replica.Proposal{Cmd: cmd, Done: func(r store.Result, e error) {
			res, err = r, e
			close(ch)
		}})
		<-ch
		if err == nil || !errors.Is(err, replica.ErrOutcomeUnknown) || attempt == 5 {
			return res, err
		}
	}
}

func TestThreeNodesServeEveryKeyFromEveryNode(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 6)
	// Leadership is spread: no node leads everything.
	leads := map[string]int{}
	for _, g := range h.any().Status().Groups {
		leads[g.Leader]++
	}
	if len(leads) < 2 {
		t.Fatalf("leaders %v: not balanced", leads)
	}
	var last hlc.Timestamp
	for i := 0; i < 60; i++ {
		key := fmt.Sprintf("key-%d", i)
		res, err := set(t, h.nodes[i%3], key, fmt.Sprint(i))
		if err != nil || res.Outcome != store.Applied {
			t.Fatalf("set %s via n%d: %+v %v", key, i%3+1, res, err)
		}
		last = res.Version
		for j := 0; j < 3; j++ { // read your write through every node
			e, ok, err := h.nodes[j].Get(ctx(t), []byte(key))
			if err != nil || !ok || string(e.Value) != fmt.Sprint(i) || e.Version != res.Version {
				t.Fatalf("get %s via n%d: %+v %v %v", key, j+1, e, ok, err)
			}
		}
	}
	_ = last
	// Ascend merges the groups in key order.
	var keys []string
	exhausted, err := h.nodes[1].Ascend(ctx(t), []byte("key-"), []byte("key-"), 1000, func(e *store.Entry) bool {
		keys = append(keys, string(e.Key))
		return true
	})
	if err != nil || !exhausted || len(keys) != 60 {
		t.Fatalf("ascend: %d keys, exhausted %v, %v", len(keys), exhausted, err)
	}
	for i := 1; i < len(keys); i++ {
		if keys[i-1] >= keys[i] {
			t.Fatalf("out of order: %s before %s", keys[i-1], keys[i])
		}
	}
	// From the start, with keys before the prefix in every group: the
	// walk begins at the prefix (it began at the first key, and ended
	// there, finding nothing: every scan of the server's own keys after
	// a client id's record missed them all).
	for i := range 8 {
		if res, err := set(t, h.nodes[0], fmt.Sprintf("a-%d", i), "x"); err != nil || res.Outcome != store.Applied {
			t.Fatalf("set: %+v %v", res, err)
		}
	}
	keys = nil
	if _, err := h.nodes[2].Ascend(ctx(t), nil, []byte("key-"), 1000, func(e *store.Entry) bool {
		keys = append(keys, string(e.Key))
		return true
	}); err != nil || len(keys) != 60 {
		t.Fatalf("ascend from the start: %d keys, %v", len(keys), err)
	}
	// A write whose request had no timestamp (a gateway's) and leaves its
	// node for its group's leader carries that node's clock when it asks
	// for it (Stamp): the version is above what the node has seen, which
	// the leader's clock has not.
	n := h.nodes[1]
	var key string
	for i := 0; key == ""; i++ {
		k := fmt.Sprintf("stamped-%d", i)
		if l := n.leaderOf(n.groupOf([]byte(k))); l != "" && l != n.cfg.NodeID {
			key = k
		}
	}
	seen := hlc.Timestamp{Wall: time.Now().UnixMilli() + 3000, Node: "elsewhere"}
	n.Clock().Observe(seen)
	write := func(stamp bool) hlc.Timestamp {
		t.Helper()
		ch := make(chan struct{})
		var res store.Result
		var err error
		n.Submit(ctx(t), replica.Proposal{Cmd: store.Command{Op: store.OpSet, Key: []byte(key), Value: []byte("v")}, Stamp: stamp,
			Done: func(r store.Result, e error) { res, err = r, e; close(ch) }})
		<-ch
		if err != nil || res.Outcome != store.Applied {
			t.Fatalf("set %s via n2 (stamp %v): %+v %v", key, stamp, res, err)
		}
		return res.Version
	}
	if v := write(false); v.Compare(seen) > 0 {
		t.Fatalf("an unstamped write got %v, above %v, which only n2 saw: the test shows nothing", v, seen)
	}
	if v := write(true); v.Compare(seen) <= 0 {
		t.Fatalf("a stamped write forwarded by n2 got %v, not above %v, which n2 saw", v, seen)
	}
}

func TestFailoverKeepsAcknowledgedWrites(t *testing.T) {
	t.Parallel()
	failover(t, newHarness(t, 3, 4), 0) // n1 dies (it led some groups)
}

// TestFailoverOfTheOnlyGroup: a cluster of one group (docs/cluster.md,
// "How many groups") loses the node that leads every key.
func TestFailoverOfTheOnlyGroup(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 1)
	leader := h.any().Status().Groups[0].Leader
	for i, n := range h.nodes {
		if n.cfg.NodeID == leader {
			failover(t, h, i)
			return
		}
	}
	t.Fatalf("group 0 led by %q: no such node", leader)
}

// failover writes through a node, stops node dead, and writes again
// through the others: every acknowledged write is read back.
func failover(t *testing.T, h *harness, dead int) {
	t.Helper()
	via, after := h.nodes[(dead+1)%3], (dead+2)%3
	acked := map[string]string{}
	var mu sync.Mutex
	for i := 0; i < 40; i++ {
		k := fmt.Sprintf("k%d", i)
		if res, err := set(t, via, k, "v1"); err != nil || res.Outcome != store.Applied {
			t.Fatal(err)
		}
		acked[k] = "v1"
	}
	h.stop(dead)
	for i := 0; i < 40; i++ {
		k := fmt.Sprintf("k%d", i)
		deadline := time.Now().Add(15 * time.Second)
		for {
			res, err := set(t, h.nodes[after], k, "v2")
			if err == nil && res.Outcome == store.Applied {
				mu.Lock()
				acked[k] = "v2"
				mu.Unlock()
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("write %s after failover: %v", k, err)
			}
		}
	}
	for k, v := range acked {
		e, ok, err := via.Get(ctx(t), []byte(k))
		if err != nil || !ok || string(e.Value) != v {
			t.Fatalf("%s: %+v %v %v, want %s", k, e, ok, err, v)
		}
	}
}

// TestEventsReachEveryFollowingNode: a node that follows gets every change
// made through any node, once, in order per key, across a leader change.
func TestEventsReachEveryFollowingNode(t *testing.T) {
	t.Parallel()
	// Four nodes, RF 3: the follower (n4) holds some groups and streams
	// the others from other nodes.
	h := newHarness(t, 4, 4)
	if len(h.nodes[3].Groups()) == 4 {
		t.Fatal("n4 holds every group: the test needs it to stream some")
	}
	if err := h.nodes[3].Follow(ctx(t)); err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{}
	write := func(via int, k, v string) {
		t.Helper()
		for {
			res, err := set(t, h.nodes[via], k, v)
			if err == nil && res.Outcome == store.Applied {
				want[k] = append(want[k], v)
				return
			}
		}
	}
	for i := 0; i < 30; i++ {
		write(i%2, fmt.Sprintf("w%d", i%5), fmt.Sprint(i))
	}
	// A leader change: every group's leader hands over.
	for _, r := range h.nodes[0].Groups() {
		r.TransferLeadership("", "").Error()
	}
	for i := 30; i < 60; i++ {
		write(i%2, fmt.Sprintf("w%d", i%5), fmt.Sprint(i))
	}
	// Each event once (by its version), and each key's values in the
	// order written. A SET the set helper sent again because an
	// election made its outcome unknown may have applied twice: two
	// versions of one value in a row, both real changes.
	got := map[string][]string{}
	seen := map[string]bool{} // key@version
	collapsed := func(vs []string) []string {
		var out []string
		for _, v := range vs {
			if len(out) == 0 || out[len(out)-1] != v {
				out = append(out, v)
			}
		}
		return out
	}
	complete := func() bool {
		for k, vs := range want {
			if fmt.Sprint(collapsed(got[k])) != fmt.Sprint(vs) {
				return false
			}
		}
		return true
	}
	take := func(evs []store.Event) {
		for _, e := range evs {
			id := string(e.Key) + "@" + e.Version.String()
			if seen[id] {
				t.Fatalf("event %s delivered twice", id)
			}
			seen[id] = true
			got[string(e.Key)] = append(got[string(e.Key)], string(e.Value))
		}
	}
	deadline := time.After(10 * time.Second)
	for !complete() {
		select {
		case evs := <-h.events[3]:
			take(evs)
		case <-deadline:
			t.Fatalf("events after 10 s: %v, want %v", got, want)
		}
	}
	select {
	case evs := <-h.events[3]:
		t.Fatalf("extra events %+v", evs)
	case <-time.After(300 * time.Millisecond):
	}
}

// TestDeadNodeIsRemovedAfterTimeout: with --dead-node-timeout, a member
// that stops answering is removed by the metadata leader and its
// replicas are rebuilt on the others; writes go on throughout.
func TestDeadNodeIsRemovedAfterTimeout(t *testing.T) {
	t.Parallel()
	// Long enough that a live member held up on a loaded machine (all of
	// CI's tests side by side) is not taken for dead with n4: at 2 s, n3
	// was once removed too.
	h := &harness{t: t, groups: 4, deadTimeout: 6 * time.Second}
	for i := range 4 {
		h.start(i)
	}
	t.Cleanup(func() {
		for i := range h.nodes {
			h.stop(i)
		}
	})
	h.awaitReplicas(3)
	h.stop(3) // n4 dies
	deadline := time.Now().Add(60 * time.Second)
	for {
		st := h.any().Status()
		if len(st.Nodes) == 3 && st.Settled(3, true) {
			for _, g := range st.Groups {
				if slices.Contains(g.Replicas, "n4") {
					t.Fatalf("group %d still holds n4: %+v", g.ID, g)
				}
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n4 not removed and replaced: %+v", st)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if res, err := set(t, h.nodes[0], "after", "v"); err != nil || res.Outcome != store.Applied {
		t.Fatalf("write after the removal: %+v %v", res, err)
	}
}

// TestStatusIsTheSameFromEveryNode: a node that holds no replica of a
// group learns its leader only from requests it forwarded; its status
// must still show the group's real leader and replicas (it showed the
// group as migrating, without replicas, for as long as its hint was
// stale).
func TestStatusIsTheSameFromEveryNode(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 5, 5)
	var want []GroupStatus
	eventuallyT(t, 10*time.Second, "n1 to see a settled cluster", func() bool {
		st := h.nodes[0].Status()
		want = st.Groups
		return st.Settled(3, false)
	})
	for i, n := range h.nodes {
		held := 0
		for _, g := range want {
			if slices.Contains(g.Replicas, n.cfg.NodeID) {
				held++
			}
		}
		if held == len(want) {
			t.Fatalf("n%d holds every group: the test needs a node without some", i+1)
		}
		for range 3 { // the rotation through the placement differs each time
			// Leadership may move meanwhile (a loaded machine), so the
			// leader is checked to be one of the group's replicas, and a
			// group between leaders (an election, once seen under -race
			// with other packages' tests) is asked again.
			got := n.Status()
			for deadline := time.Now().Add(10 * time.Second); !got.Settled(3, false); got = n.Status() {
				if time.Now().After(deadline) {
					t.Fatalf("n%d (holding %d of %d groups) sees an unsettled cluster: %+v", i+1, held, len(want), got.Groups)
				}
				time.Sleep(20 * time.Millisecond)
			}
			for g := range want {
				gs := got.Groups[g]
				if !slices.Contains(gs.Replicas, gs.Leader) || !sameSet(gs.Replicas, want[g].Replicas) {
					t.Fatalf("n%d sees group %d as %+v, n1 as %+v", i+1, g, gs, want[g])
				}
			}
		}
	}
}

func sameSet(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

// TestStaleHintNamingItselfIsIgnored: a node that once learnt it leads a
// group (a peer's not-leader answer naming it) and then lost its replica
// of that group to a migration must still reach the group's leader. The
// stale hint made it wait for a local replica that would never come:
// every write and read of the group through that node failed after the
// request's deadline, and its status showed the group without a leader.
func TestStaleHintNamingItselfIsIgnored(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 4, 4)
	var n *Node
	g := -1
	for _, node := range h.nodes {
		for grp := range h.groups {
			if node.local(grp) == nil {
				n, g = node, grp
			}
		}
	}
	if n == nil {
		t.Fatal("every node holds every group")
	}
	n.hint(g, n.cfg.NodeID)
	key := ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprint("k", i); n.groupOf([]byte(k)) == g {
			key = k
		}
	}
	if res, err := set(t, n, key, "v"); err != nil || res.Outcome != store.Applied {
		t.Fatalf("write through %s to group %d: %+v %v", n.cfg.NodeID, g, res, err)
	}
	if e, ok, err := n.Get(ctx(t), []byte(key)); err != nil || !ok || string(e.Value) != "v" {
		t.Fatalf("read through %s: %+v %v %v", n.cfg.NodeID, e, ok, err)
	}
	n.hint(g, n.cfg.NodeID)
	if st := n.Status(); st.Groups[g].Leader == "" || st.Groups[g].Migrating {
		t.Fatalf("status of group %d from %s: %+v", g, n.cfg.NodeID, st.Groups[g])
	}
}

// TestStatusWithoutQuorum: with two of three nodes down no group has a
// leader; the survivor's status says so and still lists each group's
// replicas as its own replica knows them (not "migrating" with none).
func TestStatusWithoutQuorum(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	h.stop(1)
	h.stop(2)
	// A leader may serve its read lease out (replica.ReadLease), and
	// leads until then; no longer.
	eventuallyT(t, 10*time.Second, "no group to report a leader", func() bool {
		for _, g := range h.nodes[0].Status().Groups {
			if !sameSet(g.Replicas, []string{"n1", "n2", "n3"}) || g.Migrating {
				t.Fatalf("group %d without quorum: %+v", g.ID, g)
			}
			if g.Leader != "" {
				return false
			}
		}
		return true
	})
}

// TestWritesFollowALeadershipTransfer: a write that the leader's raft
// refuses because a leadership transfer is under way (it never enters the
// log) is sent on to the next leader, not answered with an error. The
// placement moves leaders this way in normal operation.
func TestWritesFollowALeadershipTransfer(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 1)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var written atomic.Int64
	errs := make(chan error, 100)
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				_, err := set(t, h.nodes[w%3], fmt.Sprintf("t%d", w), fmt.Sprint(i))
				switch {
				case err == nil:
					written.Add(1)
				case errors.Is(err, replica.ErrOutcomeUnknown):
					// Leadership lost with the entry in flight: its fate
					// is for the client to find out, as documented.
				default:
					errs <- err
					return
				}
			}
		}()
	}
	for round := 0; round < 6; round++ {
		before := written.Load()
		for deadline := time.Now().Add(20 * time.Second); written.Load() < before+20; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: writes stopped at %d", round, written.Load())
			}
		}
		for _, n := range h.nodes {
			if r := n.local(0); r != nil {
				if _, leads := r.Leader(); leads {
					r.TransferLeadership("", "").Error()
				}
			}
		}
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("a write failed across a leadership transfer: %v", err)
	}
}
