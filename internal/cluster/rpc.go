package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/meta"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// Calls between nodes. Wire format (msgpack by field name): new ops take
// new numbers at the end; fields may be added, never renamed.
type callOp uint8

const (
	opSubmit  callOp = 1 // a write, at the group's leader
	opGet     callOp = 2 // a linearizable read, at the group's leader
	opAscend  callOp = 3 // a page of a group, at its leader
	opMeta    callOp = 4 // a metadata change, at the metadata leader
	opStatus  callOp = 5 // this node's replicas: applied index per group
	opConfig  callOp = 6 // a group's configuration, at its leader
	opEvents  callOp = 7 // follow a group's change events (a stream)
	opCluster callOp = 8 // the cluster as this node sees it (mqkv cluster status)
	opCopy    callOp = 9 // a whole group's copy, at its leader (backups by releases before opCopyBegin)

	opCopyBegin  callOp = 10 // copy a group at its leader and hold the copy for paging (backups)
	opCopyPage   callOp = 11 // a page of a held copy
	opCopyEnd    callOp = 12 // drop a held copy
	opCopyKeep   callOp = 13 // a held copy is still being read
	opWho        callOp = 14 // which node answers here (Holder)
	opMembership callOp = 15 // whether node Key is a member, or was removed (Member, Gone)
)

// unknownCall answers an op this release does not know.
const unknownCall = "unknown call"

type callReq struct {
	Op     callOp
	Group  int
	Cmd    store.Command
	After  hlc.Timestamp
	Key    []byte
	From   []byte
	Prefix []byte
	Limit  int
	Meta   meta.Op
	Since  uint64 // opEvents: the last index already seen
	// FromStart asks an opEvents stream with Since 0 to begin at the
	// start of the member's ring rather than now (a release before it
	// begins now: the follower's history is shorter, not wrong).
	FromStart bool
	// AnyReplica asks a member that does not lead the group to start an
	// opEvents stream from its own ring all the same: the follower could
	// not reach the leader it was sent to (see follower.serve).
	AnyReplica bool
	Copy       uint64 // opCopyBegin, opCopyPage, opCopyEnd, opCopyKeep: the held copy (its id, chosen by the backup)
	// Relay asks a member that does not lead the group to carry an
	// opSubmit, opGet or opAscend to its leader (see Node.via).
	Relay bool
}

// Error kinds of a reply.
type errKind uint8

const (
	errNone      errKind = 0
	errNotLeader errKind = 1 // nothing done; Leader is the hint
	errUnknown   errKind = 2 // a write's outcome is unknown
	errOther     errKind = 3 // Err says what; nothing done
	errDiskFull  errKind = 4 // DiskFull says how full; nothing done
)

type callResp struct {
	Kind       errKind
	Err        string
	Leader     string
	LeaderAddr string // opMeta: for a node that knows no member yet
	Result     store.Result
	Entry      store.Entry
	Found      bool
	Entries    []store.Entry
	Exhausted  bool
	Applied    map[int]uint64
	Servers    []server
	Committed  bool // opConfig: Servers is the committed configuration
	Status     *Status
	Events     []entryEvents // opEvents frames
	Last       uint64        // opEvents: the index the frame leaves its reader at
	Snapshot   []byte        // opCopy: the group's store, in snapshot format
	Holder     string        // opCopyBegin: the node holding the copy (this one); opWho: this node
	Inc        string        // opWho: this process's incarnation
	// opWho: the groups this node leads, with their keys and bytes (see
	// Node.Totals).
	Leads      []groupFigures
	Keys       int           // opCopyBegin: its number of keys
	MaxVersion hlc.Timestamp // opCopyBegin: its greatest version; opEvents' first frame: the group's
	Floor      hlc.Timestamp // opEvents' first frame: above every change the stream does not carry (see follower.floors)
	HasFloor   bool          // Floor is set (zero is a floor: every change carried)
	More       bool          // opEvents: more parts of the same catch-up follow at once
	DiskFull   *replica.DiskFullError
	Member     bool // opMembership
	Gone       bool // opMembership
	// opStatus: the node's volume is full; its replicas take no entries
	// (see replica.DiskGuard.Room), so it is given no leadership.
	VolumeFull bool
	MQTT       *MQTTFigures // opStatus: the node's broker's figures
	// opWho: where this node's MQTT clients connect (MQTTFigures.Addr),
	// for the routes clients learn (Node.Routes).
	MQTTAddr   string
	ServerKeys int // opCopyBegin: of Keys, the server's own (store.ServerKeys)
}

type server struct {
	ID    string
	Voter bool
}

// serveStream serves a stream another node opened: a change stream.
func (n *Node) serveStream(from string, s net.Conn) {
	c := peer.NewConn(s)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var req callReq
	if err := c.Receive(&req); err != nil || req.Op != opEvents {
		return
	}
	c.SetReadDeadline(time.Time{})
	n.events.serve(c, req)
}

// serveCall answers a call from another node.
func (n *Node) serveCall(from string, body []byte) []byte {
	if len(body) > 0 && body[0] == binAppends {
		return n.serveAppends(body)
	}
	var req callReq
	resp := callResp{Kind: errOther, Err: "malformed call"}
	bin, err := decodeCall(body, &req)
	switch {
	case !n.started.Load():
		// Calls are taken from the start (there is no refusing them
		// otherwise, only leaving them unanswered), but n.meta is not
		// there yet: nothing done, the caller tries again.
		resp = callResp{Kind: errNotLeader}
	case err == nil:
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp = n.answer(ctx, req)
		cancel()
	}
	if bin { // the caller reads the binary forms
		return appendReply(nil, &resp)
	}
	out, _ := peer.Encode(resp)
	return out
}

func (n *Node) answer(ctx context.Context, req callReq) callResp {
	var resp callResp
	switch req.Op {
	case opSubmit, opGet, opAscend, opConfig, opCopy, opCopyBegin:
		r := n.local(req.Group)
		if req.Relay && (r == nil || r.Raft().State() != raft.Leader) {
			return n.relay(ctx, req)
		}
		if r == nil {
			return callResp{Kind: errNotLeader, Leader: n.leaderOf(req.Group)}
		}
		ready := r.LeaderReady
		if req.Op == opGet || req.Op == opAscend || req.Op == opCopy || req.Op == opCopyBegin {
			ready = r.ReadReady
		}
		if err := ready(ctx); err != nil {
			var nl *replica.NotLeaderError
			if errors.As(err, &nl) {
				return callResp{Kind: errNotLeader, Leader: nl.Leader}
			}
			return callResp{Kind: errOther, Err: err.Error()}
		}
		switch req.Op {
		case opSubmit:
			return n.submitHere(r, req)
		case opGet:
			resp.Entry, resp.Found = r.Get(req.Key)
		case opAscend:
			resp.Entries, resp.Exhausted = pageOf(r, req.From, req.Prefix, req.Limit)
		case opCopy:
			var buf bytes.Buffer
			if err := r.Copy().WriteSnapshot(&buf); err != nil {
				return callResp{Kind: errOther, Err: err.Error()}
			}
			resp.Snapshot = buf.Bytes()
		case opCopyBegin:
			st := r.Copy()
			if err := n.copies.hold(req.Copy, st); err != nil {
				return callResp{Kind: errOther, Err: err.Error()}
			}
			resp.Holder, resp.Keys, resp.ServerKeys, resp.MaxVersion = n.cfg.NodeID, st.Len(), st.ServerKeys(), st.MaxVersion()
		case opConfig:
			f := r.Raft().GetConfiguration()
			resp.Servers = serversOf(f.Configuration())
			resp.Committed = f.Error() == nil && r.Raft().CommitIndex() >= f.Index()
		}
	case opCopyPage:
		var err error
		if resp.Entries, resp.Exhausted, err = n.copies.page(req.Copy, req.From); err != nil {
			return callResp{Kind: errOther, Err: err.Error()}
		}
	case opCopyEnd:
		n.copies.drop(req.Copy)
	case opCopyKeep:
		if _, err := n.copies.touch(req.Copy); err != nil {
			return callResp{Kind: errOther, Err: err.Error()}
		}
	case opMeta:
		return n.metaHere(req.Meta)
	case opStatus:
		if !n.opened.Load() {
			// Its replicas are not open yet: a leaving member restarting
			// was taken for drained, and removed (found by test).
			return callResp{Kind: errOther, Err: "the node is starting"}
		}
		resp.Applied = map[int]uint64{}
		for g, r := range n.Groups() {
			resp.Applied[g] = r.Raft().AppliedIndex()
		}
		resp.VolumeFull = n.volumeFull()
		resp.MQTT = n.mqttFigures()
	case opCluster:
		st := n.Status()
		resp.Status = &st
	case opWho:
		resp.Holder, resp.Inc = n.cfg.NodeID, n.inc
		resp.Leads = n.share()
		resp.MQTTAddr = n.mqttAddr()
	case opMembership:
		st := n.state.Load()
		if st == nil || st.Groups == 0 {
			return callResp{Kind: errNotLeader}
		}
		_, resp.Member = st.Node(string(req.Key))
		resp.Gone = st.IsGone(string(req.Key))
	default:
		return callResp{Kind: errOther, Err: unknownCall}
	}
	return resp
}

// relay carries a request another member could not send to its group's
// leader (see Node.via) to the leader, once.
func (n *Node) relay(ctx context.Context, req callReq) callResp {
	if err := n.unready(); err != nil {
		return callResp{Kind: errNotLeader}
	}
	switch req.Op {
	case opSubmit:
		ch := make(chan callResp, 1)
		n.submitRemote(ctx, req.Group, req.Cmd, req.After, true, func(res store.Result, err error) {
			var df *replica.DiskFullError
			switch {
			case err == nil:
				ch <- callResp{Result: res}
			case errors.Is(err, replica.ErrOutcomeUnknown):
				ch <- callResp{Kind: errUnknown, Err: err.Error()}
			case errors.As(err, &df):
				ch <- callResp{Kind: errDiskFull, Err: err.Error(), DiskFull: df}
			case errors.Is(err, ErrNoLeader):
				ch <- callResp{Kind: errNotLeader} // nothing done: the caller goes on
			default:
				ch <- callResp{Kind: errOther, Err: err.Error()}
			}
		})
		return <-ch
	case opGet, opAscend:
		var resp callResp
		err := n.onLeader(ctx, req.Group, req, &resp, func(r *replica.Group) {
			if req.Op == opGet {
				resp.Entry, resp.Found = r.Get(req.Key)
			} else {
				resp.Entries, resp.Exhausted = pageOf(r, req.From, req.Prefix, req.Limit)
			}
		})
		if err != nil {
			return callResp{Kind: errNotLeader}
		}
		resp.Kind = errNone
		return resp
	}
	return callResp{Kind: errOther, Err: "not relayed"}
}

// submitHere applies a forwarded write on this leader.
func (n *Node) submitHere(r *replica.Group, req callReq) callResp {
	ch := make(chan callResp, 1)
	r.Submit(replica.Proposal{Cmd: req.Cmd, After: req.After, Done: func(res store.Result, err error) {
		var nl *replica.NotLeaderError
		var df *replica.DiskFullError
		switch {
		case err == nil:
			ch <- callResp{Result: res}
		case errors.As(err, &nl):
			ch <- callResp{Kind: errNotLeader, Leader: nl.Leader}
		case errors.Is(err, replica.ErrOutcomeUnknown):
			ch <- callResp{Kind: errUnknown, Err: err.Error()}
		case errors.As(err, &df):
			ch <- callResp{Kind: errDiskFull, Err: err.Error(), DiskFull: df}
		default:
			ch <- callResp{Kind: errOther, Err: err.Error()}
		}
	}})
	return <-ch
}

// metaHere applies a metadata change if this node leads the metadata
// group, and changes the metadata group's membership to match.
func (n *Node) metaHere(op meta.Op) callResp {
	if n.meta.State() != raft.Leader {
		addr, id := n.meta.LeaderWithID()
		return callResp{Kind: errNotLeader, Leader: string(id), LeaderAddr: string(addr)}
	}
	if n.creating.Load() {
		// Not a member to join yet (see create): the caller tries again.
		return callResp{Kind: errNotLeader}
	}
	// A leader just elected may not have applied the entries before its
	// term: judged on that state, a member's join was refused as "the
	// cluster does not exist yet", and a restarted member exited (found
	// by review). Until it has (a barrier, once a term), the caller tries
	// again.
	if term := n.meta.CurrentTerm(); n.metaReadyTerm.Load() != term {
		if n.meta.Barrier(5*time.Second).Error() != nil {
			return callResp{Kind: errNotLeader}
		}
		n.metaReadyTerm.Store(term)
	}
	if err := n.stillRunning(op); err != nil {
		return callResp{Kind: errOther, Err: err.Error()}
	}
	if op.Checked {
		// Judged here first, on a copy: a join refused only inside
		// Apply would still be in the log, and a node of a release
		// before the checks would apply it (during an upgrade).
		if err := n.metaFSM.State().Apply(op); err != nil {
			return callResp{Kind: errOther, Err: err.Error()}
		}
	}
	if err := n.applyMeta(op); err != nil {
		return metaFailed(op, err)
	}
	if err := n.fitMetaMembers(); err != nil {
		return metaFailed(op, err)
	}
	return callResp{}
}

// metaFailed answers a metadata change that failed. A join or a leave
// caught by an election (a loaded machine) is asked of the next leader:
// either applied twice changes nothing (a node started then exited with
// "leadership lost while committing log"; `cluster leave` failed so in a
// CI run).
func metaFailed(op meta.Op, err error) callResp {
	if (op.Kind == meta.OpJoin || op.Kind == meta.OpLeave) && (errors.Is(err, raft.ErrLeadershipLost) || errors.Is(err, raft.ErrNotLeader)) {
		return callResp{Kind: errNotLeader}
	}
	return callResp{Kind: errOther, Err: err.Error()}
}

// stillRunning refuses a member's join from a new address while a process
// still answers as that member at its old one: a copy of its data
// directory started elsewhere, which would take the member's place in
// every group while the original goes on.
func (n *Node) stillRunning(op meta.Op) error {
	st := n.state.Load()
	if op.Kind != meta.OpJoin || !op.Checked || st == nil {
		return nil
	}
	m, ok := st.Node(op.Node.ID)
	if !ok || m.Addr == op.Node.Addr || m.Inc == op.Node.Inc {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var resp callResp
	if err := n.link.Call(ctx, m.Addr, callReq{Op: opWho}, &resp); err != nil || resp.Holder != m.ID || resp.Inc == op.Node.Inc {
		// Gone, someone else there now, or the joiner itself (its old
		// address another name for where it listens): the member moved.
		return nil
	}
	return fmt.Errorf("node %s is running at %s: a copy of its data directory cannot join as it; give the copy an empty data directory (and its own --node-id)", m.ID, m.Addr)
}

// metaVoters is how many members vote in the metadata group; the others
// follow it as non-voters, so every node has the metadata locally.
const metaVoters = 3

// fitMetaMembers makes the metadata group's raft membership match the
// member list: the first metaVoters members (by id, among the active ones)
// vote, everyone else follows.
func (n *Node) fitMetaMembers() error {
	st := n.state.Load()
	if st == nil {
		return nil
	}
	cfg := n.meta.GetConfiguration().Configuration()
	have := map[string]raft.ServerSuffrage{}
	for _, s := range cfg.Servers {
		have[string(s.ID)] = s.Suffrage
		// A member that came back at another address: the same
		// suffrage, the new address.
		if m, ok := st.Node(string(s.ID)); ok && m.Addr != string(s.Address) {
			var err error
			if s.Suffrage == raft.Voter {
				err = n.meta.AddVoter(s.ID, raft.ServerAddress(m.Addr), 0, 10*time.Second).Error()
			} else {
				err = n.meta.AddNonvoter(s.ID, raft.ServerAddress(m.Addr), 0, 10*time.Second).Error()
			}
			if err != nil {
				return err
			}
		}
	}
	voters := 0
	for _, s := range cfg.Servers {
		if s.Suffrage == raft.Voter {
			voters++
		}
	}
	for _, m := range st.Nodes {
		suffrage, ok := have[m.ID]
		switch {
		case !ok && voters < metaVoters && m.State == meta.Active:
			if err := n.meta.AddVoter(raft.ServerID(m.ID), raft.ServerAddress(m.Addr), 0, 10*time.Second).Error(); err != nil {
				return err
			}
			voters++
		case !ok:
			if err := n.meta.AddNonvoter(raft.ServerID(m.ID), raft.ServerAddress(m.Addr), 0, 10*time.Second).Error(); err != nil {
				return err
			}
		case suffrage != raft.Voter && voters < metaVoters && m.State == meta.Active:
			if err := n.meta.AddVoter(raft.ServerID(m.ID), raft.ServerAddress(m.Addr), 0, 10*time.Second).Error(); err != nil {
				return err
			}
			voters++
		}
	}
	for id := range have {
		if _, ok := st.Node(id); !ok {
			if err := n.meta.RemoveServer(raft.ServerID(id), 0, 10*time.Second).Error(); err != nil {
				return err
			}
		}
	}
	return nil
}

// proposeMeta sends a metadata change to the metadata leader, through any
// of addrs (members' link addresses) until one answers or ctx ends. A
// member that does not let this node in for its credentials ends it at
// once (peer.ErrAuth: no retry will fix that); otherwise, at the end, the
// error says what each address answered last. If retries is set, every
// round that fails is logged at info, with why, under that name.
func (n *Node) proposeMeta(ctx context.Context, op meta.Op, addrs []string, retries string) error {
	tried := map[string]bool{}
	last := map[string]string{} // address → what it answered last
	for round := 1; ; round++ {
		for _, addr := range addrs {
			var resp callResp
			err := n.link.Call(ctx, addr, callReq{Op: opMeta, Meta: op}, &resp)
			switch {
			case err == nil && resp.Kind == errNone:
				return nil
			case err == nil && resp.Kind == errOther:
				return errors.New(resp.Err)
			case errors.Is(err, peer.ErrAuth):
				return fmt.Errorf("cluster: %s did not let this node in: %w", addr, err)
			case errors.Is(err, peer.ErrClosed):
				return err
			case err != nil:
				last[addr] = err.Error()
			case resp.LeaderAddr != "":
				last[addr] = "not the metadata leader; it names " + resp.LeaderAddr
				if !tried[resp.LeaderAddr] {
					tried[resp.LeaderAddr] = true
					addrs = append(addrs, resp.LeaderAddr)
				}
			default:
				last[addr] = "no metadata leader known there (is a quorum of the members up?)"
			}
		}
		if retries != "" {
			n.log.Info(retries+": no metadata leader answered; retrying", "round", round, "answers", describeAnswers(last))
		}
		select {
		case <-ctx.Done():
			if len(last) == 0 {
				return errNoMetaLeader
			}
			return fmt.Errorf("%w (%s)", errNoMetaLeader, describeAnswers(last))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// describeAnswers lists what each address answered, in address order.
func describeAnswers(last map[string]string) string {
	addrs := make([]string, 0, len(last))
	for a := range last {
		addrs = append(addrs, a)
	}
	slices.Sort(addrs)
	var b strings.Builder
	for i, a := range addrs {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(a + ": " + last[a])
	}
	return b.String()
}

// errNoMetaLeader: no member answered as the metadata leader in time.
var errNoMetaLeader = errors.New("cluster: no metadata leader answered: is a quorum of the first members up?")

// join adds this node to the cluster through the members in cfg.Join and
// waits until the metadata reached it.
func (n *Node) join() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	n.log.Info("joining the cluster", "node", n.cfg.NodeID, "through", n.cfg.Join)
	if err := n.proposeMeta(ctx, meta.Op{Kind: meta.OpJoin, Checked: true, Fresh: true, Node: n.self()}, n.cfg.Join, "joining the cluster"); err != nil {
		return err
	}
	if err := n.awaitState(60*time.Second, func(st *meta.State) bool { _, ok := st.Node(n.cfg.NodeID); return ok }); err != nil {
		return err
	}
	if err := n.recordClusterID(n.state.Load().ID); err != nil {
		return err
	}
	n.log.Info("joined the cluster", "node", n.cfg.NodeID, "members", len(n.state.Load().Nodes))
	n.wakeReconciler()
	return nil
}

// configOf lists a group's servers as its replica knows them.
// pageOf returns up to limit entries of r from from under prefix, and
// whether that was all. A page holds at most maxPageBytes of keys and
// values (one entry at least): its entries are copied, and sent over the
// node link, and a SCAN that matches nothing would otherwise copy up to
// limit values per group. The router goes on after a short page.
func pageOf(r *replica.Group, from, prefix []byte, limit int) (entries []store.Entry, exhausted bool) {
	size := 0
	exhausted = r.Ascend(from, prefix, limit, func(e *store.Entry) bool {
		if size >= maxPageBytes {
			return false
		}
		entries = append(entries, *e)
		size += len(e.Key) + len(e.Value)
		return true
	})
	return entries, exhausted
}

const maxPageBytes = 4 << 20

func configOf(r *replica.Group) []server {
	return serversOf(r.Raft().GetConfiguration().Configuration())
}

func serversOf(cfg raft.Configuration) []server {
	var out []server
	for _, s := range cfg.Servers {
		out = append(out, server{ID: string(s.ID), Voter: s.Suffrage == raft.Voter})
	}
	return out
}
