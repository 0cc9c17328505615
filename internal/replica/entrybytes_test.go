package replica

import (
	"fmt"
	"testing"
	"time"
	"unsafe"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// TestEntryBytesReusedOnceApplied: a group on a raft-wal log of its own,
// which copies what raft gives it, encodes its next entries into the bytes
// of entries already applied; every write is still what a restart, which
// reads them back from the log, finds.
func TestEntryBytesReusedOnceApplied(t *testing.T) {
	seen := map[*byte]int{}
	prev := checkProposed
	checkProposed = func(limits store.Limits, cmds []store.Command, data []byte) {
		seen[unsafe.SliceData(data)]++ // the apply goroutine only, one entry at a time
		prev(limits, cmds, data)
	}
	defer func() { checkProposed = prev }()

	dir := t.TempDir()
	g := open(t, dir, nil)
	const writes = 40
	for i := range writes {
		write(t, g, store.Command{Op: store.OpSet, Key: fmt.Appendf(nil, "k%02d", i), Value: fmt.Appendf(nil, "value %02d", i)}, hlc.Timestamp{})
	}
	// An entry of one big value is not kept for the next.
	big := write(t, g, store.Command{Op: store.OpSet, Key: []byte("big"), Value: make([]byte, maxSpareData)}, hlc.Timestamp{})
	if big.Outcome != store.Applied {
		t.Fatalf("the big write: %v", big.Outcome)
	}
	for range len(g.spareData) {
		b := <-g.spareData
		if cap(b) > maxSpareData {
			t.Fatalf("a slice of %d bytes kept for the next entry", cap(b))
		}
		g.spareData <- b
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	entries, reused := 0, 0
	for _, n := range seen {
		entries += n
		reused += n - 1
	}
	if entries < writes || reused < writes/2 {
		t.Fatalf("%d entries applied from the proposer's bytes, %d of them in bytes used before: want most reused", entries, reused)
	}
	g = open(t, dir, nil)
	defer g.Close()
	for i := range writes {
		want := fmt.Sprintf("value %02d", i)
		if e, ok := g.Get(fmt.Appendf(nil, "k%02d", i)); !ok || string(e.Value) != want {
			t.Fatalf("after a restart k%02d holds %q (%v), want %q", i, e.Value, ok, want)
		}
	}
}

// TestEntryBytesKeptWhereTheLogKeepsThem: a group whose log store keeps
// the bytes raft gives it (the log in memory; the node's journal behind
// its cache) never encodes an entry into another's bytes: each entry in
// the log still reads as it was written after many more.
func TestEntryBytesKeptWhereTheLogKeepsThem(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  func(t *testing.T) (Config, raft.LogStore)
	}{
		{"memory", func(t *testing.T) (Config, raft.LogStore) { return Config{NodeID: "n1"}, nil }},
		{"journal", func(t *testing.T) (Config, raft.LogStore) {
			log := raft.NewInmemStore()
			return Config{NodeID: "n1", Dir: t.TempDir(), Log: log}, log
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, log := c.cfg(t)
			g, err := Open(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			if err := g.AwaitLeader(10 * time.Second); err != nil {
				t.Fatal(err)
			}
			if log == nil {
				log = g.memLog
			}
			const writes = 40
			for i := range writes {
				write(t, g, store.Command{Op: store.OpSet, Key: fmt.Appendf(nil, "k%02d", i), Value: fmt.Appendf(nil, "value %02d", i)}, hlc.Timestamp{})
			}
			first, _ := log.FirstIndex()
			last, _ := log.LastIndex()
			found := map[int]uint64{} // write -> entry
			for idx := first; idx <= last; idx++ {
				var l raft.Log
				if err := log.GetLog(idx, &l); err != nil {
					t.Fatal(err)
				}
				if l.Type != raft.LogCommand {
					continue
				}
				_, cmds, err := store.DecodeBatch(l.Data)
				if err != nil {
					t.Fatalf("entry %d: %v", idx, err)
				}
				for _, cmd := range cmds {
					var i int
					if _, err := fmt.Sscanf(string(cmd.Key), "k%02d", &i); err != nil || string(cmd.Value) != fmt.Sprintf("value %02d", i) {
						t.Fatalf("entry %d holds %q = %q", idx, cmd.Key, cmd.Value)
					}
					if at, twice := found[i]; twice {
						t.Fatalf("entries %d and %d both hold write %d: one was overwritten", at, idx, i)
					}
					found[i] = idx
				}
			}
			if len(found) != writes {
				t.Fatalf("the log holds %d of the %d writes", len(found), writes)
			}
		})
	}
}
