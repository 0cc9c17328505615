package cluster

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/meta"
)

// The reconciler moves the cluster toward its placement, one raft
// membership change at a time per group, the way a migration is done
// without new machinery: add the new replica as a non-voter, let it catch
// up by snapshot and log, make it a voter, then remove the replica it
// replaces. It runs on every node; each acts only on the groups it leads
// (and on its own replicas), so two nodes never change the same group.

const (
	reconcileEvery = 100 * time.Millisecond
	// catchUpSlack is how many entries a new replica may lag the leader
	// and still be made a voter.
	catchUpSlack = 64
	// maxMigrations bounds the non-voters one leader is catching up at
	// once, so moving replicas does not starve foreground traffic.
	maxMigrations = 4
	// balanceAfter is how long a leader keeps leadership before handing it
	// to the placement's preferred leader (avoids ping-pong after
	// elections).
	balanceAfter = 2 * time.Second
)

// reconciler state, touched only by the reconcile goroutine.
type reconciler struct {
	leaderSince     map[int]time.Time
	checked         map[int]time.Time // last time a stray replica asked its leader
	dead            *deadWatch
	namingTried     time.Time // see nameCluster
	membershipAsked time.Time // see checkMembership
}

// nameCluster names a cluster created by a release before cluster ids,
// once every member runs a release that knows them (answers opWho): a
// member of the earlier release ignores OpName, and its snapshots of the
// metadata, from which a newer member may restore, would carry no id; the
// cluster would then be named again, under another id than the one its
// members recorded.
func (n *Node) nameCluster(st *meta.State) {
	for _, m := range st.Nodes {
		if m.ID == n.cfg.NodeID {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		var resp callResp
		err := n.link.Call(ctx, m.Addr, callReq{Op: opWho}, &resp)
		cancel()
		if err != nil || resp.Holder != m.ID {
			return // down, or of the earlier release: later
		}
	}
	if err := n.applyMeta(meta.Op{Kind: meta.OpName, Cluster: randomID()}); err != nil {
		n.log.Warn("cannot name the cluster", "error", err)
	}
}

// announceRelease records this node's release and protocols in the
// metadata if its record says otherwise: a member restarted on another
// release (an upgrade, a rollback) that did not join again through
// Join (it knew nobody yet) is known as it is now.
func (n *Node) announceRelease(st *meta.State) {
	m, ok := st.Node(n.cfg.NodeID)
	me := n.self()
	if !ok || m.Release == me.Release && m.ProtoMin == me.ProtoMin && m.ProtoMax == me.ProtoMax {
		return
	}
	if err := st.Speaks(me); err != nil {
		// Restarted on a release that does not speak the cluster's
		// protocol, and let in without a join that would have refused it.
		n.Fail(err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := n.proposeMeta(ctx, meta.Op{Kind: meta.OpJoin, Checked: true, Cluster: st.ID, Node: me}, n.reopenAddrs(), ""); err != nil {
		n.log.Warn("cannot record this node's release in the metadata", "release", me.Release, "error", err)
	}
}

func (n *Node) reconcileLoop() {
	defer n.wg.Done()
	rc := &reconciler{leaderSince: map[int]time.Time{}, checked: map[int]time.Time{}, dead: newDeadWatch()}
	t := time.NewTicker(reconcileEvery)
	defer t.Stop()
	for {
		select {
		case <-n.stop:
			return
		case <-t.C:
		case <-n.changed:
		}
		n.reconcile(rc)
	}
}

func (n *Node) reconcile(rc *reconciler) {
	st := n.state.Load()
	if st == nil || st.Groups == 0 || !n.opened.Load() {
		return // (a reopening member opens its replicas itself)
	}
	n.probe(n.health, st)
	n.checkMembership(rc, st)
	if n.removed.Load() {
		n.stepAside()
		return
	}
	if n.meta.State() == raft.Leader {
		n.fitMetaMembers()
		n.removeDrained(st)
		n.judgeLiveness(rc.dead, st)
		if st.ID == "" && time.Since(rc.namingTried) > 10*time.Second {
			rc.namingTried = time.Now()
			n.nameCluster(st)
		}
		if spoken := st.Spoken(); spoken > st.Running() {
			// Every member speaks a higher protocol: the cluster runs at it.
			if err := n.applyMeta(meta.Op{Kind: meta.OpProtocol, Protocol: spoken}); err != nil {
				n.log.Warn("cannot raise the cluster protocol", "to", spoken, "error", err)
			} else {
				n.log.Info("the cluster runs at a new protocol: every member speaks it", "protocol", spoken)
			}
		}
	} else {
		rc.dead.forget()
	}
	if err := n.recordClusterID(st.ID); err != nil {
		n.log.Warn("cannot record the cluster's id in the data directory", "error", err)
	}
	n.announceRelease(st)
	table := st.Placement()
	migrating := 0 // non-voters being caught up by groups this node leads
	for _, r := range n.Groups() {
		if r.Raft().State() != raft.Leader {
			continue
		}
		for _, s := range r.Raft().GetConfiguration().Configuration().Servers {
			if s.Suffrage == raft.Nonvoter {
				migrating++
			}
		}
	}
	var wg sync.WaitGroup
	for g := range table {
		r := n.local(g)
		want := slices.Contains(table[g], n.cfg.NodeID)
		if r == nil {
			if want {
				// A replica placed here: open it empty; the group's
				// leader adds it and sends it a snapshot.
				if _, err := n.openGroup(g, nil); err != nil {
					n.log.Warn("cannot open replica", "group", g, "error", err)
				}
			}
			continue
		}
		if r.Raft().State() != raft.Leader {
			delete(rc.leaderSince, g)
			if !want && time.Since(rc.checked[g]) > 2*time.Second {
				rc.checked[g] = time.Now()
				wg.Add(1)
				go func() { defer wg.Done(); n.dropIfRemoved(g) }()
			}
			continue
		}
		if _, ok := rc.leaderSince[g]; !ok {
			rc.leaderSince[g] = time.Now()
		}
		if n.reconcileGroup(rc, st, g, table[g], &migrating) {
			delete(rc.leaderSince, g)
		}
	}
	wg.Wait()
}

// reconcileGroup makes one change to group g, which this node leads, if it
// differs from its placement. It reports a leadership transfer.
func (n *Node) reconcileGroup(rc *reconciler, st *meta.State, g int, want []string, migrating *int) bool {
	r := n.local(g)
	cfg := r.Raft().GetConfiguration().Configuration()
	suffrage := map[string]raft.ServerSuffrage{}
	for _, s := range cfg.Servers {
		suffrage[string(s.ID)] = s.Suffrage
	}
	addr := func(id string) raft.ServerAddress { return raft.ServerAddress(n.addrOf(id)) }
	// 0. A replica whose node came back at another address.
	for _, s := range cfg.Servers {
		if a := addr(string(s.ID)); a != "" && a != s.Address {
			n.log.Info("replica address changed", "group", g, "node", s.ID, "addr", a)
			if s.Suffrage == raft.Voter {
				r.Raft().AddVoter(s.ID, a, 0, 5*time.Second).Error()
			} else {
				r.Raft().AddNonvoter(s.ID, a, 0, 5*time.Second).Error()
			}
			return false
		}
	}
	// 0b. A leader whose volume is full takes no entries: its group goes
	// to a replica that can, if one answers and has caught up (see
	// handoverTarget); else it stays, refusing writes, until one can.
	if n.volumeFull() {
		if to := n.handoverTarget(g, want, suffrage, r.Raft().AppliedIndex()); to != "" {
			n.log.Info("the data volume is full: handing the group's leadership over", "group", g, "to", to)
			r.TransferLeadership(to, string(addr(to))).Error()
			return true
		}
	}
	// 1. A non-voter placed here that has caught up becomes a voter; one
	// no longer placed here is dropped before it costs anything more.
	for _, s := range cfg.Servers {
		id := string(s.ID)
		if s.Suffrage != raft.Nonvoter {
			continue
		}
		if !slices.Contains(want, id) {
			n.log.Info("dropping a replica no longer placed here", "group", g, "node", id)
			r.Raft().RemoveServer(s.ID, 0, 5*time.Second).Error()
			return false
		}
		if n.caughtUp(id, g, r.Raft().AppliedIndex()) {
			n.log.Info("replica caught up; now a voter", "group", g, "node", id)
			r.Raft().AddVoter(s.ID, addr(id), 0, 5*time.Second).Error()
			return false
		}
	}
	// 2. A replica placed here but missing: add it as a non-voter, within
	// the node's migration budget.
	for _, id := range want {
		if _, ok := suffrage[id]; !ok && n.addrOf(id) != "" {
			if *migrating >= maxMigrations {
				break
			}
			*migrating++
			n.log.Info("adding replica", "group", g, "node", id)
			r.Raft().AddNonvoter(raft.ServerID(id), addr(id), 0, 5*time.Second).Error()
			return false
		}
	}
	// 3. A voter no longer placed here: remove it once the group has its
	// placed replicas as voters (hand leadership over first if it is this
	// node). Not before: while a newcomer catches up as a non-voter, the
	// group keeps as many voters as its placement has, so that it keeps a
	// quorum when one more node fails, or the newcomer never arrives.
	voters := 0
	for _, id := range want {
		if suffrage[id] == raft.Voter {
			voters++
		}
	}
	for _, s := range cfg.Servers {
		id := string(s.ID)
		if slices.Contains(want, id) || voters < len(want) {
			continue
		}
		if id == n.cfg.NodeID {
			// Only to a placed voter that answers and has caught up: a
			// transfer to a node that is down fails, and was tried
			// again every round while the group went without a leader
			// for as long as the node stayed down (75 s; found by trying
			// it). With none, the group is served here until one is.
			if to := n.handoverTarget(g, want, suffrage, r.Raft().AppliedIndex()); to != "" {
				n.log.Info("handing over leadership before leaving the group", "group", g, "to", to)
				r.TransferLeadership(to, string(addr(to))).Error()
				return true
			}
			continue
		}
		n.log.Info("removing replica", "group", g, "node", id)
		r.Raft().RemoveServer(raft.ServerID(id), 0, 5*time.Second).Error()
		return false
	}
	// 4. Balance leadership: the placement's preferred leader leads.
	if pref := want[0]; pref != n.cfg.NodeID && suffrage[pref] == raft.Voter && time.Since(rc.leaderSince[g]) > balanceAfter {
		if n.alive(pref) && n.caughtUp(pref, g, r.Raft().AppliedIndex()) {
			r.TransferLeadership(pref, string(addr(pref))).Error()
			return true
		}
	}
	return false
}

// membershipCheck is how often a node that no longer hears the metadata
// leader asks the other members whether it is still one of them.
const membershipCheck = 5 * time.Second

// checkMembership asks the members this node knows whether it is still
// one of them, when its metadata replica has not heard a leader for
// membershipCheck: a member removed from the cluster may never get the
// entry that removes it, since the metadata group drops it right after
// (see fitMetaMembers), and it would go on as a member of a cluster that
// no longer counts it (found by test: a drained node restarted mid-drain).
func (n *Node) checkMembership(rc *reconciler, st *meta.State) {
	if n.removed.Load() || !n.wasMember.Load() || n.meta.State() == raft.Leader ||
		time.Since(n.meta.LastContact()) < membershipCheck || time.Since(rc.membershipAsked) < membershipCheck {
		return
	}
	rc.membershipAsked = time.Now()
	for _, m := range st.Nodes {
		if m.ID == n.cfg.NodeID {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		var resp callResp
		err := n.link.Call(ctx, m.Addr, callReq{Op: opMembership, Key: []byte(n.cfg.NodeID)}, &resp)
		cancel()
		if err != nil || resp.Kind != errNone {
			continue
		}
		if resp.Gone && !resp.Member {
			n.markRemoved(st.ID)
		}
		return // one answer is the metadata as it is
	}
}

// handoverTarget picks who takes group g over from this node, its leader,
// which is leaving it: the first of the placed replicas want that votes,
// answers and has applied nearly everything; "" if none does.
func (n *Node) handoverTarget(g int, want []string, suffrage map[string]raft.ServerSuffrage, applied uint64) string {
	behind := ""
	for _, id := range want {
		if id == n.cfg.NodeID || suffrage[id] != raft.Voter || !n.alive(id) {
			continue
		}
		at, full, ok := n.replicaStatus(id, g)
		if !ok || full {
			continue
		}
		if at+catchUpSlack >= applied {
			return id
		}
		if behind == "" {
			behind = id
		}
	}
	// One that answers but lags (a group written to hard): raft brings it
	// up to date before it hands over.
	return behind
}

// stepAside is the reconciling of a node that is no longer a member: it
// gives the leadership of the groups it leads to whichever voter is most
// up to date (its metadata is frozen at its removal, so the placement it
// knows may name nodes since gone), and of the metadata group; the
// groups' leaders then remove its replicas, which it closes (see
// dropIfRemoved). Nothing else: it moves nothing.
func (n *Node) stepAside() {
	for g, r := range n.Groups() {
		if r.Raft().State() == raft.Leader {
			if err := r.TransferLeadership("", "").Error(); err != nil {
				n.log.Debug("not a member: leadership not handed over yet", "group", g, "error", err)
			}
			continue
		}
		n.dropIfRemoved(g)
	}
	if n.meta.State() == raft.Leader {
		n.meta.LeadershipTransfer()
	}
}

// caughtUp asks a member whether its replica of g has applied nearly
// everything up to index.
func (n *Node) caughtUp(id string, g int, index uint64) bool {
	applied, full, ok := n.replicaStatus(id, g)
	return ok && applied+catchUpSlack >= index && !full
}

// replicaStatus asks a member how far its replica of g has applied, and
// whether its volume is full; ok is false when it does not answer or
// holds no replica of g.
func (n *Node) replicaStatus(id string, g int) (applied uint64, volumeFull, ok bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var resp callResp
	if err := n.call(ctx, id, callReq{Op: opStatus}, &resp); err != nil || resp.Kind != errNone {
		n.log.Debug("catch-up check failed", "group", g, "node", id, "error", err, "resp", resp.Err)
		return 0, false, false
	}
	applied, ok = resp.Applied[g]
	n.log.Debug("catch-up", "group", g, "node", id, "applied", applied, "ok", ok, "volume_full", resp.VolumeFull)
	return applied, resp.VolumeFull, ok
}

// dropIfRemoved closes this node's replica of g once the group's leader no
// longer counts it as a member in a committed configuration: a removal
// not committed yet can be undone by the next leader, and the replica
// would then be a voter whose data is gone. A removed replica is not
// told: it learns by asking.
func (n *Node) dropIfRemoved(g int) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var resp callResp
	// The leader as last heard, then as each answer names it: a removed
	// replica hears no more of its group, and a stale hint was asked
	// again and again for a minute and a half (found by test).
	for hops := 0; ; hops++ {
		leader := n.leaderOf(g)
		if leader == "" || leader == n.cfg.NodeID || hops == 3 {
			return
		}
		err := n.call(ctx, leader, callReq{Op: opConfig, Group: g}, &resp)
		if err == nil && resp.Kind == errNotLeader {
			n.hint(g, resp.Leader)
			continue
		}
		if err != nil || resp.Kind != errNone || !resp.Committed {
			return
		}
		break
	}
	for _, s := range resp.Servers {
		if s.ID == n.cfg.NodeID {
			return
		}
	}
	n.dropGroup(g)
}

// removeDrained forgets leaving members that no longer hold a replica
// (on the metadata leader).
func (n *Node) removeDrained(st *meta.State) {
	for _, m := range st.Nodes {
		if m.State != meta.Leaving {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		var resp callResp
		err := n.call(ctx, m.ID, callReq{Op: opStatus}, &resp)
		cancel()
		if err == nil && resp.Kind == errNone && len(resp.Applied) == 0 {
			n.log.Info("member drained; removing it", "node", m.ID)
			if n.applyMeta(meta.Op{Kind: meta.OpRemove, Node: meta.Node{ID: m.ID}}) == nil {
				n.fitMetaMembers()
			}
		}
	}
}

// Leave asks the cluster to drain this node (or id, if not empty): it is
// placed nowhere, its replicas move to the other nodes, and it is removed
// from the membership once it holds none.
func (n *Node) Leave(ctx context.Context, id string) error {
	if id == "" {
		id = n.cfg.NodeID
	}
	return n.proposeMeta(ctx, meta.Op{Kind: meta.OpLeave, Node: meta.Node{ID: id}}, n.memberAddrs(), "")
}

// Remove forgets a member at once (a dead node): its replicas are replaced
// from the survivors. Unless force, a member that answers is not removed
// (ErrMemberRunning): `mqkv cluster remove` of a live node that led groups
// took their leaders away without a word, and the node went on serving
// (found by trying it); leave drains it first.
func (n *Node) Remove(ctx context.Context, id string, force bool) error {
	st := n.state.Load()
	if st == nil {
		return errNoMetaLeader
	}
	m, ok := st.Node(id)
	if !ok {
		return fmt.Errorf("%w: %s", meta.ErrUnknownNode, id)
	}
	if !force {
		wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		var resp callResp
		err := n.link.Call(wctx, m.Addr, callReq{Op: opWho}, &resp)
		cancel()
		if id == n.cfg.NodeID || err == nil && resp.Holder == id {
			return fmt.Errorf("%w: %s answers at %s; `mqkv cluster leave --node %s` moves its data off it first, "+
				"and --force removes it as it is (its replicas are rebuilt from the others)", ErrMemberRunning, id, m.Addr, id)
		}
	}
	return n.proposeMeta(ctx, meta.Op{Kind: meta.OpRemove, Node: meta.Node{ID: id}}, n.memberAddrs(), "")
}

// ErrMemberRunning refuses to remove a member that answers.
var ErrMemberRunning = errors.New("cluster: the node is running")

func (n *Node) memberAddrs() []string {
	var out []string
	if st := n.state.Load(); st != nil {
		for _, m := range st.Nodes {
			out = append(out, m.Addr)
		}
	}
	return out
}
