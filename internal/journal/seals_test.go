package journal

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestOldSegmentCutIsDamage: an old (not the newest) segment cut at a
// batch boundary, or zeroed from one, is reported as damage. Each opened
// without a word before, and the acknowledged entries of a quiet group
// whose only copy it held were gone (found by review).
func TestOldSegmentCutIsDamage(t *testing.T) {
	for _, mode := range []string{"truncate", "zero"} {
		t.Run(mode, func(t *testing.T) {
			dir := t.TempDir()
			j := open(t, dir, smallSegments)
			quiet, busy := j.Group(1), j.Group(2)
			store(t, quiet, 1, 1)
			store(t, quiet, 2, 2)
			j.mu.RLock()
			cutAt := j.segs[0].size // the end of the batch holding entry 2
			j.mu.RUnlock()
			store(t, quiet, 3, 3)
			store(t, quiet, 4, 4)
			for n := uint64(1); len(segments(t, dir)) < 2; n++ {
				store(t, busy, n, n)
			}
			j.Close()
			old := segments(t, dir)[0]
			switch mode {
			case "truncate":
				if err := os.Truncate(old, cutAt); err != nil {
					t.Fatal(err)
				}
			default:
				data, err := os.ReadFile(old)
				if err != nil {
					t.Fatal(err)
				}
				clear(data[cutAt:])
				if err := os.WriteFile(old, data, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			j2, err := Open(dir, smallSegments)
			if err == nil {
				f, _ := j2.Group(1).FirstIndex()
				l, _ := j2.Group(1).LastIndex()
				j2.Close()
				t.Fatalf("opened without error: group 1 holds %d..%d, acknowledged 1..4", f, l)
			}
			if d := new(DamagedError); !errors.As(err, &d) {
				t.Fatalf("not the damage error: %v", err)
			}
		})
	}
}

// TestJournalBeforeSealsOpens: a journal written by a release before the
// seals file (or by one that ignored it for a while: going back one
// release and forth again) opens as ever, and seals the segments it
// finishes from then on.
func TestJournalBeforeSealsOpens(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, smallSegments)
	for n := uint64(1); len(segments(t, dir)) < 3; n++ {
		store(t, j.Group(1), n, n)
	}
	last, _ := j.Group(1).LastIndex()
	j.Close()
	if err := os.Remove(filepath.Join(dir, sealsFile)); err != nil {
		t.Fatal(err)
	}
	j = open(t, dir, smallSegments)
	if got, _ := j.Group(1).LastIndex(); got != last {
		t.Fatalf("last index %d, was %d", got, last)
	}
	before := len(segments(t, dir))
	for n := last + 1; len(segments(t, dir)) == before; n++ {
		store(t, j.Group(1), n, n)
	}
	j.Close()
	s, err := readSeals(dir)
	if err != nil || len(s) != 1 {
		t.Fatalf("seals after one more segment: %+v %v", s, err)
	}
}
