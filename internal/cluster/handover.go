package cluster

import (
	"context"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// HandOver gives the leadership of every group this node leads, and of
// the metadata group, to another voter that answers and has caught up
// (hashicorp/raft's leadership transfer, to a server named: left to
// itself raft picks the most up-to-date follower, which may be a member
// already stopped, and each such try waits for an election timeout), and
// waits until it leads none or ctx ends. A graceful stop calls it before
// Close: writes to those groups then pause for one transfer instead of
// for the followers to notice a dead leader (seconds). The new leaders
// keep the leadership for balanceAfter before the placement's preference
// may move it back, which outlasts a stop. It reports the groups still
// led (-1 for the metadata group) when it gives up: when ctx ends, or at
// once when no other voter of them answers (the last member of a cluster
// being stopped).
func (n *Node) HandOver(ctx context.Context) ([]int, error) {
	tried := map[int]time.Time{}
	for {
		var led []int
		reachable := false
		// transfer hands a group's leadership over; a data group's goes
		// through its replica (see replica.Group.TransferLeadership).
		try := func(g int, r *raft.Raft, transfer func(raft.ServerID, raft.ServerAddress)) {
			led = append(led, g)
			if time.Since(tried[g]) < handOverRetry {
				reachable = true // a transfer is under way
				return
			}
			id, addr, ok := n.handOverTo(r, g)
			if !ok {
				return
			}
			reachable = true
			tried[g] = time.Now()
			transfer(id, addr) // does not block
		}
		for g, r := range n.Groups() {
			if r.Raft().State() == raft.Leader {
				try(g, r.Raft(), func(id raft.ServerID, addr raft.ServerAddress) { r.TransferLeadership(string(id), string(addr)) })
			}
		}
		if n.meta != nil && n.meta.State() == raft.Leader {
			try(-1, n.meta, func(id raft.ServerID, addr raft.ServerAddress) { n.meta.LeadershipTransferToServer(id, addr) })
		}
		if len(led) == 0 {
			return nil, nil
		}
		if !reachable {
			return led, fmt.Errorf("cluster: no other voter of the %d groups led here answers", len(led))
		}
		select {
		case <-ctx.Done():
			return led, fmt.Errorf("cluster: %d groups still led here when the handover ended: %w", len(led), ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// handOverRetry is how long a transfer is given before another is asked
// for (one that fails, fails within an election timeout).
const handOverRetry = time.Second

// handOverTo picks the voter of r's group (g; -1 the metadata group) to
// hand its leadership to: one that answers and has caught up, else one
// that answers (raft brings it up to date before it hands over).
func (n *Node) handOverTo(r *raft.Raft, g int) (raft.ServerID, raft.ServerAddress, bool) {
	f := r.GetConfiguration()
	if f.Error() != nil {
		return "", "", false
	}
	applied := r.AppliedIndex()
	var behind *raft.Server
	for _, s := range f.Configuration().Servers {
		id := string(s.ID)
		if id == n.cfg.NodeID || s.Suffrage != raft.Voter || !n.alive(id) {
			continue
		}
		if g < 0 {
			return s.ID, s.Address, true
		}
		at, full, ok := n.replicaStatus(id, g)
		if !ok || full {
			continue
		}
		if at+catchUpSlack >= applied {
			return s.ID, s.Address, true
		}
		if behind == nil {
			behind = &s
		}
	}
	if behind != nil {
		return behind.ID, behind.Address, true
	}
	return "", "", false
}
