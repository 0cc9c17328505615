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
	t.Parallel()
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
