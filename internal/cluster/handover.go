package cluster

import (
	"context"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// HandOver gives the leadership of every group this node leads, and of
// the metadata group, to another voter (hashicorp/raft's leadership
// transfer, to the most up-to-date follower), and waits until it leads
// none or ctx ends. A graceful stop calls it before Close: writes to
// those groups then pause for one transfer (an election without the wait
// for a missed heartbeat) instead of for the followers to notice a dead
// leader (seconds). The new leaders keep the leadership for balanceAfter
// before the placement's preference may move it back, which outlasts a
// stop. It reports the groups still led when ctx ended (-1 for the
// metadata group): with no other voter up, nothing can be handed over.
func (n *Node) HandOver(ctx context.Context) ([]int, error) {
	for {
		var led []int
		reachable := false // another voter of a group still led answers
		for g, r := range n.Groups() {
			if r.Raft().State() == raft.Leader {
				led = append(led, g)
				reachable = reachable || n.anotherVoterAnswers(r.Raft())
				// Does not block; while a transfer runs, another is
				// refused (ErrLeadershipTransferInProgress); one that
				// failed is tried again.
				r.Raft().LeadershipTransfer()
			}
		}
		if n.meta != nil && n.meta.State() == raft.Leader {
			led = append(led, -1)
			reachable = reachable || n.anotherVoterAnswers(n.meta)
			n.meta.LeadershipTransfer()
		}
		if len(led) == 0 {
			return nil, nil
		}
		if !reachable {
			// The last member of a cluster being stopped, say: nobody
			// to hand over to, and nothing to wait for.
			return led, fmt.Errorf("cluster: no other voter of the %d groups led here answers", len(led))
		}
		select {
		case <-ctx.Done():
			return led, fmt.Errorf("cluster: %d groups still led here when the handover ended (no other voter took them): %w", len(led), ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// anotherVoterAnswers says whether a voter of r's group other than this
// node answers (see alive).
func (n *Node) anotherVoterAnswers(r *raft.Raft) bool {
	f := r.GetConfiguration()
	if f.Error() != nil {
		return false
	}
	for _, s := range f.Configuration().Servers {
		if id := string(s.ID); id != n.cfg.NodeID && s.Suffrage == raft.Voter && n.alive(id) {
			return true
		}
	}
	return false
}
