package replica

import (
	"bytes"
	"testing"

	"github.com/hashicorp/raft"
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
