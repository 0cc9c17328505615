package replica

import (
	"bytes"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// countingStore counts the reads that reach the store behind the cache.
type countingStore struct {
	*raft.InmemStore
	reads int
}

func (s *countingStore) GetLog(idx uint64, l *raft.Log) error {
	s.reads++
	return s.InmemStore.GetLog(idx, l)
}

// TestLogCacheIsBoundedByBytes: the cache holds at most its bytes, reads
// what it dropped (or never took: an entry over a sixteenth of its bytes)
// from the store, keeps copies rather than the Logs it was given, and
// forgets everything on a DeleteRange.
func TestLogCacheIsBoundedByBytes(t *testing.T) {
	store := &countingStore{InmemStore: raft.NewInmemStore()}
	c := newLogCache(store, 64, 16<<10) // 16 KiB; entries of up to 1 KiB cached
	entry := func(i uint64, size int) *raft.Log {
		return &raft.Log{Index: i, Term: 1, Type: raft.LogCommand, Data: bytes.Repeat([]byte{byte(i)}, size)}
	}
	var given []*raft.Log
	for i := uint64(1); i <= 200; i++ {
		size := 512
		if i%10 == 0 {
			size = 4 << 10 // too big to cache
		}
		l := entry(i, size)
		given = append(given, l)
		if err := c.StoreLogs([]*raft.Log{l}); err != nil {
			t.Fatal(err)
		}
		if c.bytes > c.maxBytes {
			t.Fatalf("after entry %d the cache holds %d bytes, over %d", i, c.bytes, c.maxBytes)
		}
	}
	given[198].Index = 0 // entry 199, cached: a change to the caller's Log does not reach the cache
	store.reads = 0
	for i := uint64(170); i <= 200; i++ {
		var l raft.Log
		if err := c.GetLog(i, &l); err != nil || l.Index != i || !bytes.Equal(l.Data, entry(i, len(l.Data)).Data) {
			t.Fatalf("entry %d: %+v %v", i, l.Index, err)
		}
	}
	// 16 KiB hold the last 32 entries of 512 bytes, less those the big
	// ones left out: 170 to 200 are cached but for 170, 180, 190, 200.
	if store.reads != 4 {
		t.Fatalf("%d reads reached the store, want the 4 big entries", store.reads)
	}
	var l raft.Log
	if err := c.GetLog(5, &l); err != nil || l.Index != 5 || store.reads != 5 {
		t.Fatalf("an old entry: %+v %v (store reads %d)", l.Index, err, store.reads)
	}
	if err := c.DeleteRange(150, 200); err != nil {
		t.Fatal(err)
	}
	if c.bytes != 0 || c.GetLog(175, &l) == nil {
		t.Fatalf("after DeleteRange: %d bytes cached, entry 175 still read", c.bytes)
	}
}

// TestMemLogIsBoundedByBytes: a group in memory snapshots once its log
// holds more than memLogBytes (its store being smaller), so that writes
// overwriting one key leave the log, and the node's memory, bounded by
// bytes instead of growing until raft's periodic snapshot check minutes
// later (it grew to 5.7 GB in 90 s of SETs before).
func TestMemLogIsBoundedByBytes(t *testing.T) {
	g := open(t, "", nil)
	defer g.Close()
	value := bytes.Repeat([]byte{'v'}, 512<<10)
	const writes = 3 * memLogBytes / (512 << 10) // three times the bound
	for i := 0; i < writes; i++ {
		write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: value}, hlc.Timestamp{})
	}
	// What the log holds, walked entry by entry rather than taken from
	// its own count: at most the bound and the entries of one snapshot's
	// run (they are written while it is taken).
	held := func() (n int64) {
		first, _ := g.memLog.FirstIndex()
		last, _ := g.memLog.LastIndex()
		for i := first; i <= last && first > 0; i++ {
			var l raft.Log
			if g.memLog.GetLog(i, &l) == nil {
				n += int64(len(l.Data))
			}
		}
		return n
	}
	deadline := time.Now().Add(10 * time.Second)
	for held() > memLogBytes+4<<20 {
		if time.Now().After(deadline) {
			t.Fatalf("after %d MiB of writes to one key the log holds %d MiB, over %d MiB", writes/2, held()>>20, memLogBytes>>20)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := g.memLog.bytes.Load(); got < held() {
		t.Fatalf("the log counts %d bytes, holds %d", got, held())
	}
	if e, ok := g.Get([]byte("k")); !ok || !bytes.Equal(e.Value, value) {
		t.Fatalf("the key after the snapshots: %v", ok)
	}
}

// TestMemLogWithTransportIsBounded: a group in memory with other members
// (an in-memory cluster) keeps entries behind each snapshot for them to
// catch up from: those are bounded by bytes too. With raft's 1,024, 600
// overwrites of one key with 128 KiB values left all 75 MiB in the log
// (found by review).
func TestMemLogWithTransportIsBounded(t *testing.T) {
	addr, trans := raft.NewInmemTransport("")
	g, err := Open(Config{NodeID: "n1", Transport: trans, Bootstrap: &raft.Configuration{Servers: []raft.Server{{ID: "n1", Address: addr}}}})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.AwaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	value := bytes.Repeat([]byte{'v'}, 128<<10)
	for i := 0; i < 600; i++ {
		write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: value}, hlc.Timestamp{})
	}
	for deadline := time.Now().Add(10 * time.Second); g.memLog.bytes.Load() > memLogBytes+8<<20; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the store holds %d KiB, the in-memory log %d MiB", g.fsm.st.Bytes()>>10, g.memLog.bytes.Load()>>20)
		}
	}
}
