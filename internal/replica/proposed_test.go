package replica

import (
	"bytes"
	"fmt"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// taken counts the proposed entries the apply goroutines took.
var taken atomic.Int64

// Every test of the package compares the commands the apply goroutine
// takes from the proposer with what their entry's bytes decode to.
func init() {
	checkProposed = func(limits store.Limits, cmds []store.Command, data []byte) {
		if err := sameBatch(limits, cmds, data); err != nil {
			panic(err)
		}
		taken.Add(1)
	}
}

// sameBatch says how an entry's commands as the proposer built them
// differ from what its bytes decode to, if they do.
func sameBatch(limits store.Limits, cmds []store.Command, data []byte) error {
	dl, dc, err := store.DecodeBatch(data)
	if err != nil {
		return err
	}
	if dl != limits || len(dc) != len(cmds) {
		return fmt.Errorf("proposed entry: limits %+v, %d commands; decoded %+v, %d", limits, len(cmds), dl, len(dc))
	}
	for i := range cmds {
		a, b := cmds[i], dc[i]
		if !bytes.Equal(a.Key, b.Key) || !bytes.Equal(a.Value, b.Value) || !bytes.Equal(a.Request, b.Request) {
			return fmt.Errorf("proposed entry: command %d's bytes differ from its decoding", i)
		}
		a.Key, a.Value, a.Request, b.Key, b.Value, b.Request = nil, nil, nil, nil, nil, nil
		if !reflect.DeepEqual(a, b) {
			return fmt.Errorf("proposed entry: command %d %+v, decoded %+v", i, a, b)
		}
	}
	return nil
}

// TestLeaderAppliesWhatItProposed: the leader applies its entries from
// the commands it built, and they are what the entries' bytes hold, for
// every kind of command, the expiries the proposer adds itself included;
// a restart, which decodes them, rebuilds the same store.
func TestLeaderAppliesWhatItProposed(t *testing.T) {
	dir := t.TempDir()
	g, err := Open(Config{NodeID: "n1", Dir: dir, Limits: store.Limits{MaxKeys: -1, MaxBytes: 1 << 30}})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	before := taken.Load()
	set := write(t, g, store.Command{Op: store.OpSet, Key: []byte("fenced"), Value: []byte("v")}, hlc.Timestamp{})
	cmds := []store.Command{
		{Op: store.OpSet, Key: []byte("a"), Value: []byte("1"), Request: []byte("req-1"), Keep: 60000},
		{Op: store.OpSet, Key: []byte("b"), Value: []byte("2"), TTL: 1},
		{Op: store.OpSet, Key: []byte("c"), Value: []byte("3"), Cond: store.NX},
		{Op: store.OpSet, Key: []byte("fenced"), Value: []byte("w"), Fence: set.Version},
		{Op: store.OpVDel, Key: []byte("c"), Value: []byte("3")},
		{Op: store.OpDel, Key: []byte("a")},
		{Op: store.OpSet, Key: []byte("d"), Value: []byte{}, Cond: store.IfVersion, Expected: hlc.Timestamp{}},
	}
	for _, c := range cmds {
		write(t, g, c, hlc.Timestamp{Wall: time.Now().UnixMilli() + 5, Node: "other"})
	}
	time.Sleep(5 * time.Millisecond) // b expires: its next write is preceded by the proposer's Expire
	write(t, g, store.Command{Op: store.OpSet, Key: []byte("b"), Value: []byte("again")}, hlc.Timestamp{})
	if n := taken.Load() - before; n < int64(len(cmds))+2 {
		t.Fatalf("the apply goroutine took %d of the %d entries proposed", n, len(cmds)+2)
	}
	want := map[string]string{}
	g.Ascend(nil, nil, 0, func(e *store.Entry) bool {
		want[string(e.Key)] = string(e.Value) + "@" + e.Version.String()
		return true
	})
	g.fsm.mu.RLock()
	left := len(g.fsm.proposed)
	g.fsm.mu.RUnlock()
	if left != 0 {
		t.Fatalf("%d proposed entries kept after they were applied", left)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	g = open(t, dir, nil)
	defer g.Close()
	got := map[string]string{}
	g.Ascend(nil, nil, 0, func(e *store.Entry) bool {
		got[string(e.Key)] = string(e.Value) + "@" + e.Version.String()
		return true
	})
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after a restart the store holds %v, not %v", got, want)
	}
}

// TestProposedEntriesDropped: an entry whose future failed is forgotten,
// and entries proposed before the one applied are dropped, so that
// neither is applied from the proposer's commands later.
func TestProposedEntriesDropped(t *testing.T) {
	f := &fsm{}
	entry := func(v string) ([]byte, []store.Command) {
		c := []store.Command{{Op: store.OpSet, Key: []byte("k"), Value: []byte(v)}}
		return store.AppendBatch(nil, store.Limits{}, c), c
	}
	d1, c1 := entry("1")
	d2, c2 := entry("2")
	d3, c3 := entry("3")
	f.propose(d1, store.Limits{}, c1, nil)
	f.propose(d2, store.Limits{}, c2, nil)
	f.propose(d3, store.Limits{}, c3, nil)
	f.forget(d2, nil)
	if _, ok := f.takeProposed(&raft.Log{Data: d2}); ok {
		t.Fatal("a forgotten entry was taken")
	}
	if e, ok := f.takeProposed(&raft.Log{Data: d3}); !ok || string(e.cmds[0].Value) != "3" {
		t.Fatalf("entry 3: %v %v", e.cmds, ok)
	}
	if _, ok := f.takeProposed(&raft.Log{Data: d1}); ok {
		t.Fatal("an entry proposed before the one applied was taken")
	}
	// The same bytes elsewhere (an entry from the network) are not taken.
	f.propose(d1, store.Limits{}, c1, nil)
	if _, ok := f.takeProposed(&raft.Log{Data: append([]byte(nil), d1...)}); ok {
		t.Fatal("a copy of the entry's bytes was taken for it")
	}
}
