package cluster

import (
	"context"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/meta"
)

// health follows whether each member answers: every node probes every
// other member about once a second over the node link (a call each, so
// it also shows the link works end to end), and says at info when one
// stops answering and when it is back. Who is up decides where a leader
// hands its group over (see handoverTarget), and, on the metadata leader,
// who is removed as dead (see deadWatch).
//
// Members' links are probed from the reconcile loop's goroutine, each
// probe on its own goroutine; everything here is under mu.
type health struct {
	mu      sync.Mutex
	seen    map[string]time.Time // member → last answer, or when it was first probed
	probed  map[string]time.Time // member → last probe sent
	probing map[string]bool
	down    map[string]bool           // said to be down
	shares  map[string][]groupFigures // what each member leads, as it said last
	mqtt    map[string]string         // where each member's MQTT clients connect, as it said last
}

// groupFigures are the keys and bytes of a group its leader holds.
// Wire format (msgpack by field name, in opWho answers).
type groupFigures struct {
	Group int
	Keys  int
	Bytes int64
}

const (
	probeEvery = time.Second
	// downAfter is how long a member may not answer before it is said to
	// be down: three probes, so that one lost to a loaded machine is not.
	downAfter = 3 * time.Second
)

func newHealth() *health {
	return &health{seen: map[string]time.Time{}, probed: map[string]time.Time{}, probing: map[string]bool{}, down: map[string]bool{}, shares: map[string][]groupFigures{}, mqtt: map[string]string{}}
}

// probe sends the probes due to the members of st, and forgets those
// that left.
func (n *Node) probe(h *health, st *meta.State) {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	members := map[string]bool{}
	for _, m := range st.Nodes {
		if m.ID == n.cfg.NodeID {
			continue
		}
		members[m.ID] = true
		if _, ok := h.seen[m.ID]; !ok {
			h.seen[m.ID] = now // given downAfter from the first look
		}
		if !h.down[m.ID] && now.Sub(h.seen[m.ID]) > downAfter {
			h.down[m.ID] = true
			n.log.Info("member stopped answering", "node", m.ID, "addr", m.Addr, "silent_for", now.Sub(h.seen[m.ID]).Round(100*time.Millisecond))
		}
		if h.probing[m.ID] || now.Sub(h.probed[m.ID]) < probeEvery {
			continue
		}
		h.probing[m.ID], h.probed[m.ID] = true, now
		go func(id, addr string) {
			ctx, cancel := context.WithTimeout(context.Background(), probeEvery)
			defer cancel()
			var resp callResp
			err := n.call(ctx, id, callReq{Op: opWho}, &resp)
			h.mu.Lock()
			defer h.mu.Unlock()
			delete(h.probing, id)
			if err != nil || resp.Holder != id {
				return
			}
			if h.down[id] {
				n.log.Info("member answers again", "node", id, "addr", addr, "was_silent_for", time.Since(h.seen[id]).Round(100*time.Millisecond))
				delete(h.down, id)
			}
			if _, member := h.seen[id]; member {
				h.seen[id] = time.Now()
				h.shares[id] = resp.Leads
				h.mqtt[id] = resp.MQTTAddr
			}
		}(m.ID, m.Addr)
	}
	for id := range h.seen {
		if !members[id] {
			delete(h.seen, id)
			delete(h.probed, id)
			delete(h.down, id)
			delete(h.shares, id)
			delete(h.mqtt, id)
		}
	}
}

// alive reports whether member id answered within downAfter (this node
// is alive).
func (n *Node) alive(id string) bool {
	if id == n.cfg.NodeID {
		return true
	}
	h := n.health
	h.mu.Lock()
	defer h.mu.Unlock()
	seen, ok := h.seen[id]
	return ok && !h.down[id] && time.Since(seen) <= downAfter
}

// lastSeen returns when member id last answered (or was first probed),
// and whether it is known.
func (h *health) lastSeen(id string) (time.Time, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	t, ok := h.seen[id]
	return t, ok
}
