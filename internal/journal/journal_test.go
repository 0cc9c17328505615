package journal

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

func open(t testing.TB, dir string, opts Options) *Journal {
	t.Helper()
	j, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	return j
}

func entry(i uint64, data string) *raft.Log {
	return &raft.Log{Index: i, Term: 1 + i/100, Type: raft.LogCommand, Data: []byte(data)}
}

// smallSegments makes a journal rotate often, so that tests see several
// segments.
var smallSegments = Options{SegmentSize: 4096}

// fillSegments opens a journal of smallSegments in dir and stores entries
// 1..n of group 1 until it has count segments; it returns it open, and n.
func fillSegments(t *testing.T, dir string, count int) (*Journal, uint64) {
	t.Helper()
	j := open(t, dir, smallSegments)
	var n uint64
	for len(segments(t, dir)) < count {
		n++
		store(t, j.Group(1), n, n)
	}
	return j, n
}

func store(t testing.TB, l *Log, from, to uint64) {
	t.Helper()
	var logs []*raft.Log
	for i := from; i <= to; i++ {
		logs = append(logs, entry(i, fmt.Sprintf("g%d-%d", l.id, i)))
	}
	if err := l.StoreLogs(logs); err != nil {
		t.Fatal(err)
	}
}

// expect checks a group's bounds and that every entry reads back.
func expect(t testing.TB, l *Log, first, last uint64) {
	t.Helper()
	f, _ := l.FirstIndex()
	la, _ := l.LastIndex()
	if f != first || la != last {
		t.Fatalf("group %d: log is %d..%d, want %d..%d", l.id, f, la, first, last)
	}
	for i := first; i <= last && last > 0; i++ {
		var got raft.Log
		if err := l.GetLog(i, &got); err != nil {
			t.Fatalf("group %d entry %d: %v", l.id, i, err)
		}
		if want := fmt.Sprintf("g%d-%d", l.id, i); string(got.Data) != want || got.Index != i || got.Term != 1+i/100 {
			t.Fatalf("group %d entry %d: got %d/%d %q", l.id, i, got.Index, got.Term, got.Data)
		}
	}
	var none raft.Log
	if err := l.GetLog(last+1, &none); !errors.Is(err, raft.ErrLogNotFound) {
		t.Fatalf("group %d entry %d: %v, want not found", l.id, last+1, err)
	}
}

func TestGroupsKeepTheirOwnLogsAcrossReopen(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, Options{})
	a, b := j.Group(1), j.Group(2)
	store(t, a, 1, 10)
	store(t, b, 5, 7) // a group may start anywhere (after a snapshot)
	store(t, a, 11, 12)
	if err := a.DeleteRange(1, 3); err != nil { // compaction
		t.Fatal(err)
	}
	if err := a.DeleteRange(11, 12); err != nil { // a conflicting suffix
		t.Fatal(err)
	}
	if err := a.DeleteRange(5, 6); err == nil {
		t.Fatal("deleting the middle of a log succeeded")
	}
	if err := a.StoreLogs([]*raft.Log{entry(13, "x")}); err == nil {
		t.Fatal("a gap in the log was accepted")
	}
	store(t, a, 11, 11)
	if err := b.SetUint64([]byte("CurrentTerm"), 7); err != nil {
		t.Fatal(err)
	}
	if err := b.Set([]byte("LastVoteCand"), []byte("n2")); err != nil {
		t.Fatal(err)
	}
	expect(t, a, 4, 11)
	expect(t, b, 5, 7)
	j.Close()
	if err := a.StoreLogs([]*raft.Log{entry(12, "x")}); !errors.Is(err, ErrClosed) {
		t.Fatalf("store after close: %v", err)
	}

	j = open(t, dir, Options{})
	a, b = j.Group(1), j.Group(2)
	expect(t, a, 4, 11)
	expect(t, b, 5, 7)
	if v, _ := b.GetUint64([]byte("CurrentTerm")); v != 7 {
		t.Fatalf("CurrentTerm = %d", v)
	}
	if v, _ := b.Get([]byte("LastVoteCand")); string(v) != "n2" {
		t.Fatalf("LastVoteCand = %q", v)
	}
	if v, err := a.GetUint64([]byte("CurrentTerm")); v != 0 || err != nil {
		t.Fatalf("unset key: %d, %v", v, err)
	}
	// Deleting everything empties the log; the next append may start anywhere.
	if err := a.DeleteRange(4, 100); err != nil {
		t.Fatal(err)
	}
	expect(t, a, 0, 0)
	store(t, a, 50, 51)
	expect(t, a, 50, 51)
	if err := j.Drop(2); err != nil {
		t.Fatal(err)
	}
	if j.Has(2) || !j.Has(1) {
		t.Fatalf("after drop: groups %v", j.Groups())
	}
	j.Close()
	j = open(t, dir, Options{})
	expect(t, j.Group(1), 50, 51)
	expect(t, j.Group(2), 0, 0)
	if got := j.Groups(); len(got) != 1 || got[0] != 1 {
		t.Fatalf("groups after reopen: %v", got)
	}
}

// The appends of groups writing at once share fsyncs, and each group's
// entries stay in order.
func TestConcurrentGroupsShareWrites(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, Options{})
	const groups, per = 8, 100
	var wg sync.WaitGroup
	for g := uint32(1); g <= groups; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := j.Group(g)
			for i := uint64(1); i <= per; i++ {
				store(t, l, i, i)
			}
		}()
	}
	wg.Wait()
	var commits int
	data, err := os.ReadFile(filepath.Join(dir, segName(1)))
	if err != nil {
		t.Fatal(err)
	}
	for off := int64(headerSize); off < dataEnd(data); off += recordLen(data[off:]) {
		if data[off+8] == kindCommit {
			commits++
		}
	}
	// One commit begins the segment; every other ends a write batch.
	if commits-1 >= groups*per {
		t.Fatalf("%d appends took %d fsyncs: nothing was shared", groups*per, commits-1)
	}
	t.Logf("%d appends, %d fsyncs", groups*per, commits-1)
	j.Close()
	j = open(t, dir, Options{})
	for g := uint32(1); g <= groups; g++ {
		expect(t, j.Group(g), 1, per)
	}
}

func segments(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "*.seg"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Old segments go once compacted; a quiet group's few entries pinning
// one are copied forward; stable values survive the old segments.
func TestSegmentsAreCollected(t *testing.T) {
	dir := t.TempDir()
	opts := Options{SegmentSize: 4096}
	j := open(t, dir, opts)
	quiet, busy := j.Group(1), j.Group(2)
	store(t, quiet, 1, 3)
	if err := quiet.SetUint64([]byte("CurrentTerm"), 3); err != nil {
		t.Fatal(err)
	}
	for i := uint64(1); i <= 2000; i += 10 {
		store(t, busy, i, i+9)
		if i > 100 {
			if err := busy.DeleteRange(i-100, i-91); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := len(segments(t, dir)); n > 4 {
		t.Fatalf("%d segments left: old ones are not collected", n)
	}
	if _, err := os.Stat(filepath.Join(dir, segName(1))); err == nil {
		t.Fatal("the quiet group's entries still pin the first segment")
	}
	expect(t, quiet, 1, 3)
	expect(t, busy, 1901, 2000)
	j.Close()
	j = open(t, dir, opts)
	expect(t, j.Group(1), 1, 3)
	expect(t, j.Group(2), 1901, 2000)
	if v, _ := j.Group(1).GetUint64([]byte("CurrentTerm")); v != 3 {
		t.Fatalf("CurrentTerm = %d after its segment went", v)
	}
}

// dataEnd is where a segment's records end and the zeros written ahead
// of them begin.
func dataEnd(data []byte) int64 {
	off := int64(headerSize)
	for off+recHeader <= int64(len(data)) && data[off+8] != 0 {
		off += recordLen(data[off:])
	}
	return off
}

func lastSegment(t *testing.T, dir string) string {
	t.Helper()
	s := segments(t, dir)
	return s[len(s)-1]
}

// A write cut short by a crash (never acknowledged) is dropped at open;
// the acknowledged entries before it are all there.
func TestTornTailIsCut(t *testing.T) {
	for _, tear := range []struct {
		name string
		do   func(path string, end int64) error
	}{
		{"half a record", func(path string, end int64) error { return os.Truncate(path, end-7) }},
		{"garbage after", func(path string, end int64) error {
			f, err := os.OpenFile(path, os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = f.WriteAt(bytes.Repeat([]byte{0xa5}, 100), end)
			return err
		}},
		{"fewer zeros after", func(path string, end int64) error { return os.Truncate(path, end+4096) }},
		{"no zeros after", func(path string, end int64) error { return os.Truncate(path, end) }},
	} {
		t.Run(tear.name, func(t *testing.T) {
			dir := t.TempDir()
			j := open(t, dir, Options{})
			l := j.Group(1)
			store(t, l, 1, 5)
			store(t, l, 6, 6)
			j.Close()
			path := lastSegment(t, dir)
			data, _ := os.ReadFile(path)
			if err := tear.do(path, dataEnd(data)); err != nil {
				t.Fatal(err)
			}
			j = open(t, dir, Options{})
			want := uint64(6)
			if tear.name == "half a record" {
				want = 5 // the last batch was torn
			}
			expect(t, j.Group(1), 1, want)
			store(t, j.Group(1), want+1, want+1)
			j.Close()
			j = open(t, dir, Options{})
			expect(t, j.Group(1), 1, want+1)
		})
	}
}

// A bit flipped at rest is damage, not a torn tail: the journal refuses
// to open rather than drop acknowledged entries. That holds in the newest
// batch too, once it was written whole (before, it was cut as torn and
// its acknowledged entries were gone without a word).
func TestDamageIsReported(t *testing.T) {
	for _, entry := range []string{"g1-3", "g1-8"} { // an older batch, the newest
		t.Run(entry, func(t *testing.T) {
			dir := t.TempDir()
			j := open(t, dir, Options{})
			l := j.Group(1)
			store(t, l, 1, 5)
			store(t, l, 6, 10)
			j.Close()
			path := lastSegment(t, dir)
			data, _ := os.ReadFile(path)
			data[bytes.Index(data, []byte(entry))] ^= 0x20
			if err := os.WriteFile(path, data, 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := Open(dir, Options{})
			var d *DamagedError
			if !errors.As(err, &d) {
				t.Fatalf("open of a damaged journal: %v", err)
			}
		})
	}
}

// A machine crash can keep a later sector of the last write and lose an
// earlier one (which then reads as the zeros written ahead): the final
// batch's own commit record survives behind its damaged first record.
// That batch was never acknowledged: it is cut, not reported as damage.
func TestTornBatchWithItsOwnCommitIsCut(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, Options{})
	l := j.Group(1)
	store(t, l, 1, 5)
	pad := strings.Repeat("x", 600) // the batch spans sectors
	if err := l.StoreLogs([]*raft.Log{entry(6, "g1-6"+pad), entry(7, "g1-7"+pad), entry(8, "g1-8"+pad)}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	path := lastSegment(t, dir)
	data, _ := os.ReadFile(path)
	start := lastBatch(data)
	clear(data[start : (start/512+1)*512]) // its first sector never landed
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	j = open(t, dir, Options{})
	expect(t, j.Group(1), 1, 5)
}

// lastBatch returns where the newest batch of a segment's data begins:
// after the last commit record but one.
func lastBatch(data []byte) int64 {
	var commits []int64
	off := int64(headerSize)
	for off+recHeader <= int64(len(data)) && data[off+8] != 0 {
		kind := data[off+8]
		off += recordLen(data[off:])
		if kind == kindCommit {
			commits = append(commits, off)
		}
	}
	return commits[len(commits)-2]
}

// A journal cut off just after its first segment was created opens empty.
func TestEmptySegmentFromACrash(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, segName(1)), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	j := open(t, dir, Options{})
	store(t, j.Group(3), 1, 2)
	expect(t, j.Group(3), 1, 2)
}

func TestWriteFailureStopsTheJournal(t *testing.T) {
	dir := t.TempDir()
	failed := make(chan error, 1)
	j := open(t, dir, Options{OnFail: func(err error) { failed <- err }})
	store(t, j.Group(1), 1, 1)
	j.mu.Lock()
	j.segs[len(j.segs)-1].f.Close() // the next write fails
	j.mu.Unlock()
	if err := j.Group(1).StoreLogs([]*raft.Log{entry(2, "x")}); err == nil {
		t.Fatal("a failed write was acknowledged")
	}
	if err := <-failed; err == nil {
		t.Fatal("OnFail got no error")
	}
	if err := j.Group(2).SetUint64([]byte("k"), 1); err == nil {
		t.Fatal("the journal took a write after a failure")
	}
}

// A finished segment may keep the zeros written ahead of its records (a
// crash can undo their removal): they read as its end, not as damage; a
// damaged record before them still is.
func TestZerosAfterAnOldSegment(t *testing.T) {
	dir := t.TempDir()
	opts := smallSegments
	j, n := fillSegments(t, dir, 3)
	j.Close()
	first := segments(t, dir)[0]
	st, _ := os.Stat(first)
	if err := os.Truncate(first, st.Size()+ahead); err != nil {
		t.Fatal(err)
	}
	j = open(t, dir, opts)
	expect(t, j.Group(1), 1, n)
	j.Close()

	data, _ := os.ReadFile(first)
	data[bytes.Index(data, []byte("g1-2"))] ^= 0x20
	if err := os.WriteFile(first, data, 0o600); err != nil {
		t.Fatal(err)
	}
	var d *DamagedError
	if _, err := Open(dir, opts); !errors.As(err, &d) {
		t.Fatalf("open with a damaged old segment: %v", err)
	}
}

func TestProbeSync(t *testing.T) {
	dir := t.TempDir()
	lat, err := ProbeSync(dir, 20, 300, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(lat) != 20 || !slices.IsSorted(lat) || lat[0] <= 0 {
		t.Fatalf("latencies %v: want 20, sorted, positive", lat)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Fatalf("the probe left %d files behind", len(left))
	}
	if lat, err := ProbeSync(dir, 3, 300, 10*time.Millisecond); err != nil || len(lat) != 3 {
		t.Fatalf("with a gap: %v %v", lat, err)
	}
	if _, err := ProbeSync(filepath.Join(dir, "missing"), 1, 1, 0); err == nil {
		t.Fatal("probing a missing directory succeeded")
	}
}

// TestTornRotationKeepsStableValues: a crash while a segment is begun can
// leave it with its header and without the stable values restated after
// it (one write, not yet synced). The torn segment goes whole at open.
// Before, it was cut to its header and kept; an older segment without
// live entries was then removed, and with it the only copy on disk of
// raft's term and vote, lost at the next crash.
func TestTornRotationKeepsStableValues(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, smallSegments)
	l := j.Group(1)
	if err := l.SetUint64([]byte("CurrentTerm"), 7); err != nil {
		t.Fatal(err)
	}
	if err := l.Set([]byte("LastVoteCand"), []byte("n2")); err != nil {
		t.Fatal(err)
	}
	store(t, l, 1, 3)
	if err := l.DeleteRange(1, 3); err != nil { // compacted behind a snapshot
		t.Fatal(err)
	}
	j.Close()
	segs := segments(t, dir)
	// The crash: the next segment was being begun; only its header sector
	// reached the disk.
	next := filepath.Join(dir, segName(uint64(len(segs))+1))
	if err := os.WriteFile(next, appendHeader(nil, uint64(len(segs))+1), 0o600); err != nil {
		t.Fatal(err)
	}
	j = open(t, dir, smallSegments) // the restart
	j.Close()
	j = open(t, dir, smallSegments) // a second crash, before the next rotation
	term, _ := j.Group(1).GetUint64([]byte("CurrentTerm"))
	vote, _ := j.Group(1).Get([]byte("LastVoteCand"))
	if term != 7 || string(vote) != "n2" {
		t.Fatalf("raft's stable values lost: CurrentTerm %d, LastVoteCand %q (want 7, n2); segments %v", term, vote, segments(t, dir))
	}
}

// TestTornSegmentHeaderOpens: a power loss while a segment is begun (one
// write of header, restated stable values and commit record; no fsync
// returned) can keep a later sector of that write and lose the first: the
// header reads as zeros while the restatement batch's commit survives.
// Nothing in that segment was acknowledged: the journal opens without it.
// Before, it refused to open (the commit was taken for a later batch's).
func TestTornSegmentHeaderOpens(t *testing.T) {
	dir := t.TempDir()
	// Segments large enough for the restatement and some entries: the
	// first keeps live entries, and is there as it is at a real tear.
	opts := Options{SegmentSize: 16 << 10}
	j := open(t, dir, opts)
	for g := uint32(1); g <= 40; g++ { // enough groups that the restatement spans sectors
		if err := j.Group(g).SetUint64([]byte("CurrentTerm"), uint64(g)); err != nil {
			t.Fatal(err)
		}
		if err := j.Group(g).Set([]byte("LastVoteCand"), []byte("node-with-a-longish-id")); err != nil {
			t.Fatal(err)
		}
	}
	store(t, j.Group(1), 1, 5)
	j.Close()
	j = open(t, dir, opts)
	if err := j.rotate(); err != nil { // a new segment: header and restatement, one write
		t.Fatal(err)
	}
	j.Close()
	last := lastSegment(t, dir)
	data, _ := os.ReadFile(last)
	end := dataEnd(data)                                // header + restatement batch (the rotation's one write)
	torn := append(make([]byte, 512), data[512:end]...) // first sector lost
	if err := os.WriteFile(last, torn, 0o600); err != nil {
		t.Fatal(err)
	}
	if segs := segments(t, dir); len(segs) < 2 {
		t.Fatalf("segments %v, want the torn one after another", segs)
	}
	j2, err := Open(dir, opts)
	if err != nil {
		t.Fatalf("a torn, never acknowledged segment start refuses the open: %v", err)
	}
	defer j2.Close()
	if term, _ := j2.Group(5).GetUint64([]byte("CurrentTerm")); term != 5 {
		t.Fatalf("group 5's term %d after the open, want 5", term)
	}
	if last, _ := j2.Group(1).LastIndex(); last != 5 {
		t.Fatalf("group 1's last entry %d, want 5", last)
	}
}

// TestZeroHeaderAfterCollectionIsDamage: the newest segment's header
// reads as zeros although its start was synced and the older segments
// were collected after it: damage, not a torn start (which leaves the
// segment before it). The open refuses; taken for a torn start, the
// segment was deleted and raft's term and vote with it.
func TestZeroHeaderAfterCollectionIsDamage(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, smallSegments)
	l := j.Group(1)
	l.SetUint64([]byte("CurrentTerm"), 7)
	var n uint64
	for len(segments(t, dir)) < 2 {
		n++
		store(t, l, n, n)
	}
	l.DeleteRange(1, n) // everything compacted
	j.Close()
	// Rotate on open until only the newest (restatement only) is left.
	for i := 0; i < 3; i++ {
		j = open(t, dir, smallSegments)
		j.rotate()
		j.Close()
	}
	last := lastSegment(t, dir)
	data, _ := os.ReadFile(last)
	copy(data[:headerSize], make([]byte, headerSize))
	os.WriteFile(last, data, 0o600)
	j2, err := Open(dir, smallSegments)
	var damaged *DamagedError
	if errors.As(err, &damaged) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	defer j2.Close()
	term, _ := j2.Group(1).GetUint64([]byte("CurrentTerm"))
	if term != 7 {
		t.Fatalf("opened without error, CurrentTerm %d (want 7); segments %v", term, segments(t, dir))
	}
}

// Without room on the volume (Options.Room), entries are refused and
// nothing else: deletes and stable values go on, the journal is not
// failed, and entries are taken again once there is room, the log
// continuing where it was.
func TestNoRoomRefusesEntriesOnly(t *testing.T) {
	dir := t.TempDir()
	var full atomic.Bool
	failed := make(chan error, 1)
	j := open(t, dir, Options{OnFail: func(err error) { failed <- err }, Room: func(int64) error {
		if full.Load() {
			return errors.New("full")
		}
		return nil
	}})
	l := j.Group(1)
	store(t, l, 1, 10)
	full.Store(true)
	if err := l.StoreLogs([]*raft.Log{entry(11, "g1-11")}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("an entry without room: %v, want ErrNoSpace", err)
	}
	if err := l.DeleteRange(1, 3); err != nil {
		t.Fatalf("a delete without room: %v", err)
	}
	if err := l.SetUint64([]byte("CurrentTerm"), 7); err != nil {
		t.Fatalf("a stable value without room: %v", err)
	}
	if st := j.Stats(); !st.Full || st.Refused != 1 {
		t.Fatalf("stats %+v, want full, one refused", st)
	}
	full.Store(false)
	store(t, l, 11, 12)
	expect(t, l, 4, 12)
	if st := j.Stats(); st.Full {
		t.Fatalf("still full: %+v", st)
	}
	select {
	case err := <-failed:
		t.Fatalf("the journal failed: %v", err)
	default:
	}
	j.Close()
	expect(t, open(t, dir, Options{}).Group(1), 4, 12)
}

// smallVolume mounts a tmpfs of size bytes for one test, or skips it where
// that is not allowed.
func smallVolume(t *testing.T, size int) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", fmt.Sprintf("size=%d", size), "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a small volume here: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", dir).Run() })
	return dir
}

// A volume filled to ENOSPC (no Options.Room to see it coming) refuses
// entries, and still takes raft's stable values and deletes, past the
// zeros the segment had written ahead, out of the spare: hashicorp/raft
// panics when it cannot save its term or vote (a member on a full volume
// did so when it had to vote). Once room is back, entries are taken again
// and the spare is filled again.
func TestFullVolumeStillTakesStableValues(t *testing.T) {
	vol := smallVolume(t, 8<<20)
	filler := filepath.Join(vol, "filler")
	if err := os.WriteFile(filler, make([]byte, 3<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(vol, "journal")
	failed := make(chan error, 1)
	j := open(t, dir, Options{OnFail: func(err error) { failed <- err }})
	if st := j.Stats(); st.SpareReleased {
		t.Fatalf("no spare at open: %+v", st)
	}
	l := j.Group(1)
	big := strings.Repeat("e", 64<<10)
	var last uint64
	for {
		err := l.StoreLogs([]*raft.Log{{Index: last + 1, Term: 1, Type: raft.LogCommand, Data: []byte(big)}})
		if errors.Is(err, ErrNoSpace) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if last++; last > 200 {
			t.Fatal("the volume never filled")
		}
	}
	// More than the zeros written ahead can hold: the segment must grow.
	for term := uint64(1); term <= 6; term++ {
		if err := l.Set([]byte(fmt.Sprint("big-", term)), []byte(strings.Repeat("s", 200<<10))); err != nil {
			t.Fatalf("stable value %d on a full volume: %v", term, err)
		}
		if err := l.SetUint64([]byte("CurrentTerm"), term); err != nil {
			t.Fatalf("term %d on a full volume: %v", term, err)
		}
	}
	if err := l.DeleteRange(1, 2); err != nil {
		t.Fatalf("a delete on a full volume: %v", err)
	}
	if st := j.Stats(); !st.Full || !st.SpareReleased || st.Refused == 0 {
		t.Fatalf("stats %+v: want full, spare released, refusals counted", st)
	}
	if err := l.StoreLogs([]*raft.Log{entry(last+1, "still full")}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("an entry while full: %v", err)
	}
	os.Remove(filler)
	// Entries fill the spare again first (tried every spareRetry).
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := l.StoreLogs([]*raft.Log{entry(last+1, "room again")})
		if err == nil {
			break
		}
		if !errors.Is(err, ErrNoSpace) || time.Now().After(deadline) {
			t.Fatalf("an entry once room is back: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if st := j.Stats(); st.Full || st.SpareReleased {
		t.Fatalf("stats once room is back: %+v", st)
	}
	store(t, l, last+2, last+3)
	if fi, err := os.Stat(filepath.Join(dir, spareName)); err != nil || fi.Size() != DefaultSpare {
		t.Fatalf("the spare file: %v %v", fi, err)
	}
	select {
	case err := <-failed:
		t.Fatalf("the journal failed: %v", err)
	default:
	}
	want, _ := l.LastIndex()
	j.Close()
	l = open(t, dir, Options{}).Group(1)
	if term, _ := l.GetUint64([]byte("CurrentTerm")); term != 6 {
		t.Fatalf("CurrentTerm after reopening: %d", term)
	}
	if first, _ := l.FirstIndex(); first != 3 {
		t.Fatalf("first index after reopening: %d, want 3", first)
	}
	if last, _ := l.LastIndex(); last != want {
		t.Fatalf("last index after reopening: %d, want %d", last, want)
	}
}
