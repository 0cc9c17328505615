package store

import (
	"bytes"
	"fmt"
	"testing"
)

// applyReq applies c as the request id, remembered for keep ms.
func (h *harness) applyReq(id string, keep int64, c Command) (Result, []Event) {
	c.Request, c.Keep = []byte(id), keep
	return h.apply(c)
}

// TestRequestExecutedOnce: a command of a request already executed
// changes nothing and gets the first execution's result, whatever the
// store holds meanwhile; another request is executed.
func TestRequestExecutedOnce(t *testing.T) {
	h := newHarness(t)
	first, ev := h.applyReq("alice\x00c1", 10_000, Command{Op: OpSet, Cond: NX, Key: []byte("lock"), Value: []byte("alice")})
	if first.Outcome != Applied || first.Repeated || len(ev) != 1 {
		t.Fatalf("first: %+v, %d events", first, len(ev))
	}
	// Someone else changes the key: a repeat must not apply over it,
	// nor answer with what the command would do now.
	h.now++
	h.apply(Command{Op: OpSet, Key: []byte("lock"), Value: []byte("bob")})
	h.now++
	again, ev := h.applyReq("alice\x00c1", 10_000, Command{Op: OpSet, Cond: NX, Key: []byte("lock"), Value: []byte("alice")})
	if !again.Repeated || again.Outcome != Applied || again.Version != first.Version || len(ev) != 0 {
		t.Fatalf("repeat: %+v (first %+v), %d events", again, first, len(ev))
	}
	if e, _ := h.s.Get([]byte("lock"), h.now); string(e.Value) != "bob" {
		t.Fatalf("the repeat changed the key: %q", e.Value)
	}
	// The same correlation data from another requester is another request.
	other, _ := h.applyReq("carol\x00c1", 10_000, Command{Op: OpSet, Cond: NX, Key: []byte("lock"), Value: []byte("carol")})
	if other.Repeated || other.Outcome != NotApplied {
		t.Fatalf("another request: %+v", other)
	}
	// A delete, and its repeat after the key came back.
	del, _ := h.applyReq("alice\x00c2", 10_000, Command{Op: OpDel, Key: []byte("lock")})
	h.apply(Command{Op: OpSet, Key: []byte("lock"), Value: []byte("dave")})
	delAgain, _ := h.applyReq("alice\x00c2", 10_000, Command{Op: OpDel, Key: []byte("lock")})
	if del.Outcome != Applied || !delAgain.Repeated || delAgain.Outcome != Applied || delAgain.Version != del.Version {
		t.Fatalf("delete %+v, repeat %+v", del, delAgain)
	}
	if _, ok := h.s.Get([]byte("lock"), h.now); !ok {
		t.Fatal("the repeated delete removed the key set after it")
	}
	if h.s.Remembered() != 3 {
		t.Fatalf("remembered %d, want 3", h.s.Remembered())
	}
}

// TestRequestForgottenWhenDue: past its Keep, a request is executed
// again (its message expired: the broker would not deliver it), and the
// records due are dropped as commands pass.
func TestRequestForgottenWhenDue(t *testing.T) {
	h := newHarness(t)
	h.applyReq("a\x00x", 100, Command{Op: OpSet, Key: []byte("k"), Value: []byte("1")})
	h.now += 99
	if r, _ := h.applyReq("a\x00x", 100, Command{Op: OpSet, Key: []byte("k"), Value: []byte("1")}); !r.Repeated {
		t.Fatal("forgotten before due")
	}
	h.now++
	if r, ev := h.applyReq("a\x00x", 100, Command{Op: OpSet, Key: []byte("k"), Value: []byte("1")}); r.Repeated || len(ev) != 1 {
		t.Fatalf("remembered past due: %+v", r)
	}
	h.now += 1000
	for i := range forgetPerCommand {
		h.apply(Command{Op: OpSet, Key: fmt.Appendf(nil, "other%d", i), Value: []byte("v")})
	}
	if n := h.s.Remembered(); n != 0 {
		t.Fatalf("%d records kept past due", n)
	}
}

// TestRequestsBounded: the table keeps at most MaxRemembered, forgetting
// those due first.
func TestRequestsBounded(t *testing.T) {
	h := newHarness(t)
	for i := range MaxRemembered + 10 {
		// Due in the order of i, but the first ten last longest.
		keep := int64(1_000_000 + i)
		if i < 10 {
			keep = 10_000_000
		}
		h.applyReq(fmt.Sprint(i), keep, Command{Op: OpSet, Key: []byte("k"), Value: []byte("v")})
	}
	if n := h.s.Remembered(); n != MaxRemembered {
		t.Fatalf("remembered %d, want %d", n, MaxRemembered)
	}
	for _, id := range []string{"0", "9", fmt.Sprint(MaxRemembered + 9)} {
		if _, ok := h.s.requests.lookup([]byte(id), h.now); !ok {
			t.Fatalf("request %s forgotten", id)
		}
	}
	for _, id := range []string{"10", "19"} {
		if _, ok := h.s.requests.lookup([]byte(id), h.now); ok {
			t.Fatalf("request %s kept, due before those kept", id)
		}
	}
}

// TestRequestsInSnapshotsAndClones: the records travel in snapshots (a
// restored replica answers a repeat as the others do), stay apart in
// clones, and follow their keys in a split. A store without records
// writes the snapshot format earlier releases read.
func TestRequestsInSnapshotsAndClones(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("a"), Value: []byte("old")})
	if data := snapshotBytes(t, h.s); data[len(snapshotMagic)] != snapshotFormat {
		t.Fatalf("snapshot format %d without records", data[len(snapshotMagic)])
	}
	set, _ := h.applyReq("r1", 60_000, Command{Op: OpSet, Key: []byte("a"), Value: []byte("new")})
	h.applyReq("r2", 60_000, Command{Op: OpSet, Cond: NX, Key: []byte("b"), Value: []byte("x")})
	clone := h.s.Clone()
	h.applyReq("r3", 60_000, Command{Op: OpDel, Key: []byte("b")})
	if clone.Remembered() != 2 || h.s.Remembered() != 3 {
		t.Fatalf("clone %d, store %d records", clone.Remembered(), h.s.Remembered())
	}
	data := snapshotBytes(t, h.s)
	if data[len(snapshotMagic)] != snapshotFormatRequests {
		t.Fatalf("snapshot format %d with records", data[len(snapshotMagic)])
	}
	restored := New(Limits{})
	if err := restored.ReadSnapshot(bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(snapshotBytes(t, restored), data) {
		t.Fatal("restored store differs")
	}
	c := Command{Op: OpSet, Key: []byte("a"), Value: []byte("new"), Request: []byte("r1"), Keep: 60_000, Version: h.version(), Now: h.now}
	ra, _ := h.s.Apply(&c, nil)
	rb, _ := restored.Apply(&c, nil)
	if !ra.Repeated || fmt.Sprint(ra) != fmt.Sprint(rb) || ra.Version != set.Version || string(rb.Previous) != "old" {
		t.Fatalf("repeat answered %+v here, %+v restored (first %+v)", ra, rb, set)
	}
	for _, bad := range [][]byte{data[:len(data)-1], flip(data, len(data)-12)} {
		if err := New(Limits{}).ReadSnapshot(bytes.NewReader(bad)); err == nil {
			t.Fatal("a damaged snapshot with records was read")
		}
	}
	parts := h.s.Split(2, func(k []byte) int {
		if string(k) == "a" {
			return 0
		}
		return 1
	})
	if parts[0].Remembered() != 1 || parts[1].Remembered() != 2 {
		t.Fatalf("split: %d and %d records", parts[0].Remembered(), parts[1].Remembered())
	}
	if Merge(parts).Remembered() != 3 {
		t.Fatal("merge lost records")
	}
}

// TestBatchWithRequests: a batch with a request is written in format 4
// and read back whole; one without keeps format 3, which earlier
// releases read. A forwarded command carries its request.
func TestBatchWithRequests(t *testing.T) {
	cmds := []Command{
		{Op: OpSet, Key: []byte("k"), Value: []byte("v"), Version: ts(1), Request: []byte("client\x00corr"), Keep: 10_000},
		{Op: OpExpire, Key: []byte("e"), Expected: ts(2), Version: ts(3)},
	}
	b := AppendBatch(nil, Limits{}, cmds)
	if b[0] != batchFormatRequests {
		t.Fatalf("format %d", b[0])
	}
	_, got, err := DecodeBatch(b)
	if err != nil || len(got) != 2 || string(got[0].Request) != "client\x00corr" || got[0].Keep != 10_000 || len(got[1].Request) != 0 {
		t.Fatalf("decoded %+v, %v", got, err)
	}
	if b := AppendBatch(nil, Limits{}, cmds[1:]); b[0] != batchFormat {
		t.Fatalf("format %d without requests", b[0])
	}
	for _, c := range cmds {
		got, err := DecodeCommand(AppendCommand(nil, &c))
		if err != nil || fmt.Sprint(got) != fmt.Sprint(c) {
			t.Fatalf("forwarded %+v, got %+v, %v", c, got, err)
		}
	}
	// An empty request written out is not a form AppendCommand makes.
	tail := appendRequest(appendCommand(nil, &cmds[1]), &Command{})
	if _, err := DecodeCommand(tail); err == nil {
		t.Fatal("a command with an empty request decoded")
	}
}

// TestSnapshotCountsServerKeys: a restored store tells the server's own
// keys from the users' as the store it was taken from.
func TestSnapshotCountsServerKeys(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte(ReservedPrefix + "retained/a"), Value: []byte("m")})
	h.apply(Command{Op: OpSet, Key: []byte("user"), Value: []byte("v")})
	restored := New(Limits{})
	if err := restored.ReadSnapshot(bytes.NewReader(snapshotBytes(t, h.s))); err != nil {
		t.Fatal(err)
	}
	if restored.ServerKeys() != 1 || h.s.ServerKeys() != 1 {
		t.Fatalf("server keys %d restored, %d before", restored.ServerKeys(), h.s.ServerKeys())
	}
}

// TestArithmeticRequestsRemembered: an arithmetic op of a request is
// executed once, its repeat answered with the first execution's number,
// and the results (a number, a refusal) survive a snapshot.
func TestArithmeticRequestsRemembered(t *testing.T) {
	h := newHarness(t)
	first, _ := h.applyReq("c\x00r1", 60_000, Command{Op: OpAdd, Key: []byte("n"), Delta: 5})
	h.apply(Command{Op: OpAdd, Key: []byte("n"), Delta: 1})
	h.apply(Command{Op: OpSet, Key: []byte("t"), Value: []byte("text")})
	refused, _ := h.applyReq("c\x00r2", 60_000, Command{Op: OpAdd, Key: []byte("t"), Delta: 1})
	if first.Outcome != Applied || string(first.Previous) != "5" || refused.Outcome != NotANumber {
		t.Fatalf("first %+v, refused %+v", first, refused)
	}
	restored := New(Limits{})
	if err := restored.ReadSnapshot(bytes.NewReader(snapshotBytes(t, h.s))); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Store{h.s, restored} {
		again, ev := s.Apply(&Command{Op: OpAdd, Key: []byte("n"), Delta: 5, Request: []byte("c\x00r1"), Keep: 60_000, Version: h.version(), Now: h.now}, nil)
		if !again.Repeated || string(again.Previous) != "5" || !again.HadPrevious || len(ev) != 0 {
			t.Fatalf("repeat: %+v, %d events", again, len(ev))
		}
		if e, _ := s.Get([]byte("n"), h.now); string(e.Value) != "6" {
			t.Fatalf("a repeat counted: %q", e.Value)
		}
		again, _ = s.Apply(&Command{Op: OpAdd, Key: []byte("t"), Delta: 1, Request: []byte("c\x00r2"), Keep: 60_000, Version: h.version(), Now: h.now}, nil)
		if !again.Repeated || again.Outcome != NotANumber {
			t.Fatalf("refusal repeated: %+v", again)
		}
	}
}
