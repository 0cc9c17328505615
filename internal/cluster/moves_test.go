package cluster

import (
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// TestMovesKeepTheGroupsVoters: while a replica moves to a joining node,
// the group keeps its RF voters until the new replica has caught up and
// become a voter. Here the joining node is cut off right after it joined,
// so it never catches up: no group loses a voter because of it. Before,
// the reconciler removed a voter as soon as the newcomer was added as a
// non-voter, and one more node down then left the group without a quorum.
func TestMovesKeepTheGroupsVoters(t *testing.T) {
	h := newHarness(t, 3, 4)
	h.start(3)
	h.links[3].Isolate(true) // n4 joined, then became unreachable
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		for i := 0; i < 3; i++ {
			for g, r := range h.nodes[i].Groups() {
				if r.Raft().State() != raft.Leader {
					continue
				}
				voters, nonvoters := 0, 0
				var desc []string
				for _, s := range r.Raft().GetConfiguration().Configuration().Servers {
					desc = append(desc, fmt.Sprintf("%s:%v", s.ID, s.Suffrage))
					if s.Suffrage == raft.Voter {
						voters++
					} else {
						nonvoters++
					}
				}
				if voters < 3 {
					t.Fatalf("group %d (leader n%d) has %d voters while n4 has not caught up: %v", g, i+1, voters, desc)
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestGroupsTakeWritesWhileJoinersCatchUp: two nodes join a three-node
// cluster and are then cut off from the network. All three original nodes
// are up, so every group (each had those three as voters) still takes
// writes. Before, the reconciler removed original voters while the new
// replicas were still catching up, and a group could end up with voters
// {n3, n4} (n4 unreachable): no leader, every write to its keys failed.
func TestGroupsTakeWritesWhileJoinersCatchUp(t *testing.T) {
	h := newHarness(t, 3, 2)
	h.start(3)
	h.start(4)
	h.links[3].Isolate(true)
	h.links[4].Isolate(true)
	time.Sleep(5 * time.Second)
	for g := 0; g < 2; g++ {
		key := ""
		for i := 0; key == ""; i++ {
			if k := fmt.Sprint("k", i); h.nodes[0].groupOf([]byte(k)) == g {
				key = k
			}
		}
		if _, err := set(t, h.nodes[0], key, "v"); err != nil {
			for i := 0; i < 3; i++ {
				if r := h.nodes[i].local(g); r != nil {
					t.Logf("n%d: %v %+v", i+1, r.Raft().State(), r.Raft().GetConfiguration().Configuration().Servers)
				}
			}
			t.Fatalf("write to group %d with n1, n2, n3 up: %v", g, err)
		}
	}
}
