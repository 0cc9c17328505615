// Package cluster runs one node's share of the keyspace and offers the
// state store a Router over all of it. Keys hash into the fixed 4,096
// partitions; partition p belongs to replica group p mod Groups; each group
// is a hashicorp/raft group whose replicas live on the nodes package
// placement assigns from the membership kept in the metadata group
// (package meta). A request for a key is served by the leader of its group:
// here if this node leads it, else forwarded over the node link (package
// peer) and answered back through this node.
//
// A node on its own (no node link) is the same thing with one group, held
// here, and no metadata group: the single-node mqkv.
//
// Goroutines: the Router methods are called concurrently by the state
// store; each group runs its own raft goroutines; the node runs one
// reconciler (membership and placement), one goroutine per forwarded call
// it serves, and one per event stream it follows or serves.
package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/meta"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// Defaults for a new cluster. One group, the shape etcd and a NATS
// JetStream KV bucket have: one leader orders every write and the others
// follow. Across nodes every group pays per batch of writes (its leader's
// loop, an AppendEntries and its answer per follower, a sync and an apply
// on every replica), and the same writes spread over more groups come in
// smaller batches. Three nodes on a two-core machine, 64 clients of
// durable SET (docs/benchmarks.md, 2026-11-29): 8 groups
// cost 111-167 µs of CPU per SET over the three nodes, 3 groups 91-95,
// 1 group 49-62; per node too, the leader of 1 group spent 30 µs per SET
// where each node of 8 spent 36, so 1 is cheaper even on machines of
// their own at that load. More groups spread leadership and, as a cluster
// grows past RF nodes, the data: `--groups` chooses that when the cluster
// is created (docs/cluster.md, "How many groups").
const (
	DefaultGroups = 1
	DefaultRF     = 3
)

// The cluster protocols this release speaks. The protocol is what the
// members write to the logs and send each other: a release that adds a
// log entry type or a node link message raises ProtocolMax and uses the
// addition only once the cluster runs at that protocol (Node.Protocol),
// which it does once every member speaks it (meta.OpProtocol); a release
// that drops the old form raises ProtocolMin. So a cluster upgrades one
// node at a time, and an older release joins while the cluster's protocol
// allows it, or is refused with both named.
//
// Protocol 1: the first, msgpack on the node link. Protocol 2: forwarded
// writes and reads, and their replies, in a binary form (callcodec.go).
// Protocol 3: raft's AppendEntries in a binary form on the call streams
// (appendcodec.go). Protocol 4: writes that carry their request's id, so
// that a request is executed once (store.Command.Request; log entries of
// batch format 4, snapshots of format 2). Protocol 5: the arithmetic
// writes (store.OpAdd, OpIncr, OpDecr: INCR and memcached's incr, applied
// by the log). Protocol 6: the value ops (store.OpAppend, OpPrepend,
// OpTouch) and SET's IfExists (memcached's replace, append, prepend and
// touch, Redis's SET XX and APPEND, applied by the log).
const (
	ProtocolMin = 1
	ProtocolMax = 6
)

// protocolRequests is the cluster protocol from which writes carry their
// request's id.
const protocolRequests = 4

// protocolArithmetic is the cluster protocol from which a write may be
// an arithmetic op.
const protocolArithmetic = 5

// protocolValueOps is the cluster protocol from which a write may be a
// value op or a SET on condition that the key exists.
const protocolValueOps = 6

// metaGroup is the stream layer id of the metadata group (replica groups
// are numbered from 0).
const metaGroup = 1<<32 - 1

// Config configures a node.
type Config struct {
	NodeID string
	// Dir holds the node's groups and metadata; empty keeps everything in
	// memory. A node on its own keeps its one group directly in Dir (the
	// layout of the single-node releases).
	Dir string
	// Link is the node link; nil runs the node on its own.
	Link *peer.Link
	// Join lists link addresses of members to join through. Empty, a node
	// without state creates a new cluster.
	Join []string
	// Groups and RF shape a new cluster; zero takes the defaults.
	Groups, RF int
	Limits     store.Limits
	// Seed, for a node creating a cluster, is data it starts with: a
	// single node's store, split over the new cluster's groups.
	Seed *store.Store
	// OnEvents receives the change events of the groups this node follows
	// (see Follow), in log order per group, one goroutine per group. It
	// must not keep the slice (its events may be kept): the slice is
	// reused for a later batch.
	OnEvents func([]store.Event)
	Timings  replica.Timings
	Logger   *slog.Logger
	// Disk, if set, refuses writes while the data volume is nearly full.
	Disk *replica.DiskGuard
	// DeadNodeTimeout, if set, removes a member that has not answered for
	// that long (see deadWatch).
	DeadNodeTimeout time.Duration
	// QuorumReads has every read of a group's leader confirm the
	// leadership with a round of heartbeats; without it the leader reads
	// under a lease (see replica.ReadLease).
	QuorumReads bool
	// OnEventsGap, if set, hears that this node lost some changes of a
	// group it follows (it fell further behind than the members' event
	// rings keep): first with the zero version, then, once the group's
	// changes are delivered again, with the version of the first. Every
	// change lost has a lower one.
	OnEventsGap func(resume hlc.Timestamp)

	// MQTT, if set, returns the node's broker's figures for the cluster's
	// status (the broker is made after the node).
	MQTT func() MQTTFigures

	// Release names the mqkv release, for the metadata and the status.
	Release string
	// Protocols, if not zero, is the range of cluster protocols the node
	// claims to speak instead of ProtocolMin to ProtocolMax (tests).
	Protocols [2]int

	// Rejoin makes a node that was removed from its cluster (its data
	// stale: see meta.ErrRemoved) a member again: once a member confirms
	// the removal, its replicas and metadata are dropped and it joins
	// through Join as a node without data, under its id. A node that is
	// still a member is refused, and keeps its data.
	Rejoin bool

	// createHook, in tests, runs as a new cluster is made: with -1 once
	// the metadata group leads, with g once group g is open, and with
	// Groups once the metadata records the cluster. An error stops Start
	// there, as a crash would.
	createHook func(g int) error
}

// Node is a running node.
type Node struct {
	cfg   Config
	log   *slog.Logger
	clock *hlc.Clock
	link  *peer.Link
	// transports are the raft transports of the groups open here, by
	// stream layer id (see serveAppends); appenders send the groups'
	// AppendEntries, by member address (see appender).
	transports, appenders sync.Map

	// journal holds the logs of every group on this node, the metadata
	// group's too (nil in memory and on a node on its own).
	journal *journal.Journal

	// metadata (nil on a node on its own)
	meta      *raft.Raft
	metaFSM   *meta.FSM
	metaTrans raft.WithClose
	state     atomic.Pointer[meta.State]
	// creating is set while this node makes a new cluster: until the
	// metadata says how many groups there are, and until the creation is
	// durable, no other node may join (see create).
	creating atomic.Bool
	started  atomic.Bool // meta is set: calls may be answered
	// born is when the node was made (see openGroup).
	born time.Time
	// forwardedWrites and forwardedReads count the requests this node
	// sent on to another member's leader (see Forwarded).
	forwardedWrites, forwardedReads atomic.Int64
	// opened says the node has created, joined or reopened its cluster,
	// its replicas opened: until then it does not say which it holds.
	opened atomic.Bool
	// inc is this process's incarnation (see meta.Node.Inc); named says
	// the data directory records the cluster's id (see recordClusterID).
	inc     string
	named   atomic.Bool
	changed chan struct{} // the metadata changed: reconcile now
	// removed says the metadata this node applied no longer has it as a
	// member: it left, or was removed (see noteRemoval).
	removed   atomic.Bool
	wasMember atomic.Bool // the metadata had this node as a member
	health    *health

	mu     sync.Mutex
	groups map[int]*replica.Group // the replicas held here
	view   atomic.Pointer[map[int]*replica.Group]
	hints  sync.Map // group → *string: the leader's node id as last heard

	events    *follower
	copies    copies   // held for backups being read
	forwarded sync.Map // group → *forwarding: writes forwarded to its leader

	stop chan struct{}
	// metaReadyTerm is the term in which this node, leading the metadata,
	// applied every entry before it (see metaHere).
	metaReadyTerm atomic.Uint64
	wg            sync.WaitGroup
	closeOnce     sync.Once
	// opening counts openGroup calls in progress; once shut (under mu)
	// none starts. Close waits for them before it closes the groups and
	// then the journal: a group opened meanwhile (on a peer's request)
	// was never closed, and its raft, told of a new term, panicked on
	// the closed journal (a CI run).
	opening     sync.WaitGroup
	openingShut bool
	// The node cannot go on once a group's log could not be applied:
	// Failed is closed, Err says why.
	*replica.Fault
}

// Start starts a node: on its own, it opens its group and returns once it
// serves; in a cluster, it opens the metadata group, creates or joins the
// cluster, and returns once it knows the membership.
func Start(cfg Config) (*Node, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Groups == 0 {
		cfg.Groups = DefaultGroups
	}
	if cfg.RF == 0 {
		cfg.RF = DefaultRF
	}
	if cfg.Groups < 0 || cfg.Groups > store.Partitions || cfg.RF < 0 {
		return nil, fmt.Errorf("cluster: %d groups and %d replicas: want 1 to %d groups and 1 replica or more", cfg.Groups, cfg.RF, store.Partitions)
	}
	clock, err := hlc.New(cfg.NodeID, nil)
	if err != nil {
		return nil, err
	}
	n := &Node{cfg: cfg, log: cfg.Logger, clock: clock, link: cfg.Link, groups: map[int]*replica.Group{},
		changed: make(chan struct{}, 1), stop: make(chan struct{}), Fault: replica.NewFault(), inc: randomID(), health: newHealth(), born: time.Now()}
	n.events = newFollower(n)
	if n.link == nil {
		return n, n.startAlone()
	}
	if cfg.Dir != "" {
		if err := redoCreation(cfg.Dir, n.log); err != nil {
			return nil, err
		}
		if cfg.Rejoin {
			if err := n.dropIfGone(); err != nil {
				return nil, err
			}
		}
		if err := n.keepIncarnation(); err != nil {
			return nil, err
		}
		j, err := journal.Open(filepath.Join(cfg.Dir, "journal"), journal.Options{OnFail: func(err error) {
			n.Fail(fmt.Errorf("%w: the node stops; restart it to recover from its journal (nothing acknowledged is lost)", err))
		}, Room: cfg.Disk.Room})
		if err != nil {
			return nil, &replica.DamagedError{Path: filepath.Join(cfg.Dir, "journal"), What: "the node's journal", Err: err}
		}
		n.journal = j
	}
	n.link.Handle(n.serveStream)
	n.link.HandleCalls(n.serveCall)
	if err := n.startMeta(); err != nil {
		n.Close()
		return nil, err
	}
	n.wg.Add(1)
	go n.reconcileLoop()
	return n, nil
}

// startAlone opens the one group of a node on its own.
func (n *Node) startAlone() error {
	g, err := replica.Open(replica.Config{
		NodeID: n.cfg.NodeID, Dir: n.cfg.Dir, Limits: n.cfg.Limits, Clock: n.clock,
		OnEvents: n.events.local(0), Timings: n.cfg.Timings, Disk: n.cfg.Disk,
	})
	if err != nil {
		n.events.closeAlone()
		return err
	}
	if err := g.AwaitLeader(30 * time.Second); err != nil {
		g.Close()
		n.events.closeAlone()
		return err
	}
	n.mu.Lock()
	n.groups[0] = g
	n.publish()
	n.mu.Unlock()
	n.watchFailure(g)
	return nil
}

// watchFailure stops the node when a group cannot go on. It ends with
// the group: a replica dropped from this node is not kept alive by it.
func (n *Node) watchFailure(g *replica.Group) {
	go func() {
		select {
		case <-g.Failed():
			n.Fail(g.Err())
		case <-g.Closing():
		case <-n.stop:
		}
	}()
}

// Clock is the node's hybrid logical clock, shared by its groups.
func (n *Node) Clock() *hlc.Clock { return n.clock }

// groupOf returns the group that owns key.
func (n *Node) groupOf(key []byte) int {
	count := n.groupCount()
	if count == 1 {
		return 0 // a node on its own: no checksum of every key to find it
	}
	return int(store.Partition(key)) % count
}

func (n *Node) groupCount() int {
	if n.link == nil {
		return 1
	}
	if st := n.state.Load(); st != nil && st.Groups > 0 {
		return st.Groups
	}
	if n.creating.Load() { // the metadata records the count last
		return n.cfg.Groups
	}
	return 1
}

// local returns this node's replica of group g, or nil. It runs for every
// request: it reads a copy of the map that changes only when replicas come
// and go.
func (n *Node) local(g int) *replica.Group {
	if m := n.view.Load(); m != nil {
		return (*m)[g]
	}
	return nil
}

// publish makes the current replica map visible to local; n.mu is held.
func (n *Node) publish() {
	m := make(map[int]*replica.Group, len(n.groups))
	for g, r := range n.groups {
		m[g] = r
	}
	n.view.Store(&m)
}

// Groups returns the node's replicas by group.
func (n *Node) Groups() map[int]*replica.Group {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make(map[int]*replica.Group, len(n.groups))
	for g, r := range n.groups {
		out[g] = r
	}
	return out
}

// addrOf returns the link address of a member.
func (n *Node) addrOf(id string) string {
	if st := n.state.Load(); st != nil {
		if m, ok := st.Node(id); ok {
			return m.Addr
		}
	}
	return ""
}

// Close stops the node: its groups, metadata group and followers. The link
// is the caller's.
func (n *Node) Close() error {
	var err error
	n.closeOnce.Do(func() {
		close(n.stop)
		n.wg.Wait()
		n.mu.Lock()
		n.openingShut = true
		n.mu.Unlock()
		n.opening.Wait()
		n.events.close()
		n.copies.close()
		n.mu.Lock()
		groups := n.groups
		n.groups = map[int]*replica.Group{}
		n.publish()
		n.mu.Unlock()
		var wg sync.WaitGroup
		var mu sync.Mutex
		for _, g := range groups {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if e := g.Close(); e != nil {
					mu.Lock()
					err = errors.Join(err, e)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		n.events.closeAlone()
		if n.meta != nil {
			f := n.meta.Shutdown()
			if n.metaTrans != nil {
				n.metaTrans.Close() // see replica.Group.Close
			}
			f.Error()
		}
		if n.journal != nil {
			n.journal.Close()
		}
	})
	return err
}

// groupLog returns the journal's view for group id, first moving in what
// an older release kept in the group's own log under dir/wal. Nil in
// memory.
func (n *Node) groupLog(id uint32, dir string) (replica.LogStore, error) {
	if n.journal == nil {
		return nil, nil
	}
	l := n.journal.Group(id)
	wal := filepath.Join(dir, "wal")
	if err := os.RemoveAll(wal + replica.ImportedSuffix); err != nil { // a move a crash ended after the copy
		return nil, err
	}
	if _, err := os.Stat(wal); err == nil {
		if n.journal.Has(id) { // a move a crash cut short: start it over
			if err := n.journal.Drop(id); err != nil {
				return nil, err
			}
		}
		if err := replica.ImportWAL(wal, l, id != metaGroup); err != nil {
			return nil, err
		}
		n.log.Info("moved a group's log into the node's journal", "group", id, "from", wal)
	}
	return l, nil
}

// groupDir is where replica g lives ("" in memory).
func (n *Node) groupDir(g int) string {
	if n.cfg.Dir == "" {
		return ""
	}
	return filepath.Join(n.cfg.Dir, "groups", strconv.Itoa(g))
}

// openGroup opens (creating if needed) this node's replica of group g;
// boot, if set, is the configuration of a group being created.
func (n *Node) openGroup(g int, boot *raft.Configuration) (*replica.Group, error) {
	n.mu.Lock()
	if r := n.groups[g]; r != nil {
		n.mu.Unlock()
		return r, nil
	}
	if n.openingShut {
		n.mu.Unlock()
		return nil, errors.New("cluster: node closed")
	}
	n.opening.Add(1)
	defer n.opening.Done()
	n.mu.Unlock()
	// Keys spread evenly over the groups by hash: each group enforces its
	// share of the node's limits, so the cluster holds about the limit.
	limits := n.cfg.Limits
	if groups := n.groupCount(); groups > 1 {
		limits.MaxKeys = (limits.MaxKeys + groups - 1) / groups
		limits.MaxBytes = (limits.MaxBytes + int64(groups) - 1) / int64(groups)
	}
	log, err := n.groupLog(uint32(g), n.groupDir(g))
	if err != nil {
		return nil, fmt.Errorf("group %d: %w", g, err)
	}
	// A replica that restarts knows no leader and could vote at once for
	// another, while a lease it granted before (accepting the leader's
	// AppendEntries) still runs: it keeps out of its group until any
	// such lease has ended (see replica.ReadLease).
	if d := time.Until(n.born.Add(replica.ReadLease)); d > 0 {
		time.Sleep(d)
	}
	tr := n.transport(uint32(g))
	r, err := replica.Open(replica.Config{
		NodeID: n.cfg.NodeID, Dir: n.groupDir(g), Log: log, Limits: limits, Clock: n.clock,
		Transport: tr, Acks: n.acks(tr), Bootstrap: boot,
		OnEvents: n.events.local(g), Timings: n.cfg.Timings, Logger: n.log.With("group", g), Disk: n.cfg.Disk,
	})
	if err != nil {
		// The reconciler tries again soon: each try would leave a
		// transport and its goroutine behind.
		tr.Close()
		return nil, fmt.Errorf("group %d: %w", g, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if old := n.groups[g]; old != nil { // opened meanwhile
		go r.Close()
		return old, nil
	}
	n.groups[g] = r
	n.serving(uint32(g), tr)
	n.publish()
	n.watchFailure(r)
	return r, nil
}

// dropGroup closes this node's replica of g and deletes its data: the group
// no longer has it as a member.
func (n *Node) dropGroup(g int) {
	n.mu.Lock()
	r := n.groups[g]
	delete(n.groups, g)
	n.publish()
	n.mu.Unlock()
	if r == nil {
		return
	}
	n.events.replicaClosed(g)
	r.Close()
	// The log goes first: a snapshot directory left by a crash in between
	// is found again if the group comes back, a log without it is not.
	if n.journal != nil {
		if err := n.journal.Drop(uint32(g)); err != nil {
			// Its snapshots stay with it: a log without them could not
			// be opened if the group comes back.
			n.log.Warn("could not drop a removed replica's log", "group", g, "err", err)
			return
		}
	}
	if dir := n.groupDir(g); dir != "" {
		os.RemoveAll(dir)
	}
	n.log.Info("replica removed", "group", g)
}

// metaSnapshot names the metadata group's snapshots in errors.
const metaSnapshot = "a snapshot of the cluster metadata"

// startMeta opens the metadata group and creates or joins the cluster.
func (n *Node) startMeta() error {
	n.metaFSM = meta.NewFSM(func(st *meta.State) {
		n.state.Store(st)
		n.noteRemoval(st)
		select {
		case n.changed <- struct{}{}:
		default:
		}
	})
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(n.cfg.NodeID)
	rc.HeartbeatTimeout, rc.ElectionTimeout, rc.LeaderLeaseTimeout = time.Second, time.Second, 500*time.Millisecond
	rc.SnapshotThreshold = 1024
	rc.TrailingLogs = 256
	rc.Logger = replica.RaftLogger("raft-meta", n.log)
	var (
		logs   raft.LogStore
		stable raft.StableStore
		snaps  raft.SnapshotStore
	)
	if n.cfg.Dir == "" {
		mem := raft.NewInmemStore()
		logs, stable, snaps = mem, mem, raft.NewInmemSnapshotStore()
	} else {
		dir := filepath.Join(n.cfg.Dir, "meta")
		l, err := n.groupLog(metaGroup, dir)
		if err != nil {
			return err
		}
		fss, err := raft.NewFileSnapshotStoreWithLogger(dir, 2, rc.Logger)
		if err != nil {
			return err
		}
		logs, stable, snaps = l, l, replica.CheckedSnapshots(dir, fss, l)
	}
	trans := n.transport(metaGroup)
	n.metaTrans = trans
	exists, err := raft.HasExistingState(logs, stable, snaps)
	if err != nil {
		return replica.SnapshotDamage(snaps, filepath.Join(n.cfg.Dir, "meta"), metaSnapshot, err)
	}
	creating := !exists && len(n.cfg.Join) == 0
	if creating {
		if err := n.checkNothingLeft(); err != nil {
			return err
		}
		n.creating.Store(true)
		if err := n.markCreating(); err != nil {
			return err
		}
		boot := raft.Configuration{Servers: []raft.Server{{ID: rc.LocalID, Address: raft.ServerAddress(n.link.Addr())}}}
		if err := raft.BootstrapCluster(rc, logs, stable, snaps, trans, boot); err != nil {
			return err
		}
	}
	r, err := raft.NewRaft(rc, n.metaFSM, logs, stable, snaps, trans)
	if err != nil {
		return replica.SnapshotDamage(snaps, filepath.Join(n.cfg.Dir, "meta"), metaSnapshot, err)
	}
	n.meta = r
	n.serving(metaGroup, trans)
	n.started.Store(true)
	switch {
	case creating:
		if err := n.create(); err != nil {
			return err
		}
	case !exists:
		if err := n.join(); err != nil {
			return err
		}
	default:
		return n.reopenServing()
	}
	n.opened.Store(true)
	return nil
}

// reopenQuick is how long Start waits for a restarting member to be let
// back in before it returns and serves: answering state store requests
// "unavailable", and saying why, until its cluster has a quorum. A
// refusal within it (a member removed meanwhile) is Start's error; one
// after it stops the node (Failed).
var reopenQuick = 2 * time.Second

// reopenServing reopens a member (see reopen), in the background once it
// has taken reopenQuick: a member restarted alone refused MQTT
// connections, without a word, until a second member was up (found by
// trying it).
func (n *Node) reopenServing() error {
	done := make(chan error, 1)
	go func() { done <- n.reopen() }()
	select {
	case err := <-done:
		if err == nil {
			n.opened.Store(true)
		}
		return err
	case <-time.After(reopenQuick):
	}
	n.log.Warn("serving before the cluster is back: state store requests are answered 'unavailable' until a quorum of its members is up",
		"node", n.cfg.NodeID, "join", n.cfg.Join)
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		err := <-done
		switch {
		case err == nil:
			n.opened.Store(true)
			n.log.Info("the cluster is back: serving", "node", n.cfg.NodeID)
			n.wakeReconciler()
		case n.closing():
		default:
			n.Fail(err)
		}
	}()
	return nil
}

// closing reports whether Close has begun.
func (n *Node) closing() bool {
	select {
	case <-n.stop:
		return true
	default:
		return false
	}
}

// StartingError answers requests on a member still waiting for its
// cluster (see reopenServing).
type StartingError struct{ Node string }

func (e *StartingError) Error() string {
	return "this node (" + e.Node + ") is starting: it waits for a quorum of its cluster's members"
}

// Reason is what a client is told (see statestore).
func (e *StartingError) Reason() string { return e.Error() }

// Ready reports whether the node serves: it has created, joined or
// reopened its cluster, and is a member.
func (n *Node) Ready() bool { return n.link == nil || n.opened.Load() && !n.removed.Load() }

// unready is the error a request gets from a node that does not serve,
// nil if it does.
func (n *Node) unready() error {
	switch {
	case n.link == nil:
		return nil
	case n.removed.Load():
		return &NotMemberError{n.cfg.NodeID}
	case !n.opened.Load():
		return &StartingError{n.cfg.NodeID}
	}
	return nil
}

// create makes this node the first member of a new cluster: it leads the
// metadata group and every replica group, alone, until others join.
//
// A crash part way must not leave a cluster with groups that never elect
// a leader. So every group is made before the metadata records the
// cluster (OpInit), and the creation marker (see markCreating) goes only
// after that: a restart that finds the marker starts again from nothing
// (redoCreation). No other node joins meanwhile (metaHere), and no client
// is served before Start returns, so nothing acknowledged is lost.
func (n *Node) create() error {
	deadline := time.Now().Add(30 * time.Second)
	for n.meta.State() != raft.Leader {
		if time.Now().After(deadline) {
			return errors.New("cluster: the new metadata group elected no leader")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := n.creationStep(-1); err != nil {
		return err
	}
	boot := &raft.Configuration{Servers: []raft.Server{{ID: raft.ServerID(n.cfg.NodeID), Address: raft.ServerAddress(n.link.Addr())}}}
	if n.cfg.Seed != nil {
		// Each group starts from its share of the seed, as from a
		// snapshot: versions, expiries and fencing tokens as they were.
		parts := n.cfg.Seed.Split(n.cfg.Groups, func(k []byte) int { return int(store.Partition(k)) % n.cfg.Groups })
		for g, part := range parts {
			if err := replica.Seed(n.groupDir(g), n.cfg.NodeID, n.link.Addr(), part); err != nil {
				return fmt.Errorf("group %d: %w", g, err)
			}
		}
		boot = nil
	}
	for g := 0; g < n.cfg.Groups; g++ {
		if _, err := n.openGroup(g, boot); err != nil {
			return err
		}
		if err := n.creationStep(g); err != nil {
			return err
		}
	}
	for g := 0; g < n.cfg.Groups; g++ {
		if err := n.local(g).AwaitLeader(30 * time.Second); err != nil {
			return fmt.Errorf("group %d: %w", g, err)
		}
	}
	_, hi := n.protocols()
	op := meta.Op{Kind: meta.OpInit, Groups: n.cfg.Groups, RF: n.cfg.RF, Cluster: randomID(), Node: n.self(), Protocol: hi}
	if err := n.applyMeta(op); err != nil {
		return err
	}
	if err := n.recordClusterID(op.Cluster); err != nil {
		return err
	}
	if err := n.creationStep(n.cfg.Groups); err != nil {
		return err
	}
	if err := n.unmarkCreating(); err != nil {
		return err
	}
	n.creating.Store(false)
	n.log.Info("cluster created", "node", n.cfg.NodeID, "groups", n.cfg.Groups, "replicas", n.cfg.RF, "link", n.link.Addr())
	return nil
}

// noteRemoval marks this node removed once the metadata says so: it
// left, or `mqkv cluster remove` forgot it. It then answers no state
// store request (its replicas are going, and nothing tells it about the
// cluster any more), gives up leading its groups, and says so; coming
// back is an explicit step (see meta.ErrRemoved).
//
// Only a removal seen after the node was a member counts: a node joining
// anew replays the metadata's history, its earlier removal included.
func (n *Node) noteRemoval(st *meta.State) {
	if _, member := st.Node(n.cfg.NodeID); member {
		n.wasMember.Store(true)
		if n.removed.Swap(false) {
			n.log.Info("this node is a member of its cluster again", "node", n.cfg.NodeID)
		}
		return
	}
	if n.wasMember.Load() && st.IsGone(n.cfg.NodeID) {
		n.markRemoved(st.ID)
	}
}

// markRemoved marks this node removed from cluster, saying so once.
func (n *Node) markRemoved(cluster string) {
	if !n.removed.Swap(true) {
		n.log.Error("this node is no longer a member of its cluster: it left, or was removed with `mqkv cluster remove`; "+
			"it answers no state store request; stop it, or make it a member again with an empty data directory or --rejoin",
			"node", n.cfg.NodeID, "cluster", cluster)
	}
}

// NotMemberError answers requests on a node that is no longer a member
// of its cluster.
type NotMemberError struct{ Node string }

func (e *NotMemberError) Error() string {
	return "this node (" + e.Node + ") is no longer a member of its cluster; connect to another node"
}

// Reason is what a client is told (see statestore).
func (e *NotMemberError) Reason() string { return e.Error() }

// Removed reports whether this node is no longer a member of its cluster.
func (n *Node) Removed() bool { return n.removed.Load() }

// self is this node as a member.
func (n *Node) self() meta.Node {
	lo, hi := n.protocols()
	return meta.Node{ID: n.cfg.NodeID, Addr: n.link.Addr(), Inc: n.inc, Release: n.cfg.Release, ProtoMin: lo, ProtoMax: hi}
}

// protocols returns the cluster protocols this node speaks.
func (n *Node) protocols() (lo, hi int) {
	if p := n.cfg.Protocols; p != [2]int{} {
		return p[0], p[1]
	}
	return ProtocolMin, ProtocolMax
}

// Protocol returns the cluster protocol the cluster runs at, as this node
// knows it: what it may write to the logs and send the other members.
func (n *Node) Protocol() int {
	if st := n.state.Load(); st != nil {
		return st.Running()
	}
	return ProtocolMin
}

// RemembersRequests reports whether a write may carry the id of its
// request (store.Command.Request), to be executed once: on a node on its
// own, which alone reads its logs, or once every member reads them.
func (n *Node) RemembersRequests() bool { return n.link == nil || n.Protocol() >= protocolRequests }

// Arithmetic reports whether a write may be an arithmetic op (store.OpAdd,
// OpIncr, OpDecr): on a node on its own, or once every member applies
// them. A member of an earlier release finds none in the logs or on the
// node link, which it could not read.
func (n *Node) Arithmetic() bool { return n.link == nil || n.Protocol() >= protocolArithmetic }

// ValueOps reports whether a write may be a value op (store.OpAppend,
// OpPrepend, OpTouch) or a SET on condition that the key exists
// (store.IfExists), as Arithmetic does for the arithmetic ops.
func (n *Node) ValueOps() bool { return n.link == nil || n.Protocol() >= protocolValueOps }

func randomID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// clusterIDFile, in a node's directory, names the cluster its data belongs
// to (meta.State.ID).
const clusterIDFile = "cluster-id"

// recordClusterID writes, durably, the id of the cluster this node's data
// belongs to, once it is known (at the creation or the join; for data of a
// release before ids, when the metadata first names one).
func (n *Node) recordClusterID(id string) error {
	if n.cfg.Dir == "" || id == "" || n.named.Load() {
		return nil
	}
	if err := journal.WriteFileSync(n.cfg.Dir, clusterIDFile, []byte(id+"\n"), 0o644); err != nil {
		return err
	}
	n.named.Store(true)
	return nil
}

// incarnationFile keeps a node's incarnation until the node knows its
// cluster (see keepIncarnation).
const incarnationFile = "incarnation"

// keepIncarnation makes a node that has not yet learned its cluster keep
// one incarnation across restarts: its join may have been recorded while
// it never heard back (it stopped, or gave up), and a join under another
// incarnation would be taken for another node claiming its id. Once the
// node records its cluster, each process has its own again, so that a
// copy of the data directory is told from the node.
func (n *Node) keepIncarnation() error {
	path := filepath.Join(n.cfg.Dir, incarnationFile)
	if _, err := os.Stat(filepath.Join(n.cfg.Dir, clusterIDFile)); err == nil {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	}
	if b, err := os.ReadFile(path); err == nil && len(bytes.TrimSpace(b)) > 0 {
		n.inc = string(bytes.TrimSpace(b))
		return nil
	}
	if err := os.MkdirAll(n.cfg.Dir, 0o755); err != nil {
		return err
	}
	return journal.WriteFileSync(n.cfg.Dir, incarnationFile, []byte(n.inc+"\n"), 0o644)
}

// recordedClusterID returns the id recordClusterID wrote, or "" for data
// written before ids.
func (n *Node) recordedClusterID() (string, error) {
	if n.cfg.Dir == "" {
		return "", nil
	}
	b, err := os.ReadFile(filepath.Join(n.cfg.Dir, clusterIDFile))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	n.named.Store(true)
	return strings.TrimSpace(string(b)), nil
}

// creationMarker, in a node's directory, says it is making a new cluster
// that is not complete yet.
const creationMarker = "creating"

// markCreating records, durably, that a creation has begun: before the
// metadata group is bootstrapped, so that no trace of it can outlive a
// crash without the marker.
func (n *Node) markCreating() error {
	if n.cfg.Dir == "" {
		return nil
	}
	if err := os.MkdirAll(n.cfg.Dir, 0o755); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(n.cfg.Dir, creationMarker))
	if err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return journal.SyncDir(n.cfg.Dir)
}

// unmarkCreating records, durably, that the cluster is complete.
func (n *Node) unmarkCreating() error {
	if n.cfg.Dir == "" {
		return nil
	}
	if err := os.Remove(filepath.Join(n.cfg.Dir, creationMarker)); err != nil {
		return err
	}
	return journal.SyncDir(n.cfg.Dir)
}

// dropIfGone is --rejoin: it asks the members given with --join whether
// this node was removed from the cluster and, if it was, drops its
// replicas and metadata, so that it joins as a node without data.
func (n *Node) dropIfGone() error {
	if len(n.cfg.Join) == 0 {
		return errors.New("cluster: --rejoin needs --join: the members to join through")
	}
	if _, err := os.Stat(filepath.Join(n.cfg.Dir, "journal")); errors.Is(err, os.ErrNotExist) {
		return nil // no data: it joins as it is
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		for _, addr := range n.cfg.Join {
			var resp callResp
			err := n.link.Call(ctx, addr, callReq{Op: opMembership, Key: []byte(n.cfg.NodeID)}, &resp)
			if err != nil || resp.Kind != errNone {
				continue
			}
			switch {
			case resp.Member:
				return fmt.Errorf("cluster: --rejoin: %s is still a member of the cluster; its data is kept (start it without --rejoin)", n.cfg.NodeID)
			case !resp.Gone:
				n.log.Warn("--rejoin: the cluster does not know this node as removed; it restarts as it is", "node", n.cfg.NodeID)
				return nil
			}
			n.log.Warn("--rejoin: this node was removed from its cluster; its replicas and metadata are dropped, and it joins again without data",
				"node", n.cfg.NodeID, "dir", n.cfg.Dir)
			for _, name := range []string{"journal", "meta", "groups", clusterIDFile, incarnationFile} {
				if err := os.RemoveAll(filepath.Join(n.cfg.Dir, name)); err != nil {
					return err
				}
			}
			return journal.SyncDir(n.cfg.Dir)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster: --rejoin: no member answered through %v", n.cfg.Join)
		case <-time.After(time.Second):
		}
	}
}

// redoCreation deletes what a creation that did not finish left in dir
// (see create), so that it starts again from nothing.
func redoCreation(dir string, log *slog.Logger) error {
	if _, err := os.Stat(filepath.Join(dir, creationMarker)); err != nil {
		return nil
	}
	log.Warn("this node was creating a new cluster when it stopped; it starts the creation again", "dir", dir)
	for _, name := range []string{"journal", "meta", "groups"} {
		if err := os.RemoveAll(filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	return journal.SyncDir(dir)
}

// checkNothingLeft refuses to create a cluster over a member's data whose
// metadata log is gone (its journal lost or damaged): it would have made a
// new cluster there, and the groups without a snapshot came back empty
// (found by review). A creation that did not complete is started again
// (redoCreation), not refused.
func (n *Node) checkNothingLeft() error {
	if n.cfg.Dir == "" {
		return nil
	}
	if _, err := os.Stat(filepath.Join(n.cfg.Dir, creationMarker)); err == nil {
		return nil
	}
	what := ""
	if id, err := n.recordedClusterID(); err != nil {
		return err
	} else if id != "" {
		what = "it belongs to cluster " + id
	} else if groups, _ := os.ReadDir(filepath.Join(n.cfg.Dir, "groups")); len(groups) > 0 {
		what = "it holds replicas of a cluster's groups"
	}
	if what == "" {
		return nil
	}
	journalDir := filepath.Join(n.cfg.Dir, "journal")
	return &replica.DamagedError{Path: journalDir, What: "the node's journal",
		Err: fmt.Errorf("the cluster metadata is missing from this node's data (%s); a new cluster is not created over it", what)}
}

// creationStep runs the test hook, if any, at a step of create.
func (n *Node) creationStep(g int) error {
	if n.cfg.createHook == nil {
		return nil
	}
	return n.cfg.createHook(g)
}

// reopen restarts a member: its replicas are where it left them. If it was
// given members to join through, it tells them its address, which may
// have changed (the others could not reach it to say so otherwise).
//
// It waits for its cluster as long as it takes, saying so every
// reopenWait: after the whole cluster stopped, members come back one by
// one, and none can go on before a quorum of the metadata's members is up
// (each gave up after 30 s, so members started more than 30 s apart never
// formed a quorum; found by review). It cannot be closed meanwhile (Start
// has not returned it): the process is stopped by its signal's default.
func (n *Node) reopen() error {
	// The member it was: asked of whoever it knows, so that a node
	// removed since (or drained by a leave) is refused instead of taking
	// replicas again with its stale data (found by trying it: a process
	// supervisor's restart undid the leave). A node that knows nobody
	// else is the only member.
	if len(n.cfg.Join) > 0 || len(n.reopenAddrs()) > 0 {
		cluster, err := n.recordedClusterID()
		if err != nil {
			return err
		}
		op := meta.Op{Kind: meta.OpJoin, Checked: true, Cluster: cluster, Node: n.self()}
		// Said after two seconds, then every reopenWait: a restart
		// waited 9.6 s without a line (found by trying it).
		warnAt := time.Now().Add(min(2*time.Second, reopenWait))
		for {
			if n.closing() {
				return errors.New("cluster: node closed")
			}
			// A round a second: the members known may change meanwhile.
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			err = n.proposeMeta(ctx, op, n.reopenAddrs(), "")
			cancel()
			if !errors.Is(err, errNoMetaLeader) {
				break
			}
			if time.Now().After(warnAt) {
				warnAt = time.Now().Add(reopenWait)
				n.log.Warn("waiting for the cluster: no metadata leader answered, through the members given with --join nor those this node knows; a quorum of the cluster's members must be up", "join", n.cfg.Join, "answers", err)
			}
		}
		if err != nil {
			return err
		}
	}
	for n.awaitState(reopenWait, func(st *meta.State) bool { return st.Groups > 0 }) != nil {
		if n.closing() {
			return errors.New("cluster: node closed")
		}
		n.log.Warn("waiting for the cluster: the metadata is not yet committed; a quorum of the cluster's members must be up (a node removed from its cluster with `mqkv cluster remove` learns nothing more: start it with --join MEMBER to join again)")
	}
	entries, _ := os.ReadDir(filepath.Join(n.cfg.Dir, "groups"))
	for _, e := range entries {
		g, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if _, err := n.openGroup(g, nil); err != nil {
			return err
		}
	}
	n.wakeReconciler()
	return nil
}

// reopenWait is how often a restarting member says it is still waiting for
// its cluster.
var reopenWait = 30 * time.Second // a variable for tests

// awaitState waits until the metadata this node has applied satisfies ok.
func (n *Node) awaitState(timeout time.Duration, ok func(*meta.State) bool) error {
	deadline := time.Now().Add(timeout)
	for {
		if st := n.state.Load(); st != nil && ok(st) {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("cluster: timed out waiting for the cluster metadata")
		}
		select {
		case <-n.stop:
			return errors.New("cluster: node closed")
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// applyMeta proposes a metadata change on this node, the metadata leader.
func (n *Node) applyMeta(op meta.Op) error {
	f := n.meta.Apply(meta.EncodeOp(op), 10*time.Second)
	if err := f.Error(); err != nil {
		return err
	}
	if err, _ := f.Response().(error); err != nil {
		return err
	}
	return nil
}

// reopenAddrs is where a restarting member asks to be let back in: the
// members given with --join, and the metadata leader and members its own
// metadata replica knows of (a --join address may be stale: a member since
// removed; found by review).
func (n *Node) reopenAddrs() []string {
	addrs := slices.Clone(n.cfg.Join)
	if l := n.metaLeader(); l != "" {
		addrs = append(addrs, l)
	}
	if st := n.state.Load(); st != nil {
		for _, m := range st.Nodes {
			if m.ID != n.cfg.NodeID {
				addrs = append(addrs, m.Addr)
			}
		}
	}
	slices.Sort(addrs)
	return slices.Compact(addrs)
}

// metaLeader returns the link address of the metadata leader, if known.
func (n *Node) metaLeader() string {
	addr, _ := n.meta.LeaderWithID()
	return string(addr)
}

func (n *Node) wakeReconciler() {
	select {
	case n.changed <- struct{}{}:
	default:
	}
}
