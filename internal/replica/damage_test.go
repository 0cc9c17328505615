package replica

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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
// newest batch (key-5's entry, written and acknowledged whole) fails the
// batch's checksum; raft-wal drops such a batch as a torn write. No
// sector of it reads as zeros, so it is not one.
func TestBitFlipInTheLastBatchIsDamage(t *testing.T) {
	damageAndReopen(t, "key-5", func(frame []byte) {
		i := bytes.Index(frame, []byte("key-5"))
		frame[i] ^= 0x20
	})
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
