package replica

import (
	"encoding/binary"
	"hash/crc32"
	"testing"
)

// segment builds a raft-wal-like segment: a header, then batches of entry
// frames each closed by a commit frame with the batch's checksum.
func segment(batches ...[]string) []byte {
	data := make([]byte, walFileHeader)
	start := 0 // the first batch's checksum covers the file header too
	for _, b := range batches {
		for _, e := range b {
			h := make([]byte, walFrameHeader)
			h[0] = 1
			binary.LittleEndian.PutUint32(h[4:], uint32(len(e)))
			data = append(data, h...)
			data = append(data, e...)
			data = append(data, make([]byte, (8-len(e)%8)%8)...)
		}
		c := make([]byte, walFrameHeader)
		c[0] = walFrameCommit
		binary.LittleEndian.PutUint32(c[4:], crc32.Checksum(data[start:], castagnoli))
		data = append(data, c...)
		start = len(data)
	}
	return append(data, make([]byte, 256)...) // preallocated zeros
}

func TestCompleteBatchesAfterADamagedHeader(t *testing.T) {
	seg := segment([]string{"a", "bb"}, []string{"ccc"}, []string{"dddd", "e"}, []string{"f"})
	if end, last := walkFrames(seg); completeBatchesAfter(seg, last) != 0 {
		t.Fatalf("an intact segment reports damage (walk stopped at %d)", end)
	}
	// Damage the header of "ccc": the two batches after it are intact.
	damaged := append([]byte(nil), seg...)
	off := walFileHeader + 8 + 8 + 8 + 8 + 8 // a, bb frames and the first commit
	damaged[off] = 0x55
	end, last := walkFrames(damaged)
	if end != off {
		t.Fatalf("walk stopped at %d, want %d", end, off)
	}
	if n := completeBatchesAfter(damaged, last); n != 2 {
		t.Fatalf("%d complete batches after the damage, want 2", n)
	}
	// A torn last batch: its commit does not match; nothing after it.
	torn := append([]byte(nil), seg...)
	f := len(seg) - 256 - 8 - 16 // the "f" frame of the last batch
	torn[f+8] ^= 0xFF
	if _, last := walkFrames(torn); completeBatchesAfter(torn, last) != 0 {
		t.Fatal("a torn last batch counted as complete batches after it")
	}
	// A payload that looks like a commit frame between two real ones
	// must not hide the batch after the damage.
	tricky := segment([]string{"a"}, []string{"b"}, []string{"\x03\x00\x00\x00\x01\x02\x03\x04"})
	tricky[walFileHeader+8+8+8] = 0x55 // the header of the second batch's entry
	if _, last := walkFrames(tricky); completeBatchesAfter(tricky, last) < 1 {
		t.Fatal("a payload shaped like a commit frame hid the batches after the damage")
	}
}

func FuzzCheckTailScan(f *testing.F) {
	f.Add(segment([]string{"a"}, []string{"b"}))
	f.Add(make([]byte, 40))
	f.Fuzz(func(t *testing.T, data []byte) {
		_, last := walkFrames(data)
		completeBatchesAfter(data, last) // must not panic
		// It may only clear what raft-wal drops.
		keep, _ := walTail(data)
		if torn, err := scanTail(data); err == nil && torn[1] > torn[0] && (torn[0] < keep || torn[1] > len(data)) {
			t.Fatalf("clears %v; raft-wal keeps %d of %d bytes", torn, keep, len(data))
		}
	})
}
