package cluster

import (
	"context"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/meta"
)

// deadWatch removes a member that has not answered for DeadNodeTimeout
// (mqkv serve --dead-node-timeout), as `mqkv cluster remove` would: its
// replicas are then replaced from the survivors. Only the metadata
// leader judges, so one node decides for the cluster, from the answers to
// its probes (see health); a member is given the whole timeout from the
// moment this node started judging, so a new metadata leader removes
// nobody on its first look.
//
// Liveness comes from these probes, not from gossip: the membership is
// the metadata group's, and one port carries all node traffic.
type deadWatch struct {
	mu      sync.Mutex
	since   map[string]time.Time // member → when this node started judging it
	removed map[string]bool      // removals asked, not yet applied
}

// judgeLiveness is called by the reconcile loop while this node leads the
// metadata group.
func (n *Node) judgeLiveness(d *deadWatch, st *meta.State) {
	timeout := n.cfg.DeadNodeTimeout
	if timeout <= 0 {
		return
	}
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	members := map[string]bool{}
	for _, m := range st.Nodes {
		if m.ID == n.cfg.NodeID {
			continue
		}
		members[m.ID] = true
		since, ok := d.since[m.ID]
		if !ok {
			d.since[m.ID] = now
			continue
		}
		last := since
		if seen, ok := n.health.lastSeen(m.ID); ok && seen.After(last) {
			last = seen
		}
		if now.Sub(last) <= timeout || d.removed[m.ID] {
			continue
		}
		d.removed[m.ID] = true
		n.log.Warn("removing a member that has not answered for --dead-node-timeout; its replicas are replaced from the others",
			"node", m.ID, "silent_for", now.Sub(last).Round(time.Second), "timeout", timeout)
		go func(id string) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := n.Remove(ctx, id, true); err != nil {
				n.log.Warn("removing a dead member failed; will try again", "node", id, "error", err)
				d.mu.Lock()
				delete(d.removed, id)
				d.mu.Unlock()
			}
		}(m.ID)
	}
	for id := range d.since { // forget who left
		if !members[id] {
			delete(d.since, id)
			delete(d.removed, id)
		}
	}
}

// forget resets the judging, when this node stops leading the metadata
// group: a later term starts afresh.
func (d *deadWatch) forget() {
	d.mu.Lock()
	clear(d.since)
	d.mu.Unlock()
}

func newDeadWatch() *deadWatch {
	return &deadWatch{since: map[string]time.Time{}, removed: map[string]bool{}}
}
