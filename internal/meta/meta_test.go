package meta

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/hashicorp/raft"
)

func TestLifecycle(t *testing.T) {
	var s State
	steps := []struct {
		op      Op
		err     error
		active  []string
		members int
	}{
		{Op{Kind: OpJoin, Node: Node{ID: "n2", Addr: "b"}}, ErrNotInitiated, nil, 0},
		{Op{Kind: OpInit, Groups: 8, RF: 3, Node: Node{ID: "n1", Addr: "a"}}, nil, []string{"n1"}, 1},
		{Op{Kind: OpInit, Groups: 8, RF: 3, Node: Node{ID: "n9", Addr: "z"}}, ErrInitialized, []string{"n1"}, 1},
		{Op{Kind: OpLeave, Node: Node{ID: "n1"}}, ErrLastNode, []string{"n1"}, 1},
		{Op{Kind: OpJoin, Node: Node{ID: "n3", Addr: "c"}}, nil, []string{"n1", "n3"}, 2},
		{Op{Kind: OpJoin, Node: Node{ID: "n2", Addr: "b"}}, nil, []string{"n1", "n2", "n3"}, 3},
		{Op{Kind: OpJoin, Node: Node{ID: "n2", Addr: "b2"}}, nil, []string{"n1", "n2", "n3"}, 3},
		{Op{Kind: OpLeave, Node: Node{ID: "n2"}}, nil, []string{"n1", "n3"}, 3},
		{Op{Kind: OpRemove, Node: Node{ID: "n2"}}, nil, []string{"n1", "n3"}, 2},
		{Op{Kind: OpRemove, Node: Node{ID: "n2"}}, ErrUnknownNode, []string{"n1", "n3"}, 2},
		{Op{Kind: OpRemove, Node: Node{ID: "n3"}}, nil, []string{"n1"}, 1},
		{Op{Kind: OpRemove, Node: Node{ID: "n1"}}, ErrLastNode, []string{"n1"}, 1},
	}
	for i, st := range steps {
		if err := s.Apply(st.op); !errors.Is(err, st.err) {
			t.Fatalf("step %d %+v: error %v, want %v", i, st.op, err, st.err)
		}
		if !slices.Equal(s.Active(), st.active) || len(s.Nodes) != st.members {
			t.Fatalf("step %d: active %v members %d, want %v %d", i, s.Active(), len(s.Nodes), st.active, st.members)
		}
	}
	if n, _ := s.Node("n1"); n.Addr != "a" {
		t.Fatalf("n1 %+v", n)
	}
}

func TestPlacementFollowsMembership(t *testing.T) {
	var s State
	s.Apply(Op{Kind: OpInit, Groups: 16, RF: 3, Node: Node{ID: "n1", Addr: "a"}})
	if p := s.Placement(); len(p) != 16 || len(p[0]) != 1 {
		t.Fatalf("one node: %v", p)
	}
	s.Apply(Op{Kind: OpJoin, Node: Node{ID: "n2", Addr: "b"}})
	s.Apply(Op{Kind: OpJoin, Node: Node{ID: "n3", Addr: "c"}})
	for g, r := range s.Placement() {
		if len(r) != 3 {
			t.Fatalf("group %d: %v", g, r)
		}
	}
	s.Apply(Op{Kind: OpLeave, Node: Node{ID: "n3"}})
	for g, r := range s.Placement() {
		if slices.Contains(r, "n3") {
			t.Fatalf("group %d placed on a leaving node: %v", g, r)
		}
	}
}

func TestFSMRoundTrip(t *testing.T) {
	var got *State
	f := NewFSM(func(s *State) { got = s })
	op := Op{Kind: OpInit, Groups: 4, RF: 3, Node: Node{ID: "n1", Addr: "a:1"}}
	if err := f.Apply(&raft.Log{Type: raft.LogCommand, Data: EncodeOp(op)}); err != nil {
		t.Fatal(err)
	}
	if got == nil || got.Groups != 4 || len(got.Nodes) != 1 || got.Nodes[0].Addr != "a:1" {
		t.Fatalf("%+v", got)
	}
	if err := f.Apply(&raft.Log{Type: raft.LogCommand, Data: []byte{9, 9}}); err == nil {
		t.Fatal("garbage applied")
	}
}

// TestJoinsAreChecked: a checked join is refused, the state unchanged,
// when the node's data is another cluster's, when a node without data
// claims a member's id (unless it is the same incarnation retrying), or
// when another member has its address. Unchecked ops (logged by a release
// before the checks) apply as they did.
func TestJoinsAreChecked(t *testing.T) {
	var s State
	steps := []struct {
		op  Op
		err error
	}{
		{Op{Kind: OpInit, Groups: 8, RF: 3, Cluster: "c1", Node: Node{ID: "n1", Addr: "a", Inc: "i1"}}, nil},
		{Op{Kind: OpJoin, Checked: true, Cluster: "c2", Node: Node{ID: "n2", Addr: "b", Inc: "i2"}}, ErrOtherCluster},
		{Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "n2", Addr: "b", Inc: "i2"}}, nil},
		{Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "n2", Addr: "b", Inc: "i2"}}, nil}, // the same process retrying
		{Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "n2", Addr: "b", Inc: "i3"}}, ErrIDTaken},
		{Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "n3", Addr: "b", Inc: "i4"}}, ErrAddrTaken},
		{Op{Kind: OpJoin, Checked: true, Cluster: "c1", Node: Node{ID: "n2", Addr: "a", Inc: "i5"}}, ErrAddrTaken},
		{Op{Kind: OpJoin, Checked: true, Cluster: "c1", Node: Node{ID: "n2", Addr: "b2", Inc: "i5"}}, nil}, // restarted elsewhere
		{Op{Kind: OpJoin, Node: Node{ID: "n4", Addr: "a"}}, nil},                                           // unchecked: as before
		{Op{Kind: OpName, Cluster: "other"}, nil},                                                          // named already: no change
	}
	for i, st := range steps {
		before := s.Clone()
		err := s.Apply(st.op)
		if !errors.Is(err, st.err) {
			t.Fatalf("step %d %+v: error %v, want %v", i, st.op, err, st.err)
		}
		if err != nil && !reflect.DeepEqual(before, s.Clone()) {
			t.Fatalf("step %d refused but changed the state: %+v, was %+v", i, s, before)
		}
	}
	if s.ID != "c1" {
		t.Fatalf("cluster id %q", s.ID)
	}
	if n, _ := s.Node("n2"); n.Addr != "b2" || n.Inc != "i5" {
		t.Fatalf("n2 %+v", n)
	}
	var legacy State
	legacy.Apply(Op{Kind: OpInit, Groups: 8, RF: 3, Node: Node{ID: "n1", Addr: "a"}})
	if err := legacy.Apply(Op{Kind: OpJoin, Checked: true, Cluster: "c9", Node: Node{ID: "n2", Addr: "b"}}); err != nil {
		t.Fatalf("a cluster without an id refuses a join: %v", err)
	}
	legacy.Apply(Op{Kind: OpName, Cluster: "c1"})
	if legacy.ID != "c1" {
		t.Fatalf("OpName left %q", legacy.ID)
	}
}

// A removed member does not come back with its data: its checked join is
// refused until it comes without (Fresh); a leave ends in the same place.
func TestRemovedMemberStaysOut(t *testing.T) {
	var s State
	s.Apply(Op{Kind: OpInit, Groups: 8, RF: 3, Node: Node{ID: "n1", Addr: "a"}})
	for _, id := range []string{"n2", "n3"} {
		if err := s.Apply(Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: id, Addr: id}}); err != nil {
			t.Fatal(err)
		}
	}
	s.Apply(Op{Kind: OpRemove, Node: Node{ID: "n2"}})
	s.Apply(Op{Kind: OpLeave, Node: Node{ID: "n3"}})
	s.Apply(Op{Kind: OpRemove, Node: Node{ID: "n3"}})
	if !s.IsGone("n2") || !s.IsGone("n3") || s.IsGone("n1") {
		t.Fatalf("gone: %v", s.Gone)
	}
	for _, id := range []string{"n2", "n3"} {
		if err := s.Apply(Op{Kind: OpJoin, Checked: true, Node: Node{ID: id, Addr: id}}); !errors.Is(err, ErrRemoved) {
			t.Fatalf("%s back with its data: %v, want ErrRemoved", id, err)
		}
	}
	if len(s.Nodes) != 1 {
		t.Fatalf("members %v", s.Nodes)
	}
	if err := s.Apply(Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "n2", Addr: "n2"}}); err != nil {
		t.Fatalf("back without data: %v", err)
	}
	if s.IsGone("n2") || len(s.Active()) != 2 {
		t.Fatalf("after the fresh join: gone %v, active %v", s.Gone, s.Active())
	}
	// A join of a release before the checks applies as it did.
	if err := s.Apply(Op{Kind: OpJoin, Node: Node{ID: "n3", Addr: "n3"}}); err != nil {
		t.Fatal(err)
	}
	for i := range maxGone + 10 {
		id := fmt.Sprint("x", i)
		s.Apply(Op{Kind: OpJoin, Node: Node{ID: id, Addr: id}})
		s.Apply(Op{Kind: OpRemove, Node: Node{ID: id}})
	}
	if len(s.Gone) != maxGone || s.Gone[len(s.Gone)-1] != fmt.Sprint("x", maxGone+9) {
		t.Fatalf("gone: %d, last %s", len(s.Gone), s.Gone[len(s.Gone)-1])
	}
}

// The cluster protocol rises only to one every member speaks, never
// falls, and a joiner must speak the running one; a member of a release
// before protocols counts as speaking 1 only.
func TestProtocol(t *testing.T) {
	var s State
	must := func(op Op) {
		t.Helper()
		if err := s.Apply(op); err != nil {
			t.Fatal(err)
		}
	}
	must(Op{Kind: OpInit, Groups: 2, RF: 3, Node: Node{ID: "a", Addr: "a:1", ProtoMin: 1, ProtoMax: 2}, Protocol: 1})
	must(Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "old", Addr: "b:1"}}) // a release before protocols
	if s.Running() != 1 || s.Spoken() != 1 {
		t.Fatalf("running %d, spoken %d, want 1 and 1", s.Running(), s.Spoken())
	}
	if err := s.Apply(Op{Kind: OpProtocol, Protocol: 2}); !errors.Is(err, ErrProtocol) || s.Running() != 1 {
		t.Fatalf("protocol 2 with a member that speaks 1 only: %v, running %d", err, s.Running())
	}
	must(Op{Kind: OpJoin, Checked: true, Node: Node{ID: "old", Addr: "b:1", Release: "new", ProtoMin: 1, ProtoMax: 2}}) // upgraded
	if s.Spoken() != 2 {
		t.Fatalf("spoken %d, want 2", s.Spoken())
	}
	must(Op{Kind: OpProtocol, Protocol: 2})
	must(Op{Kind: OpProtocol, Protocol: 1})
	if s.Running() != 2 {
		t.Fatalf("running %d after a lower OpProtocol: it never falls", s.Running())
	}
	err := s.Apply(Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "c", Addr: "c:1", Release: "older", ProtoMin: 1, ProtoMax: 1}})
	if !errors.Is(err, ErrProtocol) || len(s.Nodes) != 2 {
		t.Fatalf("a joiner that speaks 1 only into a cluster at 2: %v, %d members", err, len(s.Nodes))
	}
	err = s.Apply(Op{Kind: OpJoin, Checked: true, Fresh: true, Node: Node{ID: "d", Addr: "d:1", Release: "newer", ProtoMin: 3, ProtoMax: 4}})
	if !errors.Is(err, ErrProtocol) {
		t.Fatalf("a joiner that no longer speaks 2: %v", err)
	}
}
