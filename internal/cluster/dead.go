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
// leader judges, so one node decides for the cluster; it probes each
// member over the node link about once a second, and a member is given
// the whole timeout from the moment this node started judging, so a new
// metadata leader removes nobody on its first look.
//
// Liveness comes from these probes, not from gossip: the membership is
// the metadata group's, and one port carries all node traffic.
type deadWatch struct {
	mu      sync.Mutex
	seen    map[string]time.Time // member → last answer (or start of judging)
	probed  map[string]time.Time // member → last probe sent
	probing map[string]bool
	removed map[string]bool // removals asked, not yet applied
}

const probeEvery = time.Second

// judge is called by the reconcile loop while this node leads the
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
		last, ok := d.seen[m.ID]
		if !ok {
			d.seen[m.ID] = now
			continue
		}
		if now.Sub(last) > timeout && !d.removed[m.ID] {
			d.removed[m.ID] = true
			n.log.Warn("removing a member that has not answered for --dead-node-timeout; its replicas are replaced from the others",
				"node", m.ID, "silent_for", now.Sub(last).Round(time.Second), "timeout", timeout)
			go func(id string) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if err := n.Remove(ctx, id); err != nil {
					n.log.Warn("removing a dead member failed; will try again", "node", id, "error", err)
					d.mu.Lock()
					delete(d.removed, id)
					d.mu.Unlock()
				}
			}(m.ID)
			continue
		}
		if d.probing[m.ID] || now.Sub(last) < probeEvery || now.Sub(d.probed[m.ID]) < probeEvery {
			continue
		}
		d.probing[m.ID], d.probed[m.ID] = true, now
		go func(id string) {
			ctx, cancel := context.WithTimeout(context.Background(), probeEvery)
			defer cancel()
			var resp callResp
			err := n.call(ctx, id, callReq{Op: opStatus}, &resp)
			d.mu.Lock()
			defer d.mu.Unlock()
			delete(d.probing, id)
			if err == nil {
				d.seen[id] = time.Now()
			}
		}(m.ID)
	}
	for id := range d.seen { // forget who left
		if !members[id] {
			delete(d.seen, id)
			delete(d.probed, id)
			delete(d.removed, id)
		}
	}
}

// forget resets the judging, when this node stops leading the metadata
// group: a later term starts afresh.
func (d *deadWatch) forget() {
	d.mu.Lock()
	clear(d.seen)
	d.mu.Unlock()
}

func newDeadWatch() *deadWatch {
	return &deadWatch{seen: map[string]time.Time{}, probed: map[string]time.Time{}, probing: map[string]bool{}, removed: map[string]bool{}}
}
