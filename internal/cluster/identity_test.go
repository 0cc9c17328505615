package cluster

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/meta"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/testaddr"
)

// startAt starts node id on dir with a link at listen, joining through
// join; the node is closed at the end of the test.
func startAt(t *testing.T, id, dir, listen string, join []string) (*Node, error) {
	t.Helper()
	link, err := peer.Listen(peer.Config{NodeID: id, Listen: listen, Secret: []byte("test-secret-0123456789"), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	n, err := Start(Config{NodeID: id, Dir: dir, Link: link, Join: join, Groups: 2, RF: 3, Logger: quiet()})
	if err != nil {
		link.Close()
		return nil, err
	}
	t.Cleanup(func() { n.Close(); link.Close() })
	return n, nil
}

func members(n *Node) []string {
	var out []string
	for _, m := range n.state.Load().Nodes {
		out = append(out, m.ID+"@"+m.Addr)
	}
	return out
}

// TestJoinRefusesAnotherClustersData: a node whose data directory belongs
// to one cluster, started with --join to another, is refused with a clear
// error before anything changes: before, it was taken in, its groups took
// the numbers of the other cluster's and the two mixed, losing keys.
func TestJoinRefusesAnotherClustersData(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 1, 2)
	before := members(h.nodes[0])
	dir := t.TempDir()
	x, err := startAt(t, "x1", dir, "127.0.0.1:0", nil) // a cluster of its own
	if err != nil {
		t.Fatal(err)
	}
	if _, err := set(t, x, "k", "v"); err != nil {
		t.Fatal(err)
	}
	x.Close()
	_, err = startAt(t, "x1", dir, "127.0.0.1:0", []string{h.links[0].Addr()})
	if err == nil || !strings.Contains(err.Error(), "another cluster") || !strings.Contains(err.Error(), "empty data directory") {
		t.Fatalf("joined with another cluster's data: %v", err)
	}
	if now := members(h.nodes[0]); !slicesEqual(now, before) {
		t.Fatalf("members %v, were %v", now, before)
	}
}

// TestWipedMemberIsRefusedUntilRemoved: a member whose data is lost
// (directory wiped) and that is started again empty is refused under its
// old id (it would vote in groups without the log it acknowledged) and
// under a new id at the old address (raft refused the duplicate address
// only after the member was recorded: the node crashed, and the cluster
// kept a phantom member). After `cluster remove` of the old id it joins.
func TestWipedMemberIsRefusedUntilRemoved(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	addr := h.links[2].Addr()
	h.stop(2)
	before := members(h.nodes[0])
	_, err := startAt(t, "n3", t.TempDir(), addr, []string{h.links[0].Addr()})
	if err == nil || !strings.Contains(err.Error(), "already a member") || !strings.Contains(err.Error(), "mqkv cluster remove n3") {
		t.Fatalf("an empty node joined under a member's id: %v", err)
	}
	_, err = startAt(t, "n9", t.TempDir(), addr, []string{h.links[0].Addr()})
	if err == nil || !strings.Contains(err.Error(), "member n3's") {
		t.Fatalf("a node joined at a member's address: %v", err)
	}
	if now := members(h.nodes[0]); !slicesEqual(now, before) {
		t.Fatalf("members %v, were %v", now, before)
	}
	if err := h.nodes[0].Remove(ctx(t), "n3", false); err != nil {
		t.Fatal(err)
	}
	if _, err := startAt(t, "n9", t.TempDir(), addr, []string{h.links[0].Addr()}); err != nil {
		t.Fatalf("after removing n3: %v", err)
	}
}

// TestCopiedMemberIsRefusedWhileTheOriginalRuns: a copy of a running
// member's data directory, started at another address with --join, is
// refused: before, it took the member's place (its address) while the
// original went on, and groups lost their quorum.
func TestCopiedMemberIsRefusedWhileTheOriginalRuns(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	h.stop(2)
	copyDir(t, h.dirs[2], filepath.Join(t.TempDir(), "copy"))
	h.start(2)
	before := members(h.nodes[0])
	_, err := startAt(t, "n3", filepath.Join(filepath.Dir(h.dirs[2]), "copy"), "127.0.0.1:0", []string{h.links[0].Addr()})
	if err == nil || !strings.Contains(err.Error(), "is running at") {
		t.Fatalf("a copy of a running member joined: %v", err)
	}
	if now := members(h.nodes[0]); !slicesEqual(now, before) {
		t.Fatalf("members %v, were %v", now, before)
	}
}

func slicesEqual(a, b []string) bool { return strings.Join(a, ",") == strings.Join(b, ",") }

func copyDir(t *testing.T, from, to string) {
	t.Helper()
	err := filepath.WalkDir(from, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(from, path)
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(to, rel), 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(to, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestMemberChangesItsAdvertisedAddress: a member restarted on its
// own data, with --join, on the same listener but a new advertised
// address (an IP replaced by a host name that resolves to it) is the same
// process at both addresses. The leader's opWho probe of the old address
// is answered by the restarted node itself, and the join is refused as "a
// copy of its data directory": the node could not start (found by
// review). The probe now compares incarnations.
func TestMemberChangesItsAdvertisedAddress(t *testing.T) {
	if raceDetector {
		// hashicorp/raft (v1.7.3 and v1.8.0) reads a follower's peer
		// without its lock while a new address is written there
		// (updateLastAppended against startStopReplication; upstream
		// hashicorp/raft#681, fix open in #682): the race detector
		// fails every test running beside this one now and then. The
		// read is of the server id, which an address change leaves as
		// it is. .ci/run runs this test without -race.
		t.Skip("hashicorp/raft#681: a data race in raft itself when a member's address changes")
	}
	t.Parallel()
	h := newHarness(t, 3, 2)
	old := h.links[2].Addr() // 127.0.0.1:P
	h.stop(2)
	_, port, _ := net.SplitHostPort(old)
	link, err := peer.Listen(peer.Config{NodeID: "n3", Listen: old, Advertise: "localhost:" + port,
		Secret: []byte("test-secret-0123456789"), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	n, err := Start(Config{NodeID: "n3", Dir: h.dirs[2], Link: link, Join: []string{h.links[0].Addr()}, Groups: 2, RF: 3, Logger: quiet()})
	if err != nil {
		link.Close()
		t.Fatalf("the member restarted with a new advertised address of the same listener was refused: %v", err)
	}
	n.Close()
	link.Close()
}

// TestJoinerStoppedBeforeItLearnedTheMetadata: a new node's join is
// committed, and the node stops before the metadata reached it (a crash,
// Ctrl-C, or join()'s 60 s wait for the metadata timing out): it holds
// nothing, not even the metadata. Started again (new process, new
// incarnation) on its empty directory it is refused as "a node without
// data claiming a member's id", although it never held a replica.
// Simulated: the join op the first process sent is applied at the
// metadata leader, then the node starts. (Found by review; a node keeps
// its incarnation on disk until it knows its cluster.)
func TestJoinerStoppedBeforeItLearnedTheMetadata(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	leader := h.metaLeader()
	addr, err := testaddr.Free()
	if err != nil {
		t.Fatal(err)
	}
	// The first process kept its incarnation in the directory and its
	// join was committed; it never heard back.
	dir := t.TempDir()
	inc := randomID()
	if err := journal.WriteFileSync(dir, incarnationFile, []byte(inc+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := leader.applyMeta(meta.Op{Kind: meta.OpJoin, Checked: true, Fresh: true,
		Node: meta.Node{ID: "n4", Addr: addr, Inc: inc, ProtoMin: ProtocolMin, ProtoMax: ProtocolMax}}); err != nil {
		t.Fatal(err)
	}
	// The node is started again, on its directory, same address.
	if _, err := startAt(t, "n4", dir, addr, []string{h.links[0].Addr()}); err != nil {
		t.Fatalf("a joiner that stopped before learning the metadata cannot start again: %v", err)
	}
}

// TestRefusedJoinIsNotLogged: the metadata leader judges a checked join
// before it proposes it: one refused only inside Apply stayed in the log,
// and a node of a release before the checks (during an upgrade) applied
// it, so the memberships differed (found by review).
func TestRefusedJoinIsNotLogged(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 1, 2)
	n := h.nodes[0]
	// The leader's first change of a term appends a barrier (see
	// metaHere): counted before.
	if err := n.meta.Barrier(5 * time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	n.metaReadyTerm.Store(n.meta.CurrentTerm())
	before := n.meta.LastIndex()
	resp := n.metaHere(meta.Op{Kind: meta.OpJoin, Checked: true, Fresh: true, Node: meta.Node{ID: "n9", Addr: h.links[0].Addr(), Inc: "x", ProtoMin: ProtocolMin, ProtoMax: ProtocolMax}})
	if resp.Kind != errOther || !strings.Contains(resp.Err, "address") {
		t.Fatalf("a join at a member's address: %+v", resp)
	}
	if after := n.meta.LastIndex(); after != before {
		t.Fatalf("the refused join went into the metadata log (last index %d, was %d)", after, before)
	}
}

// TestLegacyClusterIsNamedOnceEveryMemberCan: a cluster made by a release
// before ids is named (OpName) only once every member answers opWho: a
// member of the earlier release would ignore the name, and its metadata
// snapshots would bring the cluster back without one.
func TestLegacyClusterIsNamedOnceEveryMemberCan(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	leader := h.metaLeader()
	st := leader.metaFSM.State()
	st.ID = ""
	withOld := st.Clone()
	withOld.Nodes = append(withOld.Nodes, meta.Node{ID: "old", Addr: "127.0.0.1:1"}) // nobody answers there
	before := leader.meta.LastIndex()
	leader.nameCluster(withOld)
	if after := leader.meta.LastIndex(); after != before {
		t.Fatalf("named while a member did not answer (last index %d, was %d)", after, before)
	}
	leader.nameCluster(st)
	if after := leader.meta.LastIndex(); after != before+1 {
		t.Fatalf("not named with every member answering (last index %d, was %d)", after, before)
	}
}

// metaLeader returns the node that leads the metadata group, waiting
// for one while an election runs (under CI's load one did, right after
// the harness started: "no metadata leader").
func (h *harness) metaLeader() *Node {
	h.t.Helper()
	var leader *Node
	eventuallyT(h.t, 10*time.Second, "a metadata leader", func() bool {
		for _, n := range h.nodes {
			if n != nil && n.meta.State() == raft.Leader {
				leader = n
				return true
			}
		}
		return false
	})
	return leader
}

// TestLostJournalDoesNotMakeANewCluster: a member whose journal is gone
// (the metadata and every group's log with it) but whose directory still
// names its cluster is refused with the damage error; it created a new
// cluster over its data before, and groups without a snapshot came back
// empty (found by review).
func TestLostJournalDoesNotMakeANewCluster(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	x, err := startAt(t, "x1", dir, "127.0.0.1:0", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := set(t, x, "k", "v"); err != nil {
		t.Fatal(err)
	}
	id := x.state.Load().ID
	x.Close()
	if err := os.RemoveAll(filepath.Join(dir, "journal")); err != nil {
		t.Fatal(err)
	}
	_, err = startAt(t, "x1", dir, "127.0.0.1:0", nil)
	var damaged *replica.DamagedError
	if !errors.As(err, &damaged) || !strings.Contains(err.Error(), id) {
		t.Fatalf("started over a member's data without its journal: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, clusterIDFile)); strings.TrimSpace(string(b)) != id {
		t.Fatalf("the recorded cluster id is now %q, was %q", b, id)
	}
}

// TestMembersRestartedFarApartFormTheirCluster: after the whole cluster
// stopped, a member started alone waits for the others however long they
// take, and goes on once a quorum is up. Each gave up after 30 s, so
// members restarted more than 30 s apart never formed a quorum (found by
// review); here the wait's period is cut to 100 ms and the first member
// waits ten of them alone.
func TestMembersRestartedFarApartFormTheirCluster(t *testing.T) {
	defer func(d time.Duration) { reopenWait = d }(reopenWait)
	reopenWait = 100 * time.Millisecond
	dirs := []string{t.TempDir(), t.TempDir(), t.TempDir()}
	var addrs []string
	var nodes []*Node
	for i, dir := range dirs {
		var join []string
		if i > 0 {
			join = addrs[:1]
		}
		n, err := startAt(t, fmt.Sprintf("n%d", i+1), dir, "127.0.0.1:0", join)
		if err != nil {
			t.Fatal(err)
		}
		nodes, addrs = append(nodes, n), append(addrs, n.link.Addr())
	}
	for len(nodes[0].state.Load().Placement()[0]) < 3 {
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := set(t, nodes[0], "k", "v"); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		n.Close()
		n.link.Close()
	}
	type started struct {
		n   *Node
		err error
	}
	first := make(chan started, 1)
	go func() {
		n, err := startAt(t, "n1", dirs[0], addrs[0], nil)
		first <- started{n, err}
	}()
	select {
	case s := <-first:
		t.Fatalf("n1, alone, did not wait for its cluster: %v", s.err)
	case <-time.After(10 * reopenWait):
	}
	n2, err := startAt(t, "n2", dirs[1], addrs[1], addrs[:1])
	if err != nil {
		t.Fatal(err)
	}
	s := <-first
	if s.err != nil {
		t.Fatal(s.err)
	}
	// Start returns once reopenQuick has passed, serving "starting"
	// until the members have met (a CI run's Get came before): wait for
	// both to serve, which also ends their reopening (it reads
	// reopenWait, which the deferred reset writes).
	eventuallyT(t, 30*time.Second, "n1 and n2 serving", func() bool { return s.n.Ready() && n2.Ready() })
	if e, ok, err := s.n.Get(ctx(t), []byte("k")); err != nil || !ok || string(e.Value) != "v" {
		t.Fatalf("k after the restarts: %q %v %v", e.Value, ok, err)
	}
}

// TestRestartWithStaleJoinWhileClusterIsUp: n3 restarts on its data with
// --join naming an address where no member listens any more (a member
// since removed, the flag kept in a unit file) while its cluster is up: it
// comes back through the members its own metadata knows. It waited for
// ever, asking only the --join address (found by review).
func TestRestartWithStaleJoinWhileClusterIsUp(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 3, 2)
	addr := h.links[2].Addr()
	h.stop(2)
	done := make(chan error, 1)
	go func() {
		_, err := startAt(t, "n3", h.dirs[2], addr, []string{"127.0.0.1:1"})
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("n3 still waiting after 20 s although its cluster is up")
	}
}
