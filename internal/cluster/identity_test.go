package cluster

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mqkv/mqkv/internal/peer"
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
	if err := h.nodes[0].Remove(ctx(t), "n3"); err != nil {
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
