package cluster

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/meta"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/store"
)

// TestLeaderDeliversWhileItsGroupCannotMove: RF 1; a second member joins
// and goes down before it got its replica (simulated: a member at an
// address nobody answers). The placement now puts a group on it, but the
// group cannot move: n1 stays its only replica and leader and applies
// its writes. n1's own clients must still be notified of those writes (a
// first version of the check that a node's replica is current went by
// the placement alone, and n1 stopped following its own ring; found by
// review).
func TestLeaderDeliversWhileItsGroupCannotMove(t *testing.T) {
	t.Parallel()
	link, err := peer.Listen(peer.Config{NodeID: "n1", Listen: "127.0.0.1:0", Secret: []byte("test-secret-0123456789"), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	defer link.Close()
	ev := make(chan []store.Event, 1000)
	n, err := Start(Config{NodeID: "n1", Dir: t.TempDir(), Link: link, Groups: 2, RF: 1, Logger: quiet(),
		OnEvents: func(e []store.Event) { ev <- append([]store.Event(nil), e...) }})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if err := n.Follow(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if err := n.applyMeta(meta.Op{Kind: meta.OpJoin, Node: meta.Node{ID: "n2", Addr: "127.0.0.1:1", Inc: "x"}}); err != nil {
		t.Fatal(err)
	}
	pl := n.state.Load().Placement()
	g := -1
	for i := range pl {
		if !slices.Contains(pl[i], "n1") {
			g = i
		}
	}
	if g < 0 {
		t.Fatalf("no group placed away from n1: %v", pl)
	}
	key := ""
	for i := 0; ; i++ {
		key = fmt.Sprint("k", i)
		if n.groupOf([]byte(key)) == g {
			break
		}
	}
	time.Sleep(4 * ringCheck) // for the follower to act on the placement, if it would
	if res, err := set(t, n, key, "v"); err != nil || res.Outcome != store.Applied {
		t.Fatalf("write: %+v %v", res, err)
	}
	if r := n.local(g); r == nil || r.Raft().State().String() != "Leader" {
		t.Fatalf("n1 no longer leads group %d", g)
	}
	awaitEvent(t, ev, key) // n1 applied it, the group's only replica and leader: its own clients hear of it
}
