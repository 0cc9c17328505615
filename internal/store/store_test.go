package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand"
	"runtime"
	"testing"
	"unsafe"

	"github.com/mqkv/mqkv/internal/hlc"
)

// harness stamps commands the way a proposer does: a fresh version each,
// and the wall clock of the test.
type harness struct {
	t   *testing.T
	s   *Store
	now int64
	ctr uint64
}

func newHarness(t *testing.T) *harness {
	return &harness{t: t, s: New(Limits{}), now: 1_000_000}
}

func (h *harness) version() hlc.Timestamp {
	h.ctr++
	return hlc.Timestamp{Wall: h.now, Counter: h.ctr, Node: "n1"}
}

func (h *harness) apply(c Command) (Result, []Event) {
	c.Version = h.version()
	c.Now = h.now
	return h.s.Apply(&c, nil)
}

func ts(wall int64) hlc.Timestamp { return hlc.Timestamp{Wall: wall, Node: "c"} }

func TestSetGetDel(t *testing.T) {
	h := newHarness(t)
	res, ev := h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("v1")})
	if res.Outcome != Applied || res.Version.IsZero() {
		t.Fatalf("SET: %+v", res)
	}
	if len(ev) != 1 || ev[0].Kind != EventSet || string(ev[0].Value) != "v1" || ev[0].Version != res.Version {
		t.Fatalf("SET events: %+v", ev)
	}
	e, ok := h.s.Get([]byte("k"), h.now)
	if !ok || string(e.Value) != "v1" || e.Version != res.Version {
		t.Fatalf("GET: %+v %v", e, ok)
	}
	res2, _ := h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("v2")})
	if res2.Version.Compare(res.Version) <= 0 {
		t.Fatalf("version did not increase: %v then %v", res.Version, res2.Version)
	}
	del, ev := h.apply(Command{Op: OpDel, Key: []byte("k")})
	if del.Outcome != Applied || del.Version != res2.Version {
		t.Fatalf("DEL: %+v", del)
	}
	if len(ev) != 1 || ev[0].Kind != EventDelete {
		t.Fatalf("DEL events: %+v", ev)
	}
	if _, ok := h.s.Get([]byte("k"), h.now); ok {
		t.Fatal("GET after DEL found the key")
	}
	if again, ev := h.apply(Command{Op: OpDel, Key: []byte("k")}); again.Outcome != Missing || len(ev) != 0 || !again.Version.IsZero() {
		t.Fatalf("second DEL: %+v %+v", again, ev)
	}
	if h.s.Len() != 0 || h.s.Bytes() != 0 {
		t.Fatalf("accounting: len %d bytes %d", h.s.Len(), h.s.Bytes())
	}
}

func TestEmptyValueIsAValue(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("k"), Value: nil})
	e, ok := h.s.Get([]byte("k"), h.now)
	if !ok || len(e.Value) != 0 {
		t.Fatalf("GET of empty value: %+v %v", e, ok)
	}
}

func TestConditionalSetTruthTable(t *testing.T) {
	// The Go SDK's TestStateStoreConditionalSet truth table, plus NEX renewal.
	cases := []struct {
		name    string
		preset  []byte // nil: key absent
		cond    Cond
		value   string
		outcome Outcome
	}{
		{"always/absent", nil, Always, "a", Applied},
		{"always/present", []byte("x"), Always, "a", Applied},
		{"NX/absent", nil, NX, "a", Applied},
		{"NX/present same", []byte("a"), NX, "a", NotApplied},
		{"NX/present other", []byte("x"), NX, "a", NotApplied},
		{"NEX/absent", nil, NEX, "a", Applied},
		{"NEX/present same", []byte("a"), NEX, "a", Applied},
		{"NEX/present other", []byte("x"), NEX, "a", NotApplied},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			var prev hlc.Timestamp
			if c.preset != nil {
				r, _ := h.apply(Command{Op: OpSet, Key: []byte("k"), Value: c.preset})
				prev = r.Version
			}
			res, ev := h.apply(Command{Op: OpSet, Cond: c.cond, Key: []byte("k"), Value: []byte(c.value)})
			if res.Outcome != c.outcome {
				t.Fatalf("outcome %v, want %v", res.Outcome, c.outcome)
			}
			e, _ := h.s.Get([]byte("k"), h.now)
			switch c.outcome {
			case Applied:
				if string(e.Value) != c.value || e.Version != res.Version || res.Version.Compare(prev) <= 0 || len(ev) != 1 {
					t.Fatalf("applied: entry %+v res %+v events %d", e, res, len(ev))
				}
			case NotApplied:
				if string(e.Value) != string(c.preset) || res.Version != prev || len(ev) != 0 {
					t.Fatalf("not applied must report the current version and change nothing: %+v %+v", e, res)
				}
			}
		})
	}
}

func TestVDel(t *testing.T) {
	h := newHarness(t)
	if r, _ := h.apply(Command{Op: OpVDel, Key: []byte("k"), Value: []byte("v")}); r.Outcome != Missing {
		t.Fatalf("VDEL missing: %+v", r)
	}
	set, _ := h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("v")})
	if r, ev := h.apply(Command{Op: OpVDel, Key: []byte("k"), Value: []byte("other")}); r.Outcome != NotApplied || len(ev) != 0 {
		t.Fatalf("VDEL mismatch: %+v", r)
	}
	if _, ok := h.s.Get([]byte("k"), h.now); !ok {
		t.Fatal("VDEL mismatch deleted the key")
	}
	if r, ev := h.apply(Command{Op: OpVDel, Key: []byte("k"), Value: []byte("v")}); r.Outcome != Applied || r.Version != set.Version || len(ev) != 1 {
		t.Fatalf("VDEL match: %+v", r)
	}
}

func TestFencing(t *testing.T) {
	// Spec section 4.4, for each write command.
	type step struct {
		op      Op
		fence   hlc.Timestamp
		outcome Outcome
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"unfenced key accepts writes without token", []step{{OpSet, hlc.Timestamp{}, Applied}, {OpSet, hlc.Timestamp{}, Applied}, {OpDel, hlc.Timestamp{}, Applied}}},
		{"SET with token protects the key", []step{{OpSet, ts(10), Applied}, {OpSet, hlc.Timestamp{}, FenceRequired}, {OpDel, hlc.Timestamp{}, FenceRequired}, {OpVDel, hlc.Timestamp{}, FenceRequired}}},
		{"lower token rejected", []step{{OpSet, ts(10), Applied}, {OpSet, ts(9), FenceLower}, {OpDel, ts(9), FenceLower}, {OpVDel, ts(9), FenceLower}}},
		{"equal token accepted", []step{{OpSet, ts(10), Applied}, {OpSet, ts(10), Applied}, {OpDel, ts(10), Applied}}},
		{"newer token replaces older", []step{{OpSet, ts(10), Applied}, {OpSet, ts(20), Applied}, {OpSet, ts(15), FenceLower}, {OpSet, ts(20), Applied}}},
		{"token on unfenced existing key protects it", []step{{OpSet, hlc.Timestamp{}, Applied}, {OpSet, ts(5), Applied}, {OpSet, hlc.Timestamp{}, FenceRequired}}},
		{"fence goes with the key", []step{{OpSet, ts(10), Applied}, {OpDel, ts(11), Applied}, {OpSet, hlc.Timestamp{}, Applied}}},
		{"delete of absent key with token", []step{{OpDel, ts(1), Missing}}},
		{"write without token keeps the fence", []step{{OpSet, ts(10), Applied}, {OpSet, ts(12), Applied}, {OpSet, ts(11), FenceLower}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			for i, s := range c.steps {
				before := contents(h.s)
				cmd := Command{Op: s.op, Key: []byte("k"), Value: []byte("v"), Fence: s.fence}
				res, ev := h.apply(cmd)
				if res.Outcome != s.outcome {
					t.Fatalf("step %d (%v fence %v): outcome %v, want %v", i, s.op, s.fence, res.Outcome, s.outcome)
				}
				if s.outcome == FenceLower || s.outcome == FenceRequired {
					if len(ev) != 0 || before != contents(h.s) {
						t.Fatalf("step %d: a rejected write changed the store", i)
					}
				}
			}
		})
	}
}

func TestFencingCheckedBeforeCondition(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("v"), Fence: ts(10)})
	if r, _ := h.apply(Command{Op: OpSet, Cond: NX, Key: []byte("k"), Value: []byte("v")}); r.Outcome != FenceRequired {
		t.Fatalf("NX on fenced key without token: %v", r.Outcome)
	}
	if r, _ := h.apply(Command{Op: OpVDel, Key: []byte("k"), Value: []byte("other"), Fence: ts(1)}); r.Outcome != FenceLower {
		t.Fatalf("VDEL mismatch with low token: %v", r.Outcome)
	}
}

func TestExpiry(t *testing.T) {
	h := newHarness(t)
	set, _ := h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("v"), TTL: 100})
	if at, ok := h.s.NextExpiry(); !ok || at != h.now+100 {
		t.Fatalf("NextExpiry = %d %v", at, ok)
	}
	if _, ok := h.s.Get([]byte("k"), h.now+99); !ok {
		t.Fatal("gone before its deadline")
	}
	if _, ok := h.s.Get([]byte("k"), h.now+100); ok {
		t.Fatal("GET returned a key at its deadline")
	}
	var due []hlc.Timestamp
	h.s.Due(h.now+100, 10, func(key []byte, v hlc.Timestamp) { due = append(due, v) })
	if len(due) != 1 || due[0] != set.Version {
		t.Fatalf("Due = %v", due)
	}
	h.now += 100
	// An Expire for a stale version does nothing.
	if r, _ := h.apply(Command{Op: OpExpire, Key: []byte("k"), Expected: ts(1)}); r.Outcome != Missing {
		t.Fatalf("stale expire: %+v", r)
	}
	r, ev := h.apply(Command{Op: OpExpire, Key: []byte("k"), Expected: set.Version})
	if r.Outcome != Applied || len(ev) != 1 || ev[0].Kind != EventDelete {
		t.Fatalf("expire: %+v %+v", r, ev)
	}
	if _, ok := h.s.NextExpiry(); ok || h.s.Len() != 0 {
		t.Fatal("expiry index or keys not empty")
	}
}

// GetBy reads the clock only for a key that expires, and answers as Get.
func TestGetByReadsTheClockOnlyForKeysThatExpire(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("lasting"), Value: []byte("v")})
	h.apply(Command{Op: OpSet, Key: []byte("brief"), Value: []byte("v"), TTL: 100})
	reads := 0
	at := func(t int64) func() int64 { return func() int64 { reads++; return t } }
	if _, ok := h.s.GetBy([]byte("lasting"), at(h.now+1_000_000)); !ok || reads != 0 {
		t.Fatalf("a key without expiry: found %v, %d clock reads", ok, reads)
	}
	if _, ok := h.s.GetBy([]byte("brief"), at(h.now+99)); !ok || reads != 1 {
		t.Fatalf("before its deadline: found %v, %d clock reads", ok, reads)
	}
	if _, ok := h.s.GetBy([]byte("brief"), at(h.now+100)); ok {
		t.Fatal("GetBy returned a key at its deadline")
	}
	if _, ok := h.s.GetBy([]byte("absent"), at(h.now)); ok {
		t.Fatal("GetBy found an absent key")
	}
}

func TestExpiredKeyIsAbsentToWrites(t *testing.T) {
	h := newHarness(t)
	first, _ := h.apply(Command{Op: OpSet, Key: []byte("lock"), Value: []byte("a"), Fence: ts(50), TTL: 10})
	h.now += 10
	// Before the Expire commits: NX succeeds, fencing is gone with the entry.
	if r, _ := h.apply(Command{Op: OpSet, Cond: NX, Key: []byte("lock"), Value: []byte("b"), TTL: 10}); r.Outcome != Applied {
		t.Fatalf("NX on expired key: %v", r.Outcome)
	}
	// The late Expire for the old version is a no-op.
	if r, _ := h.apply(Command{Op: OpExpire, Key: []byte("lock"), Expected: first.Version}); r.Outcome != Missing {
		t.Fatalf("late expire: %v", r.Outcome)
	}
	e, ok := h.s.Get([]byte("lock"), h.now)
	if !ok || string(e.Value) != "b" || !e.Fence.IsZero() {
		t.Fatalf("entry %+v", e)
	}
	if h.s.Len() != 1 || h.s.expiry.Len() != 1 {
		t.Fatalf("len %d expiry %d", h.s.Len(), h.s.expiry.Len())
	}
	h.now += 10
	if r, _ := h.apply(Command{Op: OpDel, Key: []byte("lock")}); r.Outcome != Missing {
		t.Fatalf("DEL of expired key: %v", r.Outcome)
	}
}

// TestWriteOverAnExpiredValueReportsItsDelete: a write that replaces a
// value past its deadline, before the value's Expire is applied (the
// proposer adds one only for values already applied when it proposes),
// reports the expiry's DELETE first, at a version between the two
// values', so observers see every expiry (spec section 5.1). A failed
// write reports nothing; the Expire still comes.
func TestWriteOverAnExpiredValueReportsItsDelete(t *testing.T) {
	h := newHarness(t)
	first, _ := h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("a"), TTL: 1})
	h.now++
	if r, evs := h.apply(Command{Op: OpSet, Cond: IfVersion, Expected: first.Version, Key: []byte("k"), Value: []byte("x")}); r.Outcome != NotApplied || len(evs) != 0 {
		t.Fatalf("a refused write over the expired value: %v, events %+v", r.Outcome, evs)
	}
	r, evs := h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("b")})
	if r.Outcome != Applied || r.HadPrevious {
		t.Fatalf("write over the expired value: %+v", r)
	}
	if len(evs) != 2 || evs[0].Kind != EventDelete || string(evs[0].Key) != "k" || evs[1].Kind != EventSet || string(evs[1].Value) != "b" {
		t.Fatalf("events %+v, want the DELETE of a, then the SET of b", evs)
	}
	if d := evs[0].Version; d.Compare(first.Version) <= 0 || d.Compare(r.Version) >= 0 {
		t.Fatalf("DELETE at %v, want between %v and %v", d, first.Version, r.Version)
	}
	if r, _ := h.apply(Command{Op: OpExpire, Key: []byte("k"), Expected: first.Version}); r.Outcome != Missing {
		t.Fatalf("the late Expire of a: %v", r.Outcome)
	}

	// The DELETE's version is unique: not the version the clock issued
	// just before the write (often another change's), yet between the
	// two values'.
	for _, tc := range []struct{ old, v, want hlc.Timestamp }{
		{hlc.Timestamp{Wall: 5, Counter: 7, Node: "n1"}, hlc.Timestamp{Wall: 5, Counter: 8, Node: "n1"}, hlc.Timestamp{Wall: 5, Counter: 7, Node: "n1!"}},
		{hlc.Timestamp{Wall: 5, Counter: 7, Node: "n1"}, hlc.Timestamp{Wall: 6, Node: "n1"}, hlc.Timestamp{Wall: 5, Counter: hlc.MaxCounter, Node: "n1!"}},
		{hlc.Timestamp{Wall: 5, Counter: 7, Node: "n2"}, hlc.Timestamp{Wall: 5, Counter: 8, Node: "n1"}, hlc.Timestamp{Wall: 5, Counter: 7, Node: "n2!"}},
		{hlc.Timestamp{Wall: 5, Counter: 8, Node: "mqkv-1"}, hlc.Timestamp{Wall: 5, Counter: 8, Node: "mqkv-10"}, hlc.Timestamp{Wall: 5, Counter: 8, Node: "mqkv-1!"}},
	} {
		got := expiredAt(tc.old, tc.v)
		if got != tc.want || got.Compare(tc.old) <= 0 || got.Compare(tc.v) >= 0 {
			t.Fatalf("expiredAt(%v, %v) = %v, want %v, between them", tc.old, tc.v, got, tc.want)
		}
	}
}

// TestExpiredAwaitsItsExpire: Expired reports the version of an entry past
// its deadline and not yet removed, and nothing for live entries, keys
// without a deadline or absent keys.
func TestExpiredAwaitsItsExpire(t *testing.T) {
	h := newHarness(t)
	if _, ok := h.s.Expired([]byte("a"), h.now); ok {
		t.Fatal("empty store: a key expired")
	}
	short, _ := h.apply(Command{Op: OpSet, Key: []byte("short"), Value: []byte("v"), TTL: 10})
	h.apply(Command{Op: OpSet, Key: []byte("long"), Value: []byte("v"), TTL: 1000})
	h.apply(Command{Op: OpSet, Key: []byte("never"), Value: []byte("v")})
	for _, k := range []string{"short", "long", "never", "absent"} {
		if _, ok := h.s.Expired([]byte(k), h.now+9); ok {
			t.Fatalf("%s expired before any deadline", k)
		}
	}
	if v, ok := h.s.Expired([]byte("short"), h.now+10); !ok || v != short.Version {
		t.Fatalf("short at its deadline: %v %v, want version %v", v, ok, short.Version)
	}
	for _, k := range []string{"long", "never", "absent"} {
		if _, ok := h.s.Expired([]byte(k), h.now+10); ok {
			t.Fatalf("%s expired with short", k)
		}
	}
	h.apply(Command{Op: OpExpire, Key: []byte("short"), Expected: short.Version})
	if _, ok := h.s.Expired([]byte("short"), h.now+10); ok {
		t.Fatal("short still awaits its Expire once applied")
	}
}

func TestSetWithoutPXClearsExpiry(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("v"), TTL: 10})
	h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("v")})
	if _, ok := h.s.Get([]byte("k"), h.now+1000); !ok {
		t.Fatal("SET without PX kept the old expiry")
	}
	if _, ok := h.s.NextExpiry(); ok {
		t.Fatal("expiry index still holds the key")
	}
}

func TestQuota(t *testing.T) {
	h := newHarness(t)
	h.s.SetLimits(Limits{MaxKeys: 2, MaxBytes: 10})
	if r, _ := h.apply(Command{Op: OpSet, Key: []byte("a"), Value: []byte("1234")}); r.Outcome != Applied { // 5 bytes
		t.Fatal(r.Outcome)
	}
	if r, _ := h.apply(Command{Op: OpSet, Key: []byte("b"), Value: []byte("123456")}); r.Outcome != QuotaExceeded { // 12 bytes
		t.Fatalf("bytes over: %v", r.Outcome)
	}
	if r, _ := h.apply(Command{Op: OpSet, Key: []byte("b"), Value: []byte("1")}); r.Outcome != Applied {
		t.Fatal(r.Outcome)
	}
	before := contents(h.s)
	if r, ev := h.apply(Command{Op: OpSet, Key: []byte("c"), Value: nil}); r.Outcome != QuotaExceeded || len(ev) != 0 {
		t.Fatalf("keys over: %v", r.Outcome)
	}
	if before != contents(h.s) {
		t.Fatal("quota rejection changed the store")
	}
	// Overwriting an existing key with something no bigger always fits.
	if r, _ := h.apply(Command{Op: OpSet, Key: []byte("a"), Value: []byte("12")}); r.Outcome != Applied {
		t.Fatalf("shrink: %v", r.Outcome)
	}
	if h.s.Bytes() != 3+2 {
		t.Fatalf("bytes = %d", h.s.Bytes())
	}
}

func TestCloneIsIsolated(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("a"), Value: []byte("1")})
	snap := h.s.Clone()
	h.apply(Command{Op: OpSet, Key: []byte("a"), Value: []byte("2")})
	h.apply(Command{Op: OpSet, Key: []byte("b"), Value: []byte("3")})
	if e, _ := snap.Get([]byte("a"), h.now); string(e.Value) != "1" || snap.Len() != 1 {
		t.Fatalf("clone saw later writes: %+v len %d", e, snap.Len())
	}
}

// TestWritesInPlaceStayUnseenByCopies: a write changes the key's entry in
// place only while no clone, split or merge shares it; what those copies
// hold never changes, and the store's own indexes stay right.
func TestWritesInPlaceStayUnseenByCopies(t *testing.T) {
	h := newHarness(t)
	set := func(s *Store, v string, ttl int64) {
		t.Helper()
		c := Command{Op: OpSet, Key: []byte("a"), Value: []byte(v), TTL: ttl, Version: h.version(), Now: h.now}
		if r, _ := s.Apply(&c, nil); r.Outcome != Applied {
			t.Fatalf("SET a %s: %v", v, r.Outcome)
		}
	}
	get := func(s *Store) string {
		e, ok := s.Get([]byte("a"), h.now)
		if !ok {
			return "(none)"
		}
		return string(e.Value)
	}
	set(h.s, "1", 0)
	first := h.s.lookup([]byte("a"))
	set(h.s, "22", 50)
	if h.s.lookup([]byte("a")) != first {
		t.Fatal("the second write of a key no copy shares replaced its entry")
	}
	clone := h.s.Clone()
	set(h.s, "333", 0)
	set(h.s, "4444", 20) // in place again, on the entry made after the clone
	if got := get(clone); got != "22" {
		t.Fatalf("the clone sees %q, want 22", got)
	}
	parts := h.s.Split(2, func([]byte) int { return 0 })
	set(h.s, "5", 0)
	if got := get(parts[0]); got != "4444" {
		t.Fatalf("the split store sees %q after a write to its source, want 4444", got)
	}
	set(parts[0], "66", 0)
	if got := get(h.s); got != "5" {
		t.Fatalf("the source sees %q after a write to a split store, want 5", got)
	}
	merged := Merge(parts)
	set(parts[0], "777", 0)
	if got := get(merged); got != "66" {
		t.Fatalf("the merge sees %q after a write to a part, want 66", got)
	}
	// The store's own accounting after in-place writes, with and without
	// a deadline.
	for _, s := range []*Store{h.s, parts[0]} {
		key := s.lookup([]byte("a")).Key
		set(s, "88", 30)
		set(s, "77", 30) // the same deadline: its item is kept
		if s.expiry.Len() != 1 {
			t.Fatalf("%d expiry items for one key", s.expiry.Len())
		}
		s.expiry.Ascend(func(it expiryItem) bool {
			if it.at != h.now+30 || !sameBytes(it.key, key) {
				t.Fatalf("expiry item %d %q, want %d and the key's bytes", it.at, it.key, h.now+30)
			}
			return true
		})
		set(s, "999", 0)
		e := s.lookup([]byte("a"))
		if !sameBytes(e.Key, key) || cap(e.Key) != len(e.Key) {
			t.Fatal("an overwrite did not keep the key's own bytes")
		}
		if s.Bytes() != 1+3 || s.expiry.Len() != 0 || s.keys.Len() != 1 {
			t.Fatalf("bytes %d, expiry items %d, tree %d: want 4, 0, 1", s.Bytes(), s.expiry.Len(), s.keys.Len())
		}
		if got, ok := s.keys.Get(&Entry{Key: []byte("a")}); !ok || got != e {
			t.Fatal("the tree does not hold the changed entry")
		}
		for k := range s.index {
			if unsafe.StringData(k) != &e.Key[0] {
				t.Fatal("the index's key still holds an old entry's buffer (and so its old value)")
			}
		}
	}
}

// contents renders every stored entry, for "nothing changed" checks.
func contents(s *Store) string {
	var b bytes.Buffer
	s.keys.Ascend(func(e *Entry) bool {
		fmt.Fprintf(&b, "%q=%q v%v f%v x%d\n", e.Key, e.Value, e.Version, e.Fence, e.ExpiresAt)
		return true
	})
	fmt.Fprintf(&b, "bytes=%d expiry=%d", s.bytes, s.expiry.Len())
	return b.String()
}

func snapshotBytes(t *testing.T, s *Store) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := s.WriteSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// randomStore drives a store with a random command sequence.
func randomStore(t *testing.T, seed int64, n int) *harness {
	h := newHarness(t)
	rng := rand.New(rand.NewSource(seed))
	for i := 0; i < n; i++ {
		key := []byte(fmt.Sprintf("key-%d", rng.Intn(50)))
		val := make([]byte, rng.Intn(20))
		rng.Read(val)
		c := Command{Key: key, Value: val}
		switch rng.Intn(6) {
		case 0, 1:
			c.Op = OpSet
			c.Cond = Cond(rng.Intn(3))
			if rng.Intn(3) == 0 {
				c.TTL = int64(rng.Intn(500))
			}
			if rng.Intn(4) == 0 {
				c.Fence = ts(int64(rng.Intn(100)))
			}
		case 2:
			c.Op = OpDel
		case 3:
			c.Op = OpVDel
		case 4:
			c.Op = OpSet
		case 5:
			h.s.Due(h.now, 5, func(k []byte, v hlc.Timestamp) {
				h.apply(Command{Op: OpExpire, Key: append([]byte(nil), k...), Expected: v})
			})
			continue
		}
		h.apply(c)
		h.now += int64(rng.Intn(20))
	}
	return h
}

func TestSnapshotRoundTrip(t *testing.T) {
	h := randomStore(t, 1, 3000)
	data := snapshotBytes(t, h.s)
	restored := New(Limits{})
	if err := restored.ReadSnapshot(bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(snapshotBytes(t, restored), data) {
		t.Fatal("restored store differs")
	}
	if restored.Len() != h.s.Len() || restored.Bytes() != h.s.Bytes() || restored.MaxVersion() != h.s.MaxVersion() || restored.expiry.Len() != h.s.expiry.Len() {
		t.Fatalf("restored accounting differs: len %d/%d bytes %d/%d", restored.Len(), h.s.Len(), restored.Bytes(), h.s.Bytes())
	}
	// And it behaves the same from here on.
	a, b := h.s, restored
	for i := 0; i < 200; i++ {
		c := Command{Op: OpSet, Cond: Cond(i % 3), Key: []byte(fmt.Sprintf("key-%d", i%60)), Value: []byte{byte(i)}, Version: hlc.Timestamp{Wall: h.now + int64(i), Node: "n"}, Now: h.now + int64(i)}
		ra, _ := a.Apply(&c, nil)
		rb, _ := b.Apply(&c, nil)
		if fmt.Sprint(ra) != fmt.Sprint(rb) {
			t.Fatalf("diverged at %d: %+v vs %+v", i, ra, rb)
		}
	}
}

func TestSnapshotCorruptionRefused(t *testing.T) {
	h := randomStore(t, 2, 500)
	data := snapshotBytes(t, h.s)
	target := New(Limits{})
	target.Apply(&Command{Op: OpSet, Key: []byte("keep"), Value: []byte("me"), Version: ts(1)}, nil)
	for _, bad := range [][]byte{
		nil,
		data[:len(data)-1],
		append(append([]byte(nil), data...), 0),
		flip(data, 20),
		flip(data, len(data)/2),
		flip(data, len(data)-2),
		[]byte("NOTASNAPSHOT"),
	} {
		if err := target.ReadSnapshot(bytes.NewReader(bad)); err == nil {
			t.Fatalf("corrupt snapshot of %d bytes accepted", len(bad))
		}
		if e, ok := target.Get([]byte("keep"), 0); !ok || string(e.Value) != "me" || target.Len() != 1 {
			t.Fatal("failed restore changed the store")
		}
	}
}

func flip(b []byte, i int) []byte {
	c := append([]byte(nil), b...)
	c[i] ^= 0x40
	return c
}

func TestBatchRoundTrip(t *testing.T) {
	cmds := []Command{
		{Op: OpSet, Cond: NEX, Key: []byte("k"), Value: []byte("v"), Version: hlc.Timestamp{Wall: 5, Counter: 2, Node: "n"}, Now: 4, TTL: 100, Fence: ts(3)},
		{Op: OpDel, Key: []byte("k2"), Version: hlc.Timestamp{Wall: 6, Node: "n"}, Now: 6},
		{Op: OpExpire, Key: []byte{}, Expected: ts(9), Version: ts(10)},
	}
	limits, got, err := DecodeBatch(AppendBatch(nil, Limits{MaxKeys: 7, MaxBytes: 99}, cmds))
	if err != nil {
		t.Fatal(err)
	}
	if limits != (Limits{MaxKeys: 7, MaxBytes: 99}) {
		t.Fatalf("limits %+v", limits)
	}
	if len(got) != len(cmds) {
		t.Fatalf("got %d commands", len(got))
	}
	for i := range cmds {
		if fmt.Sprint(got[i]) != fmt.Sprint(cmds[i]) {
			t.Fatalf("command %d: got %+v, want %+v", i, got[i], cmds[i])
		}
	}
}

// TestBatchChecksum: damage anywhere in a log entry is detected, by the
// decoder and by VerifyBatch, instead of applying what it decodes to.
func TestBatchChecksum(t *testing.T) {
	b := AppendBatch(nil, Limits{MaxKeys: 7}, []Command{{Op: OpSet, Key: []byte("key"), Value: []byte("value"), Version: ts(1)}})
	if err := VerifyBatch(b); err != nil {
		t.Fatal(err)
	}
	for i := range b {
		bad := flip(b, i)
		if _, _, err := DecodeBatch(bad); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("byte %d flipped: DecodeBatch error %v", i, err)
		}
		if err := VerifyBatch(bad); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("byte %d flipped: VerifyBatch error %v", i, err)
		}
	}
}

// TestBatchFormat2StillDecodes: logs written before checksums (format 2,
// the first release's) are replayed unchanged.
func TestBatchFormat2StillDecodes(t *testing.T) {
	// SET "k" "v" at version 1:0:n under MaxKeys 3, as format 2 wrote it.
	v2 := []byte{2, 3, 0, 1, 1, 0, 1, 'k', 1, 'v', 2, 0, 1, 'n', 0, 0, 0, 0, 0, 0, 0, 0}
	limits, cmds, err := DecodeBatch(v2)
	if err != nil || limits.MaxKeys != 3 || len(cmds) != 1 || string(cmds[0].Key) != "k" || string(cmds[0].Value) != "v" || cmds[0].Version != (hlc.Timestamp{Wall: 1, Node: "n"}) {
		t.Fatalf("format 2: %+v %+v %v", limits, cmds, err)
	}
	if err := VerifyBatch(v2); err != nil {
		t.Fatal(err)
	}
	if err := VerifyBatch(v2[:len(v2)-1]); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("truncated format 2 entry: %v", err)
	}
}

func TestPartitionIsFixed(t *testing.T) {
	// Data placement depends on these values: they must never change.
	golden := map[string]uint16{"": 0, "a": 816, "key1": 551, "hello": 2892, "lock/leader": 2115}
	for k, want := range golden {
		if got := Partition([]byte(k)); got != want {
			t.Fatalf("Partition(%q) = %d, want %d", k, got, want)
		}
	}
}

func FuzzDecodeBatch(f *testing.F) {
	f.Add(AppendBatch(nil, Limits{MaxKeys: 3}, []Command{{Op: OpSet, Key: []byte("k"), Value: []byte("v"), Version: ts(1)}}))
	f.Add(AppendBatch(nil, Limits{}, []Command{{Op: OpSet, Key: []byte("k"), Value: []byte("v"), Version: ts(1), Request: []byte("c\x00r"), Keep: 5}}))
	f.Add(AppendBatch(nil, Limits{}, []Command{{Op: OpSet, Key: []byte("n"), Value: []byte("hdr7")}, {Op: OpAdd, Key: []byte("k"), Delta: -3},
		{Op: OpIncr, Key: []byte("n"), Value: []byte("hdr"), Delta: -1}, {Op: OpDecr, Key: []byte("n"), Delta: 9}}))
	f.Add(AppendBatch(nil, Limits{}, []Command{{Op: OpSet, Key: []byte("n"), Value: []byte("hdr7")}, {Op: OpAppend, Key: []byte("n"), Value: []byte("8")},
		{Op: OpPrepend, Key: []byte("n"), Value: []byte("hdr6"), Delta: 3}, {Op: OpTouch, Key: []byte("n"), TTL: 9}, {Op: OpSet, Cond: IfExists, Key: []byte("m")}}))
	f.Add([]byte{2, 0, 0, 255, 255, 255, 255, 15})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		limits, cmds, err := DecodeBatch(b)
		if err != nil {
			return
		}
		if again := AppendBatch(nil, limits, cmds); !bytes.Equal(again, b) {
			// Varints have one canonical form per value only when
			// minimal; a non-minimal input may decode, but re-decoding
			// the canonical form must give the same commands.
			limits2, cmds2, err := DecodeBatch(again)
			if err != nil || limits2 != limits || fmt.Sprint(cmds2) != fmt.Sprint(cmds) {
				t.Fatalf("unstable decode: %v", err)
			}
		}
		s := New(limits)
		for i := range cmds {
			s.Apply(&cmds[i], nil) // must not panic on any decoded command
		}
	})
}

func FuzzReadSnapshot(f *testing.F) {
	h := randomStore(&testing.T{}, 3, 50)
	var buf bytes.Buffer
	_ = h.s.WriteSnapshot(&buf)
	f.Add(buf.Bytes())
	h.applyReq("c\x00r", 1000, Command{Op: OpSet, Key: []byte("k"), Value: []byte("v")})
	h.applyReq("c\x00s", 1000, Command{Op: OpDel, Key: []byte("k")})
	buf.Reset()
	_ = h.s.WriteSnapshot(&buf)
	f.Add(buf.Bytes())
	f.Add([]byte(snapshotMagic + "\x01"))
	f.Fuzz(func(t *testing.T, b []byte) {
		s := New(Limits{})
		if err := s.ReadSnapshot(bytes.NewReader(b)); err != nil {
			if s.Len() != 0 {
				t.Fatal("failed restore left entries behind")
			}
			return
		}
		var out bytes.Buffer
		if err := s.WriteSnapshot(&out); err != nil {
			t.Fatal(err)
		}
	})
}

func TestVersionCondition(t *testing.T) {
	h := newHarness(t)
	k := []byte("k")
	if r, _ := h.apply(Command{Op: OpSet, Cond: IfVersion, Key: k, Value: []byte("a"), Expected: ts(5)}); r.Outcome != NotApplied {
		t.Fatalf("VER x on absent key: %v", r.Outcome)
	}
	first, _ := h.apply(Command{Op: OpSet, Cond: IfVersion, Key: k, Value: []byte("a")}) // VER 0: only if absent
	if first.Outcome != Applied || first.HadPrevious {
		t.Fatalf("VER 0 on absent key: %+v", first)
	}
	if r, _ := h.apply(Command{Op: OpSet, Cond: IfVersion, Key: k, Value: []byte("b")}); r.Outcome != NotApplied || r.Version != first.Version {
		t.Fatalf("VER 0 on existing key: %+v", r)
	}
	second, _ := h.apply(Command{Op: OpSet, Cond: IfVersion, Key: k, Value: []byte("b"), Expected: first.Version})
	if second.Outcome != Applied || string(second.Previous) != "a" || !second.HadPrevious {
		t.Fatalf("VER current: %+v", second)
	}
	if r, _ := h.apply(Command{Op: OpDel, Cond: IfVersion, Key: k, Expected: first.Version}); r.Outcome != NotApplied || r.Version != second.Version {
		t.Fatalf("DEL VER stale: %+v", r)
	}
	if r, _ := h.apply(Command{Op: OpDel, Cond: IfVersion, Key: k, Expected: second.Version}); r.Outcome != Applied {
		t.Fatalf("DEL VER current: %+v", r)
	}
	if r, _ := h.apply(Command{Op: OpDel, Cond: IfVersion, Key: k, Expected: second.Version}); r.Outcome != NotApplied {
		t.Fatalf("DEL VER on absent key: %+v", r)
	}
}

// TestVersionConditionModel drives VER writes at random against a plain map
// model: the store applies exactly when the model says the version matches.
func TestVersionConditionModel(t *testing.T) {
	h := newHarness(t)
	rng := rand.New(rand.NewSource(7))
	type entry struct {
		value   string
		version hlc.Timestamp
	}
	model := map[string]entry{}
	var seen []hlc.Timestamp // versions handed out, to guess with
	for i := 0; i < 5000; i++ {
		key := fmt.Sprintf("k%d", rng.Intn(8))
		var expect hlc.Timestamp
		switch rng.Intn(3) {
		case 0: // the right version (or absent)
			expect = model[key].version
		case 1: // an old one
			if len(seen) > 0 {
				expect = seen[rng.Intn(len(seen))]
			}
		}
		cur, exists := model[key]
		matches := exists && cur.version == expect || !exists && expect.IsZero()
		if rng.Intn(3) == 0 {
			r, _ := h.apply(Command{Op: OpDel, Cond: IfVersion, Key: []byte(key), Expected: expect})
			switch {
			case matches && exists:
				if r.Outcome != Applied {
					t.Fatalf("%d: DEL %s VER %v: %v, model says applied", i, key, expect, r.Outcome)
				}
				delete(model, key)
			case !exists && expect.IsZero():
				if r.Outcome != Missing {
					t.Fatalf("%d: DEL VER 0 on absent key: %v", i, r.Outcome)
				}
			default:
				if r.Outcome != NotApplied || r.Version != cur.version {
					t.Fatalf("%d: DEL %s VER %v: %+v, model has %v", i, key, expect, r, cur.version)
				}
			}
			continue
		}
		val := fmt.Sprint(i)
		r, _ := h.apply(Command{Op: OpSet, Cond: IfVersion, Key: []byte(key), Value: []byte(val), Expected: expect})
		if matches {
			if r.Outcome != Applied || r.HadPrevious != exists || (exists && string(r.Previous) != cur.value) {
				t.Fatalf("%d: SET %s VER %v: %+v, model says applied over %+v", i, key, expect, r, cur)
			}
			model[key] = entry{val, r.Version}
			seen = append(seen, r.Version)
		} else if r.Outcome != NotApplied || r.Version != cur.version {
			t.Fatalf("%d: SET %s VER %v: %+v, model has %+v", i, key, expect, r, cur)
		}
	}
	for k, e := range model {
		got, ok := h.s.Get([]byte(k), h.now)
		if !ok || string(got.Value) != e.value || got.Version != e.version {
			t.Fatalf("%s: store %+v, model %+v", k, got, e)
		}
	}
	if h.s.Len() != len(model) {
		t.Fatalf("store has %d keys, model %d", h.s.Len(), len(model))
	}
}

// BenchmarkGet: a point read among 10,000 and 1,000,000 keys.
func BenchmarkGet(b *testing.B) {
	for _, n := range []int{10_000, 1_000_000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			s := New(Limits{})
			keys := make([][]byte, n)
			for i := range keys {
				keys[i] = []byte(fmt.Sprintf("key-%d", i))
				c := Command{Op: OpSet, Key: keys[i], Value: []byte("value"), Version: hlc.Timestamp{Wall: 1, Counter: uint64(i)}, Now: 1}
				s.Apply(&c, nil)
			}
			r := rand.New(rand.NewSource(1))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, ok := s.Get(keys[r.Intn(n)], 1); !ok {
					b.Fatal("missing")
				}
			}
		})
	}
}

// BenchmarkSet: overwriting a random key among 10,000 and 1,000,000,
// with a 256-byte value, as a durable SET's apply does (redis-benchmark's
// SET with -r 10000 -d 256).
func BenchmarkSet(b *testing.B) {
	for _, n := range []int{10_000, 1_000_000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			s := New(Limits{})
			keys := make([][]byte, n)
			value := make([]byte, 256)
			for i := range keys {
				keys[i] = []byte(fmt.Sprintf("key:%012d", i))
				c := Command{Op: OpSet, Key: keys[i], Value: value, Version: hlc.Timestamp{Wall: 1, Counter: uint64(i)}, Now: 1}
				s.Apply(&c, nil)
			}
			r := rand.New(rand.NewSource(1))
			events := make([]Event, 0, 1)
			v := uint64(n)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				v++
				c := Command{Op: OpSet, Key: keys[r.Intn(n)], Value: value, Version: hlc.Timestamp{Wall: 1, Counter: v}, Now: 1}
				if res, _ := s.Apply(&c, events[:0]); res.Outcome != Applied {
					b.Fatal(res.Outcome)
				}
			}
		})
	}
}

// TestIndexFollowsTheTree: the point-lookup index holds exactly the
// tree's entries through random sets, deletes and expiries, a snapshot
// restore, a split and a merge; a clone, without one, reads the tree.
func TestIndexFollowsTheTree(t *testing.T) {
	h := newHarness(t)
	rng := rand.New(rand.NewSource(1))
	check := func(s *Store, what string) {
		t.Helper()
		if len(s.index) != s.keys.Len() {
			t.Fatalf("%s: index has %d keys, tree %d", what, len(s.index), s.keys.Len())
		}
		s.keys.Ascend(func(e *Entry) bool {
			if s.index[string(e.Key)] != e {
				t.Fatalf("%s: index entry for %q is not the tree's", what, e.Key)
			}
			return true
		})
	}
	for i := 0; i < 5000; i++ {
		key := []byte(fmt.Sprintf("k%d", rng.Intn(300)))
		switch rng.Intn(4) {
		case 0, 1:
			c := Command{Op: OpSet, Key: key, Value: []byte(fmt.Sprint(i))}
			if rng.Intn(3) == 0 {
				c.TTL = int64(1 + rng.Intn(5))
			}
			h.apply(c)
		case 2:
			h.apply(Command{Op: OpDel, Key: key})
		case 3:
			h.now++
			h.s.Due(h.now, 10, func(k []byte, v hlc.Timestamp) {
				h.apply(Command{Op: OpExpire, Key: k, Expected: v})
			})
		}
	}
	check(h.s, "after random writes")
	restored := New(Limits{})
	if err := restored.ReadSnapshot(bytes.NewReader(snapshotBytes(t, h.s))); err != nil {
		t.Fatal(err)
	}
	check(restored, "restored")
	parts := h.s.Split(3, func(k []byte) int { return int(k[len(k)-1]) % 3 })
	for i, p := range parts {
		check(p, fmt.Sprintf("part %d", i))
	}
	check(Merge(parts), "merged")
	clone := h.s.Clone()
	h.s.keys.Ascend(func(e *Entry) bool {
		if got, _ := clone.Get(e.Key, 0); got != e {
			t.Fatalf("clone: %q not found through the tree", e.Key)
		}
		return true
	})
}

// A corrupt field length (up to maxField, 1 GiB) in a short snapshot
// allocates about what the snapshot holds, not what the length claims.
func TestSnapshotCorruptLengthAllocatesLittle(t *testing.T) {
	data := append([]byte(snapshotMagic), snapshotFormat)
	data = AppendTimestamp(data, ts(1))
	data = binary.AppendUvarint(data, 1)
	data = binary.AppendUvarint(data, maxField) // the key's length
	data = append(data, bytes.Repeat([]byte("x"), 1000)...)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	err := New(Limits{}).ReadSnapshot(bytes.NewReader(data))
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("a truncated snapshot was read")
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 16<<20 {
		t.Fatalf("reading 1 KB with a 1 GiB length allocated %d MiB", got>>20)
	}
}

const noKey = "\x00no key"

// TestArithmetic: OpAdd is Redis's INCRBY, OpIncr and OpDecr memcached's
// incr and decr, each applied to what the key holds when the log gets to
// it, stored as a SET of the number would be.
func TestArithmetic(t *testing.T) {
	type step struct {
		op      Op
		prefix  string
		delta   int64
		outcome Outcome
		value   string // what the key holds after
	}
	cases := []struct {
		name  string
		start string // noKey for none
		steps []step
	}{
		{"INCRBY creates from 0", noKey, []step{{OpAdd, "", 5, Applied, "5"}, {OpAdd, "", -7, Applied, "-2"}, {OpAdd, "", 2, Applied, "0"}}},
		{"INCRBY overflows", "9223372036854775806", []step{{OpAdd, "", 1, Applied, "9223372036854775807"}, {OpAdd, "", 1, Overflow, "9223372036854775807"}}},
		{"DECRBY overflows", "-9223372036854775807", []step{{OpAdd, "", -1, Applied, "-9223372036854775808"}, {OpAdd, "", -1, Overflow, "-9223372036854775808"}}},
		{"INCRBY of text", "abc", []step{{OpAdd, "", 1, NotANumber, "abc"}}},
		{"INCRBY of a padded number", "007", []step{{OpAdd, "", 1, NotANumber, "007"}}},
		{"INCRBY of a plus sign", "+7", []step{{OpAdd, "", 1, NotANumber, "+7"}}},
		{"INCRBY of minus zero", "-0", []step{{OpAdd, "", 1, NotANumber, "-0"}}},
		{"INCRBY of an empty value", "", []step{{OpAdd, "", 1, NotANumber, ""}}},
		{"incr wraps", "18446744073709551615", []step{{OpIncr, "", 2, Applied, "1"}}},
		{"incr reads leading zeros", "007", []step{{OpIncr, "", 1, Applied, "8"}}},
		{"decr stops at 0", "5", []step{{OpDecr, "", 3, Applied, "2"}, {OpDecr, "", 3, Applied, "0"}}},
		{"incr of a missing key", noKey, []step{{OpIncr, "", 1, Missing, ""}, {OpDecr, "", 1, Missing, ""}}},
		{"incr of a negative number", "-1", []step{{OpIncr, "", 1, NotANumber, "-1"}}},
		{"incr keeps the prefix", "hdr:41", []step{{OpIncr, "hdr:", 1, Applied, "hdr:42"}, {OpDecr, "hdr:", 50, Applied, "hdr:0"}}},
		{"incr with another prefix", "hdr:41", []step{{OpIncr, "xyz:", 1, NotApplied, "hdr:41"}, {OpIncr, "", 1, NotANumber, "hdr:41"}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			if c.start != noKey {
				h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte(c.start)})
			}
			for i, s := range c.steps {
				before, had := h.s.Get([]byte("k"), h.now)
				var was hlc.Timestamp
				if had {
					was = before.Version
				}
				res, ev := h.apply(Command{Op: s.op, Key: []byte("k"), Value: []byte(s.prefix), Delta: s.delta})
				if res.Outcome != s.outcome {
					t.Fatalf("step %d: outcome %v, want %v", i, res.Outcome, s.outcome)
				}
				e, ok := h.s.Get([]byte("k"), h.now)
				if ok != (s.value != "" || had) || ok && string(e.Value) != s.value {
					t.Fatalf("step %d: the key holds %+v (%v), want %q", i, e, ok, s.value)
				}
				if s.outcome != Applied {
					if len(ev) != 0 || ok && e.Version != was {
						t.Fatalf("step %d: a refused op changed the key: %+v", i, ev)
					}
					continue
				}
				if string(res.Previous) != s.value || !res.HadPrevious || res.Version != e.Version {
					t.Fatalf("step %d: result %+v for %q", i, res, s.value)
				}
				if len(ev) != 1 || ev[0].Kind != EventSet || string(ev[0].Value) != s.value || ev[0].Version != e.Version {
					t.Fatalf("step %d: events %+v", i, ev)
				}
			}
		})
	}
}

// An arithmetic op keeps the key's expiry, its fence, and the quota's
// rule, as a SET of the number would.
func TestArithmeticKeepsExpiryAndFence(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("1"), TTL: 5000})
	deadline, _ := h.s.Get([]byte("k"), h.now)
	h.now += 1000
	if res, _ := h.apply(Command{Op: OpAdd, Key: []byte("k"), Delta: 1}); res.Outcome != Applied {
		t.Fatal(res.Outcome)
	}
	if e, _ := h.s.Get([]byte("k"), h.now); e.ExpiresAt != deadline.ExpiresAt || e.ExpiresAt == 0 {
		t.Fatalf("expiry %d after INCRBY, was %d", e.ExpiresAt, deadline.ExpiresAt)
	}
	h.now += 5000
	if res, _ := h.apply(Command{Op: OpAdd, Key: []byte("k"), Delta: 1}); res.Outcome != Applied || string(res.Previous) != "1" {
		t.Fatalf("INCRBY of an expired key: %+v (counts from 0)", res)
	}
	if e, _ := h.s.Get([]byte("k"), h.now); e.ExpiresAt != 0 {
		t.Fatalf("a key created by INCRBY expires at %d", e.ExpiresAt)
	}

	h.apply(Command{Op: OpSet, Key: []byte("f"), Value: []byte("1"), Fence: ts(10)})
	for _, c := range []struct {
		fence   hlc.Timestamp
		outcome Outcome
	}{{hlc.Timestamp{}, FenceRequired}, {ts(9), FenceLower}, {ts(10), Applied}} {
		if res, _ := h.apply(Command{Op: OpIncr, Key: []byte("f"), Delta: 1, Fence: c.fence}); res.Outcome != c.outcome {
			t.Fatalf("incr with fence %v: %v, want %v", c.fence, res.Outcome, c.outcome)
		}
	}
	if e, _ := h.s.Get([]byte("f"), h.now); e.Fence != ts(10) || string(e.Value) != "2" {
		t.Fatalf("fenced key after incr: %+v", e)
	}
	// The fence before the value: a client it keeps out is not told
	// whether the key holds a number.
	h.apply(Command{Op: OpSet, Key: []byte("f"), Value: []byte("text"), Fence: ts(10)})
	for _, op := range []Op{OpAdd, OpIncr, OpDecr} {
		if res, _ := h.apply(Command{Op: op, Key: []byte("f"), Delta: 1}); res.Outcome != FenceRequired || !res.Version.IsZero() {
			t.Fatalf("op %d on a fenced key of text without a token: %+v", op, res)
		}
		if res, _ := h.apply(Command{Op: op, Key: []byte("f"), Value: []byte("x"), Delta: 1, Fence: ts(9)}); res.Outcome != FenceLower {
			t.Fatalf("op %d with a lower token and another prefix: %v", op, res.Outcome)
		}
	}

	q := &harness{t: t, s: New(Limits{MaxBytes: 2}), now: 1}
	q.apply(Command{Op: OpSet, Key: []byte("q"), Value: []byte("9")})
	if res, _ := q.apply(Command{Op: OpAdd, Key: []byte("q"), Delta: 1}); res.Outcome != QuotaExceeded {
		t.Fatalf("INCRBY past the quota: %v", res.Outcome)
	}
}

// The arithmetic ops go through a log entry with their delta where a
// SET's TTL goes, and only without a condition.
func TestArithmeticBatchRoundTrip(t *testing.T) {
	cmds := []Command{
		{Op: OpAdd, Key: []byte("a"), Delta: -3, Version: ts(1), Now: 1},
		{Op: OpIncr, Key: []byte("b"), Value: []byte("p"), Delta: -1, Version: ts(2), Now: 2}, // 2^64-1
		{Op: OpDecr, Key: []byte("c"), Delta: 7, Version: ts(3), Now: 3, Fence: ts(1)},
	}
	_, got, err := DecodeBatch(AppendBatch(nil, Limits{}, cmds))
	if err != nil {
		t.Fatal(err)
	}
	for i := range cmds {
		if fmt.Sprint(got[i]) != fmt.Sprint(cmds[i]) {
			t.Fatalf("command %d: got %+v, want %+v", i, got[i], cmds[i])
		}
		one, err := DecodeCommand(AppendCommand(nil, &cmds[i]))
		if err != nil || fmt.Sprint(one) != fmt.Sprint(cmds[i]) {
			t.Fatalf("command %d forwarded: %+v %v", i, one, err)
		}
	}
	bad := Command{Op: OpAdd, Cond: NX, Key: []byte("a"), Delta: 1}
	if _, err := DecodeCommand(AppendCommand(nil, &bad)); err == nil {
		t.Fatal("an arithmetic op with a condition decoded")
	}
}

// The value ops (OpAppend, OpPrepend, OpTouch) and SET's IfExists, step by
// step on one key: what each does to it, and that a refused one changes
// nothing.
func TestValueOps(t *testing.T) {
	type step struct {
		op      Op
		cond    Cond
		value   string
		delta   int64
		ttl     int64
		outcome Outcome
		holds   string // what the key holds after (noKey: none)
	}
	cases := []struct {
		name  string
		start string // noKey for none
		steps []step
	}{
		{"APPEND creates", noKey, []step{{OpAppend, Always, "ab", 0, 0, Applied, "ab"}, {OpAppend, Always, "c", 0, 0, Applied, "abc"}}},
		{"append needs a key", noKey, []step{{OpAppend, IfExists, "ab", 0, 0, Missing, noKey}}},
		{"append to a key", "x", []step{{OpAppend, IfExists, "yz", 0, 0, Applied, "xyz"}, {OpAppend, IfExists, "", 0, 0, Applied, "xyz"}}},
		{"prepend after the flags", "hdr:b", []step{{OpPrepend, Always, "hdr:a", 4, 0, Applied, "hdr:ab"}, {OpPrepend, Always, "0", 0, 0, Applied, "0hdr:ab"}}},
		{"prepend with other flags", "hdr:b", []step{{OpPrepend, Always, "xyz:a", 4, 0, NotApplied, "hdr:b"}}},
		{"prepend unless flags", "b", []step{{OpPrepend, NX, "hdr:a", 4, 0, Applied, "ab"}, {OpSet, Always, "hdr:c", 0, 0, Applied, "hdr:c"}, {OpPrepend, NX, "hdr:a", 4, 0, NotApplied, "hdr:c"}}},
		{"prepend needs a key", noKey, []step{{OpPrepend, Always, "a", 0, 0, Missing, noKey}}},
		{"touch", "v", []step{{OpTouch, Always, "", 0, 5000, Applied, "v"}, {OpTouch, Always, "", 0, 0, Applied, "v"}}},
		{"touch needs a key", noKey, []step{{OpTouch, Always, "", 0, 5000, Missing, noKey}}},
		{"SET XX", noKey, []step{{OpSet, IfExists, "a", 0, 0, NotApplied, noKey}, {OpSet, Always, "a", 0, 0, Applied, "a"}, {OpSet, IfExists, "b", 0, 0, Applied, "b"}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			if c.start != noKey {
				h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte(c.start)})
			}
			for i, s := range c.steps {
				var before Entry // a copy: the store changes its entry in place
				e, had := h.s.Get([]byte("k"), h.now)
				if had {
					before = *e
				}
				res, ev := h.apply(Command{Op: s.op, Cond: s.cond, Key: []byte("k"), Value: []byte(s.value), Delta: s.delta, TTL: s.ttl})
				if res.Outcome != s.outcome {
					t.Fatalf("step %d: outcome %v, want %v", i, res.Outcome, s.outcome)
				}
				e, ok := h.s.Get([]byte("k"), h.now)
				if ok != (s.holds != noKey) || ok && string(e.Value) != s.holds {
					t.Fatalf("step %d: the key holds %+v (%v), want %q", i, e, ok, s.holds)
				}
				if s.outcome != Applied {
					if len(ev) != 0 || ok && e.Version != before.Version {
						t.Fatalf("step %d: a refused op changed the key: %+v", i, ev)
					}
					continue
				}
				if len(ev) != 1 || ev[0].Kind != EventSet || string(ev[0].Value) != s.holds || ev[0].Version != e.Version || had && e.Version == before.Version {
					t.Fatalf("step %d: events %+v, version %v (was %v)", i, ev, e.Version, before.Version)
				}
				if (s.op == OpAppend || s.op == OpPrepend) && (string(res.Previous) != s.holds || !res.HadPrevious) {
					t.Fatalf("step %d: result %+v: the value stored, for the length", i, res)
				}
				if s.op == OpTouch && (res.Previous != nil || res.HadPrevious) {
					t.Fatalf("step %d: a touch's result carries a value: %+v", i, res)
				}
				if s.op == OpTouch && (s.ttl == 0) != (e.ExpiresAt == 0) || s.ttl > 0 && e.ExpiresAt != h.now+s.ttl {
					t.Fatalf("step %d: expires at %d after a touch of %d ms", i, e.ExpiresAt, s.ttl)
				}
			}
		})
	}
}

// Append and prepend keep the key's expiry and check its fence before
// anything else, as the arithmetic ops do; touch checks the fence too.
func TestValueOpsKeepExpiryAndFence(t *testing.T) {
	h := newHarness(t)
	h.apply(Command{Op: OpSet, Key: []byte("k"), Value: []byte("a"), TTL: 5000})
	e, _ := h.s.Get([]byte("k"), h.now)
	was := *e // a copy: the store changes its entry in place
	h.now += 1000
	for _, c := range []Command{{Op: OpAppend, Value: []byte("b")}, {Op: OpPrepend, Value: []byte("c")}} {
		c.Key = []byte("k")
		if res, _ := h.apply(c); res.Outcome != Applied {
			t.Fatal(res.Outcome)
		}
		if e, _ := h.s.Get([]byte("k"), h.now); e.ExpiresAt != was.ExpiresAt {
			t.Fatalf("op %d: expiry %d, was %d", c.Op, e.ExpiresAt, was.ExpiresAt)
		}
	}
	h.now += 5000 // expired: append makes it anew, without expiry; the others find none
	if res, _ := h.apply(Command{Op: OpTouch, Key: []byte("k"), TTL: 100}); res.Outcome != Missing {
		t.Fatalf("touch of an expired key: %v", res.Outcome)
	}
	if res, _ := h.apply(Command{Op: OpAppend, Key: []byte("k"), Value: []byte("z")}); res.Outcome != Applied || string(res.Previous) != "z" {
		t.Fatalf("APPEND to an expired key: %+v", res)
	}
	if e, _ := h.s.Get([]byte("k"), h.now); e.ExpiresAt != 0 {
		t.Fatalf("a key made by APPEND expires at %d", e.ExpiresAt)
	}

	h.apply(Command{Op: OpSet, Key: []byte("f"), Value: []byte("v"), Fence: ts(10)})
	for _, op := range []Op{OpAppend, OpPrepend, OpTouch} {
		for _, c := range []struct {
			fence   hlc.Timestamp
			value   string
			outcome Outcome
		}{{hlc.Timestamp{}, "", FenceRequired}, {ts(9), "x", FenceLower}, {ts(10), "", Applied}} {
			// A prefix that does not match is not told to a client the
			// fence keeps out.
			res, _ := h.apply(Command{Op: op, Key: []byte("f"), Value: []byte(c.value), Delta: int64(len(c.value)), Fence: c.fence})
			if res.Outcome != c.outcome {
				t.Fatalf("op %d with fence %v: %v, want %v", op, c.fence, res.Outcome, c.outcome)
			}
		}
	}
	if e, _ := h.s.Get([]byte("f"), h.now); e.Fence != ts(10) || string(e.Value) != "v" {
		t.Fatalf("fenced key after the ops: %+v", e)
	}

	q := &harness{t: t, s: New(Limits{MaxBytes: 3}), now: 1}
	q.apply(Command{Op: OpSet, Key: []byte("q"), Value: []byte("9")})
	if res, _ := q.apply(Command{Op: OpAppend, Key: []byte("q"), Value: []byte("99")}); res.Outcome != QuotaExceeded {
		t.Fatalf("APPEND past the quota: %v", res.Outcome)
	}
}

// The value ops go through a log entry as they were given (a prepend's
// Delta where a SET's TTL goes), and a batch with one that is not whole
// (a condition it does not take, a Delta beyond its value) is refused.
func TestValueOpsBatchRoundTrip(t *testing.T) {
	cmds := []Command{
		{Op: OpAppend, Key: []byte("a"), Value: []byte("x"), Version: ts(1), Now: 1},
		{Op: OpAppend, Cond: IfExists, Key: []byte("a"), Value: []byte("y"), Version: ts(2), Now: 2, Fence: ts(1)},
		{Op: OpPrepend, Key: []byte("b"), Value: []byte("hdr:z"), Delta: 4, Version: ts(3), Now: 3},
		{Op: OpPrepend, Cond: NX, Key: []byte("b"), Value: []byte("hdr:z"), Delta: 4, Version: ts(3), Now: 3},
		{Op: OpTouch, Key: []byte("c"), TTL: 1500, Version: ts(4), Now: 4},
		{Op: OpSet, Cond: IfExists, Key: []byte("d"), Value: []byte("v"), TTL: 10, Version: ts(5), Now: 5},
	}
	_, got, err := DecodeBatch(AppendBatch(nil, Limits{}, cmds))
	if err != nil {
		t.Fatal(err)
	}
	for i := range cmds {
		if fmt.Sprint(got[i]) != fmt.Sprint(cmds[i]) {
			t.Fatalf("command %d: got %+v, want %+v", i, got[i], cmds[i])
		}
	}
	for _, bad := range []Command{
		{Op: OpPrepend, Cond: IfExists, Key: []byte("a")},
		{Op: OpPrepend, Cond: IfVersion, Key: []byte("a")},
		{Op: OpTouch, Cond: NX, Key: []byte("a")},
		{Op: OpAppend, Cond: NX, Key: []byte("a")},
		{Op: OpDel, Cond: IfExists, Key: []byte("a")},
		{Op: OpPrepend, Key: []byte("a"), Value: []byte("ab"), Delta: 3},
		{Op: OpTouch + 1, Key: []byte("a")},
		{Op: OpSet, Cond: IfExists + 1, Key: []byte("a")},
	} {
		if _, err := DecodeCommand(AppendCommand(nil, &bad)); err == nil {
			t.Fatalf("%+v decoded", bad)
		}
	}
}
