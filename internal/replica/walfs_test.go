package replica

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	raftwal "github.com/hashicorp/raft-wal"
	walsegment "github.com/hashicorp/raft-wal/segment"
)

// TestZeroAheadKeepsWhatWasWritten: zeros go only past the furthest byte
// written and never past the file's size, in a new file and in one opened
// again; what was written reads back.
func TestZeroAheadKeepsWhatWasWritten(t *testing.T) {
	dir := t.TempDir()
	const size = 3 * zeroAheadBytes
	fs := newWALFS()
	wf, err := fs.Create(dir, "seg.wal", size)
	if err != nil {
		t.Fatal(err)
	}
	var want []byte
	write := func(wf interface {
		WriteAt([]byte, int64) (int, error)
		Sync() error
	}, n int) {
		t.Helper()
		for range n {
			rec := bytes.Repeat([]byte{byte(len(want)%251 + 1)}, 70_001)
			if _, err := wf.WriteAt(rec, int64(len(want))); err != nil {
				t.Fatal(err)
			}
			want = append(want, rec...)
			if err := wf.Sync(); err != nil {
				t.Fatal(err)
			}
		}
	}
	write(wf, 20) // 1.4 MB: past the first chunk of zeros
	wf.Close()
	wf, err = fs.OpenWriter(dir, "seg.wal")
	if err != nil {
		t.Fatal(err)
	}
	write(wf, 26) // up to 3.22 MB: past the file's size
	wf.Close()
	got, err := os.ReadFile(filepath.Join(dir, "seg.wal"))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("file is %d bytes, want %d (written, past the reserved %d)", len(got), len(want), size)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("what was written does not read back")
	}

	// Short of the size, the rest of the file is zeros.
	wf, err = fs.Create(dir, "short.wal", size)
	if err != nil {
		t.Fatal(err)
	}
	want = want[:0]
	write(wf, 3)
	wf.Close()
	got, _ = os.ReadFile(filepath.Join(dir, "short.wal"))
	if len(got) != size || !bytes.Equal(got[:len(want)], want) || bytes.Count(got[len(want):], []byte{0}) != size-len(want) {
		t.Fatalf("file of %d bytes: want %d, the records, then zeros", len(got), size)
	}
}

// zeroWrites is a segment file that notes the zeros written into it.
type zeroWrites struct {
	*os.File
	pieces []int64 // the length of each write of zeros
}

func (z *zeroWrites) WriteAt(p []byte, off int64) (int, error) {
	if len(p) > 0 && bytes.Count(p, []byte{0}) == len(p) {
		z.pieces = append(z.pieces, int64(len(p)))
	}
	return z.File.WriteAt(p, off)
}

// TestZeroAheadPiecesFollowTheWrites: the zeros ahead of small records go
// in small pieces and those ahead of big ones in big pieces (never more
// than the records' size rounded up to a power of two, within 64 KiB to
// 512 KiB), so that each sync writes back little besides the records
// (journal.WriteZeros); with one write of 1 MiB of zeros, a node's 10 KB
// entries made 18 times their size of disk writes.
func TestZeroAheadPiecesFollowTheWrites(t *testing.T) {
	for _, c := range []struct {
		record   int
		maxPiece int64
	}{{10_000, 64 << 10}, {100_000, 128 << 10}, {900_000, 512 << 10}} {
		f, err := os.Create(filepath.Join(t.TempDir(), "seg.wal"))
		if err != nil {
			t.Fatal(err)
		}
		const size = 8 << 20
		rec := &zeroWrites{File: f}
		z := newZeroAhead(rec, size)
		rec.pieces = nil
		var off int64
		for off+int64(c.record) < 4<<20 {
			if _, err := z.WriteAt(bytes.Repeat([]byte{7}, c.record), off); err != nil {
				t.Fatal(err)
			}
			off += int64(c.record)
		}
		z.Close() // the zeros being written are, once it returns
		if len(rec.pieces) == 0 {
			t.Fatalf("records of %d bytes: no zeros written ahead", c.record)
		}
		for _, p := range rec.pieces {
			if p > c.maxPiece {
				t.Fatalf("records of %d bytes: zeros written %d bytes at once, want at most %d", c.record, p, c.maxPiece)
			}
		}
	}
}

// slowZeros is a segment file whose first write of zeros waits until a
// big record has been written or 200 ms have passed.
type slowZeros struct {
	*os.File
	bigWritten chan struct{}
	waited     bool // zeros are written by one fill at a time
}

func (z *slowZeros) WriteAt(p []byte, off int64) (int, error) {
	if len(p) > 0 && bytes.Count(p, []byte{0}) == len(p) {
		if !z.waited {
			z.waited = true
			select {
			case <-z.bigWritten:
			case <-time.After(200 * time.Millisecond):
			}
		}
		return z.File.WriteAt(p, off)
	}
	n, err := z.File.WriteAt(p, off)
	if len(p) > zeroAheadBytes {
		close(z.bigWritten)
	}
	return n, err
}

// TestZeroAheadWritesWaitForTheZeros: the zeros are written beside the
// appends, and an append reaching into the zeros being written waits for
// them; were it written first, the zeros would land on it.
func TestZeroAheadWritesWaitForTheZeros(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "seg.wal"))
	if err != nil {
		t.Fatal(err)
	}
	z := newZeroAhead(&slowZeros{File: f, bigWritten: make(chan struct{})}, 8<<20)
	head := []byte("head")
	big := bytes.Repeat([]byte{9}, 2<<20) // over the zeros now being written
	if _, err := z.WriteAt(head, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := z.WriteAt(big, int64(len(head))); err != nil {
		t.Fatal(err)
	}
	if err := z.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := z.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:len(head)], head) || !bytes.Equal(got[len(head):len(head)+len(big)], big) {
		t.Fatalf("the record does not read back: %d of its %d bytes are zeros", bytes.Count(got[len(head):len(head)+len(big)], []byte{0}), len(big))
	}
}

// TestWALOnZeroAheadReopens: a raft-wal log on walFS rotates segments and
// reads every entry back after reopening.
func TestWALOnZeroAheadReopens(t *testing.T) {
	dir := t.TempDir()
	open := func() *raftwal.WAL {
		w, err := raftwal.Open(dir, raftwal.WithSegmentFiler(walsegment.NewFiler(dir, newWALFS())), raftwal.WithSegmentSize(256<<10))
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	w := open()
	for i := uint64(1); i <= 600; i++ { // about 3 MB: several segments
		if err := w.StoreLogs([]*raft.Log{{Index: i, Term: 1, Data: []byte(fmt.Sprintf("%05d%s", i, bytes.Repeat([]byte("x"), 5000)))}}); err != nil {
			t.Fatal(err)
		}
	}
	w.Close()
	w = open()
	defer w.Close()
	if last, _ := w.LastIndex(); last != 600 {
		t.Fatalf("last index %d after reopening, want 600", last)
	}
	for _, i := range []uint64{1, 77, 300, 600} {
		var l raft.Log
		if err := w.GetLog(i, &l); err != nil || string(l.Data[:5]) != fmt.Sprintf("%05d", i) {
			t.Fatalf("entry %d: %v %q", i, err, l.Data[:min(5, len(l.Data))])
		}
	}
}

// BenchmarkWALAppend compares raft-wal's own files (fallocated, fsynced)
// with walFS's: one entry appended and synced per op, of 320 bytes (one
// SET) or 5 KB (a batch of about 16 SETs); it also reports the process's
// CPU per op, most of it the file system's work in the sync.
func BenchmarkWALAppend(b *testing.B) {
	for _, c := range []struct {
		name string
		open func(dir string) (*raftwal.WAL, error)
	}{
		{"fallocate", func(dir string) (*raftwal.WAL, error) { return raftwal.Open(dir) }},
		{"zero-ahead", func(dir string) (*raftwal.WAL, error) {
			return raftwal.Open(dir, raftwal.WithSegmentFiler(walsegment.NewFiler(dir, newWALFS())))
		}},
	} {
		for _, size := range []int{320, 5000} {
			b.Run(fmt.Sprintf("%s/%dB", c.name, size), func(b *testing.B) {
				dir := b.TempDir()
				w, err := c.open(dir)
				if err != nil {
					b.Fatal(err)
				}
				defer w.Close()
				data := bytes.Repeat([]byte("v"), size)
				cpu := processCPU()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := w.StoreLogs([]*raft.Log{{Index: uint64(i + 1), Term: 1, Data: data}}); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				b.ReportMetric(float64((processCPU()-cpu).Microseconds())/float64(b.N), "cpu-µs/op")
			})
		}
	}
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// failingZeros is a segment file whose writes of zeros fail.
type failingZeros struct {
	*os.File
	tries int // zero writes tried; by one fill at a time
}

func (z *failingZeros) WriteAt(p []byte, off int64) (int, error) {
	if len(p) > 0 && bytes.Count(p, []byte{0}) == len(p) {
		z.tries++
		return 0, syscall.EIO
	}
	return z.File.WriteAt(p, off)
}

// TestZeroAheadFailureFailsNoAppend: the zeros only make syncs cheaper;
// when writing them fails, the appends and syncs still succeed, what was
// written reads back, and no more zeros are tried in that file.
func TestZeroAheadFailureFailsNoAppend(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "seg.wal"))
	if err != nil {
		t.Fatal(err)
	}
	rec := &failingZeros{File: f}
	z := newZeroAhead(rec, 8<<20)
	z.synced = true // fdatasync from the first Sync on
	var want []byte
	for i := range 40 { // 4 MB: past several refills
		r := bytes.Repeat([]byte{byte(i + 1)}, 100_000)
		if _, err := z.WriteAt(r, int64(len(want))); err != nil {
			t.Fatalf("append %d: %v", i, err)
		}
		if err := z.Sync(); err != nil {
			t.Fatalf("sync after append %d: %v", i, err)
		}
		want = append(want, r...)
	}
	if err := z.Close(); err != nil {
		t.Fatal(err)
	}
	if rec.tries != 1 {
		t.Fatalf("%d writes of zeros tried, want 1 (none after the first failed)", rec.tries)
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("what was written does not read back")
	}
}
