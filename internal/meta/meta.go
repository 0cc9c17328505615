// Package meta is the cluster's metadata: which nodes are members, at which
// addresses, whether they are leaving, and the shape of the keyspace (the
// number of replica groups and the replication factor). It is the state
// machine of the small metadata raft group every node follows; placement of
// the groups on the nodes is derived from it (package placement), never
// stored, so every node computes the same table from the same state.
//
// State is pure: Apply is a deterministic function of the ops, with no I/O
// and no clock. The raft FSM around it is in fsm.go.
package meta

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/mqkv/mqkv/internal/placement"
)

// NodeState is what the cluster knows of a member.
type NodeState uint8

// Node states. Wire format (logged and snapshotted): new states take new
// numbers at the end.
const (
	Active  NodeState = 1 // holds replicas as placement says
	Leaving NodeState = 2 // draining: placed nowhere, removed once empty
)

func (s NodeState) String() string {
	switch s {
	case Active:
		return "active"
	case Leaving:
		return "leaving"
	}
	return fmt.Sprintf("state(%d)", s)
}

// Node is one member.
type Node struct {
	ID    string
	Addr  string // node link address
	State NodeState
	// Inc is the incarnation of the process that last joined as the
	// node, random per start: a join retried by the same process is
	// told apart from another process claiming the id.
	Inc string
	// Release is the mqkv release the node last joined with, and
	// ProtoMin and ProtoMax the cluster protocols it speaks (see
	// State.Protocol); zero for a release before them, which speaks
	// protocol 1 only.
	Release            string
	ProtoMin, ProtoMax int
}

// Protocols returns the cluster protocols the node speaks.
func (n Node) Protocols() (lo, hi int) { return max(n.ProtoMin, 1), max(n.ProtoMax, 1) }

// State is the whole metadata.
type State struct {
	// ID names the cluster, drawn at random when it is created (or, for
	// a cluster created by a release before it, by its metadata leader,
	// OpName); a node's data directory records it, so that a node cannot
	// carry one cluster's data into another.
	ID     string
	Groups int // replica groups the 4096 partitions are spread over; fixed at creation
	RF     int // replicas per group
	Nodes  []Node
	// Gone lists the members removed (after a leave, or by `mqkv cluster
	// remove`), oldest first, at most maxGone: such a node's data is
	// stale, and a restart with it must not make it a member again (it
	// was let in and took replicas; found by trying it). It may join
	// again without data (Op.Fresh).
	Gone []string
	// Protocol is the cluster protocol the cluster runs at (zero:
	// 1, a cluster of releases before it): what its members may write to
	// the logs and send each other. It rises (OpProtocol) once every
	// member speaks a higher one, never falls, and a node that does not
	// speak it cannot join, as etcd's cluster version.
	Protocol int
}

// Running returns the protocol the cluster runs at.
func (s *State) Running() int { return max(s.Protocol, 1) }

// Spoken returns the highest protocol every member speaks (at least
// the running one: a member below it could not have joined).
func (s *State) Spoken() int {
	spoken := 0
	for _, n := range s.Nodes {
		if _, hi := n.Protocols(); spoken == 0 || hi < spoken {
			spoken = hi
		}
	}
	return max(spoken, s.Running())
}

// maxGone bounds State.Gone: the oldest are forgotten first.
const maxGone = 1024

// IsGone reports whether id was removed from the cluster (and has not
// joined again since).
func (s *State) IsGone(id string) bool { return slices.Contains(s.Gone, id) }

// OpKind names an operation. Wire format: written into the metadata log;
// new kinds take new numbers at the end, old ones keep their meaning.
type OpKind uint8

const (
	OpInit   OpKind = 1 // Groups, RF and the first node
	OpJoin   OpKind = 2 // add Node (or update its address)
	OpLeave  OpKind = 3 // mark Node.ID leaving
	OpRemove OpKind = 4 // forget Node.ID
	OpName   OpKind = 5 // name a cluster that has no ID yet Cluster
	// OpProtocol raises the cluster's protocol to Protocol. Proposed
	// only once every member speaks it, so never while a release that
	// does not know this kind is a member.
	OpProtocol OpKind = 6
)

// Op is one metadata change.
type Op struct {
	Kind   OpKind
	Node   Node
	Groups int
	RF     int
	// Cluster is the cluster's ID: OpInit and OpName set it; an OpJoin
	// carries the one the joiner's data belongs to (empty: none, or
	// data of a release before IDs).
	Cluster string
	// Fresh says that an OpJoin's node has no data: it may not take the
	// id of a member (whose replicas it does not hold) unless it is the
	// same incarnation retrying.
	Fresh bool
	// Checked says the op comes from a release that checks joins (the
	// cluster, the id, the address); ops logged before are applied as
	// they were.
	Checked bool
	// Protocol is OpInit's and OpProtocol's cluster protocol.
	Protocol int
}

// Errors of Apply; the state is unchanged when one is returned.
var (
	ErrInitialized  = errors.New("meta: the cluster already exists")
	ErrUnknownNode  = errors.New("meta: no such node")
	ErrLastNode     = errors.New("meta: the last active node cannot leave")
	ErrNotInitiated = errors.New("meta: the cluster does not exist yet")
	// ErrOtherCluster refuses a node whose data belongs to another
	// cluster.
	ErrOtherCluster = errors.New("meta: the node's data belongs to another cluster")
	// ErrIDTaken refuses a node without data that claims a member's id.
	ErrIDTaken = errors.New("meta: the node id is a member's")
	// ErrAddrTaken refuses a node at the address of another member.
	ErrAddrTaken = errors.New("meta: the address is another member's")
	// ErrRemoved refuses a node that was removed from the cluster and
	// comes back with its data.
	ErrRemoved = errors.New("meta: the node was removed from the cluster")
	// ErrProtocol refuses a node that does not speak the cluster's
	// protocol, and a protocol some member does not speak.
	ErrProtocol = errors.New("meta: cluster protocol not spoken")
)

// Apply applies op.
func (s *State) Apply(op Op) error {
	if op.Kind != OpInit && s.Groups == 0 {
		return ErrNotInitiated
	}
	switch op.Kind {
	case OpInit:
		if s.Groups != 0 {
			return ErrInitialized
		}
		if op.Groups <= 0 || op.RF <= 0 || op.Node.ID == "" {
			return fmt.Errorf("meta: bad init %+v", op)
		}
		s.ID, s.Groups, s.RF, s.Protocol = op.Cluster, op.Groups, op.RF, op.Protocol
		n := op.Node
		n.State = Active
		s.Nodes = []Node{n}
	case OpName:
		if s.ID == "" {
			s.ID = op.Cluster
		}
	case OpJoin:
		if op.Node.ID == "" || op.Node.Addr == "" {
			return fmt.Errorf("meta: bad join %+v", op.Node)
		}
		i := s.index(op.Node.ID)
		if op.Checked {
			if err := s.checkJoin(op, i); err != nil {
				return err
			}
		}
		if i >= 0 {
			s.Nodes[i].Addr = op.Node.Addr // a restarted node may move
			if op.Checked {
				s.Nodes[i].Inc = op.Node.Inc
			}
			// Its release may have changed (an upgrade, a rollback).
			s.Nodes[i].Release, s.Nodes[i].ProtoMin, s.Nodes[i].ProtoMax = op.Node.Release, op.Node.ProtoMin, op.Node.ProtoMax
			return nil
		}
		s.Gone = slices.DeleteFunc(s.Gone, func(id string) bool { return id == op.Node.ID }) // back without data
		n := op.Node
		n.State = Active
		s.Nodes = append(s.Nodes, n)
		sort.Slice(s.Nodes, func(a, b int) bool { return s.Nodes[a].ID < s.Nodes[b].ID })
	case OpLeave, OpRemove:
		i := s.index(op.Node.ID)
		if i < 0 {
			return ErrUnknownNode
		}
		if s.Nodes[i].State == Active && len(s.Active()) == 1 {
			return ErrLastNode // someone must hold the data
		}
		if op.Kind == OpLeave {
			s.Nodes[i].State = Leaving
		} else {
			s.Nodes = slices.Delete(s.Nodes, i, i+1)
			s.Gone = append(slices.DeleteFunc(s.Gone, func(id string) bool { return id == op.Node.ID }), op.Node.ID)
			if len(s.Gone) > maxGone {
				s.Gone = slices.Delete(s.Gone, 0, len(s.Gone)-maxGone)
			}
		}
	case OpProtocol:
		if op.Protocol <= s.Running() {
			return nil // it never falls
		}
		for _, n := range s.Nodes {
			if lo, hi := n.Protocols(); op.Protocol < lo || op.Protocol > hi {
				return fmt.Errorf("%w: member %s (mqkv %s) speaks cluster protocol %d to %d, not %d", ErrProtocol, n.ID, releaseOf(n), lo, hi, op.Protocol)
			}
		}
		s.Protocol = op.Protocol
	default:
		return fmt.Errorf("meta: unknown op %d", op.Kind)
	}
	return nil
}

// releaseOf names a member's release for a message.
func releaseOf(n Node) string {
	if n.Release == "" {
		return "of a release before 2026-11-28"
	}
	return n.Release
}

// checkJoin refuses a join that would mix two clusters' data, give a
// member's replicas to a node that does not hold them, or put two members
// at one address (raft refuses the second, after the member is recorded);
// i is the node's index, or -1 for a new member.
func (s *State) checkJoin(op Op, i int) error {
	if op.Cluster != "" && s.ID != "" && op.Cluster != s.ID {
		return fmt.Errorf("%w: this node's data directory is cluster %s's, the members it joins through are cluster %s's; "+
			"to join them, start it with an empty data directory", ErrOtherCluster, op.Cluster, s.ID)
	}
	if i < 0 && !op.Fresh && s.IsGone(op.Node.ID) {
		return fmt.Errorf("%w: %s was removed from the cluster (it left, or `mqkv cluster remove` forgot it), and its data "+
			"is stale; to make it a member again, start it with an empty data directory, or with --rejoin, which drops its "+
			"data and keeps its id", ErrRemoved, op.Node.ID)
	}
	if i >= 0 && op.Fresh && s.Nodes[i].Inc != op.Node.Inc {
		return fmt.Errorf("%w: %s is already a member, and this node has no data: if the member's data is lost, "+
			"remove it first (mqkv cluster remove %s), then start this node again, or start it with another --node-id", ErrIDTaken, op.Node.ID, op.Node.ID)
	}
	if err := s.Speaks(op.Node); err != nil {
		return err
	}
	for j, m := range s.Nodes {
		if j != i && m.Addr == op.Node.Addr {
			return fmt.Errorf("%w: %s is member %s's; if that node is gone, remove it first (mqkv cluster remove %s)", ErrAddrTaken, m.Addr, m.ID, m.ID)
		}
	}
	return nil
}

// Speaks refuses a node that does not speak the protocol the cluster runs
// at, naming both.
func (s *State) Speaks(n Node) error {
	if lo, hi := n.Protocols(); s.Running() < lo || s.Running() > hi {
		return fmt.Errorf("%w: this node runs mqkv %s, which speaks cluster protocol %d to %d, and the cluster runs at protocol %d "+
			"(its members: %s): start it with a release that speaks protocol %d", ErrProtocol, releaseOf(n), lo, hi, s.Running(), s.releases(), s.Running())
	}
	return nil
}

// releases lists the members' releases, for a message.
func (s *State) releases() string {
	var out []string
	for _, n := range s.Nodes {
		out = append(out, n.ID+" "+releaseOf(n))
	}
	return strings.Join(out, ", ")
}

func (s *State) index(id string) int {
	for i, n := range s.Nodes {
		if n.ID == id {
			return i
		}
	}
	return -1
}

// Node returns the member with id.
func (s *State) Node(id string) (Node, bool) {
	if i := s.index(id); i >= 0 {
		return s.Nodes[i], true
	}
	return Node{}, false
}

// Active returns the ids of the members that hold replicas.
func (s *State) Active() []string {
	var out []string
	for _, n := range s.Nodes {
		if n.State == Active {
			out = append(out, n.ID)
		}
	}
	return out
}

// Placement is where every group's replicas belong now.
func (s *State) Placement() placement.Table {
	return placement.Plan(s.Active(), s.Groups, s.RF)
}

// Clone returns a deep copy.
func (s *State) Clone() *State {
	c := *s
	c.Nodes = slices.Clone(s.Nodes)
	c.Gone = slices.Clone(s.Gone)
	return &c
}
