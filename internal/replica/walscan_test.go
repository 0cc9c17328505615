package replica

import (
	"encoding/binary"
	"hash/crc32"
	"math/rand"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/hashicorp/raft-wal/fs"
	walseg "github.com/hashicorp/raft-wal/segment"
	"github.com/hashicorp/raft-wal/types"
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

// genSegment makes the data of a raft-wal segment: up to three batches,
// the last one's checksum sometimes bad, then a torn or damaged tail.
func genSegment(r *rand.Rand, info types.SegmentInfo) []byte {
	data := make([]byte, walFileHeader)
	binary.LittleEndian.PutUint32(data[0:], 0x58eb6b0d)
	binary.LittleEndian.PutUint64(data[8:], info.BaseIndex)
	binary.LittleEndian.PutUint64(data[16:], info.ID)
	binary.LittleEndian.PutUint64(data[24:], info.Codec)
	start := 0
	frame := func(typ byte, payload []byte) {
		h := make([]byte, 8)
		h[0] = typ
		binary.LittleEndian.PutUint32(h[4:], uint32(len(payload)))
		data = append(data, h...)
		data = append(data, payload...)
		data = append(data, make([]byte, (8-len(payload)%8)%8)...)
	}
	commit := func(good bool) {
		c := make([]byte, 8)
		c[0] = 3
		sum := crc32.Checksum(data[start:], castagnoli)
		if !good {
			sum ^= 1
		}
		binary.LittleEndian.PutUint32(c[4:], sum)
		data = append(data, c...)
		start = len(data)
	}
	nb := r.Intn(4)
	for b := 0; b < nb; b++ {
		ne := r.Intn(3)
		for e := 0; e < ne; e++ {
			p := make([]byte, r.Intn(30))
			r.Read(p)
			frame(1, p)
		}
		if r.Intn(6) == 0 {
			frame(2, make([]byte, 4*r.Intn(3)))
		}
		commit(b < nb-1 || r.Intn(3) > 0)
	}
	// a torn tail
	switch r.Intn(6) {
	case 0:
		p := make([]byte, r.Intn(30))
		r.Read(p)
		frame(1, p)
	case 1:
		g := make([]byte, r.Intn(40))
		r.Read(g)
		data = append(data, g...)
	case 2:
		if len(data) > walFileHeader {
			for i := r.Intn(3); i >= 0; i-- {
				data[walFileHeader+r.Intn(len(data)-walFileHeader)] ^= byte(1 << r.Intn(8))
			}
		}
	case 3:
		data = data[:walFileHeader+r.Intn(len(data)-walFileHeader+1)]
	case 4:
		h := make([]byte, 8)
		h[0] = byte(1 + r.Intn(2))
		binary.LittleEndian.PutUint32(h[4:], 0xFFFFFFF0+uint32(r.Intn(16)))
		data = append(data, h...)
	}
	return append(data, make([]byte, r.Intn(40))...)
}

// TestWalTailMatchesRaftWal checks walTail, which checkTail trusts before
// it clears a torn tail, against raft-wal's own recovery of a segment
// (RecoverTail; where its writer resumes is read from an unexported field:
// raft-wal is pinned) on generated segments: batches with good and bad
// checksums, index frames, flipped bits, garbage, files cut short, lengths
// near 2^32.
func TestWalTailMatchesRaftWal(t *testing.T) {
	r := rand.New(rand.NewSource(1))
	dir := t.TempDir()
	info := types.SegmentInfo{ID: 7, BaseIndex: 1, MinIndex: 1, Codec: 0, SizeLimit: 1 << 20}
	filer := walseg.NewFiler(dir, fs.New())
	bad := 0
	for i := 0; i < 5000 && bad < 5; i++ {
		data := genSegment(r, info)
		path := filepath.Join(dir, walseg.FileName(info))
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		w, err := filer.RecoverTail(info)
		if err != nil {
			continue
		}
		wo := int(reflect.ValueOf(w).Elem().FieldByName("writer").FieldByName("writeOffset").Uint())
		w.Close()
		if wo == 0 {
			wo = walFileHeader
		}
		keep, _ := walTail(data)
		if keep != wo {
			bad++
			t.Errorf("walTail keeps %d, raft-wal resumes at %d: % x", keep, wo, data)
		}
		if torn, err := scanTail(data); err == nil && torn[1] > torn[0] && torn[0] < wo {
			bad++
			t.Errorf("zero-fills %v, raft-wal keeps %d", torn, wo)
		}
	}
}
