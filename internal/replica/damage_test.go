package replica

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// TestFlippedEntryTypeIsDamage: one bit flipped in an entry's type
// (LogCommand 0 -> LogNoop 1) in a raft-wal segment, in a batch that is
// not the newest, is reported as damage. Before, nothing checked the type
// (raft-wal verifies only the newest batch's checksum, the batch's own
// checksum covers only the entry's data, and verifyLog skipped entries
// that are not commands): the acknowledged write vanished without a word.
func TestFlippedEntryTypeIsDamage(t *testing.T) {
	damageAndReopen(t, "key-1", func(frame []byte) {
		payload := frame[walFrameHeader:]
		// payload: uvarint index | uvarint term | uvarint type | ...
		_, a := binary.Uvarint(payload)
		_, b := binary.Uvarint(payload[a:])
		if payload[a+b] != 0 {
			t.Fatalf("type byte %d", payload[a+b])
		}
		payload[a+b] = 1 // LogNoop
	})
}

// TestDamagedFrameLengthIsDamage: one bit flipped in the length of an
// entry frame of an early batch of the newest raft-wal segment makes the
// reading jump into the preallocated zeros; raft-wal takes that for the
// end of the log and would keep only the batches before the damaged one.
// checkTail reports it. Before, it counted only the commit frames after
// where the reading stopped, which was past all of them.
func TestDamagedFrameLengthIsDamage(t *testing.T) {
	damageAndReopen(t, "key-1", func(frame []byte) {
		frame[4+2] ^= 0x10 // length += 1 MiB: one bit
	})
}

// TestBitFlipInTheLastBatchIsDamage: one bit flipped at rest in the
// newest batch (key-5's entry and its commit frame, written and
// acknowledged whole), in its payload or in a frame header. raft-wal
// drops such a batch as a torn write; no sector of it reads as zeros, so
// it is not one.
func TestBitFlipInTheLastBatchIsDamage(t *testing.T) {
	for name, damage := range map[string]func(frame []byte){
		"payload":        func(frame []byte) { frame[bytes.Index(frame, []byte("key-5"))] ^= 0x20 },
		"entry type":     func(frame []byte) { frame[0] ^= 0x20 },
		"entry length":   func(frame []byte) { frame[4+2] ^= 0x10 }, // the walk goes past the batch
		"length low bit": func(frame []byte) { frame[4] ^= 1 },      // it lands in the entry's payload
		"length bit 6":   func(frame []byte) { frame[4] ^= 1 << 6 },
		"commit type": func(frame []byte) {
			// The commit frame follows the entry frame; frame's capacity
			// runs to the end of the segment.
			n := int(binary.LittleEndian.Uint32(frame[4:]))
			n += (walFrameHeader - n%walFrameHeader) % walFrameHeader
			frame[:cap(frame)][walFrameHeader+n] ^= 0x20
		},
	} {
		t.Run(name, func(t *testing.T) { damageAndReopen(t, "key-5", damage) })
	}
}

// damageAndReopen writes six keys through a single node's group, one
// entry each, has damage change the raft-wal frame of key's entry, and
// reopens the group: it must report a DamagedError, or else still hold
// every key.
func damageAndReopen(t *testing.T, key string, damage func(frame []byte)) {
	dir := t.TempDir()
	g := open(t, dir, nil)
	for i := 0; i < 6; i++ {
		write(t, g, store.Command{Op: store.OpSet, Key: []byte(fmt.Sprintf("key-%d", i)), Value: []byte("value")}, hlc.Timestamp{})
	}
	g.Close()
	segs, _ := filepath.Glob(filepath.Join(dir, "wal", "*.wal"))
	path := segs[len(segs)-1]
	data, _ := os.ReadFile(path)
	found := false
	for off := walFileHeader; off+walFrameHeader <= len(data) && data[off] != 0; {
		n := 0
		if data[off] != walFrameCommit {
			n = int(binary.LittleEndian.Uint32(data[off+4:]))
			if bytes.Contains(data[off+walFrameHeader:off+walFrameHeader+n], []byte(key)) {
				damage(data[off : off+walFrameHeader+n])
				found = true
				break
			}
			n += (walFrameHeader - n%walFrameHeader) % walFrameHeader
		}
		off += walFrameHeader + n
	}
	if !found {
		t.Fatal(key + "'s entry not found")
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	g2, err := Open(Config{NodeID: "n1", Dir: dir})
	if err == nil {
		defer g2.Close()
		err = g2.AwaitLeader(10 * time.Second)
	}
	if damaged := new(DamagedError); errors.As(err, &damaged) {
		return // reported
	}
	if err != nil {
		t.Fatalf("not reported as damage: %v", err)
	}
	for i := 0; i < 6; i++ {
		if _, ok := g2.Get([]byte(fmt.Sprintf("key-%d", i))); !ok {
			t.Errorf("acknowledged key-%d is gone, and the node started without a word", i)
		}
	}
}

// TestSecondTornWriteIsNotDamage: two machine crashes, each tearing the
// batch being written (never acknowledged). raft-wal recovers a torn tail
// by moving its writer back, not by clearing what is there, so the next
// batch lands on the torn one's bytes; a sector of it lost in the second
// crash read as those bytes, not as zeros, and a torn write looked like
// damage (the node refused to start). checkTail now clears the torn tail.
func TestSecondTornWriteIsNotDamage(t *testing.T) {
	dir := t.TempDir()
	segment := func() string {
		segs, _ := filepath.Glob(filepath.Join(dir, "wal", "*.wal"))
		return segs[len(segs)-1]
	}
	set := func(g *Group, k string, v []byte) {
		write(t, g, store.Command{Op: store.OpSet, Key: []byte(k), Value: v}, hlc.Timestamp{})
	}
	g := open(t, dir, nil)
	for _, k := range []string{"a", "b", "c"} {
		set(g, k, []byte("v"))
	}
	set(g, "big1", bytes.Repeat([]byte("1"), 3<<20)) // batch B
	g.Close()
	// Crash 1: B's first sector never landed, the rest did.
	crash1, _ := os.ReadFile(segment())
	bStart, _ := lastTwoBatches(crash1)
	clear(crash1[bStart : (bStart/512+1)*512])
	if err := os.WriteFile(segment(), crash1, 0o600); err != nil {
		t.Fatal(err)
	}
	g = open(t, dir, nil)
	onDisk, _ := os.ReadFile(segment()) // what batch C is written over
	set(g, "big2", bytes.Repeat([]byte("2"), 2<<20))
	g.Close()
	crash2, _ := os.ReadFile(segment())
	cStart, cEnd := lastTwoBatches(crash2)
	// Crash 2: a sector well inside C (past the zeros written ahead of the
	// writer) never landed: it holds what was there before.
	s := (cEnd - 64<<10) / 512 * 512
	if s < cStart || !bytes.Contains(crash1[s:s+512], []byte("1111")) {
		t.Fatalf("layout: B from %d, C %d to %d, sector %d", bStart, cStart, cEnd, s)
	}
	copy(crash2[s:s+512], onDisk[s:s+512])
	if err := os.WriteFile(segment(), crash2, 0o600); err != nil {
		t.Fatal(err)
	}
	g = open(t, dir, nil) // fails the test on a DamagedError
	defer g.Close()
	for _, k := range []string{"a", "b", "c"} {
		if _, ok := g.Get([]byte(k)); !ok {
			t.Errorf("acknowledged %s is gone", k)
		}
	}
}

// lastTwoBatches returns where the newest batch of a raft-wal segment
// begins and ends (after its commit frame).
func lastTwoBatches(data []byte) (start, end int) {
	last, prev := -1, -1
	for off := walFileHeader; off+walFrameHeader <= len(data) && data[off] != 0; {
		if data[off] == walFrameCommit {
			prev, last = last, off
			off += walFrameHeader
			continue
		}
		n := int(binary.LittleEndian.Uint32(data[off+4:]))
		off += walFrameHeader + n + (walFrameHeader-n%walFrameHeader)%walFrameHeader
	}
	return prev + walFrameHeader, last + walFrameHeader
}

// TestTornWriteEndingLikeACommitIsTorn: a crash cut a batch short in the
// middle of an entry whose payload holds words that look like a commit
// frame (type 3, three zero bytes). The last word that landed is one of
// them; it is not the batch's commit frame (walking the frames does not
// end there), so the batch is torn, not damaged.
func TestTornWriteEndingLikeACommitIsTorn(t *testing.T) {
	pattern := bytes.Repeat([]byte("\x03\x00\x00\x00yyyy"), 1000)
	write6 := func(dir string, pad int) (data []byte, path string, at, end int) {
		g := open(t, dir, nil)
		for _, k := range []string{"a", "b", "c"} {
			write(t, g, store.Command{Op: store.OpSet, Key: []byte(k), Value: []byte("v")}, hlc.Timestamp{})
		}
		v := append(bytes.Repeat([]byte("y"), pad), pattern...)
		write(t, g, store.Command{Op: store.OpSet, Key: []byte("big"), Value: v}, hlc.Timestamp{})
		g.Close()
		segs, _ := filepath.Glob(filepath.Join(dir, "wal", "*.wal"))
		path = segs[len(segs)-1]
		data, _ = os.ReadFile(path)
		_, end = lastTwoBatches(data)
		return data, path, bytes.Index(data, pattern), end
	}
	_, _, at, _ := write6(t.TempDir(), 0)
	dir := t.TempDir()
	data, path, at, end := write6(dir, (8-at%8)%8) // the pattern's words on frame boundaries
	cut := (at/512 + 2) * 512                      // the batch's sectors from here on never landed
	if at%8 != 0 || cut+512 > end {
		t.Fatalf("layout: pattern at %d, batch ends at %d", at, end)
	}
	clear(data[cut:end])
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	g := open(t, dir, nil) // fails the test on a DamagedError
	defer g.Close()
	if _, ok := g.Get([]byte("c")); !ok {
		t.Fatal("acknowledged c is gone")
	}
}

// TestMissingNewestSnapshotIsDamage: the newest snapshot's directory is
// gone, an older one is left, and the log was compacted past the older one:
// the group is refused with the damage error (raft panicked on the missing
// entries; found by review).
func TestMissingNewestSnapshotIsDamage(t *testing.T) {
	dir := t.TempDir()
	g := open(t, dir, nil)
	for round := 0; round < 2; round++ {
		for i := 0; i < 3000; i++ {
			write(t, g, store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint(i % 50)), Value: []byte(fmt.Sprint(round, i))}, hlc.Timestamp{})
		}
		if err := g.Snapshot(); err != nil {
			t.Fatal(err)
		}
	}
	g.Close()
	snaps, err := os.ReadDir(filepath.Join(dir, "snapshots"))
	if err != nil || len(snaps) != 2 {
		t.Fatalf("snapshots: %v %v", snaps, err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "snapshots", snaps[1].Name())); err != nil { // names sort by term, index
		t.Fatal(err)
	}
	if err := reopenErr(dir); !isDamage(err, "newest snapshot") {
		t.Fatalf("opened with the newest snapshot gone: %v", err)
	}
}

// reopenErr opens the group in dir again and returns why it did not.
func reopenErr(dir string) error {
	g, err := Open(Config{NodeID: "n1", Dir: dir})
	if err == nil {
		g.Close()
	}
	return err
}

// isDamage reports whether err is the damage error and names what.
func isDamage(err error, what string) bool {
	var damaged *DamagedError
	return errors.As(err, &damaged) && strings.Contains(err.Error(), what)
}

// TestMissingWALMetadataIsDamage: a log whose segments are there but whose
// metadata database is removed or emptied is refused with the damage
// error: raft-wal made a new one, and the group started on an empty log
// after its snapshot (removed), or crashed (emptied) (found by review).
func TestMissingWALMetadataIsDamage(t *testing.T) {
	for _, damage := range []string{"removed", "emptied"} {
		t.Run(damage, func(t *testing.T) {
			dir := t.TempDir()
			g := open(t, dir, nil)
			write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("v")}, hlc.Timestamp{})
			g.Close()
			meta := filepath.Join(dir, "wal", "wal-meta.db")
			var err error
			if damage == "removed" {
				err = os.Remove(meta)
			} else {
				err = os.Truncate(meta, 0)
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := reopenErr(dir); !isDamage(err, "wal-meta.db") {
				t.Fatalf("opened with wal-meta.db %s: %v", damage, err)
			}
		})
	}
}
