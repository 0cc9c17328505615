package cluster

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/testaddr"
)

// A crash while the first node creates the cluster (some groups made,
// others not) must not leave groups that never elect a leader: the
// restart makes the cluster again. It never served, so nothing is lost.
func TestCreationInterruptedIsRedone(t *testing.T) {
	t.Parallel()
	const groups = 4
	// -1: the metadata made, no group yet; groups: every group made and
	// the cluster recorded, the creation not yet marked complete.
	for _, crashAt := range []int{-1, 1, groups} {
		t.Run(fmt.Sprint("crash at ", crashAt), func(t *testing.T) {
			dir := t.TempDir()
			start := func(addr string, hook func(int) error) (*Node, *peer.Link, error) {
				link, err := peer.Listen(peer.Config{NodeID: "n1", Listen: addr, Secret: []byte("test-secret-0123456789"), Logger: quiet()})
				if err != nil {
					t.Fatal(err)
				}
				n, err := Start(Config{NodeID: "n1", Dir: dir, Link: link, Groups: groups, RF: 3, Logger: quiet(), createHook: hook})
				if err != nil {
					link.Close()
				}
				return n, link, err
			}
			crashed := false
			addr, err := testaddr.Free() // the restart below comes back at it
			if err != nil {
				t.Fatal(err)
			}
			_, link, err := start(addr, func(g int) error {
				if g == crashAt {
					crashed = true
					return errors.New("simulated crash")
				}
				return nil
			})
			if err == nil || !crashed {
				t.Fatalf("creation went on past the simulated crash: %v", err)
			}
			n, link, err := start(link.Addr(), nil)
			if err != nil {
				t.Fatalf("restart: %v", err)
			}
			t.Cleanup(func() { n.Close(); link.Close() })
			seen := map[int]bool{}
			for i := 0; len(seen) < groups; i++ {
				key := fmt.Sprint("k", i)
				g := n.groupOf([]byte(key))
				if seen[g] {
					continue
				}
				seen[g] = true
				if _, err := set(t, n, key, "v"); err != nil {
					t.Fatalf("group %d takes no write after the restart: %v", g, err)
				}
			}
		})
	}
}

// A node told to join while the first node is still creating the cluster
// waits for it, instead of giving up (nodes started together, as by a
// compose file, do this).
func TestJoinWaitsForTheCreation(t *testing.T) {
	t.Parallel()
	l1, l2 := listenLink(t, "n1"), listenLink(t, "n2")
	joined := make(chan error, 1)
	var n2 *Node
	hook := func(g int) error {
		if g != 1 {
			return nil
		}
		go func() {
			n, err := Start(Config{NodeID: "n2", Dir: t.TempDir(), Link: l2, Join: []string{l1.Addr()}, Groups: 4, RF: 3, Logger: quiet()})
			n2 = n
			joined <- err
		}()
		// Give the joiner time for several tries while the creation
		// cannot take it.
		select {
		case err := <-joined:
			t.Errorf("joined a cluster still being created: %v", err)
			joined <- err
		case <-time.After(time.Second):
		}
		return nil
	}
	n1, err := Start(Config{NodeID: "n1", Dir: t.TempDir(), Link: l1, Groups: 4, RF: 3, Logger: quiet(), createHook: hook})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n1.Close() })
	if err := <-joined; err != nil {
		t.Fatalf("the joiner gave up: %v", err)
	}
	t.Cleanup(func() { n2.Close() })
	if st := n2.state.Load(); st == nil || len(st.Nodes) != 2 {
		t.Fatalf("the joiner's metadata: %+v", st)
	}
}

// Nodes started together, as by a compose file: the joiner's first calls
// reach the first node before its metadata group exists. It must wait,
// not give up ("not a cluster member").
func TestNodesStartedTogether(t *testing.T) {
	t.Parallel()
	for i := 0; i < 3; i++ {
		l1, l2 := listenLink(t, "n1"), listenLink(t, "n2")
		joined := make(chan error, 1)
		go func() {
			n, err := Start(Config{NodeID: "n2", Dir: t.TempDir(), Link: l2, Join: []string{l1.Addr()}, Groups: 2, RF: 3, Logger: quiet()})
			if err == nil {
				t.Cleanup(func() { n.Close() })
			}
			joined <- err
		}()
		n1, err := Start(Config{NodeID: "n1", Dir: t.TempDir(), Link: l1, Groups: 2, RF: 3, Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n1.Close() })
		if err := <-joined; err != nil {
			t.Fatalf("round %d: the joiner started with the first node gave up: %v", i, err)
		}
	}
}

// listenLink opens a node link for id on a free loopback port, closed
// when the test ends.
func listenLink(t *testing.T, id string) *peer.Link {
	t.Helper()
	link, err := peer.Listen(peer.Config{NodeID: id, Listen: "127.0.0.1:0", Secret: []byte("test-secret-0123456789"), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { link.Close() })
	return link
}
