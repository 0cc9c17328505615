package journal

import (
	"bytes"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// Damage to the newest segment's header (or a format this release does
// not know) is reported: the segment holds acknowledged entries.
func TestNewestHeaderDamageIsReported(t *testing.T) {
	dir := t.TempDir()
	opts := smallSegments
	j, n := fillSegments(t, dir, 2)
	n++
	store(t, j.Group(1), n, n) // acknowledged, lives in the newest segment
	j.Close()
	path := lastSegment(t, dir)
	data, _ := os.ReadFile(path)
	data[len(magic)] = 2 // e.g. written by a newer release (format 2), or one flipped bit
	os.WriteFile(path, data, 0o600)
	j2, err := Open(dir, opts)
	var d *DamagedError
	if !errors.As(err, &d) {
		if err == nil {
			last, _ := j2.Group(1).LastIndex()
			j2.Close()
			t.Fatalf("open succeeded; group 1 ends at %d but %d was acknowledged", last, n)
		}
		t.Fatalf("open: %v, want a DamagedError", err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the damaged segment was removed: %v", err)
	}
}

// A torn final batch whose commit record reached the disk but an
// earlier page did not (power loss before fdatasync returned) is cut.
func TestTornLastBatchLosingAnEarlierPageIsCut(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, Options{})
	l := j.Group(1)
	store(t, l, 1, 5)
	big := bytes.Repeat([]byte("x"), 8192)
	if err := l.StoreLogs([]*raft.Log{{Index: 6, Data: big}, {Index: 7, Data: big}}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	path := lastSegment(t, dir)
	data, _ := os.ReadFile(path)
	i := bytes.Index(data, big)
	start := i - recHeader - 33                          // the batch's first record
	copy(data[start:i+4096], make([]byte, i+4096-start)) // a page of the unacknowledged batch never landed
	os.WriteFile(path, data, 0o600)
	j, err := Open(dir, Options{})
	if err != nil {
		t.Fatalf("a torn unacknowledged batch keeps the node from starting: %v", err)
	}
	defer j.Close()
	expect(t, j.Group(1), 1, 5)
}

// A quiet group whose live entries exceed a quarter of the oldest segment
// does not stop collection: the journal stays bounded.
func TestCollectionGoesOnBehindAQuietGroup(t *testing.T) {
	dir := t.TempDir()
	opts := Options{SegmentSize: 64 << 10}
	j := open(t, dir, opts)
	quiet, busy := j.Group(1), j.Group(2)
	big := bytes.Repeat([]byte("q"), 10<<10)
	if err := quiet.StoreLogs([]*raft.Log{{Index: 1, Data: big}, {Index: 2, Data: big}}); err != nil {
		t.Fatal(err)
	}
	for i := uint64(1); i <= 60000; i += 10 {
		store(t, busy, i, i+9)
		if i > 100 {
			busy.DeleteRange(i-100, i-91)
		}
	}
	j.mu.RLock()
	for _, s := range j.segs {
		t.Logf("seg %d size %d live %d liveBytes %d", s.seq, s.size, s.live, s.liveBytes)
	}
	j.mu.RUnlock()
	if n := len(segments(t, dir)); n > 6 {
		t.Fatalf("%d segments kept for ~20 KB of live quiet entries + 100 busy entries", n)
	}
}

// A rejected StoreLogs leaves no partial bounds behind for a later op of
// the same group in the same batch.
func TestRejectedAppendLeavesTheBoundsAlone(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, Options{})
	l := j.Group(1)
	store(t, l, 1, 4)
	j.mu.Lock() // hold the writer in its next batch
	go j.Group(2).SetUint64([]byte("k"), 1)
	waitQueue := func(n int) {
		for {
			j.qmu.Lock()
			q := len(j.queue)
			j.qmu.Unlock()
			if q == n {
				return
			}
			time.Sleep(time.Millisecond)
		}
	}
	time.Sleep(100 * time.Millisecond)
	waitQueue(0) // writer took it and waits on mu
	errA, errB := make(chan error, 1), make(chan error, 1)
	go func() { errA <- l.StoreLogs([]*raft.Log{entry(5, "g1-5"), entry(6, "g1-6"), entry(8, "g1-8")}) }()
	waitQueue(1)
	go func() { errB <- l.StoreLogs([]*raft.Log{entry(7, "g1-7")}) }()
	waitQueue(2)
	j.mu.Unlock()
	if a, b := <-errA, <-errB; a == nil || b == nil {
		t.Fatalf("A (a gap): %v; B (7 after 4): %v; want both refused", a, b)
	}
	expect(t, l, 1, 4)
	j.Close()
	j = open(t, dir, Options{})
	expect(t, j.Group(1), 1, 4)
}

// A missing middle segment is reported, not papered over.
func TestMissingSegmentIsReported(t *testing.T) {
	dir := t.TempDir()
	opts := smallSegments
	j, n := fillSegments(t, dir, 4)
	j.Close()
	os.Remove(segments(t, dir)[1])
	j2, err := Open(dir, opts)
	var d *DamagedError
	if !errors.As(err, &d) {
		if err == nil {
			f, _ := j2.Group(1).FirstIndex()
			la, _ := j2.Group(1).LastIndex()
			j2.Close()
			t.Fatalf("opened without error: group 1 is %d..%d, was 1..%d", f, la, n)
		}
		t.Fatalf("open: %v, want a DamagedError", err)
	}
}
