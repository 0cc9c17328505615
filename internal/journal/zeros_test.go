package journal

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

func TestZeroPiece(t *testing.T) {
	for _, c := range []struct{ n, want int64 }{
		{0, 64 << 10}, {1, 64 << 10}, {10_000, 64 << 10}, {64 << 10, 64 << 10},
		{64<<10 + 1, 128 << 10}, {100_000, 128 << 10}, {300_000, 512 << 10},
		{512 << 10, 512 << 10}, {5 << 20, 512 << 10},
	} {
		if got := ZeroPiece(c.n); got != c.want {
			t.Errorf("ZeroPiece(%d) = %d, want %d", c.n, got, c.want)
		}
	}
}

// recordWrites is a file that notes where each write went.
type recordWrites struct {
	*os.File
	writes [][2]int64 // offset, length
}

func (r *recordWrites) WriteAt(p []byte, off int64) (int, error) {
	r.writes = append(r.writes, [2]int64{off, int64(len(p))})
	return r.File.WriteAt(p, off)
}

// TestWriteZerosInAlignedPieces: zeros cover exactly [from, to), written
// in pieces that end on multiples of the piece (so the kernel's folios
// for them are aligned and no larger), and nothing outside changes.
func TestWriteZerosInAlignedPieces(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "seg"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const size = 3 << 20
	if _, err := f.WriteAt(bytes.Repeat([]byte{0xAA}, size), 0); err != nil {
		t.Fatal(err)
	}
	rec := &recordWrites{File: f}
	from, to, piece := int64(10_007), int64(1<<20+70_001), ZeroPiece(20_000)
	if err := WriteZeros(rec, from, to, piece); err != nil {
		t.Fatal(err)
	}
	at := from
	for i, w := range rec.writes {
		off, n := w[0], w[1]
		if off != at || n <= 0 || n > piece {
			t.Fatalf("write %d at %d of %d bytes; want at %d, 1 to %d bytes", i, off, n, at, piece)
		}
		if end := off + n; end != to && end%piece != 0 {
			t.Fatalf("write %d ends at %d: neither the end (%d) nor a multiple of %d", i, end, to, piece)
		}
		at = off + n
	}
	if at != to {
		t.Fatalf("zeros end at %d, want %d", at, to)
	}
	if want := (to/piece - from/piece) + 1; int64(len(rec.writes)) != want {
		t.Fatalf("%d writes, want %d", len(rec.writes), want)
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:from], bytes.Repeat([]byte{0xAA}, int(from))) ||
		!bytes.Equal(got[from:to], make([]byte, to-from)) ||
		!bytes.Equal(got[to:], bytes.Repeat([]byte{0xAA}, int(size-to))) {
		t.Fatal("zeros not exactly over [from, to)")
	}
}
