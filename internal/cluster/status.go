package cluster

import (
	"context"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// Status is the cluster as one node sees it (mqkv cluster status).
type Status struct {
	Node string `json:"node"`
	// NotMember says the node is no longer a member of its cluster (it
	// left, or was removed): what follows is the cluster as it was then.
	NotMember bool          `json:"not_member,omitempty"`
	Nodes     []NodeStatus  `json:"nodes"`
	Groups    []GroupStatus `json:"groups"`
	// Protocol is the cluster protocol the cluster runs at (see
	// ProtocolMax).
	Protocol int `json:"protocol"`
}

// NodeStatus is one member. State is alive (answered just now), suspect
// (not for a few seconds), dead (not for longer) or leaving (draining).
type NodeStatus struct {
	ID       string `json:"id"`
	Addr     string `json:"addr"`
	State    string `json:"state"`
	Leads    int    `json:"leads"`
	Replicas int    `json:"replicas"`
	// VolumeFull says its data volume is full: its replicas take no log
	// entries until space is freed.
	VolumeFull bool `json:"volume_full,omitempty"`
	// MQTT is what the node's broker holds (see MQTTFigures); nil when it
	// did not answer.
	MQTT *MQTTFigures `json:"mqtt,omitempty"`
	// Release is the mqkv release it last joined with ("" for one before
	// releases were recorded), speaking cluster protocols ProtoMin to
	// ProtoMax.
	Release  string `json:"release,omitempty"`
	ProtoMin int    `json:"protocol_min"`
	ProtoMax int    `json:"protocol_max"`
}

// MQTTFigures are a node's MQTT figures, in the cluster's status. Wire
// format (msgpack by field name).
type MQTTFigures struct {
	Clients       int64 `json:"clients"`       // connected
	Sessions      int   `json:"sessions"`      // held, connected or not
	Subscriptions int64 `json:"subscriptions"` // of those sessions
	RouteFilters  int   `json:"route_filters"` // filters the other nodes said they want (its route table)
	// Addr is where its MQTT clients connect (--advertise, else its
	// listener's address unless that is a wildcard); empty if unknown.
	Addr string `json:"addr,omitempty"`
}

// GroupStatus is one replica group.
type GroupStatus struct {
	ID         int      `json:"id"`
	Leader     string   `json:"leader"`
	Replicas   []string `json:"replicas"`
	Placement  []string `json:"placement"`
	Partitions int      `json:"partitions"`
	Migrating  bool     `json:"migrating"`
}

// Status reports what this node knows: the membership, where each group's
// replicas are, who leads them, and whether each member answers.
func (n *Node) Status() Status {
	st := n.state.Load()
	out := Status{Node: n.cfg.NodeID, NotMember: n.removed.Load()}
	if st == nil {
		return out
	}
	out.Protocol = st.Running()
	table := st.Placement()
	leads, holds := map[string]int{}, map[string]int{}
	// Each group's configuration is asked of its leader (following
	// not-leader answers: a node that holds no replica of a group knows its
	// leader only from the last request it forwarded), all groups at once.
	groups := make([]GroupStatus, st.Groups)
	var wg sync.WaitGroup
	for g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gs := GroupStatus{ID: g, Placement: table[g], Partitions: partitionsOf(g, st.Groups)}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			var resp callResp
			if n.onLeader(ctx, g, callReq{Op: opConfig, Group: g}, &resp, func(r *replica.Group) { resp.Servers = configOf(r) }) == nil {
				gs.Leader = n.leaderOf(g)
			} else if r := n.local(g); r != nil {
				// No leader (no quorum): the replicas as this one knows them.
				resp.Servers = configOf(r)
			}
			for _, s := range resp.Servers {
				gs.Replicas = append(gs.Replicas, s.ID)
				if !s.Voter {
					gs.Migrating = true
				}
			}
			if resp.Servers != nil && len(gs.Replicas) != len(table[g]) {
				gs.Migrating = true
			}
			groups[g] = gs
		}()
	}
	wg.Wait()
	for _, gs := range groups {
		for _, id := range gs.Replicas {
			holds[id]++
		}
		if gs.Leader != "" {
			leads[gs.Leader]++
		}
	}
	out.Groups = groups
	for _, m := range st.Nodes {
		ns := NodeStatus{ID: m.ID, Addr: m.Addr, State: m.State.String(), Leads: leads[m.ID], Replicas: holds[m.ID], Release: m.Release}
		ns.ProtoMin, ns.ProtoMax = m.Protocols()
		if ns.State == "active" {
			ns.State, ns.VolumeFull, ns.MQTT = n.liveness(m.ID)
		}
		out.Nodes = append(out.Nodes, ns)
	}
	sort.Slice(out.Nodes, func(a, b int) bool { return out.Nodes[a].ID < out.Nodes[b].ID })
	return out
}

// liveness asks a member whether it is there, and whether its volume is
// full.
func (n *Node) liveness(id string) (string, bool, *MQTTFigures) {
	if id == n.cfg.NodeID {
		return "alive", n.volumeFull(), n.mqttFigures()
	}
	for i, wait := range []time.Duration{500 * time.Millisecond, 2 * time.Second} {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		var resp callResp
		err := n.call(ctx, id, callReq{Op: opStatus}, &resp)
		cancel()
		if err == nil {
			if i == 0 {
				return "alive", resp.VolumeFull, resp.MQTT
			}
			return "suspect", resp.VolumeFull, resp.MQTT
		}
	}
	return "dead", false, nil
}

// mqttFigures are this node's broker's, if it says (Config.MQTT).
func (n *Node) mqttFigures() *MQTTFigures {
	if n.cfg.MQTT == nil {
		return nil
	}
	f := n.cfg.MQTT()
	return &f
}

// mqttAddr is where this node's MQTT clients connect, "" if unknown.
func (n *Node) mqttAddr() string {
	if f := n.mqttFigures(); f != nil {
		return f.Addr
	}
	return ""
}

// Routes returns, for each group, the MQTT address of the member that
// leads it ("" where that is not known): this node's own replicas say for
// the groups it holds, the others' answers to its probes (a second or
// so old) for the rest. A key belongs to group store.Partition(key) %
// len(routes). A client that sends each request there saves the hop from
// the node it is connected to to the leader (client.Config.Direct); a
// route gone stale costs only that hop again, since any member forwards.
func (n *Node) Routes() []string {
	groups := n.groupCount()
	leaders := make([]string, groups)
	for g := range groups {
		if r := n.local(g); r != nil {
			leaders[g], _ = r.Leader()
		}
	}
	h := n.health
	h.mu.Lock()
	addrs := map[string]string{n.cfg.NodeID: n.mqttAddr()}
	for id, a := range h.mqtt {
		if !h.down[id] {
			addrs[id] = a
		}
	}
	for id, fs := range h.shares {
		for _, f := range fs {
			if f.Group < groups && leaders[f.Group] == "" {
				leaders[f.Group] = id
			}
		}
	}
	h.mu.Unlock()
	out := make([]string, groups)
	for g, id := range leaders {
		out[g] = addrs[id]
	}
	return out
}

// partitionsOf counts the partitions of group g.
func partitionsOf(g, groups int) int {
	n := store.Partitions / groups
	if g < store.Partitions%groups {
		n++
	}
	return n
}

// Stats sums this node's share: the groups it leads (so that the figures
// of all nodes add up to the cluster's), with Leader set if it leads any.
// A node on its own reports its one group.
func (n *Node) Stats() replica.Stats {
	var out replica.Stats
	for _, r := range n.Groups() {
		s := r.Stats()
		if !s.Leader {
			continue
		}
		out.Leader = true
		out.Keys += s.Keys
		out.Bytes += s.Bytes
		out.AppliedIndex += s.AppliedIndex
		out.LastIndex += s.LastIndex
		out.Expired += s.Expired
		out.SnapshotBytes += s.SnapshotBytes
		if s.LastSnapshot.After(out.LastSnapshot) {
			out.LastSnapshot = s.LastSnapshot
		}
	}
	return out
}

// share is what this node leads now, in group order.
func (n *Node) share() []groupFigures {
	var out []groupFigures
	for g, r := range n.Groups() {
		if s := r.Stats(); s.Leader {
			out = append(out, groupFigures{Group: g, Keys: s.Keys, Bytes: s.Bytes})
		}
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Group < out[b].Group })
	return out
}

// Totals are the keys and bytes of the whole store.
type Totals struct {
	Keys  int
	Bytes int64
	// Partial says some group's figures are missing: no member that
	// answers leads it (no leader, or one this node does not hear).
	Partial bool
}

// Totals returns the store's keys and bytes: on a cluster member, the
// sum over the groups of what their leaders hold, this node's now and the
// others' as they said in their last answer to its probes (see health),
// so a second or two old. Each node counting only the groups it led,
// three nodes showed 35, 16 and 0 keys for a store of 51 (found by trying
// it).
func (n *Node) Totals() Totals {
	if n.link == nil {
		st := n.Stats()
		return Totals{Keys: st.Keys, Bytes: st.Bytes}
	}
	var t Totals
	seen := map[int]bool{}
	add := func(fs []groupFigures) {
		for _, f := range fs {
			if !seen[f.Group] { // once, while a leadership changes hands
				seen[f.Group] = true
				t.Keys += f.Keys
				t.Bytes += f.Bytes
			}
		}
	}
	add(n.share())
	h := n.health
	h.mu.Lock()
	for id, fs := range h.shares {
		if !h.down[id] {
			add(fs)
		}
	}
	h.mu.Unlock()
	t.Partial = len(seen) < n.groupCount()
	return t
}

// Role says what the node is: "single node", "starting" (waiting for its
// cluster), "not a member" (left or removed), or "member, leads groups
// 0, 3" ("leads no group").
func (n *Node) Role() string {
	switch {
	case n.link == nil:
		return "single node"
	case n.removed.Load():
		return "not a member"
	case !n.opened.Load():
		return "starting"
	}
	sh := n.share()
	if len(sh) == 0 {
		return "member, leads no group"
	}
	parts := make([]string, len(sh))
	for i, f := range sh {
		parts[i] = strconv.Itoa(f.Group)
	}
	word := "groups"
	if len(parts) == 1 {
		word = "group"
	}
	return "member, leads " + word + " " + strings.Join(parts, ", ")
}

// Members returns the cluster's members as this node knows them, id →
// node link address (itself included; none once it is no longer one).
func (n *Node) Members() map[string]string {
	out := map[string]string{}
	if st := n.state.Load(); st != nil && !n.removed.Load() {
		for _, m := range st.Nodes {
			out[m.ID] = m.Addr
		}
	}
	return out
}

// OtherMQTT returns the MQTT address of another member that answers now
// (one of those that do, the first in id order), or "" if none does
// within ctx: where this node's clients may go when it stops.
func (n *Node) OtherMQTT(ctx context.Context) string {
	var ids []string
	for id := range n.Members() {
		if id != n.cfg.NodeID && n.alive(id) {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	for _, id := range ids {
		var resp callResp
		if err := n.call(ctx, id, callReq{Op: opStatus}, &resp); err == nil && resp.MQTT != nil && resp.MQTT.Addr != "" {
			return resp.MQTT.Addr
		}
	}
	return ""
}

// Alive reports whether member id answers this node's probes (see
// health).
func (n *Node) Alive(id string) bool { return n.alive(id) }

// Clustered reports whether the node is a cluster member (not on its own).
func (n *Node) Clustered() bool { return n.link != nil }

// Settled reports whether every group has rf replicas, none moving, and a
// leader (with preferred, the placement's preferred leader): a cluster at
// rest, as tests and benchmarks wait for.
func (s Status) Settled(rf int, preferred bool) bool {
	if len(s.Groups) == 0 {
		return false
	}
	for _, g := range s.Groups {
		if g.Migrating || len(g.Replicas) != rf || g.Leader == "" || preferred && g.Leader != g.Placement[0] {
			return false
		}
	}
	return true
}

// GroupStats returns the figures of each replica this node holds.
func (n *Node) GroupStats() map[int]replica.Stats {
	out := map[int]replica.Stats{}
	for g, r := range n.Groups() {
		out[g] = r.Stats()
	}
	return out
}

// JournalStats are the figures of the node's journal; false on a node
// without one (on its own, or in memory).
func (n *Node) JournalStats() (journal.Stats, bool) {
	if n.journal == nil {
		return journal.Stats{}, false
	}
	return n.journal.Stats(), true
}

// volumeFull reports whether this node's replicas take no log entries for
// want of room on the data volume: below half its reserve, or out of
// space outright (a volume without a reserve, see journal.ErrNoSpace).
func (n *Node) volumeFull() bool {
	if n.cfg.Disk.Full() {
		return true
	}
	if n.journal != nil {
		return n.journal.Stats().Full
	}
	return false
}
